"""Every command in the ``bash`` blocks of the README and the docs/ pages still matches the code (issue 26), parsed
exactly as the shell would pass it: an example script's arguments compose and validate against its YAML and schema
(Hydra's grammar, every key known, every value of its type), a tool's options appear in its ``--help``, a ``make``
target exists, a benchmark script exists and takes the flags shown. Paths in the commands are stand-ins (``<run>``,
``...``); the runs themselves are covered at tiny sizes by tests/test_examples_tp.py. Also (issue 62): the README
stays short, its links and the docs' links lead somewhere, and every module, name and file the pages mention
exists (a renamed module cannot leave an old path behind)."""

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
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
README_MAX_LINES = 300


def readme_commands(page: Path = README) -> list[str]:
    """The commands of every ``bash`` block of ``page``: continuation lines joined, comments and prompts removed."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S):
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
    """The words of ``command``, ``...`` and leading ``VAR=value`` settings dropped, ``<placeholder>`` paths made
    concrete."""
    words = [w for w in shlex.split(re.sub(r"<[^>]*>", "x", command)) if w != "..."]
    while words and re.match(r"[A-Z_][A-Z0-9_]*=", words[0]):
        words = words[1:]
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


COMMANDS = [command for page in PAGES for command in readme_commands(page)]
PAGE_COMMANDS = [pytest.param(c, id=f"{p.name}:{c[:60]}") for p in PAGES for c in dict.fromkeys(readme_commands(p))]


def test_the_readme_has_commands_of_every_kind():
    kinds = {_stand_ins(c)[0].rsplit("/", 1)[-1] for c in COMMANDS}
    assert {"make", "python"} <= kinds and len(readme_commands()) > 20 and len(COMMANDS) > 60


def test_the_readme_is_short_and_every_page_it_links_exists():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"
    linked = {target.split("#")[0] for target in re.findall(r"\]\(([^)\s]+)\)", README.read_text())}
    pages = {t for t in linked if t.startswith("docs/")}
    assert pages and all((ROOT / t).is_file() for t in pages), sorted(t for t in pages if not (ROOT / t).is_file())
    unlinked = [p.name for p in DOCS if f"docs/{p.name}" not in pages]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_link_of_a_page_leads_somewhere(page):
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            bad.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", file.read_text(), flags=re.M)
            if anchor not in {_anchor(h) for h in headings}:
                bad.append(f"{target}: no such heading")
    assert not bad, "\n".join(bad)


def _resolves(name: str) -> bool:
    """Whether the dotted ``name`` (``speechtrain.asr.jobs.fit_and_report``) is a module or a name in one."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            if not hasattr(target, attribute):
                return False
            target = getattr(target, attribute)
        return True
    return False


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_module_name_and_file_a_page_mentions_exists(page):
    text = page.read_text()
    names = set(re.findall(r"\bspeechtrain(?:\.[A-Za-z_]\w*)+", text))
    missing = sorted(n for n in names if not _resolves(n))
    files = set(
        re.findall(r"(?<![\w/.<-])((?:speechtrain|examples|benchmarks|tests|tools|docs|results)/[\w./-]*\w)", text)
    )
    missing += sorted(f for f in files if not (ROOT / f).exists() and not (ROOT / f).with_suffix(".yaml").exists())
    assert not missing, f"{page.name} names what does not exist: {missing}"


@pytest.mark.parametrize("command", PAGE_COMMANDS)
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
