"""The fork tool: pinned upstream wheel + our files + patches/series -> a git tree -> a wheel.

One tree builder (``tree.assemble``) serves build, check, rebase and export: the assembled
tree is a git repository whose root commit is the upstream release and whose next commits
are the patches of ``patches/series``, one each, with the files of ours each patch owns.
Git does all applying, merging and diffing; this package orders, checks and reports.
Standard library only, so it runs before any virtual environment exists.
"""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


class ForkError(Exception):
    """A failure the tool reports in one message and exit status 1 (no traceback)."""
