"""Provenance of a result JSON: which fork build wrote it, on which device, with which versions.

Every result JSON the e2e harness or a benchmark writes goes through ``write_result``, which adds
one ``provenance`` block to the payload::

    "provenance": {"fork_version": "<upstream>+fork.<n>.<series>", "device": "NVIDIA H200",
                   "torch": "...", "triton": "...", "python": "..."}

so a number read later can be traced to the build and the machine that produced it (a result
without its build is not evidence of anything). ``check`` lists what a payload lacks.

Evidence that docs cite is never silently replaced by another build's: when the target file
exists, was written by a different build (a file without a provenance block counts as a past
build) and a docs page links to its file name, ``write_result`` writes beside it, to the same
name with the build appended (``foo-NVIDIA_H200.<build>.json``), and says so, unless
``overwrite=True`` (``--overwrite`` on every writer's command line). It never refuses outright:
a GPU run's numbers are kept either way. Docs pages: ``README.md``, ``docs/**/*.md``,
``benchmark/README.md`` and ``benchmark/*/README.md`` under ``root`` (the repository).

Importable from ``benchmark/`` (``harness`` puts ``tools/`` on ``sys.path``) and from
``tools/e2e``; it imports nothing of the harness, and torch only to name the device.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import platform
import re
import sys
from pathlib import Path
from typing import Any, Iterable

REPO = Path(__file__).resolve().parents[2]
KEY = "provenance"
FIELDS = ("fork_version", "device", "torch", "triton", "python")
NOT_INSTALLED = "not installed"
OVERWRITE_HELP = (
    "replace an existing result of another fork build that docs cite (default: write "
    "<name>.<build>.json beside it)"
)


def _package_version(name: str) -> str:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return NOT_INSTALLED


def fork_build() -> str:
    """The running fork build (``sglang.fork.fork_version()``), or what stands in its place."""
    try:
        from sglang.fork import fork_version
    except ImportError:  # upstream's tree, or no sglang at all
        return f"not a fork build (sglang {_package_version('sglang')})"
    return fork_version()


def device_name() -> str:
    """The accelerator the process ran on: the CUDA device's name, else ``cpu-<N>core``."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name()
    except ImportError:
        pass
    return f"cpu-{os.cpu_count()}core"


def provenance(device: str | None = None) -> dict[str, str]:
    """The block ``write_result`` adds; ``device`` overrides the detected one (a writer that
    measured on another device than ``torch.cuda``'s current one names it)."""
    return {
        "fork_version": fork_build(),
        "device": device or device_name(),
        "torch": _package_version("torch"),
        "triton": _package_version("triton"),
        "python": platform.python_version(),
    }


def check(payload: Any) -> list[str]:
    """What ``payload`` lacks to be a result with provenance (empty: nothing)."""
    if not isinstance(payload, dict):
        return [f"a result is a JSON object, not {type(payload).__name__}"]
    block = payload.get(KEY)
    if not isinstance(block, dict):
        return [f"no {KEY!r} block"]
    return [
        f"{KEY}.{f} missing or empty"
        for f in FIELDS
        if not isinstance(block.get(f), str) or not block[f]
    ]


def written_by(path: Path) -> str | None:
    """The build recorded in an existing result file; None if it records none (a past build)."""
    try:
        payload = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(payload, dict):
        return None
    block = payload.get(KEY)
    if isinstance(block, dict) and isinstance(block.get("fork_version"), str):
        return block["fork_version"]
    return None


def docs_pages(root: Path = REPO) -> list[Path]:
    root = Path(root)
    pages = [root / "README.md", root / "benchmark" / "README.md"]
    pages += sorted((root / "docs").rglob("*.md"))
    pages += sorted((root / "benchmark").glob("*/README.md"))
    return [p for p in pages if p.is_file()]


def citing_pages(name: str, root: Path = REPO) -> list[Path]:
    """The docs pages with a markdown link whose target ends in the file name ``name``."""
    link = re.compile(r"\]\(([^)#\s]*/)?" + re.escape(name) + r"(#[^)]*)?\)")
    return [p for p in docs_pages(root) if link.search(p.read_text(errors="replace"))]


def build_tag(build: str) -> str:
    """``build`` as a file-name part: every character but letters, digits, ``.``, ``_`` and
    ``-`` becomes ``_`` (``+fork.`` -> ``_fork.``)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", build)


def target(
    path: Path, build: str, *, overwrite: bool = False, root: Path = REPO
) -> tuple[Path, list[Path]]:
    """Where a result for ``path`` written by ``build`` goes, and the docs pages that made it move.

    ``path`` itself, unless it exists, records another build (or none) and docs cite its name
    while ``overwrite`` is false: then ``<stem>.<build>.json`` beside it.
    """
    path = Path(path)
    if overwrite or not path.exists() or written_by(path) == build:
        return path, []
    pages = citing_pages(path.name, root)
    if not pages:
        return path, []
    return path.with_name(f"{path.stem}.{build_tag(build)}{path.suffix}"), pages


def stamp(payload: dict, device: str | None = None) -> dict:
    """A copy of ``payload`` with its ``provenance`` block (replacing any it had)."""
    if not isinstance(payload, dict):
        raise TypeError(f"a result is a JSON object, not {type(payload).__name__}")
    return {**payload, KEY: provenance(device)}


def write_result(
    path: str | Path,
    payload: dict,
    *,
    overwrite: bool = False,
    device: str | None = None,
    root: Path = REPO,
    indent: int | None = 1,
    quiet: bool = False,
    **dumps_kw: Any,
) -> Path:
    """Write ``payload`` with its provenance to ``path`` (or beside it, see ``target``).

    Returns the path written; ``dumps_kw`` go to ``json.dumps`` (e.g. ``default=str``).
    """
    stamped = stamp(payload, device)
    problems = check(stamped)
    assert not problems, problems
    path = Path(path)
    dest, pages = target(
        path, stamped[KEY]["fork_version"], overwrite=overwrite, root=root
    )
    if pages and not quiet:
        cited = ", ".join(str(_rel(p, root)) for p in pages)
        print(
            f"{path} holds another build's result ({written_by(path) or 'no provenance'}) "
            f"that {cited} cite(s): writing {dest.name} beside it (--overwrite replaces it)",
            file=sys.stderr,
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(stamped, indent=indent, **dumps_kw) + "\n")
    return dest


def add_overwrite_arg(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--overwrite`` (see ``write_result``) on a writer's command line."""
    parser.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    return parser


def check_files(paths: Iterable[Path]) -> dict[Path, list[str]]:
    """``check`` over result files on disk: {path: problems} for those that fail."""
    bad = {}
    for p in paths:
        try:
            problems = check(json.loads(Path(p).read_text()))
        except ValueError as e:
            problems = [f"not JSON: {e}"]
        if problems:
            bad[Path(p)] = problems
    return bad


def _rel(p: Path, root: Path) -> Path:
    try:
        return p.relative_to(root)
    except ValueError:
        return p
