"""The upstream pin (``upstream.toml``) and the verified wheel cache.

Upstream is a PyPI wheel (sglang ships no sdist since 0.5.11). A wheel is fetched with pip
for one interpreter tag into a temporary directory and enters the cache (shared by every
clone) only once it matches the pinned sha256; ``<wheel>.sha256`` beside it records the hash
it was stored under. A cached file that does not match the pin is refused, never used, and
kept: the pin may be what is wrong. Only a file that no longer matches its own recorded hash
(damaged since) is replaced.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
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
        [
            python,
            "-c",
            "import sys; print(f'{sys.version_info[0]}{sys.version_info[1]}')",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    return f"cp{ver}-cp{ver}-{PLATFORM}"


def cache_dir() -> Path:
    base = os.environ.get("FORK_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
        "sglang-fork",
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
    record = _record(target)
    stored = record.read_text().strip() if record.exists() else None
    got = file_sha256(target) if target.exists() else None
    if got is not None and stored is not None and got != stored:
        print(
            f"{target.name}: damaged in the cache since it was stored (sha256 {got}, stored "
            f"as {stored}); fetching it again",
            flush=True,
        )
        got = None
    if got is None:
        got = _download(package, version, tag, target, sha256)
    elif stored is None and (sha256 is None or got == sha256):
        _write_record(
            target, got
        )  # a file cached before records were kept: record it now
    if sha256 is not None and got != sha256:
        raise ForkError(
            f"{target.name}: the cached wheel's sha256 is {got}"
            + (
                ", the hash it was verified against when it entered the cache"
                if stored == got
                else ""
            )
            + f"; it does not match the pinned {sha256}. The wheel is refused, and kept in "
            f"{target.parent} (other clones share it). Check the hash in upstream.toml; if PyPI "
            "really re-published this release, review the change and update upstream.toml by "
            f"hand; if the cached file is what is wrong, delete {target} and run again."
        )
    return target


def _record(target: Path) -> Path:
    return target.with_name(target.name + ".sha256")


def _write_record(target: Path, sha: str) -> None:
    tmp = _record(target).with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(sha + "\n")
    os.replace(tmp, _record(target))


def _download(
    package: str, version: str, tag: str, target: Path, sha256: str | None
) -> str:
    """Fetch into a temporary directory, verify, then move into the cache with its record."""
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        got_path = _pip_download(package, version, tag, Path(tmp))
        got = file_sha256(got_path)
        if sha256 is not None and got != sha256:
            raise ForkError(
                f"downloaded {got_path.name}: sha256 {got} does not match the pinned {sha256}; "
                "it was not cached. If PyPI really re-published this release, review the change "
                "and update upstream.toml by hand."
            )
        os.replace(got_path, target)
        _write_record(target, got)
    return got


def _pip_download(package: str, version: str, tag: str, dest: Path) -> Path:
    py, abi, platform = tag.split("-", 2)
    name = wheel_name(package, version, tag)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        py[2:],
        "--implementation",
        "cp",
        "--abi",
        abi,
        "--platform",
        platform,
        "-d",
        str(dest),
        f"{package}=={version}",
    ]
    print(f"fetching {package}=={version} ({tag}) from PyPI ...", flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True)
    got = list(dest.glob("*.whl"))
    if r.returncode != 0 or len(got) != 1 or got[0].name != name:
        said = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise ForkError(
            f"cannot fetch {package}=={version} as {name} from PyPI: {said}. "
            f"Is {version} a released version with a {tag} wheel?"
        )
    return got[0]


def fetch_pinned(pin: Pin, tag: str) -> Path:
    return fetch_wheel(pin.package, pin.version, tag, pin.sha256(tag))
