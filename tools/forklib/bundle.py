"""``make gpu-bundle``: everything the GPU tests and benchmarks need, for a machine with only
torch and triton (the H200 test machine: Python 3.12, no network, sglang's binary
dependencies do not load there).

The bundle holds the assembled tree's pure-Python ``sglang`` (xz tar; the compiled .so
files stay behind), the small cp312 wheels of ``tools/requirements-import.txt``, the
import-only stand-ins, this repository's ``test/``, ``benchmark/``, ``patches/`` and
``upstream.toml`` (the tests read the series and the pin), and ``run.sh``,
which unpacks, runs ``pytest -m gpu`` and every ``benchmark/*/bench_*.py`` and writes the
results to one folder; ``VERSION`` (the fork build) and ``COMMIT`` (this repository's commit,
``-dirty`` when tracked files differ from it), which every result's provenance records on a
machine without git (``tools/e2e/provenance.py``); and for the end-to-end matrix, ``tools/e2e`` with the serving wheels
of ``tools/requirements-serve-gpu.txt`` and ``e2e.sh``, which serves the tiny DeepSeek-V4
through ``launch_server`` row by row (``python -m e2e.matrix``).
"""

from __future__ import annotations

import io
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from . import REPO_ROOT, ForkError
from .git import git, out
from .git import run as git_run
from .tree import PKG

# A device run carries the repository's tracked files plus the bundle, 64 MiB in all.
RUN_LIMIT = 64 * 2**20
GPU_WHEEL_TAG = "cp312-cp312-manylinux_2_34_x86_64"  # the pinned upstream wheel the bundle's tree comes from
GPU_PYTHON = "3.12"
# pip matches manylinux tags exactly: offer every one the import set's wheels use.
PLATFORMS = [
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_34_x86_64",
    "any",
]


# The diffusion server (3 MiB of xz): neither ``sglang.launch_server`` for a language model nor a
# GPU test imports it, and both trees the matrix serves lack it alike.
LEFT_OUT = (f"{PKG}/multimodal_gen/",)


def _tree_tarball(tree: Path, dest: Path) -> None:
    """The tree's HEAD under ``python/`` as an xz tar, without compiled files and
    ``LEFT_OUT`` (xz: a third smaller than gzip; bundle and repo share 64 MiB)."""
    r = git_run(tree, "archive", "--format=tar", "HEAD", PKG, text=False)
    if r.returncode != 0:
        raise ForkError(
            f"git archive HEAD {PKG} failed in {tree}: {r.stderr.decode(errors='replace')}"
        )
    archive = r.stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as src, tarfile.open(
        dest, "w:xz", preset=9
    ) as out:
        for member in src:
            if member.isfile() and member.name.endswith(".so"):
                continue
            if member.name.startswith(LEFT_OUT):
                continue
            out.addfile(member, src.extractfile(member) if member.isfile() else None)


def _upstream_overlay(tree: Path, dest: Path) -> int:
    """What turns the bundle's fork tree back into the pinned release's: upstream's own version of
    every file the series edits (``upstream-tree.tar.xz``) and the list of files the series adds
    (``upstream-added.txt``). The tree's first commit is the release, so the overlay is exact;
    ``e2e.sh`` lays it over a copy of the fork tree to serve unpatched upstream beside the fork.
    """
    base = out(tree, "rev-list", "--max-parents=0", "HEAD").splitlines()[-1]
    changed = out(
        tree, "diff", "--name-status", "--no-renames", base, "HEAD", "--", PKG
    )
    edited, added = [], []
    for line in changed.splitlines():
        status, path = line.split("\t", 1)
        if path.endswith(".so"):
            continue
        (added if status == "A" else edited).append(path)
    with tarfile.open(dest / "upstream-tree.tar.xz", "w:xz", preset=9) as tar:
        for path in edited:
            data = git(tree, "show", f"{base}:{path}").stdout.encode()
            info = tarfile.TarInfo(path)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    (dest / "upstream-added.txt").write_text("".join(p + "\n" for p in added))
    return len(edited)


