"""What our modules need from upstream (tools/forklib/needs.py): read from our syntax trees,
checked against a release's source, and failing ``make`` / ``make check`` on a missing name.

A scratch upstream package and one module of ours show each kind of read resolved, and each
renamed in turn failing naming the name, the reading line and the release; the real series
passes against the pinned release with the series, and fails the same way when one of the
private names it reads is renamed there.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import REPO, UPSTREAM
from forklib import ForkError, cli, docs, needs
from forklib.pin import fetch_pinned, load_pin
from forklib.series import Patch
from forklib.tree import Applied, Assembled

TAG = "cp311-cp311-manylinux_2_34_x86_64"
READER = "python/sglang/ours/reader.py"

UPSTREAM_FILES = {
    "sglang/__init__.py": "",
    "sglang/_version.py": "__version__ = version = '9.9.9'\n",
    "sglang/up/__init__.py": "from .impl import Thing, _helper\nfrom .star_src import *\n",
    "sglang/up/impl.py": """\
        import torch


        class Base:
            _base_attr = 1


        class Thing(Base):
            def __init__(self):
                self._inst = 0

            def _method(self):
                pass


        class Config:
            FLAG = 1


        class Net(torch.nn.Module):
            pass


        def _helper():
            pass


        _CONST = 3
        cfg = Config()
        if cfg:
            _COND = 1
        """,
    "sglang/up/star_src.py": "__all__ = ['_starred']\n_starred = 1\n",
    "sglang/up/sub.py": "VALUE = 1\n",
}
OURS = """\
from sglang.up import Thing, _helper
from sglang.up import impl
import sglang.up.sub as sub


def read(x):
    a = impl._CONST
    b = Thing._method
    c = Thing._base_attr
    d = Thing._inst
    e = impl.cfg.FLAG
    f = getattr(impl, "_COND", None)
    g = impl.Net._anything
    h = x._runtime_private
    i = sub.VALUE
    from sglang.up import _starred

    return a, b, c, d, e, f, g, h, i, _starred


def shadowed(impl):
    return impl._not_upstream


def optional():
    try:
        from sglang.up.plugin import fast
    except ImportError:
        return None
    return fast.value
