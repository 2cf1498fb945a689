"""Nothing dead in the wheel: every module of ours under python/sglang/ is reached by the engine.

A module is reached when a patch's hunk in an upstream file imports it (the wiring), or when a
module that is reached imports it, transitively; a package is reached with any module in it. A
module nothing reaches ships code no flag can run: it belongs beside its tests or benchmark
(test/, benchmark/<area>/), not in the wheel. Imports are read with ``ast`` from our modules and
from the lines the hunks add (absolute ``import`` / ``from ... import``, relative imports, a
submodule imported from its package, and a module named as a string, for lazy imports).
"""

from __future__ import annotations

import ast
import re

from conftest import REPO


def _module(path: str) -> str:
    """python/sglang/a/b.py -> sglang.a.b; python/sglang/a/__init__.py -> sglang.a."""
    return (
        path[len("python/") : -len(".py")].replace("/", ".").removesuffix(".__init__")
    )


def _imports(source: str, module: str, is_package: bool) -> set[str]:
    """Every dotted name ``source`` imports (a ``from X import y`` gives X and X.y), plus every
    string constant that looks like a dotted ``sglang.`` name."""
    names: set[str] = set()
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            names.add(base)
            names |= {f"{base}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if re.fullmatch(r"sglang(\.\w+)+", node.value):
                names.add(node.value)
    return names


def _added_source(patch_text: str) -> str:
    """The lines the patch's hunks add to upstream files, dedented per line (enough for ``ast``
    once each import statement is read alone)."""
    diff = patch_text.partition("\n---\n")[2]
    return "\n".join(
        line[1:]
        for line in diff.splitlines()
        if line.startswith("+") and not line.startswith("+++")
    )


def _hunk_imports(added: str) -> set[str]:
    """Imports in added hunk lines: each statement parsed alone (hunks are not whole modules)."""
    names: set[str] = set()
    statements = re.findall(
        r"^[ \t]*((?:from\s+\S+\s+import\s+(?:\([^)]*\)|[^\n]*))|(?:import\s+[^\n]*))",
        added,
        re.M,
    )
    for stmt in statements:
        try:
            names |= _imports(stmt.strip(), "sglang", True)
        except SyntaxError:
            continue
    names |= set(re.findall(r"[\"'](sglang(?:\.\w+)+)[\"']", added))
    return names


def unreachable(ours: dict[str, str], hunks: list[str]) -> list[str]:
    """The modules of ``ours`` (dotted name -> source; a package's name is its __init__'s) that
    no hunk reaches, directly or through modules of ours."""
    packages = {m for m in ours if any(o.startswith(m + ".") for o in ours)}
    edges = {m: _imports(src, m, m in packages) for m, src in ours.items()}
    frontier = set().union(*(_hunk_imports(h) for h in hunks)) if hunks else set()
    reached: set[str] = set()
    while frontier:
        name = frontier.pop()
        for m in ours:
            # importing a.b.c imports a.b too; importing a package's name reaches its __init__
            if m not in reached and (m == name or name.startswith(m + ".")):
                reached.add(m)
                frontier |= edges[m]
    # a package is reached with any module in it
    reached |= {p for p in packages if any(m.startswith(p + ".") for m in reached)}
    return sorted(set(ours) - reached)


def test_every_module_of_ours_is_reached_by_the_engine(series):
    ours = {
        _module(own): (REPO / own).read_text()
        for p in series
        for own in p.owns
        if own.endswith(".py")
    }
    hunks = [_added_source(p.path.read_text()) for p in series]
    assert ours and unreachable(ours, hunks) == []


def test_a_module_nothing_imports_is_found():
    hunk = "+from sglang.srt.ours.a import run\n+    import sglang.srt.ours.lazy\n"
    ours = {
        "sglang.srt.ours.a": "from .b import helper\n",
        "sglang.srt.ours.b": "from sglang.srt.ours import c\n",
        "sglang.srt.ours.c": "X = 1\n",
        "sglang.srt.ours.lazy": "Y = 'sglang.srt.ours.by_name'\n",
        "sglang.srt.ours.by_name": "Z = 3\n",
        "sglang.srt.ours.dead": "from sglang.srt.ours.c import X\n",
    }
    assert unreachable(ours, [_added_source("head\n---\n" + hunk)]) == [
        "sglang.srt.ours.dead"
    ]
    # Without the hunk, nothing of ours is reached.
    assert unreachable(ours, []) == sorted(ours)


def test_a_multiline_import_in_a_hunk_reaches_its_module():
    hunk = (
        "head\n---\n"
        "+from sglang.srt.ours.args import (\n"
        "+    parse_x,\n"
        "+    parse_y,\n"
        "+)\n"
    )
    assert unreachable({"sglang.srt.ours.args": ""}, [_added_source(hunk)]) == []
