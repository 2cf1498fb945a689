"""`tools/fork export`: one patch as a diff that applies alone to a clean upstream tree."""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

import pytest

from fakefork import BASE, TAG, Spec, make_fork, set_line
from forklib import ForkError
from forklib.export import export
from forklib.pin import fetch_pinned, load_pin

SPECS = [
    Spec("first", {"python/sglang/a.py": lambda t: set_line(t, 5, "a5 = 'first'")}),
    Spec("module", {"python/sglang/e.py": lambda t: set_line(t, 5, "from sglang.extra import X")},
         owns={"python/sglang/extra.py": "X = 'ours'\n"}),
    # Its context is patch 0001's line: it cannot apply without it.
    Spec("needs-first", {"python/sglang/a.py": lambda t: set_line(t, 6, "a6 = 'second'")}),
]


def clean_tree(wheel: Path, dest: Path) -> Path:
    """The wheel's sglang/ under python/, as upstream's repository lays it out."""
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            if name.startswith("sglang/") and not name.endswith("/"):
                zf.extract(name, dest / "python")
    return dest


def applies(diff: Path, tree: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "apply", "--check", str(diff)], cwd=tree, capture_output=True, text=True)


@pytest.fixture
def fork(tmp_path, monkeypatch):
    monkeypatch.setenv("FORK_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    make_fork(tmp_path / "fork", tmp_path / "cache", "1.0.0", BASE, SPECS)
    return tmp_path / "fork"


def test_export_is_self_contained(fork, tmp_path):
    diff, md = export("2", root=fork)
    text = diff.read_text()
    assert "python/sglang/e.py" in text and "new file mode" in text and "python/sglang/extra.py" in text
    assert "sglang/a.py" not in text and "first" not in text  # nothing of another patch
    wheel = tmp_path / "cache/wheels" / f"sglang-1.0.0-{TAG}.whl"
    assert applies(diff, clean_tree(wheel, tmp_path / "clean")).returncode == 0
    desc = md.read_text()
    assert "# module: change things" in desc and "Body of module." in desc
    assert "test module" in desc and "not sent" in desc and "`python/sglang/extra.py` (new)" in desc
    assert "Why: test" not in desc  # trailers are fields, not body text


def test_export_names_the_patch_it_depends_on(fork):
    with pytest.raises(ForkError, match="depends on earlier patch.*0001-first"):
        export("0003-needs-first", root=fork)
    assert not (fork / "build/export/0003-needs-first.diff").exists()


def test_every_real_patch_exports_alone(tmp_path, series):
    """Each patch of the series, alone with the files it owns, applies to a clean 0.5.23 tree."""
    tree = clean_tree(fetch_pinned(load_pin(), TAG), tmp_path / "clean")
    for patch in series:
        diff, md = export(patch.name, out_dir=tmp_path / "export")
        r = applies(diff, tree)
        assert r.returncode == 0, f"{patch.name}: {r.stderr}"
        text = diff.read_text()
        assert all(f"b/{own}" in text for own in patch.owns)
        assert all(flag in md.read_text() for flag in patch.flags)
