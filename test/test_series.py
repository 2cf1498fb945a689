"""The series against the pinned release: exact application, headers, ownership, packaging."""

from __future__ import annotations

import ast
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


def test_tree_differs_from_upstream_only_in_the_files_the_series_names(
    assembled, series
):
    changed = set(
        out(assembled.tree, "diff", "--name-only", assembled.base, "HEAD").split()
    )
    named = {f for p in series for f in (*p.files, *p.owns)} | set(STAMP_FILES)
    assert changed == named


def test_assembled_tree_byte_compiles(assembled):
    pkg = assembled.tree / "python" / "sglang"
    assert compileall.compile_dir(str(pkg), quiet=2, workers=0, legacy=False)


def _broken_copy(tmp_path: Path, series, edit) -> Path:
    """A copy of the first patch with one hunk edited by ``edit(text) -> text``."""
    src = series[0].path
    dst = tmp_path / src.name
    dst.write_text(edit(src.read_text()))
    return dst


def _first_hunk(text: str) -> tuple[str, str]:
    m = re.search(
        r"^diff --git a/(\S+) .*?^(@@ -\d+,\d+ \+\d+,\d+ @@[^\n]*)$", text, re.M | re.S
    )
    return m.group(1), m.group(2)


def test_hunk_that_no_longer_matches_names_patch_and_hunk(tmp_path, series):
    path, header = _first_hunk(series[0].path.read_text())

    def edit(text):
        # Change one context line of the first hunk so it no longer matches upstream.
        start = text.index(header) + len(header) + 1
        line_end = text.index("\n", start)
        return (
            text[:start]
            + " # drifted"
            + text[start:line_end].lstrip(" ")
            + text[line_end:]
        )

    broken = parse_patch(_broken_copy(tmp_path, series, edit))
    wheel = fetch_pinned(load_pin(), TAG)
    with pytest.raises(PatchError) as e:
        assemble(tmp_path / "tree", wheel, load_pin().version, [broken])
    msg = str(e.value)
    assert broken.path.name in msg and path in msg and header.split(" @@")[0] in msg


def test_hunk_at_an_offset_is_an_error(tmp_path, series):
    path, header = _first_hunk(series[0].path.read_text())
    old, new = map(int, re.match(r"@@ -(\d+),\d+ \+(\d+)", header).groups())

    def edit(
        text,
    ):  # the hunk's text is intact, its place moved 3 lines (as upstream drift does)
        moved = header.replace(f"-{old},", f"-{old + 3},", 1).replace(
            f"+{new},", f"+{new + 3},", 1
        )
        return text.replace(header, moved, 1)

    shifted = parse_patch(_broken_copy(tmp_path, series, edit))
    wheel = fetch_pinned(load_pin(), TAG)
    with pytest.raises(PatchError, match=r"offset"):
        assemble(tmp_path / "tree", wheel, load_pin().version, [shifted])


def test_editing_tree_merges_a_drifted_patch(tmp_path, series):
    """`make tree` merges a patch that moved (git am -3) so `make refresh` can rewrite it exactly."""
    path, header = _first_hunk(series[0].path.read_text())
    old, new = map(int, re.match(r"@@ -(\d+),\d+ \+(\d+)", header).groups())
    moved = header.replace(f"-{old},", f"-{old + 3},", 1).replace(
        f"+{new},", f"+{new + 3},", 1
    )
    shifted = parse_patch(
        _broken_copy(tmp_path, series, lambda t: t.replace(header, moved, 1))
    )
    wheel = fetch_pinned(load_pin(), TAG)
    asm = assemble(
        tmp_path / "tree",
        wheel,
        load_pin().version,
        [shifted],
        stamp=False,
        three_way=True,
    )
    exact = assemble(
        tmp_path / "exact", wheel, load_pin().version, series[:1], stamp=False
    )
    assert out(asm.tree, "rev-parse", "HEAD^{tree}") == out(
        exact.tree, "rev-parse", "HEAD^{tree}"
    )


