"""Provenance of a result JSON: which fork build wrote it, on which device, with which versions.

Every result JSON the e2e harness or a benchmark writes goes through ``write_result``, which adds
one ``provenance`` block to the payload::

    "provenance": {"fork_version": "<upstream>+fork.<n>.<series>", "device": "NVIDIA H200",
                   "torch": "...", "triton": "...", "python": "...", "commit": "<40 hex>"}

so a number read later can be traced to the build, the harness code and the machine that produced
it (a result without its build is not evidence of anything). ``commit`` is the commit of the
repository whose harness ran: ``git rev-parse HEAD`` (``-dirty`` appended when tracked files
differ from it), or in the GPU bundle (no git on its machine) the ``COMMIT`` file it carries
beside its ``VERSION`` (``harness_commit``). ``check`` lists what a payload lacks; a value this module could not determine
(``unknown ...``) counts as missing.

The block names the machine that produced the numbers. A result evaluated elsewhere (the e2e
matrix's ``--evaluate`` on a CPU from a GPU run's raw tokens) passes that machine's block as
``produced_by``, recorded when it ran; the evaluating machine goes in ``evaluated_by``.

A file that is not JSON (a log, a tarball, a text record) carries the block in a sidecar,
``<name>.provenance.json`` (``write_sidecar``; ``python3 tools/e2e/provenance.py stamp FILE``).
``check_results`` applies these rules to every file of ``benchmark/results/`` but its
``archive/`` (older files without complete provenance, cited by no docs page).

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
import gzip
import importlib.metadata as md
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterable

REPO = Path(__file__).resolve().parents[2]
KEY = "provenance"
FIELDS = ("fork_version", "device", "torch", "triton", "python", "commit")
NOT_INSTALLED = "not installed"
UNKNOWN = "unknown"
SIDECAR = ".provenance.json"
ARCHIVE = (
    "archive"  # benchmark/results/archive/: exempt from check_results, cited by no page
)
COMMIT_FILE = "COMMIT"  # beside the GPU bundle's VERSION (tools/forklib/bundle.py)
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


def harness_commit(root: Path = REPO) -> str:
    """The commit of the harness that runs: where ``root`` is the top of a git work tree,
    ``git rev-parse HEAD`` (``-dirty`` appended when tracked files differ from it); else (an
    unpacked GPU bundle, a copy without ``.git``) the ``COMMIT`` file the bundle carries; else
    ``unknown`` (which ``check`` refuses). A bundle inside a checkout reads its own ``COMMIT``,
    not the checkout's ``HEAD``, which may have moved since the bundle was built."""
    root = Path(root).resolve()
    top = _git(root, "rev-parse", "--show-toplevel")
    if top is not None and Path(top).resolve() == root:
        head = _git(root, "rev-parse", "HEAD")
        dirty = _git(root, "status", "--porcelain", "--untracked-files=no")
        if head and dirty is not None:
            return head + ("-dirty" if dirty else "")
    stamped = root / COMMIT_FILE
    if stamped.is_file() and stamped.read_text().strip():
        return stamped.read_text().strip()
    return f"{UNKNOWN} (no git work tree, no {COMMIT_FILE} file at {root})"


def _git(root: Path, *args: str) -> str | None:
    """``git -C root ARGS``'s output, stripped; None when it fails or git is missing."""
    try:
        r = subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def provenance(device: str | None = None) -> dict[str, str]:
    """The block ``write_result`` adds; ``device`` overrides the detected one (a writer that
    measured on another device than ``torch.cuda``'s current one names it)."""
    return {
        "fork_version": fork_build(),
        "device": device or device_name(),
        "torch": _package_version("torch"),
        "triton": _package_version("triton"),
        "python": platform.python_version(),
        "commit": harness_commit(),
    }


def check_block(block: Any, where: str = KEY) -> list[str]:
    """What a provenance block lacks: each field of ``FIELDS`` missing, empty or ``unknown``."""
    if not isinstance(block, dict):
        return [f"no {where!r} block"]
    return [
        f"{where}.{f} missing or empty"
        for f in FIELDS
        if not isinstance(block.get(f), str)
        or not block[f]
        or block[f].startswith(UNKNOWN)
    ]


def check(payload: Any) -> list[str]:
    """What ``payload`` lacks to be a result with provenance (empty: nothing)."""
    if not isinstance(payload, dict):
        return [f"a result is a JSON object, not {type(payload).__name__}"]
    return check_block(payload.get(KEY))


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


