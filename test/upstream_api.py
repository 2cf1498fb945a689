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
