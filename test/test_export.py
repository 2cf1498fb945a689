"""`tools/fork export`: one patch as a diff that applies alone to a clean upstream tree."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from fakefork import BASE, TAG, Spec, make_fork, set_line
from forklib import ForkError
from forklib.export import export
from forklib.hooks import check_diff
from forklib.pin import fetch_pinned, load_pin

SPECS = [
    Spec("first", {"python/sglang/a.py": lambda t: set_line(t, 5, "a5 = 'first'")}),
    Spec(
        "module",
        {"python/sglang/e.py": lambda t: set_line(t, 5, "from sglang.extra import X")},
        owns={"python/sglang/extra.py": "X = 'ours'\n"},
    ),
    # Its context is patch 0001's line: it cannot apply without it.
    Spec(
        "needs-first", {"python/sglang/a.py": lambda t: set_line(t, 6, "a6 = 'second'")}
    ),
]


def clean_tree(wheel: Path, dest: Path) -> Path:
    """The wheel's sglang/ under python/, as upstream's repository lays it out."""
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            if name.startswith("sglang/") and not name.endswith("/"):
                zf.extract(name, dest / "python")
    return dest


def applies(diff: Path, tree: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["git", "apply", "--check", str(diff)], cwd=tree, capture_output=True, text=True
    )


@pytest.fixture
def fork(tmp_path, monkeypatch):
    monkeypatch.setenv("FORK_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    make_fork(tmp_path / "fork", tmp_path / "cache", "1.0.0", BASE, SPECS)
    return tmp_path / "fork"


def test_export_is_self_contained(fork, tmp_path):
    diff, md = export("2", root=fork)
    text = diff.read_text()
    assert (
        "python/sglang/e.py" in text
        and "new file mode" in text
        and "python/sglang/extra.py" in text
    )
    assert "sglang/a.py" not in text and "first" not in text  # nothing of another patch
    wheel = tmp_path / "cache/wheels" / f"sglang-1.0.0-{TAG}.whl"
    assert applies(diff, clean_tree(wheel, tmp_path / "clean")).returncode == 0
    desc = md.read_text()
    assert "# module: change things" in desc and "Body of module." in desc
    assert (
        "test module" in desc
        and "not sent" in desc
        and "`python/sglang/extra.py` (new)" in desc
    )
    assert "Why: test" not in desc  # trailers are fields, not body text


def test_export_names_the_patch_it_depends_on(fork):
    """0003's hunk has 0001's line as context: adjacency, named with the line, and the
    advice is to move ours (Depends: only where the code is used)."""
    with pytest.raises(
        ForkError,
        match=r"(?s)0003-needs-first does not apply alone.*0001-first's line\(s\) as context "
        r"\(python/sglang/a.py:5 `a5 = 'first'`\).*adjacency, not a dependence. Move our line",
    ):
        export("0003-needs-first", root=fork)
    assert not (fork / "build/export/0003-needs-first.diff").exists()


def test_every_real_patch_exports_alone(tmp_path, series):
    """Each patch of the series, alone with the files it owns, applies to a clean tree of the
    pinned release and passes upstream's Python pre-commit hooks there."""
    tree = clean_tree(fetch_pinned(load_pin(), TAG), tmp_path / "clean")

    def export_some(
        worker: int,
    ) -> None:  # each worker its own build tree; most of the time is the import check
        for patch in series[worker::2]:
            diff, md = export(patch.name, out_dir=tmp_path / f"export{worker}")
            r = applies(diff, tree)
            assert r.returncode == 0, f"{patch.name}: {r.stderr}"
            text = diff.read_text()
            assert all(f"b/{own}" in text for own in patch.owns)
            assert all(flag in md.read_text() for flag in patch.flags)
            # upstream's Python pre-commit hooks, on our lines (test_export_hooks.py)
            hooks = check_diff(diff, tree, Path(sys.executable).parent)
            problems.extend(f"{patch.name}: {p}" for p in hooks)

    problems: list[str] = []
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(export_some, range(2)))
    assert problems == [], "\n".join(problems)


# ---------------------------------------------------------------------------- dependencies

DEP_SPECS = [
    Spec(
        "helper",
        {"python/sglang/a.py": lambda t: set_line(t, 5, "a5 = 'helper'")},
        owns={"python/sglang/helper.py": "H = 1\n"},
    ),
    Spec(
        "user",
        {"python/sglang/b.py": lambda t: set_line(t, 5, "b5 = 'user'")},
        owns={"python/sglang/user.py": "from sglang.helper import H\n"},
    ),
    # Imports a name an earlier patch adds to an upstream file: only an import shows it.
    Spec("adds", {"python/sglang/c.py": lambda t: set_line(t, 5, "def added(): pass")}),
    Spec("uses", {}, owns={"python/sglang/uses.py": "from sglang.c import added\n"}),
]


