"""The ``key=value`` command line shared by the tools (``transcribe``, ``synthesize``, ``generate``, ``ngram``).

``parse_key_values(argv, Schema, doc)`` reads ``key=value`` arguments into a checked dataclass: ``-h``/``--help``
prints the tool's description, every option with its default and meaning (from the dataclass's ``Attributes:``
docstring) and exits 0; an argument that is not ``key=value``, an unknown key (with the closest known one) or a
wrong type stops with one line on stderr and exit status 2 (:func:`fail`).
"""

import dataclasses
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from omegaconf import OmegaConf

from speechtrain.common.config import ConfigError, validate_config

USAGE_EXIT = 2  # the status of a command-line mistake (argparse's and Hydra's convention)


class CommandLineError(SystemExit):
    """Exit with status 2; ``str()`` is the one-line message (already printed to stderr)."""

    def __init__(self, message: str) -> None:
        super().__init__(USAGE_EXIT)
        self.message = message

    def __str__(self) -> str:
        return f"error: {self.message}"


def fail(message: str, prog: str | None = None) -> NoReturn:
    """Print ``<prog>: error: <message>`` (one line) to stderr and exit with status 2."""
    prog = prog or _prog()
    line = " ".join(str(message).split())
    print(f"{prog}: error: {line}", file=sys.stderr)
    raise CommandLineError(line)


def _prog() -> str:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return f"python -m {spec.name}" if spec is not None and spec.name else (sys.argv[0] or "speechtrain")


def option_help(schema: type) -> list[tuple[str, Any, str]]:
    """``(name, default, description)`` of every field of ``schema``, descriptions read from its docstring's
    ``Attributes:`` section (``name: text`` entries, continuation lines indented; ``a, b: text`` covers both)."""
    described: dict[str, str] = {}
    doc = schema.__doc__ or ""
    section = doc.split("Attributes:", 1)[1] if "Attributes:" in doc else ""
    current: list[str] = []
    for line in section.splitlines():
        match = re.match(r"^\s{4,8}([\w, ]+):\s*(.*)$", line)
        if match and not line.startswith(" " * 12):
            current = [n.strip() for n in match.group(1).split(",")]
            for name in current:
                described[name] = match.group(2).strip()
        elif line.strip() and current:
            for name in current:
                described[name] += " " + line.strip()
    rows = []
    for f in dataclasses.fields(schema):
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = "(required)"
        rows.append((f.name, default, described.get(f.name, "")))
    return rows


def help_text(schema: type, doc: str | None, prog: str | None = None) -> str:
    """Usage line, the tool's description (``doc``) and its options with their defaults."""
    prog = prog or _prog()
    lines = [f"usage: {prog} [key=value ...]", ""]
    if doc:
        lines += [doc.strip(), ""]
    lines.append("options (key=default):")
    rows = option_help(schema)
    width = max(len(f"{n}={'null' if d is None else d}") for n, d, _ in rows)
    for name, default, text in rows:
        shown = f"{name}={'null' if default is None else default}"
        lines.append(f"  {shown:<{width}}  {text}".rstrip())
    return "\n".join(lines)


def parse_key_values[T](argv: Sequence[str], schema: type[T], doc: str | None = None, prog: str | None = None) -> T:
    """``key=value`` arguments as a checked ``schema`` instance (see the module docstring).

    Raises:
        SystemExit: 0 after printing the help; 2 (:class:`CommandLineError`) on a bad argument, with the message
            on stderr.
    """
    argv = list(argv)
    if any(a in ("-h", "--help") for a in argv):
        print(help_text(schema, doc, prog))
        raise SystemExit(0)
    bad = [a for a in argv if "=" not in a or a.startswith("=")]
    if bad:
        example = option_help(schema)[0][0]
        fail(f"Arguments must be key=value (e.g. {example}=...; --help lists them), got: {' '.join(bad)}", prog)
    try:
        return OmegaConf.to_object(validate_config(OmegaConf.from_dotlist(argv), schema))
    except ConfigError as error:
        fail(str(error), prog)
