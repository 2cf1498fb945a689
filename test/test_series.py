"""The series against the pinned release: exact application, headers, ownership, packaging."""

from __future__ import annotations

import compileall
import hashlib
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import REPO

from forklib import ForkError
from forklib.git import out
from forklib.pin import fetch_pinned, load_pin
from forklib.series import header_problems, ownership_problems, parse_patch
from forklib.tree import STAMP_FILES, PatchError, assemble

TAG = "cp311-cp311-manylinux_2_34_x86_64"


def test_series_applies_exactly(assembled, series):
    assert [a.patch.name for a in assembled.applied] == [p.name for p in series]
    assert out(assembled.tree, "status", "--porcelain") == ""


def test_every_patch_header_is_complete(series):
    assert {p.name: header_problems(p) for p in series if header_problems(p)} == {}


def test_every_file_of_ours_is_owned_once(series):
    assert ownership_problems(series) == []


def test_tree_differs_from_upstream_only_in_the_files_the_series_names(assembled, series):
    changed = set(out(assembled.tree, "diff", "--name-only", assembled.base, "HEAD").split())
    named = {f for p in series for f in (*p.files, *p.owns)} | set(STAMP_FILES)
    assert changed == named


def test_assembled_tree_byte_compiles(assembled):
    pkg = assembled.tree / "python" / "sglang"
    assert compileall.compile_dir(str(pkg), quiet=2, workers=0, legacy=False)


def test_every_patch_imports_its_own_modules_at_its_commit(assembled, tmp_path):
    """Each patch stands alone on what precedes it (one upstream PR each): at its commit of the
    assembled tree, with no later patch applied, every module it owns imports."""
    from forklib.git import git

    wt = tmp_path / "wt"
    git(assembled.tree, "worktree", "add", "-q", "--detach", str(wt), assembled.base)
    env = {"PYTHONPATH": f"{wt / 'python'}:{REPO / 'tools' / 'standins'}", "PATH": "/usr/bin:/bin"}
    try:
        for applied in assembled.applied:
            git(wt, "checkout", "-q", "--detach", applied.commit)
            mods = [o[len("python/"):-len(".py")].replace("/", ".") for o in applied.patch.owns if o.endswith(".py")]
            run = subprocess.run([sys.executable, "-W", "ignore", "-c",
                                  "import importlib, sys\nfor m in sys.argv[1:]: importlib.import_module(m)", *mods],
                                 capture_output=True, text=True, env=env)
            assert run.returncode == 0, f"{applied.patch.name}: {run.stderr[-1500:]}"
    finally:
        git(assembled.tree, "worktree", "remove", "--force", str(wt), check=False)


def _broken_copy(tmp_path: Path, series, edit) -> Path:
    """A copy of the first patch with one hunk edited by ``edit(text) -> text``."""
    src = series[0].path
    dst = tmp_path / src.name
    dst.write_text(edit(src.read_text()))
    return dst


def _first_hunk(text: str) -> tuple[str, str]:
    m = re.search(r"^diff --git a/(\S+) .*?^(@@ -\d+,\d+ \+\d+,\d+ @@[^\n]*)$", text, re.M | re.S)
    return m.group(1), m.group(2)


def test_hunk_that_no_longer_matches_names_patch_and_hunk(tmp_path, series):
    path, header = _first_hunk(series[0].path.read_text())

    def edit(text):
        # Change one context line of the first hunk so it no longer matches upstream.
        start = text.index(header) + len(header) + 1
        line_end = text.index("\n", start)
        return text[:start] + " # drifted" + text[start:line_end].lstrip(" ") + text[line_end:]

    broken = parse_patch(_broken_copy(tmp_path, series, edit))
    wheel = fetch_pinned(load_pin(), TAG)
    with pytest.raises(PatchError) as e:
        assemble(tmp_path / "tree", wheel, load_pin().version, [broken])
    msg = str(e.value)
    assert broken.path.name in msg and path in msg and header.split(" @@")[0] in msg


