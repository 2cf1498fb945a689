"""Thin, deterministic git calls for the scratch trees (fixed identity and dates)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from . import ForkError

IDENTITY = {
    "GIT_AUTHOR_NAME": "sglang-fork",
    "GIT_AUTHOR_EMAIL": "fork@sglang-fork.invalid",
    "GIT_COMMITTER_NAME": "sglang-fork",
    "GIT_COMMITTER_EMAIL": "fork@sglang-fork.invalid",
    # Fixed dates: the same inputs give the same commit ids, so trees are comparable.
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00+0000",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00+0000",
}


def git(
    repo: Path,
    *args: str,
    check: bool = True,
    input: str | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **IDENTITY, "GIT_CONFIG_NOSYSTEM": "1", **(env or {})}
    r = subprocess.run(
        [
            "git",
            "-c",
            "core.autocrlf=false",
            "-c",
            "advice.detachedHead=false",
            "-c",
            "init.defaultBranch=main",
            *args,
        ],
        cwd=repo,
        capture_output=True,
        text=True,
        input=input,
        env=full_env,
    )
    if check and r.returncode != 0:
        raise ForkError(
            f"git {' '.join(args[:3])} failed in {repo}:\n{r.stderr.strip()}"
        )
    return r


def out(repo: Path, *args: str) -> str:
    return git(repo, *args).stdout.strip()


def out_diff(repo: Path, *args: str) -> str:
    """A diff or patch without its final newline: not ``out``'s strip(), which also eats the
    single space of a last context line that is blank and leaves a corrupt hunk."""
    return git(repo, *args).stdout.rstrip("\n")
