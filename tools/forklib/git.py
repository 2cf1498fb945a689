"""Every git call of the tools: thin, deterministic, in git's untranslated messages.

The tools match git's messages (``Hunk #1 succeeded at ... (offset``, ``error: patch
failed``), so each call runs with ``LC_ALL=C``: on a translated git an offset hunk would
otherwise pass the exactness check. Fixed identity and dates make the same inputs give the
same commit ids. No module of forklib runs ``git`` except through this one (a test says so).
"""

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
# git's own messages, untranslated, whatever the caller's environment says.
LOCALE = {"LC_ALL": "C", "LANGUAGE": "C"}


def git(
    repo: Path,
    *args: str,
    check: bool = True,
    input: str | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    r = run(repo, *args, input=input, env=env, text=True)
    if check and r.returncode != 0:
        raise ForkError(
            f"git {' '.join(args[:3])} failed in {repo}:\n{r.stderr.strip()}"
        )
    return r


def run(
    repo: Path,
    *args: str,
    input: str | bytes | None = None,
    env: dict[str, str] | None = None,
    text: bool = True,
) -> subprocess.CompletedProcess:
    """``git args`` in ``repo`` with the fixed environment; ``text=False`` for raw bytes."""
    full_env = {
        **os.environ,
        **IDENTITY,
        "GIT_CONFIG_NOSYSTEM": "1",
        **(env or {}),
        **LOCALE,
    }
    return subprocess.run(
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
        text=text,
        input=input,
        env=full_env,
    )


def out(repo: Path, *args: str) -> str:
    return git(repo, *args).stdout.strip()


def out_diff(repo: Path, *args: str) -> str:
    """A diff or patch without its final newline: not ``out``'s strip(), which also eats the
    single space of a last context line that is blank and leaves a corrupt hunk."""
    return git(repo, *args).stdout.rstrip("\n")


def show(repo: Path, commit: str, path: str) -> bytes:
    """A file's bytes at ``commit`` (binary-safe: owned files may be any bytes)."""
    r = run(repo, "show", f"{commit}:{path}", text=False)
    if r.returncode != 0:
        raise ForkError(
            f"git show {commit}:{path} failed in {repo}:\n{r.stderr.decode(errors='replace').strip()}"
        )
    return r.stdout
