"""Shared fixtures: the fork tool, the installed engine, the GPU marker.

Tests run with the venv that `make` installed (.venv/bin/python -m pytest test). Tests
marked ``gpu`` need CUDA and are skipped without it; the GPU bundle runs them on the H200.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import torch

    HAS_CUDA = torch.cuda.is_available()
except ImportError:
    HAS_CUDA = False
if not HAS_CUDA:
    # Triton kernels run under its interpreter on CPU machines (small shapes). Set before any
    # test module imports a kernel: @triton.jit reads it when the kernel is defined.
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
# Engine modules import sgl_kernel / deep_gemm users: the import-only stand-ins come first.
sys.path.insert(0, str(REPO / "tools" / "standins"))

from forklib.pin import load_pin  # noqa: E402

# The pinned upstream release: tests read it here, so they pass unedited after a rebase.
UPSTREAM = load_pin().version


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "gpu: needs a CUDA GPU (run on the H200 through the GPU bundle)"
    )
    config.addinivalue_line(
        "markers", "slow: builds or installs something (a few seconds to a minute)"
    )
    config.addinivalue_line(
        "markers", "e2e: starts real launch_server processes (tools/e2e)"
    )
    _error_on_our_deprecations(config)


def _dropped() -> dict[str, list[str]]:
    """Test files of patches a rebase dropped (patches/series says so) that no patch names now."""
    from forklib.series import dropped_tests, load_series

    named = {t for p in load_series() for t in p.trailers.get("Tests", [])}
    return {t: names for t, names in dropped_tests().items() if t not in named}


def pytest_ignore_collect(collection_path, config):
    # A dropped patch's tests import its modules, which are gone: not collected at all.
    path = Path(collection_path).resolve()
    return (
        path.is_relative_to(REPO)
        and path.relative_to(REPO).as_posix() in _dropped()
        or None
    )


def pytest_report_header(config):
    dropped = _dropped()
    if dropped:
        return [
            f"not collected: {t} (its patch {', '.join(n)} was dropped from patches/series by a rebase)"
            for t, n in sorted(dropped.items())
        ]


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def series():
    from forklib.series import load_series

    return load_series()


@pytest.fixture(scope="session")
def assembled(tmp_path_factory, series):
    """The pinned release + the series, assembled from scratch in a temporary tree."""
    from forklib.pin import fetch_pinned, load_pin
    from forklib.tree import assemble

    pin = load_pin()
    wheel = fetch_pinned(pin, "cp311-cp311-manylinux_2_34_x86_64")
    return assemble(tmp_path_factory.mktemp("tree"), wheel, pin.version, series)


def run_engine(*args: str, check: bool = False) -> subprocess.CompletedProcess:
    """Run the installed engine's Python (this interpreter) with warnings silenced."""
    return subprocess.run(
        [sys.executable, "-W", "ignore", *args],
        capture_output=True,
        text=True,
        check=check,
    )


# A model directory with only a config.json: enough for real server-argument resolution
# (the same fixture upstream's resolution tests use), no weights, no tokenizer.
TINY_LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 128,
    "max_position_embeddings": 2048,
}


@pytest.fixture(scope="session")
def llama_config(tmp_path_factory):
    import json

    path = tmp_path_factory.mktemp("llama-config")
    (path / "config.json").write_text(json.dumps(TINY_LLAMA_CONFIG))
    return path


def resolve_server_args(model_path, **kwargs):
    """ServerArgs(...) resolved through the real pipeline (``device="cuda"`` as upstream's own
    resolution tests: no device is touched on a CPU machine)."""
    from sglang.srt.server_args import ServerArgs

    sa = ServerArgs(model_path=str(model_path), **{"device": "cuda", **kwargs})
    sa.resolve_once()
    return sa


def _our_modules() -> list[str]:
    from forklib.series import load_series

    return sorted(
        own[len("python/") : -len(".py")].replace("/", ".").removesuffix(".__init__")
        for p in load_series()
        for own in p.owns
        if own.endswith(".py")
    )


def _error_on_our_deprecations(config):
    """A DeprecationWarning raised from a module of ours is an error: our code must use the
    replacements upstream names (upstream's own deprecations stay warnings)."""
    import re

    pattern = (
        "(" + "|".join(re.escape(m) for m in _our_modules()) + r")\Z"
    )  # a colon would split the filter
    config.addinivalue_line("filterwarnings", f"error::DeprecationWarning:{pattern}")


def with_model(cfg, arch=None, hf_config=None):
    """A stand-in server-args record for a validator's table of cases: ``cfg``'s fields (a
    namespace or a dict) and the model ``model_config_of`` hands back for it (a configuration
    a fixture supplies carries no key, so it is returned as it is). Each validator also has a
    case through a real ``ServerArgs`` (``test_validators_resolution.py``)."""
    from types import SimpleNamespace

    fields = dict(cfg) if isinstance(cfg, dict) else dict(vars(cfg))
    hf = {} if hf_config is None else dict(vars(hf_config))
    if arch is not None:
        hf["architectures"] = [arch]
    fields["_model_config"] = SimpleNamespace(hf_config=SimpleNamespace(**hf))
    return SimpleNamespace(**fields)
