"""The rooms of DESIGN.md: the model families stay independent of each other, ``data`` and ``core`` never import
each other, and ``common`` imports no other room. Checked on the source (every import, also inside functions)."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "speechtrain"

# room -> rooms it must never import (module prefixes inside speechtrain). speechlm reuses the ASR encoder and
# front-end (DESIGN.md), nothing else of asr.
FORBIDDEN = {
    "common": ("asr", "core", "data", "lightning", "nn", "speechlm", "tts", "testing"),
    "nn": ("asr", "core", "data", "speechlm", "tts"),
    "lightning": ("asr", "core", "data", "nn", "speechlm", "tts"),
    "data": ("asr", "core", "speechlm", "tts"),
    "core": ("asr", "data", "speechlm", "tts"),
    "tts": ("asr", "speechlm"),
    "speechlm": ("asr", "tts"),
    "asr": ("speechlm", "tts"),
}
ALLOWED = {"speechlm": ("asr.conformer", "asr.features")}


def _imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            found += [(node.lineno, n) for n in names if n.startswith("speechtrain.")]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("speechtrain.")]
    return found


@pytest.mark.parametrize("room", sorted(FORBIDDEN))
def test_room_imports_only_what_it_may(room):
    bad = []
    for path in sorted((PACKAGE / room).rglob("*.py")):
        for line, name in _imports(path):
            target = name.split(".", 1)[1]
            if any(target.startswith(a) for a in ALLOWED.get(room, ())):
                continue
            if target.split(".")[0] in FORBIDDEN[room]:
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}")
    assert not bad, "\n".join(bad)
