"""How verl_ds's code is written (README, "How the code is written"): modules of at most 400 lines, module
docstrings that say what a module is for in at most five lines (the detail lives in docs/), no issue numbers or
benchmark diaries in code (their history is in git, their figures in benchmarks/README.md)."""
from __future__ import annotations

import ast
import os
import re

import pytest

import verl_ds

PACKAGE = os.path.dirname(os.path.abspath(verl_ds.__file__))
MAX_LINES = 400
MAX_MODULE_DOC_LINES = 5
ISSUE_NUMBER = re.compile(r"\b[Ii]ssues? \d+")  # ours; a peer's is cited with its repository and #


def _sources(root: str = PACKAGE) -> dict[str, str]:
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                with open(path, encoding="utf-8") as fh:
                    out[os.path.relpath(path, os.path.dirname(root))] = fh.read()
    return out


def long_modules(sources: dict[str, str]) -> list[str]:
    return [f"{p}: {n} lines" for p, s in sorted(sources.items()) if (n := len(s.splitlines())) > MAX_LINES]


def long_module_docstrings(sources: dict[str, str]) -> list[str]:
    out = []
    for path, src in sorted(sources.items()):
        body = ast.parse(src).body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            n = body[0].end_lineno - body[0].lineno + 1
            if n > MAX_MODULE_DOC_LINES:
                out.append(f"{path}: a module docstring of {n} lines")
    return out


def issue_numbers(sources: dict[str, str]) -> list[str]:
    return [f"{p}:{i}: {line.strip()}" for p, s in sorted(sources.items())
            for i, line in enumerate(s.splitlines(), 1) if ISSUE_NUMBER.search(line)]


@pytest.mark.parametrize("rule", [long_modules, long_module_docstrings, issue_numbers], ids=lambda f: f.__name__)
def test_the_package_keeps_the_rule(rule):
    offenders = rule(_sources())
    assert not offenders, f"{rule.__name__}:\n" + "\n".join(offenders)


def test_each_rule_sees_its_offence():
    long_doc = '"""' + "\n".join(["line"] * 6) + '"""\nx = 1\n'
    sources = {"a.py": "x = 1\n" * 401, "b.py": long_doc, "c.py": "# measured in issue 32\n",
               "d.py": '"""Five\nlines\nare\nfine\nhere."""\n# see the issues page\n'}
    assert long_modules(sources) == ["a.py: 401 lines"]
    assert long_module_docstrings(sources) == ["b.py: a module docstring of 6 lines"]
    assert issue_numbers(sources) == ["c.py:1: # measured in issue 32"]