"""
# each read of OURS: the upstream name it needs and the line that reads it
READS = {
    "sglang.up:_helper": 1,
    "sglang.up.impl": 2,
    "sglang.up.sub": 3,
    "sglang.up.impl:_CONST": 7,
    "sglang.up:Thing._method": 8,
    "sglang.up:Thing._base_attr": 9,
    "sglang.up:Thing._inst": 10,
    "sglang.up.impl:cfg.FLAG": 11,
    "sglang.up.impl:_COND": 12,
    "sglang.up.sub:VALUE": 15,
    "sglang.up:_starred": 16,
}
PATCH = Patch(Path("0001-ours.patch"), "ours", "", {"Owns": [READER]}, ())


def scratch(root: Path, rename: tuple[str, str] | None = None) -> Path:
    """An assembled-tree layout: the scratch upstream under python/, with our module; an
    upstream rename (``old`` -> ``new`` in every file, or ``new`` None: delete the file
    ``old``) applied."""
    for rel, text in UPSTREAM_FILES.items():
        text = textwrap.dedent(text)
        if rename and rename[1] is None and rel == rename[0]:
            continue
        if rename and rename[1] is not None:
            text = re.sub(rf"\b{rename[0]}\b", rename[1], text)
        (root / "python" / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / "python" / rel).write_text(text)
    (root / READER).parent.mkdir(parents=True, exist_ok=True)
    (root / READER).write_text(OURS)
    return root


def report(root: Path) -> needs.Report:
    return needs.check(needs.UpstreamTree.from_dir(root), [PATCH], root)


def test_every_kind_of_read_is_collected_and_resolved(tmp_path):
    r = report(scratch(tmp_path))
    by_name = {e.name: e for e in r.entries}
    assert r.release == "9.9.9"
    for name, line in READS.items():
        assert by_name[name].status == "ok", (name, by_name[name].why)
        assert needs.Site(READER, line) in by_name[name].sites, name
    assert by_name["sglang.up:Thing"].status == "ok"
    # a base class of another package: not provable either way, never a failure
    net = by_name["sglang.up.impl:Net._anything"]
    assert net.status == "unknown" and "torch.nn.Module" in net.why
    # a parameter shadows the import: a runtime object, listed as unchecked
    assert not any("_not_upstream" in n for n in by_name)
    # an import whose ImportError the code handles is optional, not a need
    assert not any("plugin" in n for n in by_name)
    assert {(u.expr, u.attr, u.site.line) for u, _ in r.unchecked} == {
        ("x", "_runtime_private", 14),
        ("impl", "_not_upstream", 22),
    }
    needs.require(r)  # unknown and unchecked do not fail


@pytest.mark.parametrize(
    "rename, name",
    [
        (("_CONST", "_CONST2"), "sglang.up.impl:_CONST"),
        (("_method", "_method2"), "sglang.up:Thing._method"),
        (("_base_attr", "_base"), "sglang.up:Thing._base_attr"),
        (("_inst", "_instance"), "sglang.up:Thing._inst"),
        (("FLAG", "FLAGS"), "sglang.up.impl:cfg.FLAG"),
        (("_COND", "_CONDITION"), "sglang.up.impl:_COND"),
        (("_helper", "_helpers"), "sglang.up:_helper"),
        (("_starred", "_star"), "sglang.up:_starred"),
        (("sglang/up/sub.py", None), "sglang.up.sub"),
    ],
)
def test_an_upstream_rename_fails_naming_the_name_the_reader_and_the_release(
    tmp_path, rename, name
):
    assert not report(scratch(tmp_path / "before")).missing
    r = report(scratch(tmp_path / "after", rename))
    assert [e.name for e in r.missing] == [name]
    with pytest.raises(ForkError) as e:
        needs.require(r)
    msg = str(e.value)
    assert "sglang 9.9.9" in msg and name in msg
    assert f"read at {READER}:{READS[name]}" in msg


def _build_args(tmp_path: Path) -> list[str]:
    return ["--build", str(tmp_path / "build"), "build", "--tag", TAG]


class Packaged(Exception):
    """build_wheel reached: the check let the build through."""


@pytest.mark.parametrize("broken", [False, True])
def test_make_stops_before_packaging_on_a_missing_name(
    tmp_path, monkeypatch, capsys, broken
):
    tree = scratch(tmp_path / "tree", ("_CONST", "_CONST2") if broken else None)
    asm = Assembled(tree, "9.9.9", "", [Applied(PATCH, "")], "9.9.9+fork", "")

    def package(*a, **k):
        raise Packaged

    monkeypatch.setattr(cli, "assemble_series", lambda args, tag: (asm, None))
    monkeypatch.setattr(cli, "build_wheel", package)
    if not broken:
        with pytest.raises(Packaged):
            cli.main(_build_args(tmp_path))
        return
    assert cli.main(_build_args(tmp_path)) == 1
    err = capsys.readouterr().err
    assert "sglang 9.9.9" in err and "sglang.up.impl:_CONST" in err
    assert f"read at {READER}:7" in err


# ---------------------------------------------------------------------------- the real series


@pytest.fixture(scope="module")
def pinned(series):
    """The pinned release with the series, as `make` assembles it, and its report."""
    tree = needs.series_tree(fetch_pinned(load_pin(), TAG), series, REPO, UPSTREAM)
    return tree, needs.check(tree, series)


def test_the_series_reads_only_names_the_pinned_release_has(pinned):
    tree, r = pinned
    assert r.release == UPSTREAM
    assert r.entries and not r.missing, needs.render(r)
    assert [e for e in r.entries if e.private], "no private name found: the walk broke"


def _renamed(tree: needs.UpstreamTree, entry: needs.Entry) -> needs.UpstreamTree:
    """``tree`` with ``entry``'s last name renamed in the module our code reads it from."""
    _, rel = tree.module_files(entry.module)
    old = entry.attrs[-1]
    text = re.sub(rf"\b{re.escape(old)}\b", old + "_renamed", tree.text(rel))
    return needs.UpstreamTree(
        tree.release, tree.paths, tree.text, "renamed", {**tree.overlay, rel: text}
    )


def _module_private(r: needs.Report) -> needs.Entry:
    """A private module-level name our code reads (the first)."""
    return next(e for e in r.entries if len(e.attrs) == 1 and e.private)


def test_a_renamed_private_name_of_the_release_fails_naming_each_reader(pinned, series):
    tree, r = pinned
    entry = _module_private(r)
    broken = needs.check(_renamed(tree, entry), series)
    assert [e.name for e in broken.missing] == [entry.name]
    with pytest.raises(ForkError) as e:
        needs.require(broken)
    msg = str(e.value)
    assert f"sglang {UPSTREAM}" in msg and entry.name in msg
    for site in entry.sites:
        assert f"read at {site}" in msg
        line = (REPO / site.path).read_text().splitlines()[site.line - 1]
        assert entry.attrs[-1] in line or "import" in line


@pytest.mark.parametrize("broken", [False, True])
def test_make_check_runs_the_check(pinned, monkeypatch, capsys, broken):
    tree, r = pinned
    entry = _module_private(r)
    target = _renamed(tree, entry) if broken else tree
    monkeypatch.setattr(needs, "target_tree", lambda *a, **k: target)
    # the series' form, the docs and the formatters have their own tests
    monkeypatch.setattr(cli, "check_series", lambda patches: None)
    monkeypatch.setattr(docs, "problems", lambda *a: [])
    monkeypatch.setattr(cli, "cmd_lint", lambda args: None)
    rc = cli.main(["check"])
    out = capsys.readouterr()
    if not broken:
        assert rc == 0 and "upstream names our modules read: found" in out.out
        return
    assert rc == 1 and entry.name in out.err and f"sglang {UPSTREAM}" in out.err