def _wheels(dest: Path, requirements: Path) -> None:
    cache = Path.home() / ".cache" / "sglang-fork" / "gpu-wheels"
    cache.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "-q",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        GPU_PYTHON,
        "--implementation",
        "cp",
        "-d",
        str(cache),
        "-r",
        str(requirements),
    ]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise ForkError(
            f"cannot fetch the GPU bundle's wheels: {r.stderr.strip().splitlines()[-1]}"
        )
    wanted = {
        line.split("==")[0].lower().replace("-", "_"): line.split("==")[1]
        for line in requirements.read_text().splitlines()
        if line and not line.startswith("#")
    }
    dest.mkdir()
    for whl in cache.glob("*.whl"):
        name, version = whl.name.split("-")[:2]
        if wanted.get(name.lower()) == version:
            shutil.copy(whl, dest)
    missing = set(wanted) - {w.name.split("-")[0].lower() for w in dest.glob("*.whl")}
    if missing:
        raise ForkError(f"no cp312 wheel for: {', '.join(sorted(missing))}")


def make_bundle(tree: Path, version: str, dest: Path) -> int:
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    _tree_tarball(tree, dest / "sglang-tree.tar.xz")
    _upstream_overlay(tree, dest)
    _wheels(dest / "wheels", REPO_ROOT / "tools" / "requirements-import.txt")
    _wheels(dest / "serve-wheels", REPO_ROOT / "tools" / "requirements-serve-gpu.txt")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(REPO_ROOT / "tools" / "standins", dest / "standins", ignore=ignore)
    shutil.copytree(REPO_ROOT / "test", dest / "test", ignore=ignore)
    # test/conftest.py puts tools/ on sys.path; the CPU-only test modules still get collected.
    shutil.copytree(
        REPO_ROOT / "tools" / "forklib", dest / "tools" / "forklib", ignore=ignore
    )
    shutil.copytree(REPO_ROOT / "tools" / "e2e", dest / "tools" / "e2e", ignore=ignore)
    # conftest reads the pin and the series (the release, our modules, dropped patches' tests).
    shutil.copytree(REPO_ROOT / "patches", dest / "patches")
    shutil.copy(REPO_ROOT / "upstream.toml", dest / "upstream.toml")
    shutil.copytree(
        REPO_ROOT / "benchmark",
        dest / "benchmark",
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "results"),
    )
    shutil.copy(REPO_ROOT / "tools" / "gpu_bundle_run.sh", dest / "run.sh")
    shutil.copy(REPO_ROOT / "tools" / "gpu_e2e_run.sh", dest / "e2e.sh")
    (dest / "VERSION").write_text(version + "\n")
    (dest / "COMMIT").write_text(repo_commit() + "\n")
    size = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())
    repo = _tracked_bytes()
    if size + repo > RUN_LIMIT:
        raise ForkError(
            f"the GPU bundle ({size / 2**20:.1f} MiB) and the repository's tracked files "
            f"({repo / 2**20:.1f} MiB) are over a device run's {RUN_LIMIT / 2**20:.0f} MiB"
        )
    return size


def repo_commit(repo: Path = REPO_ROOT) -> str:
    """``HEAD``'s commit, ``-dirty`` appended when tracked files differ from it (the bundle then
    carries code no commit holds, and says so)."""
    head = out(repo, "rev-parse", "HEAD").strip()
    dirty = out(repo, "status", "--porcelain", "--untracked-files=no").strip()
    return head + ("-dirty" if dirty else "")


def _tracked_bytes() -> int:
    names = git(REPO_ROOT, "ls-files", "-z").stdout.split("\0")
    return sum(
        f.stat().st_size
        for f in map(REPO_ROOT.joinpath, filter(None, names))
        if f.is_file()
    )
