"""Flags off = upstream on any release (tools/forklib/importcheck.py): every upstream module
our hunks edit imports even where a module of ours cannot (a release that lacks what it
reads), so an upstream file imports our module at module level only where that brings in
nothing of upstream the file does not import itself; elsewhere inside the flag's branch.

Statically (``make``, ``make check``): the series passes on the pinned release, and a
scratch upstream module importing ours at module level fails naming the line, the module
and the patch, while the lazy form passes. By import: with 0012's fast-load module made
unimportable, upstream's DeepSeek-V4 modules still import (they did not before 0012's
imports moved into its hook), and a scratch module importing a blocked one fails, saying so.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import REPO, UPSTREAM
from forklib import ForkError, importcheck, needs
from forklib.pin import fetch_pinned, load_pin
from forklib.series import Patch

TAG = "cp311-cp311-manylinux_2_34_x86_64"
FAST_LOAD = "sglang.srt.models.deepseek_v4_fast_load"
MODELS = [
    "sglang.srt.models.deepseek_v4",
    "sglang.srt.models.deepseek_v4_dspark",
    "sglang.srt.models.deepseek_v4_nextn",
]

OURS = Patch(
    Path("0001-ours.patch"),
    "ours",
    "",
    {"Owns": ["python/sglang/ours.py"]},
    ("python/sglang/up/model.py",),
)
EAGER = "from sglang.up.base import Base\nfrom sglang.ours import helper\n"
LAZY = (
    "from sglang.up.base import Base\n\n\ndef hook():\n"
    "    from sglang.ours import helper\n\n    return helper\n"
)


def scratch_texts(model: str, ours: str) -> dict[str, str]:
    return {
        "python/sglang/up/model.py": model,
        "python/sglang/ours.py": ours,
        "python/sglang/up/base.py": "class Base:\n    pass\n",
        "python/sglang/up/other.py": "X = 1\n",
    }


@pytest.mark.parametrize(
    "model, ours, bad",
    [
        (EAGER, "from sglang.up.other import X\n\n\ndef helper():\n    pass\n", True),
        (LAZY, "from sglang.up.other import X\n\n\ndef helper():\n    pass\n", False),
        # what our module imports, upstream's file imports itself: nothing new can fail
        (
            EAGER,
            "from sglang.up.base import Base\n\n\ndef helper():\n    pass\n",
            False,
        ),
        # imported in a function of ours: not at import time
        (EAGER, "def helper():\n    from sglang.up.other import X\n", False),
    ],
)
def test_an_eager_import_of_ours_that_brings_in_upstream_is_named(model, ours, bad):
    texts = scratch_texts(model, ours)
    problems = importcheck.flags_off_problems(texts.get, [OURS])
    if not bad:
        assert problems == []
        return
    assert len(problems) == 1
    p = problems[0]
    assert p.startswith("python/sglang/up/model.py:2 imports sglang.ours (0001-ours)")
    assert "sglang.up.other (python/sglang/ours.py:1)" in p
    assert "inside the branch its flag turns on" in p


@pytest.fixture(scope="module")
def pinned(series):
    return needs.series_tree(fetch_pinned(load_pin(), TAG), series, REPO, UPSTREAM)


def test_the_series_imports_nothing_eagerly_that_upstream_does_not(pinned, series):
    assert "flags off" in importcheck.verify_flags_off(pinned, series)


def test_0012s_old_eager_import_fails_the_check(pinned, series):
    """The form 0012 had: the fast-load module imported at the top of the NextN model."""
    rel = "sglang/srt/models/deepseek_v4_nextn.py"
    text = pinned.text(rel)
    anchor = "from sglang.srt.models import deepseek_v4_boundary as hc_boundary\n"
    assert anchor in text
    eager = text.replace(
        anchor, anchor + "from sglang.srt.models import deepseek_v4_fast_load\n"
    )
    tree = needs.UpstreamTree(
        pinned.release,
        pinned.paths,
        pinned.text,
        "eager",
        {**pinned.overlay, rel: eager},
    )
    with pytest.raises(ForkError) as e:
        importcheck.verify_flags_off(tree, series)
    msg = str(e.value)
    assert f"python/{rel}:" in msg and f"imports {FAST_LOAD} (0012-" in msg


def test_upstreams_models_import_with_the_fast_load_module_unimportable():
    """By import, in this venv (third-party packages it lacks stood in): the DeepSeek-V4
    models import with 0012's module blocked, and the block itself is effective."""
    failures, _ = importcheck.run(
        MODELS + [FAST_LOAD],
        sys.executable,
        block=(FAST_LOAD,),
        standin=True,
        root=REPO,
    )
    assert [f.module for f in failures] == [FAST_LOAD], failures
    assert "made unimportable by the check" in failures[0].error


def test_an_upstream_module_importing_a_blocked_module_fails_naming_it(tmp_path):
    for rel, text in scratch_texts(EAGER, "def helper():\n    pass\n").items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    (tmp_path / "python/sglang/__init__.py").write_text("")
    (tmp_path / "python/sglang/up/__init__.py").write_text("")
    mods = ["sglang.up.model"]
    assert importcheck.run(mods, sys.executable, tree=tmp_path) == ([], [])
    failures, _ = importcheck.run(
        mods, sys.executable, tree=tmp_path, block=("sglang.ours",)
    )
    (f,) = failures
    assert f.module == "sglang.up.model" and f.at == "sglang/up/model.py:2"
    advice = importcheck.advice(f, [OURS], "9.9.9")
    assert "imports sglang.ours, a module of ours" in advice
    assert "inside the branch its flag turns on" in advice


@pytest.mark.parametrize(
    "error, missing, says",
    [
        (
            "ModuleNotFoundError: No module named 'sglang.ours'",
            "sglang.ours",
            "a module of ours (0001-ours): name it in a `Depends:` trailer",
        ),
        (
            "ModuleNotFoundError: No module named 'sglang.srt.layers.engram'",
            "sglang.srt.layers.engram",
            "is upstream's, and sglang 9.9.9 lacks it (no `Depends:` helps)",
        ),
        (
            "ImportError: cannot import name '_x' from 'sglang.up.other' (/t/other.py)",
            "sglang.up.other",
            "sglang.up.other._x is upstream's, and sglang 9.9.9 lacks it",
        ),
        (
            "ModuleNotFoundError: No module named 'compressed_tensors'",
            "compressed_tensors",
            "a third-party package this environment lacks",
        ),
    ],
)
def test_advice_tells_ours_from_upstreams_from_the_environment(error, missing, says):
    f = importcheck.Failure("sglang.x", error, missing, "")
    ours = Patch(OURS.path, "ours", "", OURS.trailers, ())  # edits no upstream file
    assert says in importcheck.advice(f, [ours], "9.9.9")
