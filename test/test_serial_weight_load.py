"""--weight-loader-disable-async-load: DeepSeek-V4 weights copied one at a time (patch: serial weight load).

A synthetic checkpoint in DeepSeek-V4's tensor names is loaded through the engine's real
``DeepseekV4ForCausalLM.load_weights`` and ``safetensors_weights_iterator``, once with the
stock thread pool and once serial, each in a fresh process (benchmark/loading/bench_serial_weight_load.py's
children): every parameter is bitwise identical, and the serial load's peak RSS above its
baseline stays within one open shard plus one tensor (the pool's has no such bound; both are
printed). The flag off is upstream (no published config, or the flag unset: the pool);
refusals where it would do nothing; the flag on the command line.
"""

from __future__ import annotations

import argparse
import sys
from types import SimpleNamespace

import pytest
from conftest import REPO, with_model

sys.path.insert(0, str(REPO / "benchmark" / "loading"))
import os  # noqa: E402

import bench_serial_weight_load as bench  # noqa: E402

from sglang.srt.model_loader import serial_weight_load as swl  # noqa: E402

CPU_ENV = {
    "SGLANG_USE_CPU_ENGINE": "1",
    "PYTHONPATH": os.pathsep.join(
        [str(REPO / "tools" / "standins"), os.environ.get("PYTHONPATH", "")]
    ),
}


def test_serial_load_is_bitwise_the_pool_load_and_bounded(tmp_path):
    ckpt = bench.write_checkpoint(
        tmp_path / "ckpt", layers=4, mib_per_matrix=4, shards=3
    )
    stock = bench.run_child(ckpt, serial=False, env=CPU_ENV)
    serial = bench.run_child(ckpt, serial=True, env=CPU_ENV)
    assert stock["params"] == serial["params"] == 3 + 3 * 4
    assert serial["digests"] == stock["digests"]
    shard_mib = max(f.stat().st_size for f in ckpt.glob("*.safetensors")) / 2**20
    print(
        f"peak RSS above baseline: pool {stock['peak_rss_above_baseline_mib']} MiB, "
        f"serial {serial['peak_rss_above_baseline_mib']} MiB (largest shard {shard_mib:.1f} MiB)"
    )
    assert serial["peak_rss_above_baseline_mib"] <= shard_mib + 4 + 24


def test_flag_off_keeps_the_pool():
    from upstream_api import require

    from sglang.srt import runtime_context

    require(hasattr(runtime_context, "use_context"), "runtime_context.use_context")
    from sglang.srt.runtime_context import ParallelContext, RuntimeContext, use_context

    # No published configuration (offline loading): upstream's pool.
    with use_context(RuntimeContext(parallel=ParallelContext())):
        assert swl.async_weight_load_enabled() is True
    # Published with the flag off (its default): the pool; on: serial. (The children above load both.)


def test_wiring_in_the_v4_loader():
    import inspect

    from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM

    src = inspect.getsource(DeepseekV4ForCausalLM.load_weights)
    assert "async_load = async_weight_load_enabled()" in src
    assert "use_async_loading = async_load and should_async_load(loaded_weight)" in src


def cfg(**kw):
    return SimpleNamespace(
        **{"weight_loader_disable_async_load": False, "load_format": "auto", **kw}
    )


def test_refusals():
    swl.validate_weight_loader_disable_async_load(with_model(cfg(), "LlamaForCausalLM"))
    swl.validate_weight_loader_disable_async_load(
        with_model(cfg(weight_loader_disable_async_load=True), "DeepseekV4ForCausalLM")
    )
    with pytest.raises(
        ValueError,
        match="LlamaForCausalLM loader does not copy weights on a thread pool",
    ):
        swl.validate_weight_loader_disable_async_load(
            with_model(cfg(weight_loader_disable_async_load=True), "LlamaForCausalLM")
        )
    with pytest.raises(ValueError, match="dummy would do nothing"):
        swl.validate_weight_loader_disable_async_load(
            with_model(
                cfg(weight_loader_disable_async_load=True, load_format="dummy"),
                "DeepseekV4ForCausalLM",
            )
        )


def test_flag_on_the_command_line():
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    assert (
        parser.parse_args(["--model-path", "m"]).weight_loader_disable_async_load
        is False
    )
    assert parser.parse_args(
        ["--model-path", "m", "--weight-loader-disable-async-load"]
    ).weight_loader_disable_async_load
