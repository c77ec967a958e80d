"""verl_ds's modules import each other without a cycle: module-level and function-local imports alike (a local
import is still a dependency; it only hides the cycle from the interpreter), relative imports resolved."""
from __future__ import annotations

import ast
import os
import sys

import verl_ds

ROOT = os.path.dirname(verl_ds.__file__)


def _modules() -> dict[str, str]:
    """dotted module name -> file, for every .py under verl_ds/ (a package is its __init__)."""
    out = {}
    for dirpath, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, name), os.path.dirname(ROOT))[:-3].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                out[".".join(rel)] = os.path.join(dirpath, name)
    return out


def _resolve(target: str, modules: dict) -> str | None:
    """The verl_ds module ``target`` names (``a.b.c`` may be the name ``c`` inside module ``a.b``), or None."""
    while target:
        if target in modules:
            return target
        target = target.rpartition(".")[0]
    return None


def import_graph() -> dict[str, set]:
    """module -> the verl_ds modules it imports anywhere in its file (``import x``, ``from x import y``, relative)."""
    modules = _modules()
    graph = {}
    for mod, path in modules.items():
        package = mod if path.endswith("__init__.py") else mod.rpartition(".")[0]
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), path)
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    parts = parts[:len(parts) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                names = [f"{base}.{a.name}" for a in node.names] + [base]
            else:
                continue
            for name in names:
                found = _resolve(name, modules) if name.startswith("verl_ds") else None
                while found:  # importing a.b.c runs a/__init__ and a/b/__init__ first: those are dependencies too
                    # ... except the module's own packages (verl_ds.config from verl_ds.config.schema): Python has
                    # started them before the module, as their part, so that is not a cycle
                    if found != mod and not mod.startswith(found + "."):
                        deps.add(found)
                    found = found.rpartition(".")[0]
        graph[mod] = deps
    return graph


def find_cycle(graph: dict[str, set]) -> list | None:
    """One cycle as ``[a, b, ..., a]``, or None (iterative depth-first search, modules in sorted order)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def all_cycles(graph: dict[str, set]) -> list[list]:
    """Cycles until none is left, each found and then cut at its last edge (so every tangle is named)."""
    graph = {k: set(v) for k, v in graph.items()}
    found = []
    while (cycle := find_cycle(graph)) is not None:
        found.append(cycle)
        graph[cycle[-2]].discard(cycle[-1])
    return found


def test_the_checker_sees_cycles_and_local_imports(tmp_path, monkeypatch):
    """The checker itself, on a package written here: a cycle through a function-local relative import is
    found, and a package's __init__ counts as imported by its submodules' importers."""
    pkg = tmp_path / "verl_ds"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("import os\nfrom verl_ds.sub.c import x\n")
    (pkg / "sub" / "__init__.py").write_text("from . import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..a import y\n")
    (pkg / "sub" / "c.py").write_text("x = 1\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(pkg))
    graph = import_graph()
    assert graph["verl_ds.a"] == {"verl_ds.sub.c", "verl_ds.sub"} and graph["verl_ds.sub.b"] == {"verl_ds.a"}
    assert all_cycles(graph) == [["verl_ds.a", "verl_ds.sub", "verl_ds.sub.b", "verl_ds.a"]]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle_in_verl_ds():
    graph = import_graph()
    assert len(graph) > 50 and "verl_ds.config.schema" in graph["verl_ds.config.validate"]
    cycles = all_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)
