"""A fork repository in miniature for the rebase and export tests: fake upstream wheels in a
temporary FORK_CACHE and a temporary fork repository whose patches the real tools wrote."""

from __future__ import annotations

import dataclasses
import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path

from forklib.git import git, out
from forklib.pin import Pin, file_sha256, render_pin
from forklib.tree import commit_patch

TAG = "cp311-cp311-manylinux_2_34_x86_64"
TAG312 = "cp312-cp312-manylinux_2_34_x86_64"


def lines(prefix: str, n: int = 30) -> str:
    return "".join(f"{prefix}{i} = {i}\n" for i in range(1, n + 1))


def set_line(text: str, lineno: int, new: str) -> str:
    rows = text.splitlines(keepends=True)
    rows[lineno - 1] = new + "\n"
    return "".join(rows)


BASE = {f"sglang/{m}.py": lines(m) for m in "abcde"} | {"sglang/__init__.py": ""}


def make_wheel(cache: Path, version: str, files: dict[str, str], tag: str = TAG) -> str:
    """A wheel with ``sglang/`` files and a dist-info, where fetch_wheel looks first."""
    path = cache / "wheels" / f"sglang-{version}-{tag}.whl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as zf:
        for name, text in sorted(files.items()):
            zf.writestr(name, text)
        zf.writestr(
            f"sglang-{version}.dist-info/METADATA",
            f"Name: sglang\nVersion: {version}\n",
        )
    return file_sha256(path)


@dataclasses.dataclass
class Spec:
    slug: str
    edits: dict[str, Callable[[str], str]]  # python/sglang/x.py -> new text from old
    owns: dict[str, str] = dataclasses.field(default_factory=dict)


def make_fork(
    root: Path,
    cache: Path,
    version: str,
    files: dict[str, str],
    specs: list[Spec],
    extra_tags: tuple[str, ...] = (),
) -> None:
    """Write patches with the real write-back code (upstream wheel -> commits -> patch files)."""
    wheels = {TAG: make_wheel(cache, version, files)}
    for tag in extra_tags:
        wheels[tag] = make_wheel(cache, version, files, tag)
    author = root.parent / f"{root.name}-author"
    for name, text in files.items():
        (author / "python" / name).parent.mkdir(parents=True, exist_ok=True)
        (author / "python" / name).write_text(text)
    git(author, "init", "-q")
    git(author, "add", "-A")
    git(author, "commit", "-qm", "upstream")
    (root / "patches").mkdir(parents=True)
    (root / "test").mkdir()
    (root / "test" / "test_x.py").write_text("")
    names = []
    for i, spec in enumerate(specs, 1):
        for path, fn in spec.edits.items():
            f = author / path
            f.write_text(fn(f.read_text()))
        for path, text in spec.owns.items():
            for base in (author, root):
                (base / path).parent.mkdir(parents=True, exist_ok=True)
                (base / path).write_text(text)
        git(author, "add", "-A")
        msg = (
            f"{spec.slug}: change things\n\nBody of {spec.slug}.\n\nServer-Args: none\n"
            f"Why: test {spec.slug}\nUpstream-Status: not sent\nTests: test/test_x.py\n"
        )
        git(author, "commit", "-qm", msg)
        name = f"{i:04d}-{spec.slug}.patch"
        (root / "patches" / name).write_text(
            commit_patch(author, "HEAD", sorted(spec.owns))
        )
        names.append(name)
    (root / "patches" / "series").write_text("".join(n + "\n" for n in names))
    (root / "upstream.toml").write_text(render_pin(Pin("sglang", version, wheels)))
    (root / ".gitignore").write_text("/build/\n")
    git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "fork")
    shutil.rmtree(author)


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file of the repository outside .git and build/."""
    return {
        str(f.relative_to(root)): f.read_bytes()
        for f in root.rglob("*")
        if f.is_file() and not {".git", "build"} & set(f.relative_to(root).parts)
    }


def status(root: Path) -> str:
    return out(root, "status", "--porcelain")