def test_hunk_at_an_offset_is_an_error(tmp_path, series):
    path, header = _first_hunk(series[0].path.read_text())
    old, new = map(int, re.match(r"@@ -(\d+),\d+ \+(\d+)", header).groups())

    def edit(text):  # the hunk's text is intact, its place moved 3 lines (as upstream drift does)
        moved = header.replace(f"-{old},", f"-{old + 3},", 1).replace(f"+{new},", f"+{new + 3},", 1)
        return text.replace(header, moved, 1)

    shifted = parse_patch(_broken_copy(tmp_path, series, edit))
    wheel = fetch_pinned(load_pin(), TAG)
    with pytest.raises(PatchError, match=r"offset"):
        assemble(tmp_path / "tree", wheel, load_pin().version, [shifted])


def test_editing_tree_merges_a_drifted_patch(tmp_path, series):
    """`make tree` merges a patch that moved (git am -3) so `make refresh` can rewrite it exactly."""
    path, header = _first_hunk(series[0].path.read_text())
    old, new = map(int, re.match(r"@@ -(\d+),\d+ \+(\d+)", header).groups())
    moved = header.replace(f"-{old},", f"-{old + 3},", 1).replace(f"+{new},", f"+{new + 3},", 1)
    shifted = parse_patch(_broken_copy(tmp_path, series, lambda t: t.replace(header, moved, 1)))
    wheel = fetch_pinned(load_pin(), TAG)
    asm = assemble(tmp_path / "tree", wheel, load_pin().version, [shifted], stamp=False, three_way=True)
    exact = assemble(tmp_path / "exact", wheel, load_pin().version, series[:1], stamp=False)
    assert out(asm.tree, "rev-parse", "HEAD^{tree}") == out(exact.tree, "rev-parse", "HEAD^{tree}")


def test_editing_tree_continues_the_series_after_a_stop(tmp_path, series):
    """`tools/fork tree --continue` merges the patches a stopped editing tree has not applied yet."""
    from forklib.tree import continue_assembly

    wheel = fetch_pinned(load_pin(), TAG)
    partial = assemble(tmp_path / "tree", wheel, load_pin().version, series[:1], stamp=False)
    applied = continue_assembly(partial.tree, load_pin().version, series)
    assert [a.patch.name for a in applied] == [p.name for p in series[1:]]
    full = assemble(tmp_path / "full", wheel, load_pin().version, series, stamp=False)
    assert out(partial.tree, "rev-parse", "HEAD^{tree}") == out(full.tree, "rev-parse", "HEAD^{tree}")


@pytest.mark.slow
def test_failed_build_packages_and_installs_nothing(tmp_path, series):
    path, header = _first_hunk(series[0].path.read_text())
    patches = tmp_path / "patches"
    patches.mkdir()
    text = series[0].path.read_text()
    start = text.index(header) + len(header) + 1
    # The whole series (every python/sglang file must stay owned), the first patch drifted.
    for p in series[1:]:
        (patches / p.path.name).write_text(p.path.read_text())
    (patches / series[0].path.name).write_text(text[:start] + " # drifted" + text[start:])
    for p in series[1:]:  # the rest unchanged: every file under python/sglang keeps its owner
        (patches / p.path.name).write_text(p.path.read_text())
    (patches / "series").write_text("".join(p.path.name + "\n" for p in series))
    venv = tmp_path / "venv"
    r = subprocess.run(
        [sys.executable, str(REPO / "tools" / "fork"), "--series", str(patches / "series"),
         "--build", str(tmp_path / "build"), "build", "--install", str(venv)],
        capture_output=True, text=True,
    )
    assert r.returncode == 1
    assert series[0].path.name in r.stderr and path in r.stderr
    assert not list((tmp_path / "build").glob("dist/*.whl"))
    assert not venv.exists()


def test_unknown_release_is_a_clear_error(tmp_path, monkeypatch):
    from forklib.pin import fetch_wheel

    monkeypatch.setenv("FORK_CACHE", str(tmp_path))
    with pytest.raises(ForkError, match=r"0\.5\.999.*released version"):
        fetch_wheel("sglang", "0.5.999", TAG, None)


def test_hash_mismatch_is_refused_and_the_file_dropped(tmp_path, monkeypatch):
    from forklib.pin import cache_dir, fetch_wheel, wheel_name

    monkeypatch.setenv("FORK_CACHE", str(tmp_path))
    fake = cache_dir() / wheel_name("sglang", "0.5.23", TAG)
    fake.write_bytes(b"not the release")
    with pytest.raises(ForkError, match="does not match the pinned"):
        fetch_wheel("sglang", "0.5.23", TAG, load_pin().sha256(TAG))
    assert not fake.exists()