def test_editing_tree_continues_the_series_after_a_stop(tmp_path, series):
    """`tools/fork tree --continue` merges the patches a stopped editing tree has not applied yet."""
    from forklib.tree import continue_assembly

    wheel = fetch_pinned(load_pin(), TAG)
    partial = assemble(
        tmp_path / "tree", wheel, load_pin().version, series[:1], stamp=False
    )
    applied = continue_assembly(partial.tree, load_pin().version, series)
    assert [a.patch.name for a in applied] == [p.name for p in series[1:]]
    full = assemble(tmp_path / "full", wheel, load_pin().version, series, stamp=False)
    assert out(partial.tree, "rev-parse", "HEAD^{tree}") == out(
        full.tree, "rev-parse", "HEAD^{tree}"
    )


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
    (patches / series[0].path.name).write_text(
        text[:start] + " # drifted" + text[start:]
    )
    for p in series[
        1:
    ]:  # the rest unchanged: every file under python/sglang keeps its owner
        (patches / p.path.name).write_text(p.path.read_text())
    (patches / "series").write_text("".join(p.path.name + "\n" for p in series))
    venv = tmp_path / "venv"
    r = subprocess.run(
        [
            sys.executable,
            str(REPO / "tools" / "fork"),
            "--series",
            str(patches / "series"),
            "--build",
            str(tmp_path / "build"),
            "build",
            "--install",
            str(venv),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1
    assert series[0].path.name in r.stderr and path in r.stderr
    assert not list((tmp_path / "build").glob("dist/*.whl"))
    assert not venv.exists()


@pytest.mark.slow
def test_build_is_a_no_op_when_nothing_changed(tmp_path):
    """`make` twice: the second run assembles, packages and installs nothing; a change to
    the series (here: its file list) builds again."""

    def build(series):
        return subprocess.run(
            [
                sys.executable,
                str(REPO / "tools" / "fork"),
                "--series",
                str(series),
                "--build",
                str(tmp_path / "build"),
                "build",
            ],
            capture_output=True,
            text=True,
            check=True,
        )

    series = REPO / "patches" / "series"
    first = build(series)
    assert "==> assembling" in first.stdout
    (wheel,) = (tmp_path / "build" / "dist").glob("*.whl")
    mtime = wheel.stat().st_mtime_ns
    second = build(series)
    assert "==> assembling" not in second.stdout and "up to date" in second.stdout
    assert wheel.stat().st_mtime_ns == mtime and wheel.name in second.stdout
    assert "0001-" in second.stdout  # the patch table is still shown
    from forklib.series import read_series

    names = [p.name for p in read_series(series)]
    trimmed = tmp_path / "patches" / "series"  # the series without its last patch
    trimmed.parent.mkdir()
    for p in names[:-1]:
        (trimmed.parent / p).write_text((series.parent / p).read_text())
    trimmed.write_text("".join(p + "\n" for p in names[:-1]))
    third = subprocess.run(
        [
            sys.executable,
            str(REPO / "tools" / "fork"),
            "--series",
            str(trimmed),
            "--build",
            str(tmp_path / "build"),
            "build",
        ],
        capture_output=True,
        text=True,
    )
    assert (
        "up to date" not in third.stdout
    )  # it ran (the trimmed series leaves files unowned)


def test_unknown_release_is_a_clear_error(tmp_path, monkeypatch):
    from forklib.pin import fetch_wheel

    monkeypatch.setenv("FORK_CACHE", str(tmp_path))
    with pytest.raises(ForkError, match=r"0\.5\.999.*released version"):
        fetch_wheel("sglang", "0.5.999", TAG, None)


def test_hash_mismatch_is_refused_and_the_file_kept(tmp_path, monkeypatch):
    """A cached file that does not match the pin is refused, never used; it is not deleted
    either (the cache is shared, and the pin may be what is wrong)."""
    from forklib.pin import cache_dir, fetch_wheel, wheel_name

    monkeypatch.setenv("FORK_CACHE", str(tmp_path))
    fake = cache_dir() / wheel_name("sglang", "9.9.9", TAG)
    fake.write_bytes(b"not the release")
    with pytest.raises(
        ForkError, match=r"(?s)does not match the pinned.*kept.*upstream.toml"
    ):
        fetch_wheel("sglang", "9.9.9", TAG, "0" * 64)
    assert fake.read_bytes() == b"not the release"


def _fake_pypi(monkeypatch, payload: bytes):
    """pip download stand-in: 'downloads' ``payload``."""
    from forklib import pin

    def download(package, version, tag, dest_dir):
        path = Path(dest_dir) / pin.wheel_name(package, version, tag)
        path.write_bytes(payload)
        return path

    monkeypatch.setattr(pin, "_pip_download", download)


def test_a_wrong_pin_never_deletes_a_good_cached_wheel(tmp_path, monkeypatch):
    from forklib.pin import cache_dir, fetch_wheel, file_sha256, wheel_name

    monkeypatch.setenv("FORK_CACHE", str(tmp_path))
    _fake_pypi(monkeypatch, b"the real release")
    good = hashlib.sha256(b"the real release").hexdigest()
    path = fetch_wheel("sglang", "9.9.9", TAG, good)
    assert path == cache_dir() / wheel_name("sglang", "9.9.9", TAG)
    _fake_pypi(monkeypatch, b"never fetched again")
    with pytest.raises(
        ForkError,
        match=r"(?s)when it entered the cache.*does not match the pinned.*kept",
    ):
        fetch_wheel("sglang", "9.9.9", TAG, "1" * 64)  # upstream.toml edited wrongly
    assert path.exists() and file_sha256(path) == good
    assert (
        fetch_wheel("sglang", "9.9.9", TAG, good) == path
    )  # and it still serves the right pin


def test_a_download_is_verified_before_it_enters_the_cache(tmp_path, monkeypatch):
    from forklib.pin import cache_dir, fetch_wheel

    monkeypatch.setenv("FORK_CACHE", str(tmp_path))
    _fake_pypi(monkeypatch, b"a tampered release")
    with pytest.raises(ForkError, match="does not match the pinned"):
        fetch_wheel(
            "sglang", "9.9.9", TAG, hashlib.sha256(b"the real release").hexdigest()
        )
    assert [p.name for p in cache_dir().iterdir()] == []  # nothing entered the cache


def test_a_cached_file_damaged_since_it_was_stored_is_fetched_again(
    tmp_path, monkeypatch
):
    from forklib.pin import fetch_wheel

    monkeypatch.setenv("FORK_CACHE", str(tmp_path))
    _fake_pypi(monkeypatch, b"the real release")
    good = hashlib.sha256(b"the real release").hexdigest()
    path = fetch_wheel("sglang", "9.9.9", TAG, good)
    path.write_bytes(b"the real rel")  # truncated
    assert fetch_wheel("sglang", "9.9.9", TAG, good).read_bytes() == b"the real release"


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
                n: hashlib.sha256(zf.read(n)).hexdigest()
                for n in zf.namelist()
                if n.endswith(".so")
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
        [
            str(py),
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-compile",
            str(wheel),
        ],
        check=True,
    )
    version = wheel.name.split("-")[1]
    # sglang/__init__ needs the whole dependency set; read what was installed instead.
    probe = (
        "import importlib.metadata as md; d = md.distribution('sglang'); "
        "print(d.version); print(d.locate_file('sglang/_version.py').read_text()); "
        "print(d.locate_file('sglang/_fork_manifest.json').read_text())"
    )
    r = subprocess.run(
        [str(py), "-c", probe], capture_output=True, text=True, check=True
    )
    assert r.stdout.splitlines()[0] == version
    assert f"__version__ = version = {version!r}" in r.stdout
    assert f'"version": "{version}"' in r.stdout


README = REPO / "README.md"
README_MAX_LINES = 250
README_MAX_CELL = 300
FLAG_TABLE_HEADER = ["flag", "default", "what it does", "patch"]


def _table_rows(text: str) -> list[list[list[str]]]:
    """Every markdown table of ``text``: its rows (header first, separator dropped), each a list of
    cells, split on ``|`` but not on an escaped ``\\|``."""
    tables, rows = [], None
    for line in text.splitlines():
        if not line.startswith("|"):
            rows = None
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if all(re.fullmatch(r":?-+:?", c) for c in cells):
            continue
        if rows is None:
            rows = []
            tables.append(rows)
        rows.append(cells)
    return tables


def _readme_flag_rows() -> list[list[str]]:
    tables = [t for t in _table_rows(README.read_text()) if t[0] == FLAG_TABLE_HEADER]
    assert (
        len(tables) == 1
    ), f"README.md needs one flag table headed {' | '.join(FLAG_TABLE_HEADER)}"
    return tables[0][1:]


def test_every_flag_is_in_the_readme_flag_table_with_its_patch(series):
    documented = {}
    for row in _readme_flag_rows():
        assert len(row) == len(FLAG_TABLE_HEADER), row
        flag = re.search(r"`(--[a-z0-9-]+)", row[0]).group(1)
        # a value a patch adds to an upstream flag is its own row (two patches, two values)
        key = (
            row[0]
            if row[1].endswith("(a value the fork adds to upstream's flag)")
            else flag
        )
        assert key not in documented, f"{key}: two rows"
        documented[key] = row[3]
    declared = {f: p.name[:4] for p in series for f in p.flags}
    assert set(declared) - set(documented) == set()
    wrong = {
        f: documented[f] for f, n in declared.items() if not documented[f].startswith(n)
    }
    assert (
        wrong == {}
    ), f"patch column does not start with the declaring patch's number: {wrong}"


def test_every_readme_flag_row_links_its_docs_page():
    for row in _readme_flag_rows():
        pages = re.findall(r"\]\((docs/[^)#]+\.md)(?:#[^)]*)?\)", " ".join(row))
        assert pages, f"{row[0]}: no link to its docs/ page"
        assert all((REPO / page).is_file() for page in pages), f"{row[0]}: {pages}"


def test_readme_stays_short():
    text = README.read_text()
    assert len(text.splitlines()) < README_MAX_LINES
    long = [
        c[:60] + "..."
        for table in _table_rows(text)
        for row in table
        for c in row
        if len(c) > README_MAX_CELL
    ]
    assert long == [], f"README table cells over {README_MAX_CELL} characters"


def test_readme_links_resolve():
    targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README.read_text())
    local = [t for t in targets if not re.match(r"[a-z]+://", t)]
    assert local and [t for t in local if not (REPO / t).exists()] == []


