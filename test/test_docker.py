"""docker/: what can be checked of the serving image without an image registry.

The image is not built in CI. Checked instead: the first stage's
script builds the fork wheel from a clean copy of the repository, for the tag the image's own
Python installs (docker/wheel_tag.py); that wheel's dependency metadata is upstream's own, so
installing it ``--no-deps`` over upstream's pinned set (the image's second stage) leaves
``pip check`` exactly as upstream's wheel leaves it; the entry point is ``launch_server`` taking
the container's arguments; the Dockerfile passes hadolint; the base image is the pinned release,
by tag, and by digest in the right form once a digest is filled in (docker/README.md).
"""

from __future__ import annotations

import json
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


def base_image_problems(dockerfile: str, version: str) -> list[str]:
    """The base image's ARG must name upstream's image of the pinned release, by tag, with an
    optional ``@sha256:<64 hex>`` digest; every FROM uses that ARG."""
    m = re.search(r"^ARG SGLANG_IMAGE=(\S+)$", dockerfile, re.M)
    if not m:
        return ["no ARG SGLANG_IMAGE=..."]
    image, _, digest = m.group(1).partition("@")
    problems = []
    if image != f"lmsysorg/sglang:v{version}":
        problems.append(f"{image}: not lmsysorg/sglang:v{version}")
    if digest and not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
        problems.append(f"{digest}: not a digest (sha256:<64 hex>)")
    forms = re.findall(r"^FROM (\S+)", dockerfile, re.M)
    if not forms or any(f != "${SGLANG_IMAGE}" for f in forms):
        problems.append(f"FROM {forms}: every stage starts from ${{SGLANG_IMAGE}}")
    return problems


def test_base_image_is_the_pinned_release():
    from forklib.pin import load_pin

    text = (DOCKER / "Dockerfile").read_text()
    assert base_image_problems(text, load_pin().version) == []


def test_a_wrong_base_image_or_digest_is_refused():
    good = "ARG SGLANG_IMAGE=lmsysorg/sglang:v9.8.7\nFROM ${SGLANG_IMAGE} AS wheel\nFROM ${SGLANG_IMAGE}\n"
    assert base_image_problems(good, "9.8.7") == []
    digest = "sha256:" + "0123456789abcdef" * 4
    pinned = good.replace("v9.8.7\n", f"v9.8.7@{digest}\n", 1)
    assert base_image_problems(pinned, "9.8.7") == []
    assert base_image_problems(good, "9.8.8") == [
        "lmsysorg/sglang:v9.8.7: not lmsysorg/sglang:v9.8.8"
    ]
    short = good.replace("v9.8.7\n", "v9.8.7@sha256:abc\n", 1)
    assert base_image_problems(short, "9.8.7") == [
        "sha256:abc: not a digest (sha256:<64 hex>)"
    ]
    other = good + "FROM python:3.12-slim\n"
    assert len(base_image_problems(other, "9.8.7")) == 1


def _exec_form(dockerfile: str, instruction: str):
    (line,) = re.findall(rf"^{instruction} (.*)$", dockerfile, re.M)
    return json.loads(
        line
    )  # exec form (a JSON list); the shell form is not JSON and fails


def test_entrypoint_is_launch_server_with_the_containers_arguments():
    """`docker run IMAGE --model-path M --dsv4-wo-a-fp8-twin small` runs the server with them."""
    text = (DOCKER / "Dockerfile").read_text()
    assert _exec_form(text, "ENTRYPOINT") == ["python3", "-m", "sglang.launch_server"]
    assert _exec_form(text, "CMD") == ["--version"]
    with pytest.raises(json.JSONDecodeError):
        _exec_form("ENTRYPOINT python3 -m sglang.launch_server\n", "ENTRYPOINT")


def test_wheel_tag_is_the_pinned_wheel_this_python_installs(tmp_path):
    from forklib.pin import load_pin

    r = subprocess.run(
        [sys.executable, str(DOCKER / "wheel_tag.py")],
        capture_output=True,
        text=True,
        check=True,
    )
    tag = r.stdout.strip()
    assert tag in load_pin().wheels
    assert tag.startswith(f"cp{sys.version_info.major}{sys.version_info.minor}-")
    # No pinned wheel for this Python: refused, naming what is pinned.
    toml = tmp_path / "upstream.toml"
    toml.write_text(
        '[upstream]\npackage = "sglang"\nversion = "0"\n'
        '[upstream.wheels]\n"cp39-cp39-win32" = "00"\n'
    )
    r = subprocess.run(
        [sys.executable, str(DOCKER / "wheel_tag.py"), str(toml)],
        capture_output=True,
        text=True,
    )
    assert r.returncode != 0 and "cp39-cp39-win32" in r.stderr


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