def _built_wheel() -> Path:
    wheels = sorted((REPO / "build" / "dist").glob("sglang-*.whl"))
    assert len(wheels) == 1, "run `make` first: build/dist holds no fork wheel"
    return wheels[0]


def test_wheel_version_says_what_it_is(series):
    name = _built_wheel().name
    m = re.match(r"sglang-(\d+\.\d+\.\d+)\+fork\.(\d+)\.([0-9a-f]{7})-cp", name)
    assert m and m.group(1) == load_pin().version and int(m.group(2)) == len(series)


def test_wheel_carries_upstream_compiled_files_unchanged():
    upstream = fetch_pinned(load_pin(), TAG)

    def so_files(path):
        with zipfile.ZipFile(path) as zf:
            return {
                n: hashlib.sha256(zf.read(n)).hexdigest() for n in zf.namelist() if n.endswith(".so")
            }

    ours, theirs = so_files(_built_wheel()), so_files(upstream)
    assert theirs and ours == theirs


@pytest.mark.slow
def test_wheel_installs_into_a_fresh_venv(tmp_path):
    wheel = _built_wheel()
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-compile", str(wheel)], check=True
    )
    version = wheel.name.split("-")[1]
    # sglang/__init__ needs the whole dependency set; read what was installed instead.
    probe = (
        "import importlib.metadata as md; d = md.distribution('sglang'); "
        "print(d.version); print(d.locate_file('sglang/_version.py').read_text()); "
        "print(d.locate_file('sglang/_fork_manifest.json').read_text())"
    )
    r = subprocess.run([str(py), "-c", probe], capture_output=True, text=True, check=True)
    assert r.stdout.splitlines()[0] == version
    assert f"__version__ = version = {version!r}" in r.stdout
    assert f'"version": "{version}"' in r.stdout


def test_every_flag_is_in_the_readme_flag_table(series):
    table = [line for line in (REPO / "README.md").read_text().splitlines() if line.startswith("| `--")]
    documented = {re.match(r"\| `(--[a-z0-9-]+)", line).group(1) for line in table}
    assert {f for p in series for f in p.flags} - documented == set()


def test_a_patch_that_only_adds_our_files_round_trips(tmp_path):
    """A commit that edits no upstream file (a utility module a later patch calls) becomes a
    header with an empty diff, not the last commit that did edit upstream (path-limited
    format-patch walks back to it), and applies again as the same commit."""
    from forklib.git import git
    from forklib.tree import apply_patch, commit_patch, owned_files

    tree = tmp_path / "tree"
    tree.mkdir()
    git(tree, "init", "-q")
    (tree / "python" / "sglang").mkdir(parents=True)
    (tree / "python" / "sglang" / "up.py").write_text("x = 1\n")
    git(tree, "add", "-A")
    git(tree, "commit", "-qm", "upstream")
    base = out(tree, "rev-parse", "HEAD")
    (tree / "python" / "sglang" / "up.py").write_text("x = 2\n")
    git(tree, "commit", "-qam", "edit upstream\n\nServer-Args: none")
    (tree / "python" / "sglang" / "ours.py").write_text("y = 1\n")
    git(tree, "add", "-A")
    git(tree, "commit", "-qm", "add a module of ours\n\nBody line.\n\nServer-Args: none")
    commit = out(tree, "rev-parse", "HEAD")
    owns = owned_files(tree, commit)
    assert owns == ["python/sglang/ours.py"]
    text = commit_patch(tree, commit, owns)
    assert "Subject: [PATCH] add a module of ours" in text and "diff --git" not in text
    assert "Owns: python/sglang/ours.py" in text
    patch_file = tmp_path / "0002-add.patch"
    patch_file.write_text(text)
    patch = parse_patch(patch_file)
    assert patch.files == () and patch.owns == ["python/sglang/ours.py"]
    src = tmp_path / "src"
    (src / "python" / "sglang").mkdir(parents=True)
    (src / "python" / "sglang" / "ours.py").write_text("y = 1\n")
    git(tree, "checkout", "-q", "--detach", base)
    again = apply_patch(tree, patch, src)
    assert out(tree, "log", "-1", "--format=%B", again).startswith("add a module of ours\n\nBody line.")
    assert commit_patch(tree, again, owns) == text