def _with_depends(root, name, dep):
    from forklib.git import git

    path = root / "patches" / f"{name}.patch"
    path.write_text(
        path.read_text().replace(
            "Tests: test/test_x.py\n", f"Tests: test/test_x.py\nDepends: {dep}\n", 1
        )
    )
    git(root, "commit", "-qam", f"{name} depends on {dep}")


@pytest.fixture
def dep_fork(tmp_path, monkeypatch):
    monkeypatch.setenv("FORK_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    root = tmp_path / "fork"
    make_fork(root, tmp_path / "cache", "1.0.0", BASE, DEP_SPECS)
    return root


def test_check_requires_a_depends_where_a_patch_imports_anothers_module(dep_fork):
    from forklib.series import check_series, load_series

    with pytest.raises(
        ForkError,
        match=r"0002-user.patch: imports sglang.helper, which 0001-helper owns: add `Depends: 0001-helper`",
    ):
        check_series(load_series(dep_fork / "patches/series"), dep_fork)
    _with_depends(dep_fork, "0002-user", "0001-helper")
    check_series(load_series(dep_fork / "patches/series"), dep_fork)
    _with_depends(dep_fork, "0001-helper", "0004-uses")
    with pytest.raises(
        ForkError, match=r"0001-helper.patch: Depends 0004-uses, which comes after it"
    ):
        check_series(load_series(dep_fork / "patches/series"), dep_fork)


def test_export_carries_what_the_patch_depends_on(dep_fork, tmp_path):
    _with_depends(dep_fork, "0002-user", "0001-helper")
    diff, md = export("2", root=dep_fork)
    text = diff.read_text()
    assert (
        "b/python/sglang/helper.py" in text and "a5 = 'helper'" in text
    )  # the dependency, carried
    assert "b/python/sglang/user.py" in text and "b5 = 'user'" in text
    wheel = tmp_path / "cache/wheels" / f"sglang-1.0.0-{TAG}.whl"
    assert applies(diff, clean_tree(wheel, tmp_path / "clean")).returncode == 0
    assert "0001-helper" in md.read_text() and "depends on" in md.read_text()


def test_export_refuses_a_patch_whose_modules_do_not_import_alone(dep_fork):
    _with_depends(dep_fork, "0002-user", "0001-helper")
    with pytest.raises(
        ForkError,
        match=r"(?s)0004-uses.*sglang.uses does not import.*ImportError.*added.*Depends:",
    ):
        export("4", root=dep_fork)
    assert not (dep_fork / "build/export/0004-uses.diff").exists()
    _with_depends(dep_fork, "0004-uses", "0003-adds")
    diff, _ = export("4", root=dep_fork)
    assert "def added(): pass" in diff.read_text()


def test_check_reads_imports_with_ast(dep_fork):
    """``from pkg import module``, a lazy import inside a function and a relative import all
    name the module another patch owns; the check fails on each until `Depends:` says so.
    """
    from forklib.series import check_series, imports_in, load_series, series_problems

    assert "sglang.helper" in imports_in("from sglang import helper\n", None)
    assert "sglang.helper" in imports_in("def f():\n    import sglang.helper\n", None)
    assert "sglang.helper" in imports_in("from . import helper\n", ["sglang"])
    assert "sglang.helper" not in imports_in("# from sglang import helper\n", None)
    user = dep_fork / "python/sglang/user.py"
    for text in (
        "from sglang import helper\n",
        "def f():\n    from sglang.helper import H\n",
        "from . import helper\n",
    ):
        user.write_text(text)
        with pytest.raises(
            ForkError,
            match=r"0002-user.patch: imports sglang.helper, which 0001-helper",
        ):
            check_series(load_series(dep_fork / "patches/series"), dep_fork)
    user.write_text("from sglang import c\n")  # an upstream module: no Depends needed
    problems = series_problems(load_series(dep_fork / "patches/series"), dep_fork)
    assert [p for p in problems if "0002-user" in p] == []


def test_every_git_call_goes_through_git_py_in_the_c_locale(tmp_path, monkeypatch):
    """git's messages are matched by the tools: each call runs with LC_ALL=C even when the
    caller's locale says otherwise, and no forklib module runs git on its own."""
    import ast

    import forklib
    from forklib import git as gitmod

    monkeypatch.setenv("LC_ALL", "de_DE.UTF-8")
    monkeypatch.setenv("LANGUAGE", "de")
    seen = {}
    real = subprocess.run

    def spy(cmd, **kw):
        seen.update(kw["env"])
        return real(cmd, **kw)

    monkeypatch.setattr(gitmod.subprocess, "run", spy)
    gitmod.git(tmp_path, "--version")
    assert seen["LC_ALL"] == "C" and seen["LANGUAGE"] == "C"
    bypass = []
    for f in sorted(Path(forklib.__file__).parent.glob("*.py")):
        if f.name == "git.py":
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.List) and any(
                isinstance(e, ast.Constant) and e.value == "git" for e in node.elts[:1]
            ):
                bypass.append(f"{f.name}:{node.lineno}")
    assert bypass == [], f"git run outside forklib/git.py: {bypass}"
