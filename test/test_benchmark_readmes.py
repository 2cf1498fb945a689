"""benchmark/ by feature: each folder's README lists exactly the scripts in it, every result file in
benchmark/results/ is listed by some README with the script or tool that wrote it (archive/ lists
its own), every README link
resolves, removed probes are gone, and every script finds its helpers (harness.py, a sibling module)
from where it now lives, the way `python benchmark/<folder>/<script>.py` runs it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from conftest import REPO

BENCH = REPO / "benchmark"
RESULTS = BENCH / "results"
FOLDERS = sorted(
    p
    for p in BENCH.iterdir()
    if p.is_dir() and p.name not in ("results", "__pycache__")
)
SCRIPTS = sorted(p for folder in FOLDERS for p in folder.glob("*.py"))


def _section(text: str, title: str) -> str:
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    return m.group(1) if m else ""


def _first_cells(table: str) -> list[str]:
    """The backticked name in the first cell of each table row (header and rule rows skipped)."""
    return re.findall(r"^\| `([^`]+)` \|", table, re.M)


def test_scripts_live_in_feature_folders():
    assert sorted(p.name for p in BENCH.glob("*.py")) == ["harness.py"]
    assert FOLDERS and all((f / "README.md").is_file() for f in FOLDERS)


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: p.name)
def test_readme_lists_exactly_the_folders_scripts(folder):
    listed = _first_cells(_section((folder / "README.md").read_text(), "Scripts"))
    assert sorted(listed) == sorted(p.name for p in folder.glob("*.py"))


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: p.name)
def test_removed_probes_are_gone_and_their_results_stay(folder):
    removed = _section((folder / "README.md").read_text(), "Removed probes")
    for line in (l for l in removed.splitlines() if l.startswith("| `")):
        name = _first_cells(line)[0]
        assert not list(
            BENCH.rglob(name)
        ), f"{name} is listed as removed but is still in benchmark/"
        assert (
            "../results/" in line or "awaits a re-run" in line
        ), f"{name}: its result file is not linked, nor marked as awaiting a re-run"


def test_every_readme_link_resolves():
    for readme in [BENCH / "README.md", *(f / "README.md" for f in FOLDERS)]:
        for target in re.findall(r"\]\(([^)#]+)\)", readme.read_text()):
            if "://" not in target:
                assert (
                    readme.parent / target
                ).exists(), f"{readme.relative_to(REPO)}: {target}"


def test_every_result_file_is_listed_with_its_writer():
    """A result row names the file in its first cell (a link) and who wrote it in the second."""
    rows = {}
    for readme in [BENCH / "README.md", *(f / "README.md" for f in FOLDERS)]:
        text = readme.read_text()
        for line in text.splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) >= 2 and "results/" in cells[0]:
                for name in re.findall(r"results/([^)]+?)/?\)", cells[0]):
                    rows[name] = cells[1]
        for line in _section(
            text, "Removed probes"
        ).splitlines():  # | probe | what | result files |
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            for name in re.findall(r"results/([^)]+?)/?\)", " ".join(cells[2:])):
                rows.setdefault(name, cells[0])
    # archive/ lists its own files; a sidecar is listed with the file it describes
    files = sorted(
        p.name
        for p in RESULTS.iterdir()
        if p.is_file() and not p.name.endswith(".provenance.json")
    )
    assert [f for f in files if f not in rows] == []
    assert all(rows[f] for f in files)


def _local_imports(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    local = {p.stem for p in BENCH.rglob("*.py")}
    return names & local


def _search_path(script: Path, tree: ast.Module) -> list[Path]:
    """sys.path as the script sees it: its own folder, then each top-level
    ``sys.path.insert(0, str(<expr>))``, evaluated with ``__file__`` the script."""
    ns: dict = {"Path": Path, "__file__": str(script)}
    path = [script.parent]
    for node in tree.body:
        src = ast.get_source_segment(script.read_text(), node) or ""
        if isinstance(node, ast.Assign) and "__file__" in src:
            exec(compile(ast.Module([node], []), str(script), "exec"), ns)
        elif isinstance(node, ast.Expr) and src.startswith("sys.path.insert("):
            call = node.value
            path.insert(
                0,
                Path(
                    eval(compile(ast.Expression(call.args[1]), str(script), "eval"), ns)
                ),
            )
    return path


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_script_finds_its_benchmark_helpers(script):
    tree = ast.parse(script.read_text())
    path = _search_path(script, tree)
    for name in sorted(_local_imports(tree)):
        assert any((d / f"{name}.py").is_file() for d in path), f"{name} not on {path}"
