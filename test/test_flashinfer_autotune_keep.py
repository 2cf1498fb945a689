"""--flashinfer-autotune-keep-cache: the cache gate agrees on the load decision (patch: autotune keep).

Two gloo ranks on CPU run the gate on real files, one collective per scenario, as two TP ranks
do before tuning: caches with the same stamp and disjoint shapes (expert parallelism) are kept
on both (upstream's byte digest, run on the same files, drops them: sglang#40320); one rank
stale, a launch-fingerprint mismatch, a file missing or unreadable on one rank: dropped on all,
files and fingerprints. The fingerprint is stable across two resolutions of the same
arguments and moves with what reaches kernels; the flag is refused where no gate runs.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import traceback
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import REPO

ENV = {
    "flashinfer_version": "0.7.2",
    "cuda_version": "13.0",
    "cublas_version": "13.1.0",
    "cudnn_version": "92000",
    "cudnn_frontend_version": "1.16.0",
    "gpu": "NVIDIA GB10",
}
FP = "f" * 64


def engine_file(rel: str) -> Path:
    """A file of the installed engine, found without importing sglang (16 s on this machine)."""
    import importlib.util

    return Path(importlib.util.find_spec("sglang").origin).parent / rel


def keep_module():
    """The gate's module, loaded by path: it imports only the standard library (and
    torch.distributed when gating), so a rank process need not import the engine."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "flashinfer_autotune_keep",
        engine_file("srt/model_executor/runner/flashinfer_autotune_keep.py"),
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_cache(path: Path, shapes, stamp=ENV, fingerprint=FP, writer=None):
    if writer is None:
        from sglang.srt.model_executor.runner.flashinfer_autotune_keep import (
            write_launch_fingerprint as writer,
        )

    configs = {"_metadata": stamp} if stamp is not None else {}
    configs.update(
        {
            str(("trtllm::fused_moe", "MoERunner", ((m, 7168),))): ["MoERunner", m % 5]
            for m in shapes
        }
    )
    path.write_text(json.dumps(configs))
    if fingerprint is not None:
        writer(path, fingerprint)


# rank -> how its files look before the gate, per scenario
SCENARIOS = {
    "disjoint shapes, same stamp": {0: dict(shapes=[1, 2, 4]), 1: dict(shapes=[8, 16])},
    "one rank stale": {
        0: dict(shapes=[1, 2]),
        1: dict(shapes=[1, 2], stamp={**ENV, "flashinfer_version": "0.6.18"}),
    },
    "fingerprint mismatch": {
        0: dict(shapes=[1, 2]),
        1: dict(shapes=[1, 2], fingerprint="0" * 64),
    },
    "no fingerprint on one rank": {
        0: dict(shapes=[1, 2]),
        1: dict(shapes=[1, 2], fingerprint=None),
    },
    "file missing on one rank": {0: dict(shapes=[1, 2]), 1: None},
    "unreadable on both": {0: "garbage", 1: "garbage"},
    "no cache anywhere": {0: None, 1: None},
}
KEPT = {"disjoint shapes, same stamp"}


def upstream_gate():
    """Upstream's digest gate, lifted out of the engine's source (importing its module would pull
    the model runner into each rank process; the two functions need only these names).
    """
    import ast
    import hashlib

    import torch

    source = engine_file("srt/model_executor/runner/flashinfer_autotune.py").read_text()
    wanted = {"_autotune_cache_digest", "_drop_diverged_autotune_cache"}
    module = ast.Module(
        body=[
            n
            for n in ast.parse(source).body
            if isinstance(n, ast.FunctionDef) and n.name in wanted
        ],
        type_ignores=[],
    )
    assert {
        n.name for n in module.body
    } == wanted, "upstream's gate moved: update this test"
    namespace = {
        "json": json,
        "hashlib": hashlib,
        "torch": torch,
        "Path": Path,
        "logger": None,
        "log_info_on_rank0": lambda logger, message: None,
    }
    exec(compile(module, "flashinfer_autotune.py", "exec"), namespace)
    return namespace["_drop_diverged_autotune_cache"]


