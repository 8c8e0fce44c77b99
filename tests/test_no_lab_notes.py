"""No lab notes in the recipes, the Makefile, the example scripts or the library's docstrings and comments.

Figures of a run (timings, WERs, memory) and the machines and commits they came from belong in the records
(``results/*.jsonl``, rendered into RESULTS.md), where each keeps its date, machine and command; text that explains
the code gives the reason in words, so it does not go stale when the next run differs. Flagged here: a commit hash,
a milliseconds figure, a machine name, and (in recipe and Makefile comments) a percentage.
"""

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

COMMIT = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")  # hex with a digit and a letter
MILLISECONDS = re.compile(r"\b\d+(?:\.\d+)? ?ms\b")
MACHINE = re.compile(
    r"\b(?:EPYC|Xeon|AMX|Zen ?\d|Intel|AMD|Sapphire Rapids|Emerald Rapids|Granite Rapids|Ice Lake|Cascade Lake|"
    r"Skylake|Genoa|Graviton|Neoverse|Apple M\d|H100|H200|GH200|A100|B200|L40S)\b"
)
PERCENT = re.compile(r"\d+(?:\.\d+)? ?%")
EVERYWHERE = {"commit hash": COMMIT, "milliseconds": MILLISECONDS, "machine name": MACHINE}
RECIPES = {**EVERYWHERE, "percentage": PERCENT}

# (file, text of the note, why it is not a measurement). Keep it short: rephrase rather than add.
ALLOWED = [
    ("speechtrain/data/augment.py", "(after 2-5 ms)", "the synthetic room's direct-path delay, a model parameter"),
]


def hash_comments(path: Path) -> list[tuple[int, str]]:
    """(line, text) of each ``#`` comment of a YAML file, the Makefile or a shell script (``@#`` in a make recipe)."""
    notes = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        found = re.search(r"(?:^|[\s@])#(.*)", line)
        if found:
            notes.append((number, found.group(1)))
    return notes


def python_notes(path: Path) -> list[tuple[int, str]]:
    """(line, text) of each comment and each docstring line (module, class, function) of a Python file."""
    text = path.read_text()
    notes = [
        (token.start[0], token.string)
        for token in tokenize.generate_tokens(io.StringIO(text).readline)
        if token.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                if isinstance(first.value.value, str):
                    notes += [(first.lineno + i, line) for i, line in enumerate(first.value.value.splitlines())]
    return notes


def recipe_files() -> list[Path]:
    return [*sorted((ROOT / "examples" / "conf").glob("*.yaml")), *sorted((ROOT / "examples").glob("slurm/*")),
            ROOT / "Makefile"]  # fmt: skip


def python_files() -> list[Path]:
    return [*sorted((ROOT / "examples").glob("*.py")), *sorted((ROOT / "speechtrain").rglob("*.py"))]


def allowed(path: Path, note: str) -> bool:
    name = path.relative_to(ROOT).as_posix()
    return any(name == file and text in note for file, text, _ in ALLOWED)


def lab_notes(path: Path, notes: list[tuple[int, str]], patterns: dict[str, re.Pattern]) -> list[str]:
    found = []
    for line, note in notes:
        for kind, pattern in patterns.items():
            match = pattern.search(note)
            if match and not allowed(path, note):
                found.append(f"{path.relative_to(ROOT)}:{line}: {kind} {match.group(0)!r}: {note.strip()}")
    return found


def test_the_patterns_tell_a_lab_note_from_an_explanation():
    assert COMMIT.search("on the demo machine, c4c2058: 18.46%") and COMMIT.search("fixed in 9a5c09e")
    for text in ("0x7fffffff", "deadbeef", "1234567", "1099511627776", "fp32 rounding"):
        assert not COMMIT.search(text), text
    assert MILLISECONDS.search("314 ms vs 77 ms") and MILLISECONDS.search("(1.5ms)")
    assert not MILLISECONDS.search("ms-level") and not MILLISECONDS.search("10 msgs")
    assert MACHINE.search("on the AMD EPYC machine") and MACHINE.search("a Zen 4") and MACHINE.search("one H200")
    assert not MACHINE.search("an intelligible voice")
    assert PERCENT.search("greedy 16.96% / 40.24%") and not PERCENT.search("--output=%x-%j.out")


def test_the_notes_are_found():
    """The extraction sees the notes it checks (so that the tests below cannot pass on nothing)."""
    assert any("BPE" in note for _, note in hash_comments(ROOT / "examples" / "conf" / "asr_train.yaml"))
    assert any("make demo" in note for _, note in hash_comments(ROOT / "Makefile"))
    notes = python_notes(ROOT / "speechtrain" / "data" / "augment.py")
    assert any("(after 2-5 ms)" in note for _, note in notes)  # a docstring line
    assert any(note.startswith("#") for _, note in notes)  # a comment


@pytest.mark.parametrize("path", recipe_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_figures_in_recipes_or_the_makefile(path):
    found = lab_notes(path, hash_comments(path), RECIPES)
    assert not found, "\n".join(["figures belong in results/*.jsonl, not in comments:", *found])


@pytest.mark.parametrize("path", python_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_lab_notes_in_docstrings_or_comments(path):
    found = lab_notes(path, python_notes(path), EVERYWHERE)
    assert not found, "\n".join(["say why in words; figures belong in results/*.jsonl:", *found])


def test_every_allowed_note_is_still_there():
    for file, text, _ in ALLOWED:
        assert any(text in note for _, note in python_notes(ROOT / file)), (file, text)
