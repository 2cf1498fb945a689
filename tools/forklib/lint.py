"""Upstream's Python hooks on the files we own: black, isort, codespell and ruff's unused-import
rule (F401) at the versions and settings of sglang's ``.pre-commit-config.yaml`` (and its
``.isort.cfg`` and the codespell section of ``python/pyproject.toml``), and its
check-shebang-scripts-are-executable, so a file of ours reads as upstream's own and an exported
patch passes upstream's hooks. Every tracked file of this repository is ours (upstream's files
live only in the assembled tree), so all of them are held.

The pins live here once; ``tools/requirements-cpu.txt`` installs the same versions into ``.venv``
and ``lint`` refuses to run other versions (a newer black formats differently, so a check with it
would pass or fail for the wrong reason).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from . import REPO_ROOT, ForkError
from .git import out

VERSIONS = {
    "black": "24.10.0",
    "isort": "5.13.2",
    "codespell": "2.4.1",
    "ruff": "0.11.7",
}
ISORT_ARGS = ["--profile", "black", "-p", "sglang"]  # upstream's .isort.cfg
# upstream's hook arguments, then the ignore list and skips of upstream's [tool.codespell]
CODESPELL_ARGS = [
    "-L",
    "cann,thi,makro,wil,rouge,PRIS",
    "-L",
    "ans,als,hel,boostrap,childs,te,vas,hsa,ment",
]
CODESPELL_SKIP = (".json", ".jsonl", ".patch", ".txt", ".gz", ".log")
# upstream's ruff hook arguments; --isolated reads no configuration file, --no-cache writes none
RUFF_ARGS = ["check", "--isolated", "--no-cache", "--select=F401", "--fixable=F401"]
PYTHON_SCRIPTS = ("tools/fork",)  # Python files without the .py suffix


def owned_files(repo: Path = REPO_ROOT) -> tuple[list[str], list[str]]:
    """(Python files, every text file codespell reads) tracked in this repository and present:
    a file deleted but not yet committed (a rebase removes a dropped patch's modules) is not
    read."""
    tracked = [f for f in out(repo, "ls-files").splitlines() if (repo / f).is_file()]
    python = [f for f in tracked if f.endswith(".py") or f in PYTHON_SCRIPTS]
    spell = [f for f in tracked if not f.endswith(CODESPELL_SKIP)]
    return python, spell


def scripts_without_run_bit(repo: Path = REPO_ROOT) -> list[str]:
    """Tracked files that start with ``#!`` but whose index mode is not executable: upstream's
    check-shebang-scripts-are-executable refuses them (``git update-index --chmod=+x``).
    """
    missing = []
    for entry in out(repo, "ls-files", "-s", "-z").split("\0"):
        if not entry:
            continue
        mode, path = entry.split(" ", 1)[0], entry.split("\t", 1)[1]
        if mode == "100644" and (repo / path).is_file():
            with open(repo / path, "rb") as f:
                if f.read(2) == b"#!":
                    missing.append(path)
    return missing


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
    """Run the four tools over the repository's files and look for scripts without a run bit;
    return one problem per failing check (its output), empty when all pass. ``fix`` rewrites
    files instead of checking (a run bit is not set for you)."""
    python, spell = owned_files(repo)
    check = [] if fix else ["--check"]
    runs = [  # ruff first: what its --fix leaves, black and isort format
        (
            "ruff",
            [
                _tool(bindir, "ruff"),
                *RUFF_ARGS,
                *(["--fix"] if fix else []),
                "--output-format=concise",
                *python,
            ],
        ),
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
    if unset := scripts_without_run_bit(repo):
        problems.append(
            "run bits: these start with a shebang but git does not mark them executable "
            "(`git update-index --chmod=+x FILE`, then commit):\n" + "\n".join(unset)
        )
    return problems
