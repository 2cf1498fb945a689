"""docker/: what can be checked of the serving image without an image registry.

The image itself cannot be built on the project's machines. Checked instead: the first stage's
script builds the fork wheel for the image's Python from a clean copy of the repository; that wheel's
dependency metadata is upstream's own, so installing it ``--no-deps`` over upstream's pinned set (the
image's second stage) leaves ``pip check`` exactly as upstream's wheel leaves it; the Dockerfile
passes hadolint; the base image follows the pinned release.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import REPO

DOCKER = REPO / "docker"
TAG = "cp312-cp312-manylinux_2_34_x86_64"


def _requires(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return sorted(
            l
            for l in z.read(meta).decode().splitlines()
            if l.startswith(("Requires-Dist:", "Requires-Python:"))
        )


def test_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    r = subprocess.run(
        [hadolint, str(DOCKER / "Dockerfile")], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_base_image_is_the_pinned_release():
    from forklib.pin import load_pin

    text = (DOCKER / "Dockerfile").read_text()
    assert f"ARG SGLANG_IMAGE=lmsysorg/sglang:v{load_pin().version}\n" in text


@pytest.mark.slow
def test_build_stage_builds_a_wheel_with_upstreams_dependencies(tmp_path):
    """docker/build-wheel.sh from a copy of the tracked files (no build/, no .venv, no .git)."""
    from forklib.pin import fetch_pinned, load_pin

    files = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout
    src = tmp_path / "src"
    for rel in filter(None, files.decode().split("\0")):
        if (REPO / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, src / rel)
    r = subprocess.run(
        ["bash", "docker/build-wheel.sh", str(tmp_path / "dist"), TAG],
        cwd=src,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    assert re.fullmatch(
        rf"sglang-{re.escape(load_pin().version)}\+fork\.\d+\.[0-9a-f]{{7}}-{TAG}\.whl",
        wheel.name,
    )
    assert _requires(wheel) == _requires(fetch_pinned(load_pin(), TAG))
