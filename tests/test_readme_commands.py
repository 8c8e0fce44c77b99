"""Every command in the README's ``bash`` blocks still matches the code (issue 26), parsed exactly as the shell
would pass it: an example script's arguments compose and validate against its YAML and schema (Hydra's grammar,
every key known, every value of its type), a tool's options appear in its ``--help``, a ``make`` target exists, a
benchmark script exists and takes the flags shown. Paths in the commands are stand-ins (``<run>``, ``...``); the
runs themselves are covered at tiny sizes by tests/test_examples_tp.py."""

import contextlib
import importlib
import importlib.util
import io
import re
import shlex
import sys
from pathlib import Path

import pytest

from speechtrain.core.hydra_runner import _config_from_argv

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def readme_commands() -> list[str]:
    """The commands of every ``bash`` block: continuation lines joined, comments and prompts removed."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S):
        for command in block.replace("\\\n", " ").splitlines():
            words = shlex.split(command, comments=True)
            if words:
                commands.append(shlex.join(words))
    return commands


# Programs the README shows that are not ours (lhotse's corpus recipes, a shell loop around them): not checked here.
OTHER_PROGRAMS = {"lhotse", "for", "done"}
# Folders the README's commands name that a user brings: the tests' own copies stand in for them.
FOLDERS = {"nemo_conf": str(ROOT / "tests" / "asr" / "nemo_conf")}


def _stand_ins(command: str) -> list[str]:
    """The words of ``command``, ``...`` dropped and ``<placeholder>`` paths made concrete."""
    words = [w for w in shlex.split(re.sub(r"<[^>]*>", "x", command)) if w != "..."]
    return [FOLDERS.get(w, w) for w in words]


def _script(words: list[str], monkeypatch) -> None:
    path = ROOT / words[0]
    assert path.is_file(), words[0]
    spec = importlib.util.spec_from_file_location(f"readme_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setattr(sys, "argv", [str(path), *words[1:]])  # a script may pick its schema from its arguments
    spec.loader.exec_module(module)
    if path.parent.name == "benchmarks":
        text = path.read_text()
        for flag in (w for w in words[1:] if w.startswith("--")):
            assert f'"{flag}"' in text or f"'{flag}'" in text, f"{words[0]} takes no {flag}"
        return
    main = module.main
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            _config_from_argv(
                words[1:],
                main.config_dir.parent,
                main.config_dir.name,
                main.config_name,
                main.schema,
                translate=main.translate,
            )
        except SystemExit as error:
            pytest.fail(f"{shlex.join(words)} exits {error.code}")


def _tool(module_name: str, args: list[str]) -> None:
    module = importlib.import_module(module_name)
    if not hasattr(module, "main"):  # a ``__main__`` block that hands over to another module's main
        handover = re.search(r"from ([\w.]+) import main", Path(module.__file__).read_text())
        assert handover, f"python -m {module_name}: no main()"
        module = importlib.import_module(handover.group(1))
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
        module.main(["--help"])
    assert exit_.value.code in (0, None), module_name
    text = out.getvalue()
    for arg in args:
        if arg.startswith("--") and arg != "--help":
            assert arg in text, f"python -m {module_name}: no option {arg}"
        elif "=" in arg and not arg.startswith("-"):
            key = arg.split("=", 1)[0]
            assert re.search(rf"(^|\s){re.escape(key)}=", text, flags=re.M), f"python -m {module_name}: no {key}="


COMMANDS = readme_commands()


def test_the_readme_has_commands_of_every_kind():
    kinds = {c.split()[0].rsplit("/", 1)[-1] for c in COMMANDS}
    assert {"make", "python"} <= kinds and len(COMMANDS) > 30


@pytest.mark.parametrize("command", COMMANDS)
def test_readme_command_matches_the_code(command, monkeypatch):
    words = _stand_ins(command)
    if words[0] in OTHER_PROGRAMS:
        return
    if words[0] == "make":
        targets = re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M)
        assert words[1] in targets, command
    elif words[1] == "-m":
        _tool(words[2], words[3:])
    else:
        _script(words[1:], monkeypatch)