def rank_main(rank: int, world: int, root: str, store: str, out: str) -> None:
    sys.path.insert(0, str(REPO / "tools" / "standins"))
    try:
        import torch.distributed as dist

        _drop_diverged_autotune_cache = upstream_gate()
        keep = keep_module()

        dist.init_process_group(
            "gloo", init_method=f"file://{store}", rank=rank, world_size=world
        )
        results = {}
        for name, ranks in SCENARIOS.items():
            for gate in ("keep", "upstream"):
                path = (
                    Path(root)
                    / gate
                    / name.replace(" ", "_")
                    / f"rank_tp{rank}_pp0_dp0.json"
                )
                path.parent.mkdir(parents=True, exist_ok=True)
                spec = ranks[rank]
                if spec == "garbage":
                    path.write_text("{not json")
                elif spec is not None:
                    write_cache(path, writer=keep.write_launch_fingerprint, **spec)
                dist.barrier()
                if gate == "keep":
                    kept = keep.keep_or_drop_autotune_cache(
                        path, dist.group.WORLD, ENV, FP
                    )
                else:
                    _drop_diverged_autotune_cache(path, dist.group.WORLD, ENV)
                    kept = None
                results[f"{gate}/{name}"] = {
                    "returned": kept,
                    "cache": path.exists(),
                    "fingerprint": keep.fingerprint_path(path).exists(),
                }
                dist.barrier()
        Path(out).write_text(json.dumps(results))
        dist.destroy_process_group()
    except BaseException:
        Path(out).write_text(json.dumps({"error": traceback.format_exc()}))
        raise


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("autotune")
    ctx = mp.get_context("spawn")
    env_before = os.environ.get("SGLANG_USE_CPU_ENGINE")
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    try:
        procs = [
            ctx.Process(
                target=rank_main,
                args=(
                    r,
                    2,
                    str(root / "files"),
                    str(root / "store"),
                    str(root / f"out{r}.json"),
                ),
            )
            for r in range(2)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(300)
    finally:
        if env_before is None:
            os.environ.pop("SGLANG_USE_CPU_ENGINE", None)
    results = [json.loads((root / f"out{r}.json").read_text()) for r in range(2)]
    for r in results:
        assert "error" not in r, r.get("error")
    assert all(p.exitcode == 0 for p in procs)
    return results


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_every_rank_decides_alike(two_ranks, name):
    key = f"keep/{name}"
    r0, r1 = two_ranks[0][key], two_ranks[1][key]
    kept = name in KEPT
    for r, spec in ((r0, SCENARIOS[name][0]), (r1, SCENARIOS[name][1])):
        assert r["returned"] is kept
        assert r["cache"] is (kept and spec is not None)
        assert r["fingerprint"] is (kept and spec is not None)


def test_upstream_digest_drops_the_disjoint_shapes_cache(two_ranks):
    key = "upstream/disjoint shapes, same stamp"
    assert not two_ranks[0][key]["cache"] and not two_ranks[1][key]["cache"]


# ---------------------------------------------------------------- fingerprint, flag


def resolved(*extra):
    from sglang.srt.server_args import ServerArgs

    sa = ServerArgs(model_path="dummy", device="cpu", **dict(extra))
    sa.resolve_once()
    return sa


def test_launch_fingerprint_is_stable_and_moves_with_the_configuration(monkeypatch):
    from sglang.srt.model_executor.runner.flashinfer_autotune_keep import (
        launch_fingerprint,
    )

    env = {"SGLANG_RUN_ID": "a", "SGLANG_OPT_X": "1", "HOME": "/x"}
    first = resolved()
    base = launch_fingerprint(first, env)
    assert (
        launch_fingerprint(resolved(), {**env, "SGLANG_RUN_ID": "b", "HOME": "/y"})
        == base
    )  # seed, run id
    assert (
        launch_fingerprint(resolved(("port", 31000)), env) == base
    )  # HTTP serving does not reach kernels
    assert launch_fingerprint(resolved(("max_running_requests", 8)), env) != base
    assert launch_fingerprint(resolved(("chunked_prefill_size", 1024)), env) != base
    assert (
        launch_fingerprint(first, {**env, "SGLANG_FLASHINFER_AUTOTUNE_EXTEND": "1"})
        != base
    )


def cfg(**kw):
    base = dict(
        flashinfer_autotune_keep_cache=True,
        device="cuda",
        disable_flashinfer_autotune=False,
        enable_deterministic_inference=False,
        tp_size=4,
    )
    return SimpleNamespace(**{**base, **kw})


def test_refusals(monkeypatch):
    from sglang.srt.model_executor.runner.flashinfer_autotune_keep import (
        validate_flashinfer_autotune_keep,
    )

    validate_flashinfer_autotune_keep(cfg())
    validate_flashinfer_autotune_keep(
        cfg(flashinfer_autotune_keep_cache=False, tp_size=1)
    )
    for kw, match in (
        (dict(device="cpu"), "CUDA only"),
        (dict(disable_flashinfer_autotune=True), "disable"),
        (dict(enable_deterministic_inference=True), "deterministic"),
        (dict(tp_size=1), "no other rank"),
    ):
        with pytest.raises(ValueError, match=f"would do nothing: .*{match}"):
            validate_flashinfer_autotune_keep(cfg(**kw))
    monkeypatch.setenv("SGLANG_FLASHINFER_AUTOTUNE_CACHE", "0")
    with pytest.raises(ValueError, match="reuses none"):
        validate_flashinfer_autotune_keep(cfg())


def test_flag_on_the_command_line():
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    assert (
        parser.parse_args(["--model-path", "m"]).flashinfer_autotune_keep_cache is False
    )
    assert parser.parse_args(
        ["--model-path", "m", "--flashinfer-autotune-keep-cache"]
    ).flashinfer_autotune_keep_cache


@pytest.mark.gpu
def test_loadable_agrees_with_flashinfer(tmp_path):
    """On the GPU machine: a cache this gate keeps is one FlashInfer's own load_configs loads
    in this environment (the gate may only be stricter: a missing stamp is dropped)."""
    autotuner = pytest.importorskip("flashinfer.autotuner")
    from sglang.srt.model_executor.runner.flashinfer_autotune_keep import cache_record

    env = autotuner._collect_metadata()
    first = next(iter(env))
    stamps = {
        "same": env,
        "wildcard": {**env, first: "*"},
        "stale": {**env, first: "other"},
        "none": None,
    }
    for name, stamp in stamps.items():
        path = tmp_path / f"{name}.json"
        write_cache(path, shapes=[1, 2], stamp=stamp)
        ours = cache_record(path, env, FP)["loadable"]
        theirs = autotuner.AutoTuner.get().load_configs(str(path)) is not False
        autotuner.AutoTuner.get().clear_cache()
        assert not ours or theirs, (name, ours, theirs)
        assert ours is (name in ("same", "wildcard")), name