# ---------------------------------------------------------------------------- refresh and tree

from fakefork import BASE
from fakefork import TAG as FAKE_TAG  # noqa: E402
from fakefork import Spec, make_fork, set_line, snapshot

FAKE_SPECS = [
    Spec("first", {"python/sglang/a.py": lambda t: set_line(t, 5, "a5 = 'first'")}),
    Spec(
        "module",
        {"python/sglang/e.py": lambda t: set_line(t, 5, "from sglang.extra import X")},
        owns={"python/sglang/extra.py": "X = 'ours'\n"},
    ),
]


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A fake fork and its editing tree (``make tree``): (fork root, build/tree)."""
    from forklib.pin import fetch_pinned
    from forklib.pin import load_pin as load
    from forklib.series import load_series

    monkeypatch.setenv("FORK_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    root = tmp_path / "fork"
    make_fork(root, tmp_path / "cache", "1.0.0", BASE, FAKE_SPECS)
    pin = load(root / "upstream.toml")
    tree = root / "build" / "tree"
    assemble(
        tree,
        fetch_pinned(pin, FAKE_TAG),
        pin.version,
        load_series(root / "patches/series"),
        stamp=False,
        src=root,
        three_way=True,
    )
    return root, tree


def _commit(tree, message, edits):
    from forklib.git import git

    for path, text in edits.items():
        (tree / path).write_text(text)
    git(tree, "add", "-A")
    git(tree, "commit", "-q", "-F", "-", input=message)


HEADER = (
    "Server-Args: none\nWhy: a test\nUpstream-Status: not sent\nTests: test/test_x.py\n"
)


def test_refresh_refuses_an_edit_of_a_file_another_patch_owns(fake):
    from forklib.tree import refresh

    root, tree = fake
    before = snapshot(root)
    _commit(
        tree,
        "third: touch extra\n\nBody.\n\n" + HEADER,
        {"python/sglang/extra.py": "X = 'changed'\n"},
    )
    with pytest.raises(
        ForkError,
        match=r"(?s)edits python/sglang/extra.py, which 0002-module owns.*git commit --fixup=",
    ):
        refresh(tree, root)
    assert snapshot(root) == before  # nothing written


def test_editing_tree_never_folds_a_patch_into_the_one_before(fake, tmp_path):
    """A patch whose change is already in the tree makes no commit under git am -3: refuse,
    never amend the previous patch's commit with its files."""
    from forklib.pin import fetch_pinned
    from forklib.pin import load_pin as load
    from forklib.series import load_series

    root, _ = fake
    first, module = load_series(root / "patches/series")
    head, sep, _ = module.path.read_text().partition("\n---\n")
    module.path.write_text(
        head + sep + first.path.read_text().partition("\n---\n")[2]
    )  # 0001's edit again
    pin = load(root / "upstream.toml")
    tree = tmp_path / "again"
    with pytest.raises(PatchError, match="0002-module.patch changes nothing"):
        assemble(
            tree,
            fetch_pinned(pin, FAKE_TAG),
            pin.version,
            load_series(root / "patches/series"),
            stamp=False,
            src=root,
            three_way=True,
        )
    assert out(tree, "log", "-1", "--format=%s") == "first: change things"
    assert out(tree, "diff", "--name-only", "HEAD^", "HEAD").split() == [
        "python/sglang/a.py"
    ]


