"""Skip a test that needs a private name of upstream's when the installed release lacks it.

A test that reaches into upstream's private API (a helper, a signature) is bound to the
release it was written on; after a rebase onto another one it is the test, not the
feature, that breaks. ``require`` turns that into a skip whose reason names the missing
API and the release, so the suite stays green apart from skips that say what is absent.
"""

from __future__ import annotations

import importlib.metadata

import pytest


def release() -> str:
    """The installed engine's upstream release (the fork's local version suffix dropped)."""
    return importlib.metadata.version("sglang").split("+", 1)[0]


def require(present: bool, api: str) -> None:
    """Skip the calling test unless ``present``: ``api`` says what it needs, e.g.
    ``"FusedMoE._load_w13 without tp_rank"``."""
    if not present:
        pytest.skip(f"needs upstream's {api}, which sglang {release()} does not have")


def require_patch(name: str, what: str, series_file=None) -> None:
    """Skip the calling test when a rebase dropped patch ``name`` from ``patches/series`` (the
    target lacks the code it edits); ``what`` is the part of that patch the test drives. A
    tool test that exercises a patch's module is not in the patch's ``Tests:``, so conftest
    does not leave it out: this says why it cannot run."""
    from forklib.series import DROPPED_RE, SERIES_FILE

    for line in (series_file or SERIES_FILE).read_text().splitlines():
        m = DROPPED_RE.match(line.strip())
        if m and m.group(1) == name:
            onto = line.split(" to ", 1)[1].split(":", 1)[0]
            pytest.skip(
                f"needs {what} of patch {name}, which the rebase onto sglang {onto} dropped: "
                f"{onto} lacks the code it edits (patches/series says so)"
            )