def stamp(
    payload: dict, device: str | None = None, produced_by: dict | None = None
) -> dict:
    """A copy of ``payload`` with its ``provenance`` block (replacing any it had): this
    machine's, or ``produced_by`` (the block the producing machine recorded) with this machine's
    in ``evaluated_by`` where it differs."""
    if not isinstance(payload, dict):
        raise TypeError(f"a result is a JSON object, not {type(payload).__name__}")
    here = provenance(device)
    if produced_by is None:
        return {**payload, KEY: here}
    out = {k: v for k, v in payload.items() if k != "evaluated_by"}
    out[KEY] = dict(produced_by)
    if here != produced_by:
        out["evaluated_by"] = provenance()
    return out


def write_result(
    path: str | Path,
    payload: dict,
    *,
    overwrite: bool = False,
    device: str | None = None,
    root: Path = REPO,
    indent: int | None = 1,
    quiet: bool = False,
    produced_by: dict | None = None,
    **dumps_kw: Any,
) -> Path:
    """Write ``payload`` with its provenance to ``path`` (or beside it, see ``target``).

    ``produced_by``: the provenance block of the machine that produced the numbers, when that is
    not this one (see ``stamp``). Returns the path written; ``dumps_kw`` go to ``json.dumps``
    (e.g. ``default=str``). A block that fails ``check`` is written all the same (a GPU run's
    numbers are kept) and named on stderr: ``check_results`` refuses the file until it is
    re-run where the block is complete.
    """
    stamped = stamp(payload, device, produced_by)
    problems = check(stamped)
    if problems:
        print(f"{path}: incomplete provenance: {'; '.join(problems)}", file=sys.stderr)
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
    """``check`` over result files on disk: {path: problems} for those that fail. A ``.json``
    is read as JSON, a ``.json.gz`` as gzipped JSON; any other file by its sidecar
    (``<name>.provenance.json``)."""
    bad = {}
    for p in map(Path, paths):
        problems = _file_problems(p)
        if problems:
            bad[p] = problems
    return bad


def _file_problems(p: Path) -> list[str]:
    if p.name.endswith(SIDECAR):
        payload, problems = _read_json(p)
        if problems:
            return problems
        described = payload.get("describes") if isinstance(payload, dict) else None
        if not described or not (p.parent / described).is_file():
            return [f"sidecar of no file: 'describes' names {described!r}"]
        return check(payload)
    if p.name.endswith(".json") or p.name.endswith(".json.gz"):
        payload, problems = _read_json(p)
        return problems or check(payload)
    sidecar = p.with_name(p.name + SIDECAR)
    if not sidecar.is_file():
        return [f"not JSON and no sidecar {sidecar.name} with its provenance"]
    payload, problems = _read_json(sidecar)
    return [f"{sidecar.name}: {x}" for x in problems or check(payload)]


def _read_json(p: Path) -> tuple[Any, list[str]]:
    try:
        if p.name.endswith(".gz"):
            with gzip.open(p, "rt") as f:
                return json.load(f), []
        return json.loads(p.read_text()), []
    except (OSError, ValueError, EOFError) as e:
        return None, [f"not JSON: {e}"]


def result_files(results: Path) -> list[Path]:
    """Every file under ``results`` but its ``archive/`` folder."""
    results = Path(results)
    return sorted(
        p
        for p in results.rglob("*")
        if p.is_file() and ARCHIVE not in p.relative_to(results).parts[:1]
    )


def check_results(results: Path) -> dict[Path, list[str]]:
    """``check_files`` over ``result_files(results)``."""
    return check_files(result_files(results))


def write_sidecar(path: str | Path, produced_by: dict | None = None) -> Path:
    """``<path>.provenance.json``: the provenance of a result that is not JSON (a log, a
    tarball), written by the machine that produced it (or ``produced_by``)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file to stamp")
    dest = path.with_name(path.name + SIDECAR)
    payload = stamp({"describes": path.name}, produced_by=produced_by)
    problems = check(payload)
    if problems:
        print(f"{dest}: incomplete provenance: {'; '.join(problems)}", file=sys.stderr)
    dest.write_text(json.dumps(payload, indent=1) + "\n")
    return dest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="stamp a non-JSON result with this machine's provenance, or check "
        "result files"
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    st = sub.add_parser("stamp", help="write FILE.provenance.json beside each FILE")
    st.add_argument("files", type=Path, nargs="+")
    ck = sub.add_parser(
        "check", help="check every result file under DIR (not archive/)"
    )
    ck.add_argument("dir", type=Path, nargs="?", default=REPO / "benchmark" / "results")
    a = p.parse_args(argv)
    if a.cmd == "stamp":
        for f in a.files:
            print(f"wrote {write_sidecar(f)}")
        return 0
    bad = check_results(a.dir)
    for path, problems in bad.items():
        print(f"{_rel(path, REPO)}: {'; '.join(problems)}")
    return 1 if bad else 0


def _rel(p: Path, root: Path) -> Path:
    try:
        return p.relative_to(root)
    except ValueError:
        return p


if __name__ == "__main__":
    sys.exit(main())