def test_a_commit_without_a_body_keeps_its_trailers(fake):
    from forklib.series import header_problems, load_series
    from forklib.tree import refresh

    root, tree = fake
    _commit(
        tree,
        "third: no body\n\n" + HEADER,
        {"python/sglang/b.py": set_line(BASE["sglang/b.py"], 3, "b3 = 0")},
    )
    refresh(tree, root)
    third = load_series(root / "patches/series")[2]
    assert third.trailers["Why"] == ["a test"] and header_problems(third, root) == []


def test_a_new_patch_takes_the_number_past_the_series_last(fake):
    """Numbers freed by a patch that left (as 0013 and 0016 are) stay free: a new patch at the
    end is numbered past the last one, not by its position."""
    from forklib.series import load_series
    from forklib.tree import refresh

    root, tree = fake
    series = root / "patches" / "series"
    (root / "patches/0002-module.patch").rename(root / "patches/0004-module.patch")
    series.write_text(series.read_text().replace("0002-module", "0004-module"))
    _commit(
        tree,
        "third: a new patch\n\nBody.\n\n" + HEADER,
        {"python/sglang/b.py": set_line(BASE["sglang/b.py"], 3, "b3 = 0")},
    )
    refresh(tree, root)
    names = [p.name for p in load_series(series)]
    assert names == ["0001-first", "0004-module", "0005-third-a-new-patch"]


