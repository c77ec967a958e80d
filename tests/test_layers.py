"""Layers of verl_ds that imports must respect, counting imports inside functions: ``verl_ds.config`` is data and
imports nothing of the package outside itself (registries check their names in ``verl_ds.run``), and the floors
(packages and top-level modules, README "How the code is written") import each other without a cycle."""
from __future__ import annotations

import ast
import graphlib
import os

import verl_ds

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(verl_ds.__file__)))  # the directory holding verl_ds/


def _inside(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _imported(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """The dotted names an import node (or an ``importlib.import_module("...")`` call) brings in, relative resolved."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            parts = module.split(".")[:len(module.split(".")) - node.level + is_package]
            base = ".".join(parts + ([base] if base else []))
        return [f"{base}.{a.name}" for a in node.names]
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
            and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
        return [node.args[0].value]
    return []


def _parsed(package: str, root: str):
    """(path, dotted module, whether it is a package's __init__, its AST) for each .py file of ``package``."""
    for dirpath, _, files in os.walk(os.path.join(root, *package.split("."))):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, root)[:-3].split(os.sep)
                is_package = rel[-1] == "__init__"
                with open(path, encoding="utf-8") as fh:
                    yield path, ".".join(rel[:-1] if is_package else rel), is_package, ast.parse(fh.read(), path)


def imports_outside(package: str, root: str = ROOT, top: str = "verl_ds") -> list[str]:
    """``path:line: name`` for each import of a ``top`` module outside ``package`` (dotted, a directory under
    ``root``) anywhere in the package's files: module level and function-local, relative imports resolved."""
    offenders = []
    for path, module, is_package, tree in _parsed(package, root):
        found = sorted((node.lineno, target) for node in ast.walk(tree)
                       for target in _imported(node, module, is_package))
        offenders += [f"{os.path.relpath(path, root)}:{line}: {target}" for line, target in found
                      if _inside(target, top) and not _inside(target, package)]
    return offenders


def test_the_checker_sees_local_relative_and_dynamic_imports(tmp_path):
    pkg = tmp_path / "verl_ds" / "config"
    pkg.mkdir(parents=True)
    (tmp_path / "verl_ds" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from .a import x\nfrom . import b\n")
    (pkg / "a.py").write_text("import os\nfrom verl_ds.config.b import y\nx = 1\n"
                              "def f():\n    from ..algos import kl\n    import verl_ds.rewards\n")
    (pkg / "b.py").write_text("import importlib\ny = importlib.import_module('verl_ds.agent.registry')\n"
                              "from verl_ds import checkpoint\n")
    found = imports_outside("verl_ds.config", str(tmp_path))
    assert sorted(found) == sorted([os.path.join("verl_ds", "config", "a.py") + ":5: verl_ds.algos.kl",
                                    os.path.join("verl_ds", "config", "a.py") + ":6: verl_ds.rewards",
                                    os.path.join("verl_ds", "config", "b.py") + ":2: verl_ds.agent.registry",
                                    os.path.join("verl_ds", "config", "b.py") + ":3: verl_ds.checkpoint"])


def test_config_imports_nothing_outside_config():
    offenders = imports_outside("verl_ds.config")
    assert not offenders, ("verl_ds.config is data: it imports nothing of verl_ds outside itself (a check that needs "
                           "a registry belongs to verl_ds.run):\n" + "\n".join(offenders))


def package_graph(root: str = ROOT, top: str = "verl_ds") -> dict[str, set]:
    """Floor -> the floors it imports anywhere (module level or inside a function): a floor is a package directly
    under ``top`` or a module directly in it."""
    graph: dict[str, set] = {}
    for _, module, is_package, tree in _parsed(top, root):
        if module == top:
            continue
        floor = module.split(".")[1]
        deps = graph.setdefault(floor, set())
        for node in ast.walk(tree):
            for target in _imported(node, module, is_package):
                parts = target.split(".")
                if parts[0] == top and len(parts) > 1 and parts[1] != floor:
                    deps.add(parts[1])
    return graph


def package_cycle(graph: dict[str, set]) -> list[str] | None:
    """One cycle between floors as ``[a, b, ..., a]``, or None."""
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as exc:
        return list(exc.args[1])
    return None


def test_the_package_checker_sees_a_cycle_through_a_local_import(tmp_path):
    pkg = tmp_path / "verl_ds"
    (pkg / "engines").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "engines" / "__init__.py").write_text("from .build import make\n")
    (pkg / "engines" / "build.py").write_text("from verl_ds.models import policy\ndef make():\n    pass\n")
    (pkg / "models.py").write_text("def sample():\n    from verl_ds.engines import build\n")
    (pkg / "config.py").write_text("")
    graph = package_graph(str(tmp_path))
    assert graph == {"engines": {"models"}, "models": {"engines"}, "config": set()}
    assert sorted(package_cycle(graph)[:2]) == ["engines", "models"]
    (pkg / "models.py").write_text("from verl_ds import config\n")
    assert package_cycle(package_graph(str(tmp_path))) is None


def test_packages_import_each_other_without_a_cycle():
    """Each package and top-level module of verl_ds is a floor: a floor may import those below it, never one above
    (README, "How the code is written", lists them from the bottom up)."""
    cycle = package_cycle(package_graph())
    assert cycle is None, "floors of verl_ds import each other in a cycle: " + " -> ".join(cycle)