def test_tools_fork_needs_lists_a_target_tree(pinned, tmp_path):
    """``tools/fork needs --target-tree DIR`` on a directory holding only the upstream files
    the check reads (copied from the pinned tree), then with one private name renamed.
    """
    tree, r = pinned
    for rel in tree.looked_up():
        (tmp_path / "python" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "python" / rel).write_text(tree.text(rel))
    (tmp_path / "python/sglang/_version.py").write_text(tree.text("sglang/_version.py"))

    def run() -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "tools/fork", "needs", "--target-tree", str(tmp_path)],
            cwd=REPO,
            capture_output=True,
            text=True,
        )

    ok = run()
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert f"checked against sglang {UPSTREAM}" in ok.stdout
    assert f"{len(r.entries)} ok, 0 missing" in ok.stdout
    entry = _module_private(r)
    _, rel = tree.module_files(entry.module)
    path = tmp_path / "python" / rel
    path.write_text(re.sub(rf"\b{entry.attrs[-1]}\b", "renamed", path.read_text()))
    bad = run()
    assert bad.returncode == 1
    row = next(line for line in bad.stdout.splitlines() if entry.name + " " in line)
    assert row.split()[0] == "missing" and entry.sites[0].path in row


def test_contributing_lists_the_private_names_the_series_reads(pinned):
    """CONTRIBUTING.md's list of the private upstream names our modules read is current."""
    _, r = pinned
    text = (REPO / "CONTRIBUTING.md").read_text()
    block = text.split(needs.DOC_BEGIN, 1)[1].split(needs.DOC_END, 1)[0]
    assert block.strip() == needs.doc_list(r).strip(), (
        "CONTRIBUTING.md: the private upstream names our modules read changed; "
        "replace the list between its markers with:\n" + needs.doc_list(r)
    )


def test_the_walk_follows_scopes(tmp_path):
    """An import inside a function binds there only; an assignment shadows a module-level
    import; `import a.b` binds `a`; a class body's names are not seen from its methods.
    """
    ours = textwrap.dedent(
        """\
        import sglang.up.impl
        from sglang.up import impl as im


        def f():
            from sglang.up import sub

            return sub.VALUE


        def g():
            sub = object()
            im = None
            return sub._x, im._y, sglang.up.impl._CONST


        class C:
            from sglang.up import impl as inner

            def m(self):
                return inner._z
        """
    )
    root = scratch(tmp_path)
    (root / READER).write_text(ours)
    r = report(root)
    names = {e.name: e.sites for e in r.entries}
    assert names["sglang.up.sub"] == [needs.Site(READER, 6)]
    assert names["sglang.up.sub:VALUE"] == [needs.Site(READER, 8)]
    assert names["sglang.up.impl"] == [needs.Site(READER, n) for n in (1, 2, 18)]
    assert names["sglang.up.impl:_CONST"] == [needs.Site(READER, 14)]
    assert {(u.expr, u.attr) for u, _ in r.unchecked} == {
        ("sub", "_x"),
        ("im", "_y"),
        ("inner", "_z"),
    }


def test_a_bare_release_credits_a_name_the_series_adds(tmp_path):
    """Against a release without the series (a rebase target as it ships), a name one of
    our patches adds to an upstream file is reported ok, naming the patch; with the series
    in the tree (our module present) it is not excused."""
    patch = tmp_path / "0001-ours.patch"
    patch.write_text(
        "From x\nSubject: [PATCH] ours\n\nOwns: " + READER + "\n---\n"
        "diff --git a/python/sglang/up/impl.py b/python/sglang/up/impl.py\n"
        "+_CONST = 3\n"
    )
    adder = Patch(patch, "ours", "", {"Owns": [READER]}, ("python/sglang/up/impl.py",))
    root = scratch(tmp_path / "tree", ("_CONST", "_CONST2"))
    with_series = needs.check(needs.UpstreamTree.from_dir(root), [adder], root)
    assert [e.name for e in with_series.missing] == ["sglang.up.impl:_CONST"]
    (root / READER).rename(tmp_path / "reader.py")
    bare = needs.check(
        needs.UpstreamTree.from_dir(root), [adder], _ours_only(tmp_path / "reader.py")
    )
    entry = next(e for e in bare.entries if e.name == "sglang.up.impl:_CONST")
    assert entry.status == "ok" and "0001-ours" in entry.why


def _ours_only(reader: Path) -> Path:
    root = reader.parent / "ours-root"
    (root / READER).parent.mkdir(parents=True)
    (root / READER).write_text(reader.read_text())
    return root