def test_refresh_writes_nothing_until_the_series_checks(fake):
    from forklib.tree import refresh

    root, tree = fake
    before = snapshot(root)
    _commit(
        tree,
        "third: no Why\n\nBody.\n\nServer-Args: none\nUpstream-Status: not sent\nTests: test/test_x.py\n",
        {
            "python/sglang/b.py": set_line(BASE["sglang/b.py"], 3, "b3 = 0"),
            "python/sglang/new.py": "N = 1\n",
        },
    )
    with pytest.raises(ForkError, match="0003-third-no-Why.patch: no Why: trailer"):
        refresh(tree, root)
    assert snapshot(root) == before


def test_refresh_keeps_the_series_comments_on_dropped_patches(fake):
    """A rebase that dropped a patch leaves a comment in patches/series naming it and its tests
    (conftest skips them); a later `make refresh` (porting a patch after the rebase) keeps it.
    """
    from forklib.series import dropped_tests
    from forklib.tree import refresh

    root, tree = fake
    series = root / "patches" / "series"
    note = "# dropped in the rebase from 2.0.0 to 1.0.0: 0009-gone (tests: test/test_gone.py)\n"
    series.write_text(series.read_text() + note)
    _commit(
        tree,
        "third: a port\n\nBody.\n\n" + HEADER,
        {"python/sglang/b.py": set_line(BASE["sglang/b.py"], 3, "b3 = 0")},
    )
    refresh(tree, root)
    assert series.read_text().endswith(note) and dropped_tests(series) == {
        "test/test_gone.py": ["0009-gone"]
    }


