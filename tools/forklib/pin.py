"""The upstream pin (``upstream.toml``) and the verified wheel cache.

Upstream is a PyPI wheel (sglang ships no sdist since 0.5.11). A wheel is fetched with pip
for one interpreter tag, checked against the pinned sha256 and kept in the cache; a file
that does not match is deleted, never used.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

from . import REPO_ROOT, ForkError

PIN_FILE = REPO_ROOT / "upstream.toml"
PLATFORM = "manylinux_2_34_x86_64"


@dataclasses.dataclass(frozen=True)
class Pin:
    package: str
    version: str
    wheels: dict[str, str]  # wheel tag ("cp311-cp311-manylinux_2_34_x86_64") -> sha256

    def sha256(self, tag: str) -> str:
        try:
            return self.wheels[tag]
        except KeyError:
            raise ForkError(
                f"upstream.toml pins no {self.package} {self.version} wheel for {tag}; "
                f"pinned tags: {', '.join(sorted(self.wheels))}"
            ) from None


def load_pin(path: Path = PIN_FILE) -> Pin:
    with open(path, "rb") as f:
        data = tomllib.load(f)
    up = data["upstream"]
    return Pin(up["package"], up["version"], dict(up["wheels"]))


def render_pin(pin: Pin) -> str:
    lines = [
        "# The upstream release this fork is built on: sglang's PyPI wheels, verified by sha256.",
        "# `make` downloads the wheel for its Python, checks the hash and caches it; nothing of upstream is committed.",
        "# `make rebase TO=<release>` rewrites this file.",
        "",
        "[upstream]",
        f'package = "{pin.package}"',
        f'version = "{pin.version}"',
        "",
        "[upstream.wheels]",
    ]
    lines += [f'"{tag}" = "{sha}"' for tag, sha in sorted(pin.wheels.items())]
    return "\n".join(lines) + "\n"


def python_tag(python: str = sys.executable) -> str:
    """The wheel tag of an interpreter, e.g. ``cp311-cp311-manylinux_2_34_x86_64``."""
    ver = subprocess.run(
        [python, "-c", "import sys; print(f'{sys.version_info[0]}{sys.version_info[1]}')"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()
    return f"cp{ver}-cp{ver}-{PLATFORM}"


def cache_dir() -> Path:
    base = os.environ.get("FORK_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "sglang-fork"
    )
    path = Path(base) / "wheels"
    path.mkdir(parents=True, exist_ok=True)
    return path


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def wheel_name(package: str, version: str, tag: str) -> str:
    return f"{package}-{version}-{tag}.whl"


def fetch_wheel(package: str, version: str, tag: str, sha256: str | None) -> Path:
    """Return the cached wheel, downloading it with pip if needed.

    ``sha256=None`` trusts the first download (a release not pinned yet, as in a rebase) and
    the caller records the hash it returns with ``file_sha256``.
    """
    target = cache_dir() / wheel_name(package, version, tag)
    if not target.exists():
        _download(package, version, tag, target)
    if sha256 is not None:
        got = file_sha256(target)
        if got != sha256:
            target.unlink()
            raise ForkError(
                f"{target.name}: sha256 {got} does not match the pinned {sha256}; "
                "the file was deleted from the cache. If PyPI really re-published this "
                "release, review the change and update upstream.toml by hand."
            )
    return target


def _download(package: str, version: str, tag: str, target: Path) -> None:
    py, abi, platform = tag.split("-", 2)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [
            sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
            "--only-binary=:all:", "--python-version", py[2:], "--implementation", "cp",
            "--abi", abi, "--platform", platform, "-d", tmp, f"{package}=={version}",
        ]
        print(f"fetching {package}=={version} ({tag}) from PyPI ...", flush=True)
        r = subprocess.run(cmd, capture_output=True, text=True)
        got = list(Path(tmp).glob("*.whl"))
        if r.returncode != 0 or len(got) != 1 or got[0].name != target.name:
            said = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise ForkError(
                f"cannot fetch {package}=={version} as {target.name} from PyPI: {said}. "
                f"Is {version} a released version with a {tag} wheel?"
            )
        shutil.move(str(got[0]), target)


def fetch_pinned(pin: Pin, tag: str) -> Path:
    return fetch_wheel(pin.package, pin.version, tag, pin.sha256(tag))
