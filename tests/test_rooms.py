"""The rooms of docs/architecture.md: the model families stay independent of each other, ``data`` and ``core``
never import each other, ``common`` imports no other room, the built-in corpora and the data tools sit at the edges,
and no module of the package imports another that imports it back. Checked on the source (every import, also inside
functions)."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "speechtrain"
ROOMS = ("asr", "backends", "common", "core", "corpora", "data", "datatools", "lightning", "nn", "speechlm",
         "testing", "tts")  # fmt: skip

# room -> rooms it must never import (module prefixes inside speechtrain). speechlm reuses the ASR encoder and
# front-end, nothing else of asr. The data tools are a leaf: only entry scripts and users call them.
FORBIDDEN = {
    "common": tuple(r for r in ROOMS if r != "common"),
    "corpora": tuple(r for r in ROOMS if r not in ("corpora", "common")),
    "backends": ("asr", "core", "corpora", "data", "datatools", "nn", "speechlm", "tts", "testing"),
    "nn": ("asr", "core", "corpora", "data", "datatools", "speechlm", "tts"),
    "lightning": ("asr", "core", "corpora", "data", "datatools", "nn", "speechlm", "tts"),
    "data": ("asr", "core", "datatools", "speechlm", "tts"),
    "core": ("asr", "corpora", "data", "datatools", "speechlm", "tts"),
    "tts": ("asr", "datatools", "speechlm"),
    "speechlm": ("asr", "datatools", "tts"),
    "asr": ("datatools", "speechlm", "tts"),
}
ALLOWED = {"speechlm": ("asr.conformer", "asr.features")}


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            found += [(node.lineno, n) for n in names if n.startswith("speechtrain.")]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("speechtrain.")]
    return found


def test_every_room_is_listed():
    rooms = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert rooms == set(ROOMS)


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


def import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports (``from a.b import c``: ``a.b.c`` when that is a module, else
    ``a.b``), imports inside functions included."""
    modules = _modules()
    graph = {m: set() for m in modules}
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                while name not in modules and "." in name:
                    name = name.rsplit(".", 1)[0]
                if name in modules and name != module:
                    graph[module].add(name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_sees_a_cycle_hidden_in_a_function():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_one_that_imports_it_back():
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)