def test_no_test_hard_codes_the_pinned_release():
    """After `make rebase TO=<release>` the tests must pass unedited: they read the release
    from upstream.toml."""
    pinned = load_pin().version
    hits = [
        f"{f.name}:{n}"
        for f in sorted((REPO / "test").glob("*.py"))
        for n, line in enumerate(f.read_text().splitlines(), 1)
        if pinned in line
    ]
    assert hits == []


def test_no_module_of_ours_binds_a_top_level_name_twice(series):
    """A second import or def of one name hides the first (fork.py once held two PrintVersion)."""
    import ast

    problems = []
    for patch in series:
        for own in (o for o in patch.owns if o.endswith(".py")):
            seen: dict[str, int] = {}
            for node in ast.parse((REPO / own).read_text()).body:
                if isinstance(
                    node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
                ):
                    names = [node.name]
                elif isinstance(node, ast.Import):
                    names = [a.asname or a.name.split(".")[0] for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    names = [a.asname or a.name for a in node.names]
                else:
                    continue
                for name in names:
                    if name in seen:
                        problems.append(
                            f"{own}:{node.lineno}: {name} bound again (first at line {seen[name]})"
                        )
                    seen.setdefault(name, node.lineno)
    assert problems == []


# A git short sha or a fork build string (<release>+fork.7.170b0a5): which build a figure came from
# is the results file's business (and git log's), never the code's or a patch header's.
# A hash is 7-12 hex digits with a digit and a letter among them, standing alone: hex constants
# are written 0x..., pinned sha256 digests are 64 digits, English words have no digit.
BUILD_HASH_RE = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,12}\b")
FORK_BUILD_RE = re.compile(r"\+fork\.\d+\.[0-9a-f]{7}")
# (file, text) allowed to match. fork.py documents the version format with an example string;
# it names no build.
BUILD_HASH_ALLOWED = {("python/sglang/fork.py", "+fork.1.3f9a1c2")}


def _build_hashes(name: str, text: str) -> list[str]:
    hits = []
    for n, line in enumerate(text.splitlines(), 1):
        for allowed in (a for f, a in BUILD_HASH_ALLOWED if f == name):
            line = line.replace(allowed, "")
        hits += [
            f"{name}:{n}: {m.group()}"
            for r in (FORK_BUILD_RE, BUILD_HASH_RE)
            for m in r.finditer(line)
        ]
    return hits


def test_the_build_hash_check_catches_what_it_is_for():
    found = _build_hashes(
        "x", "measured at build e1f555d\n9.9.9+fork.7.170b0a5 (the run at bffc136)"
    )
    assert [h.split(": ")[1] for h in found] == [
        "e1f555d",
        "+fork.7.170b0a5",
        "170b0a5",
        "bffc136",
    ]
    clean = "e4m3 0xB3A2 prmt 0x9180 sha256 " + "0a" * 32 + " 1234567 defaced accede"
    assert _build_hashes("x", clean) == []


def test_no_build_hash_in_our_modules_or_patch_headers(series):
    """Our modules and the patch headers (subject and message, not the diff) name no build."""
    hits = []
    for patch in series:
        hits += _build_hashes(patch.path.name, f"{patch.subject}\n{patch.body}")
        for own in patch.owns:
            hits += _build_hashes(own, (REPO / own).read_text(errors="replace"))
    assert hits == []


