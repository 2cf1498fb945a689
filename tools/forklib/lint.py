"""Upstream's Python formatters on the files we own: black, isort and codespell at the versions
and settings of sglang's ``.pre-commit-config.yaml`` (and its ``.isort.cfg`` and the codespell
section of ``python/pyproject.toml``), so a file of ours reads as upstream's own and an exported
patch passes upstream's hooks.

The pins live here once; ``tools/requirements-cpu.txt`` installs the same versions into ``.venv``
and ``lint`` refuses to run other versions (a newer black formats differently, so a check with it
would pass or fail for the wrong reason).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from . import REPO_ROOT, ForkError
from .git import out

VERSIONS = {"black": "24.10.0", "isort": "5.13.2", "codespell": "2.4.1"}
ISORT_ARGS = ["--profile", "black", "-p", "sglang"]  # upstream's .isort.cfg
# upstream's hook arguments, then the ignore list and skips of upstream's [tool.codespell]
CODESPELL_ARGS = [
    "-L",
    "cann,thi,makro,wil,rouge,PRIS",
    "-L",
    "ans,als,hel,boostrap,childs,te,vas,hsa,ment",
]
CODESPELL_SKIP = (".json", ".jsonl", ".patch", ".txt", ".gz", ".log")
PYTHON_SCRIPTS = ("tools/fork",)  # Python files without the .py suffix


def owned_files(repo: Path = REPO_ROOT) -> tuple[list[str], list[str]]:
    """(Python files, every text file codespell reads) tracked in this repository and present:
    a file deleted but not yet committed (a rebase removes a dropped patch's modules) is not
    read."""
    tracked = [f for f in out(repo, "ls-files").splitlines() if (repo / f).is_file()]
    python = [f for f in tracked if f.endswith(".py") or f in PYTHON_SCRIPTS]
    spell = [f for f in tracked if not f.endswith(CODESPELL_SKIP)]
    return python, spell


def _tool(bindir: Path, name: str) -> str:
    exe = bindir / name
    if not exe.exists():
        raise ForkError(
            f"{exe} not found: `make` installs upstream's formatters into .venv "
            "(tools/requirements-cpu.txt)"
        )
    version = subprocess.run(
        [str(exe), "--version"], capture_output=True, text=True
    ).stdout
    if VERSIONS[name] not in version:
        raise ForkError(
            f"{name} {VERSIONS[name]} is upstream's pin; {exe} is {version.strip()!r}"
        )
    return str(exe)


def lint(bindir: Path, repo: Path = REPO_ROOT, fix: bool = False) -> list[str]:
    """Run the three tools over the repository's files; return one problem per failing tool
    (its output), empty when all pass. ``fix`` rewrites files instead of checking."""
    python, spell = owned_files(repo)
    check = [] if fix else ["--check"]
    runs = [
        ("black", [_tool(bindir, "black"), *(["-q"] if fix else check), *python]),
        (
            "isort",
            [
                _tool(bindir, "isort"),
                *ISORT_ARGS,
                *(["-q"] if fix else ["--check-only"]),
            ]
            + python,
        ),
        (
            "codespell",
            [
                _tool(bindir, "codespell"),
                *CODESPELL_ARGS,
                *(["-w"] if fix else []),
                *spell,
            ],
        ),
    ]
    problems = []
    for name, cmd in runs:
        r = subprocess.run(cmd, cwd=repo, capture_output=True, text=True)
        if r.returncode != 0:
            problems.append(f"{name}:\n{(r.stdout + r.stderr).strip()}")
    return problems