# Tests of the tools and of the series as a whole; every other test file belongs to a patch.
TOOL_TESTS = {
    "test/test_series.py",
    "test/test_rebase.py",
    "test/test_export.py",
    "test/test_docs.py",
    "test/test_export_hooks.py",
    "test/test_format.py",
    "test/test_e2e_cpu.py",
    "test/test_e2e_tools.py",
    "test/test_side_by_side.py",
    "test/test_gpu_bundle_smoke.py",
    "test/test_docker.py",
    "test/test_gb10_validate.py",
    "test/test_benchmark_readmes.py",
    "test/test_provenance.py",
    "test/test_upstream_tables.py",
    "test/test_reachable.py",
    "test/test_docs_tables.py",
    "test/test_docs_words.py",
    "test/test_cost_model.py",
    "test/test_cap_advisor.py",
    "test/test_needs.py",
    # every patch's validator through ServerArgs resolution (a case per patch present)
    "test/test_validators_resolution.py",
    "test/test_docstring_share.py",
    # modules outside the wheel, beside their tests and benchmarks (no patch ships them)
    "test/test_pad_k.py",
    "test/test_l2_prefetch.py",
    "test/test_sm90_compile.py",
}


def test_every_test_file_belongs_to_a_patch_or_the_tools(series):
    """A feature's tests are named by its patch's Tests: trailer, so a rebase that drops the
    patch can say which tests go with it (conftest skips them then)."""
    from forklib.series import dropped_tests

    named = {t for p in series for t in p.trailers.get("Tests", [])} | set(
        dropped_tests()
    )
    files = {f"test/{f.name}" for f in (REPO / "test").glob("test_*.py")}
    assert sorted(files - named - TOOL_TESTS) == []


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
    git(
        tree, "commit", "-qm", "add a module of ours\n\nBody line.\n\nServer-Args: none"
    )
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
    assert out(tree, "log", "-1", "--format=%B", again).startswith(
        "add a module of ours\n\nBody line."
    )
    assert commit_patch(tree, again, owns) == text


def _added_import_statements(lines: list[str]) -> list[ast.stmt]:
    """The import statements among a diff's added lines, each parsed on its own."""
    stmts, i = [], 0
    while i < len(lines):
        stmt = lines[i].strip()
        i += 1
        if not stmt.startswith(("import ", "from ")):
            continue
        while stmt.count("(") > stmt.count(")") and i < len(lines):
            stmt += "\n" + lines[i].strip()
            i += 1
        try:
            stmts.extend(ast.parse(stmt).body)
        except SyntaxError:
            continue
    return stmts


def test_upstream_hunks_read_no_private_name_of_ours(series):
    """Upstream code calls public names of ours only: no hunk imports ``_name`` from one of our
    modules or reads ``alias._name`` on one it imported (feature state is an object handed to
    its user, never a private module global that upstream code reads)."""
    ours = {
        own[len("python/") : -len(".py")].replace("/", ".")
        for p in series
        for own in p.owns
        if own.endswith(".py")
    }
    problems = []
    for p in series:
        diff = p.path.read_text().partition("\n---\n")[2]
        added = [
            line[1:]
            for line in diff.splitlines()
            if line.startswith("+") and not line.startswith("+++")
        ]
        aliases = set()
        for node in _added_import_statements(added):
            if isinstance(node, ast.Import):
                aliases.update(
                    a.asname for a in node.names if a.name in ours and a.asname
                )
            elif isinstance(node, ast.ImportFrom) and node.module:
                for a in node.names:
                    if node.module in ours and a.name.startswith("_"):
                        problems.append(f"{p.name}: from {node.module} import {a.name}")
                    if f"{node.module}.{a.name}" in ours:
                        aliases.add(a.asname or a.name)
        for alias in aliases:
            for line in added:
                for name in re.findall(rf"\b{re.escape(alias)}\.(_\w+)", line):
                    problems.append(f"{p.name}: {alias}.{name} in {line.strip()!r}")
    assert not problems, problems
