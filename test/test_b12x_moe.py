"""--moe-runner-backend b12x (DeepSeek-V4 MXFP4 experts on b12x's fused MoE), up to the hardware:
the startup refusals (naming what they found), the dispatch choosing b12x exactly for MXFP4
experts under the flag, the checkpoint bytes landing in b12x's FC1 order, the plan tables and
pins, expert ids (EP1 as the router gives them, EP2 mapped to local experts by upstream's
dispatcher), and a call's padding to its planned count, against a stand-in b12x."""

from __future__ import annotations

import argparse
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from sglang.srt.layers.quantization import mxfp4_b12x_moe as bm
from sglang.srt.utils import b12x_pin

# ---------------------------------------------------------------- refusals


def test_refusal_names_what_it_found_on_this_machine():
    msg = b12x_pin.b12x_refusal(bm.FLAG, "moe.fused_moe", "plan_execution")
    assert msg.startswith("--moe-runner-backend b12x refused: device: ")
    if not torch.cuda.is_available():
        assert "no CUDA device, b12x kernels need SM120/SM121" in msg
    assert "pip install b12x==1.5.1" in msg


def test_refusal_branches(monkeypatch):
    def case(cap, version, why=""):
        monkeypatch.setattr(
            b12x_pin,
            "found_device",
            lambda: (cap, f"GPU (SM{cap[0]}{cap[1]})" if cap else "no CUDA device"),
        )
        monkeypatch.setattr(b12x_pin, "found_b12x", lambda api, attr: (version, why))
        return b12x_pin.b12x_refusal("--x", "moe.fused_moe", "plan_execution")

    assert case((12, 1), "1.5.1") is None
    assert case((12, 0), "1.5.1") is None
    assert "device: GPU (SM90), b12x kernels need SM120/SM121" in case((9, 0), "1.5.1")
    assert "b12x 1.4.0 is installed, the fork is written against b12x==1.5.1" in case(
        (12, 1), "1.4.0"
    )
    assert "b12x is not installed" in case((12, 1), None, "b12x is not installed")
    both = case(
        (10, 0),
        "1.5.1",
        "b12x 1.5.1 is installed but b12x.moe.fused_moe.plan_execution does not load (ModuleNotFoundError: No module named 'cuda')",
    )
    assert "SM100" in both and "No module named 'cuda'" in both


def test_found_b12x_without_the_package(monkeypatch):
    from importlib import metadata

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    assert b12x_pin.found_b12x("moe.fused_moe", "plan_execution") == (
        None,
        "b12x is not installed",
    )


def vcfg(**kw):
    base = dict(
        moe_runner_backend="b12x", moe_a2a_backend="none", chunked_prefill_size=2048
    )
    base.update(kw)
    return SimpleNamespace(**base)


def test_validate(monkeypatch):
    bm.validate_b12x_moe(vcfg(moe_runner_backend="auto"))  # flag off: nothing is asked
    with pytest.raises(
        ValueError, match="cannot be used with --moe-a2a-backend deepep"
    ):
        bm.validate_b12x_moe(vcfg(moe_a2a_backend="deepep"))
    with pytest.raises(
        ValueError,
        match=r"bounded prefill chunk \(--chunked-prefill-size > 0, found -1\)",
    ):
        bm.validate_b12x_moe(vcfg(chunked_prefill_size=-1))
    monkeypatch.setattr(b12x_pin, "found_device", lambda: (None, "no CUDA device"))
    with pytest.raises(
        ValueError, match="--moe-runner-backend b12x refused: device: no CUDA device"
    ):
        bm.validate_b12x_moe(vcfg())
    monkeypatch.setattr(
        b12x_pin, "found_device", lambda: ((12, 1), "NVIDIA GB10 (SM121)")
    )
    monkeypatch.setattr(b12x_pin, "found_b12x", lambda api, attr: ("1.5.1", ""))
    bm.validate_b12x_moe(vcfg())


def test_flag_on_command_line():
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    assert parser.parse_args(["--model-path", "x"]).moe_runner_backend == "auto"
    assert (
        parser.parse_args(
            ["--model-path", "x", "--moe-runner-backend", "b12x"]
        ).moe_runner_backend
        == "b12x"
    )
    from sglang.srt.layers.moe.utils import MoeRunnerBackend

    assert MoeRunnerBackend("b12x") is MoeRunnerBackend.B12X


# ---------------------------------------------------------------- dispatch


def test_dispatch_chooses_b12x_exactly_for_mxfp4_experts_under_the_flag():
    assert bm.wants_b12x_moe(True, "b12x", "model.layers.3.mlp.experts")
    for backend in ("auto", "flashinfer_mxfp4", "marlin", "triton"):
        assert not bm.wants_b12x_moe(True, backend, "x")
        assert not bm.wants_b12x_moe(False, backend, "x")
    with pytest.raises(
        ValueError,
        match="layer model.layers.3.mlp.experts has experts that are not MXFP4",
    ):
        bm.wants_b12x_moe(False, "b12x", "model.layers.3.mlp.experts")


def fp8_config_for_fp4_experts():
    from sglang.srt.layers.quantization.fp8 import Fp8Config

    cfg = object.__new__(Fp8Config)
    cfg.ignored_layers, cfg.packed_modules_mapping = [], {}
    cfg.is_fp4_experts, cfg.dequant_fp4_to_fp8, cfg.is_dsv4_fp4_experts = (
        True,
        False,
        True,
    )
    cfg.use_mxfp8 = False
    return cfg


def test_fp8_config_returns_the_b12x_method(monkeypatch):
    """Upstream's Fp8Config.get_quant_method with the flag on and off, for an MXFP4 MoE layer."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.layers.moe.utils import MoeRunnerBackend
    from sglang.srt.layers.quantization import fp8 as fp8_mod

    monkeypatch.setattr(
        fp8_mod, "Fp8MoEMethod", lambda cfg: SimpleNamespace(kind="fp8")
    )
    monkeypatch.setattr(fp8_mod, "is_npu", lambda: False, raising=False)
    monkeypatch.setattr(bm, "settings_from_runtime", lambda: {"counts": (1, 2, 4)})
    layer = object.__new__(FusedMoE)
    cfg = fp8_config_for_fp4_experts()
    monkeypatch.setattr(
        fp8_mod, "get_moe_runner_backend", lambda: MoeRunnerBackend.B12X
    )
    method = cfg.get_quant_method(layer, "model.layers.5.mlp.experts")
    assert isinstance(method, bm.Mxfp4B12xMoEMethod) and method.counts == (1, 2, 4)
    monkeypatch.setattr(
        fp8_mod, "get_moe_runner_backend", lambda: MoeRunnerBackend.AUTO
    )
    assert cfg.get_quant_method(layer, "model.layers.5.mlp.experts").kind == "fp8"
    cfg.is_fp4_experts = False
    monkeypatch.setattr(
        fp8_mod, "get_moe_runner_backend", lambda: MoeRunnerBackend.B12X
    )
    with pytest.raises(ValueError, match="not MXFP4"):
        cfg.get_quant_method(layer, "model.layers.5.mlp.experts")


# ---------------------------------------------------------------- weights


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_checkpoint_fc1_lands_in_b12x_order_bitwise(tp_rank):
    """The loader asked by the method (load_up_proj_weight_first) writes each expert's FC1 as
    [up; gate] (b12x's W13 kernel order) from the checkpoint's w1 (gate) / w3 (up), TP-sliced,
    bytes unchanged: no repacking pass after load. Weights (packed e2m1 bytes) and E8M0 scales.
    """
    import inspect

    from upstream_api import require

    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    require(
        "tp_rank" not in inspect.signature(FusedMoE._load_w13).parameters,
        "FusedMoE._load_w13 without tp_rank",
    )
    method = object.__new__(bm.Mxfp4B12xMoEMethod)
    n_full, k = 1152, 5120  # 2 x 576 per rank at TP2
    layer = SimpleNamespace(
        moe_runner_config=SimpleNamespace(is_gated=True),
        quant_method=method,
        use_padded_loading=False,
        use_presharded_weights=False,
        use_triton_kernels=False,
        moe_tp_rank=tp_rank,
        moe_tp_size=2,
    )
    g = torch.Generator().manual_seed(tp_rank)
    for cols in (k // 2, k // 32):  # e2m1 bytes, then E8M0 scale bytes
        gate = torch.randint(0, 256, (n_full, cols), dtype=torch.uint8, generator=g)
        up = torch.randint(0, 256, (n_full, cols), dtype=torch.uint8, generator=g)
        w13 = torch.zeros(2 * n_full // 2, cols, dtype=torch.uint8)
        FusedMoE._load_w13(
            layer, expert_data=w13, shard_dim=0, shard_id="w1", loaded_weight=gate
        )
        FusedMoE._load_w13(
            layer, expert_data=w13, shard_dim=0, shard_id="w3", loaded_weight=up
        )
        sl = slice(tp_rank * 576, (tp_rank + 1) * 576)
        assert torch.equal(w13, torch.cat([up[sl], gate[sl]]))


def test_create_weights_takes_576_wide_experts_and_refuses_what_b12x_cannot():
    calls = []
    fp8 = SimpleNamespace(create_weights=lambda *a, **kw: calls.append((a, kw)))
    m = bm.Mxfp4B12xMoEMethod(fp8, "model.layers.1.mlp.experts", (1, 2))
    m.create_weights(None, 384, 5120, 576, torch.bfloat16)
    assert (
        calls[0][1]["fp4_scale_dtype"] is torch.float8_e8m0fnu and calls[0][0][3] == 576
    )
    with pytest.raises(
        ValueError,
        match="layer model.layers.1.mlp.experts: .* found hidden=5120, intermediate per rank=560",
    ):
        m.create_weights(None, 384, 5120, 560, torch.bfloat16)
    with pytest.raises(ValueError, match="fuses shared experts"):
        m.create_moe_runner(None, SimpleNamespace(num_fused_shared_experts=1))


# ---------------------------------------------------------------- plans


def test_plan_token_counts():
    counts = bm.plan_token_counts([1, 2, 4, 8, 12, 16], [1, 4], 2048)
    decode = {1, 2, 4, 8, 12, 16}
    verify = {4, 8, 16, 32, 48, 64}
    ladder = {16, 32, 64, 128, 256, 512, 1024, 2048}
    assert set(counts) == decode | verify | ladder and list(counts) == sorted(counts)
    assert bm.plan_token_counts([3], [1], 100) == (3, 16, 32, 64, 100)


def test_pins_for_576_wide_experts_only():
    pin = bm.pinned_config(8, 576)
    assert (
        pin["backend"] == "dynamic"
        and pin["dynamic_tile_m"] == 16
        and pin["dynamic_route_mode"] == "grouped"
    )
    assert bm.pinned_config(9, 576) is None and bm.pinned_config(2048, 576) is None
    assert bm.pinned_config(1, 512) is None and bm.pinned_config(4, 1024) is None
    groups = bm.plan_groups((1, 2, 4, 8, 12, 16, 2048), 576)
    assert groups == [((1, 2, 4, 8), pin), ((12, 16, 2048), None)]
    assert bm.plan_groups((1, 16), 512) == [((1, 16), None)]


def test_pin_fields_are_b12x_moe_decode_config_fields():
    import json
    from pathlib import Path

    snap = json.loads(
        (Path(__file__).parent / "data" / "b12x-api-1.5.1.json").read_text()
    )
    assert sorted(bm.pinned_config(1, 576)) == sorted(
        snap["api"]["fused_moe.MoeDecodeConfig"]["fields"]
    )


def test_padded_count():
    counts = (1, 2, 4, 8, 16, 2048)
    assert [bm.padded_count(m, counts) for m in (1, 3, 8, 9, 17, 2048)] == [
        1,
        4,
        8,
        16,
        2048,
        2048,
    ]
    with pytest.raises(
        RuntimeError,
        match="a call of 2049 rows exceeds the largest prepared plan .2048 rows.",
    ):
        bm.padded_count(2049, counts)


# ---------------------------------------------------------------- ids and a call


class FakeB12x:
    """Stand-ins for b12x.moe.fused_moe / b12x.preparation: bind records its keywords, run
    computes out[t] = sum_j w[t, j] * (id[t, j] + 1) * a[t] over ids >= 0 (b12x skips -1).
    """

    def __init__(self):
        self.bound = []
        fm = types.ModuleType("b12x.moe.fused_moe")
        fm.bind = self.bind
        fm.run = self.run
        prep = types.ModuleType("b12x.preparation")
        prep.require_prepared = lambda plan, component, device=None: SimpleNamespace(
            scratch=SimpleNamespace(
                scratch_specs=lambda: (SimpleNamespace(shape=(4,), dtype=torch.uint8),)
            )
        )
        self.modules = {
            "b12x": types.ModuleType("b12x"),
            "b12x.moe": types.ModuleType("b12x.moe"),
            "b12x.moe.fused_moe": fm,
            "b12x.preparation": prep,
        }
        self.modules["b12x.moe"].fused_moe = fm

    def bind(self, plan, **kw):
        self.bound.append((plan, kw))
        return SimpleNamespace(**kw)

    def run(self, *, binding):
        ids, w, a = binding.topk_ids.long(), binding.topk_weights, binding.a.float()
        scale = torch.where(ids >= 0, (ids + 1).float() * w, torch.zeros_like(w)).sum(
            -1, keepdim=True
        )
        binding.output.copy_((scale * a).to(binding.output.dtype))
        return binding.output


@pytest.fixture
def fake_b12x(monkeypatch):
    fake = FakeB12x()
    for name, mod in fake.modules.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return fake


def dispatch(x, ids, w):
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    return SimpleNamespace(
        hidden_states=x, topk_output=StandardTopKOutput(w, ids, None)
    )


def test_ep1_ids_reach_b12x_as_the_router_gave_them_and_calls_pad_to_their_plan(
    fake_b12x,
):
    m = bm.Mxfp4B12xMoEMethod(None, "model.layers.1.mlp.experts", (1, 2, 4, 8, 16))
    m.geometry = (16, 64, 576)
    m.plans = {c: f"plan{c}" for c in m.counts}
    g = torch.Generator().manual_seed(0)
    for rows in (1, 3, 8, 11):
        x = torch.randn(rows, 64, generator=g).to(torch.bfloat16)
        ids = torch.randint(0, 16, (rows, 6), generator=g, dtype=torch.int32)
        ids[0, 5] = -1  # padding the router already left
        w = torch.rand(rows, 6, generator=g)
        out = m.apply(None, dispatch(x, ids, w)).hidden_states
        plan, kw = fake_b12x.bound[-1]
        count = bm.padded_count(rows, m.counts)
        assert (
            plan == f"plan{count}"
            and kw["a"].shape[0] == count
            and out.shape == (rows, 64)
        )
        assert torch.equal(kw["topk_ids"][:rows], ids)  # EP1: the router's ids, -1 kept
        assert bool((kw["topk_ids"][rows:] == -1).all()) and bool(
            (kw["topk_weights"][rows:] == 0).all()
        )
        ref = FakeB12x().run(
            binding=SimpleNamespace(
                topk_ids=ids, topk_weights=w, a=x, output=torch.empty_like(x)
            )
        )
        assert torch.equal(out, ref)


def test_ep2_local_expert_ids_from_upstreams_dispatcher():
    """At EP2 b12x sees local expert ids: upstream's StandardDispatcher maps them in the graph
    (b12x is not a backend that keeps global ids), -1 for the other rank's experts and padding.
    """
    from upstream_api import require

    from sglang.srt.layers.moe.token_dispatcher import standard
    from sglang.srt.layers.moe.utils import MoeRunnerBackend

    require(
        hasattr(standard, "_keeps_global_expert_ids")
        and hasattr(standard, "_map_topk_ids_to_local_experts"),
        "StandardDispatcher helpers _keeps_global_expert_ids and _map_topk_ids_to_local_experts",
    )
    _keeps_global_expert_ids = standard._keeps_global_expert_ids
    _map_topk_ids_to_local_experts = standard._map_topk_ids_to_local_experts

    assert not _keeps_global_expert_ids(MoeRunnerBackend.B12X)
    num_experts, ep_size = 8, 2
    ids = torch.tensor([[0, 3, 4, 7], [5, -1, 1, 6]], dtype=torch.int32)
    for rank, want in (
        (0, [[0, 3, -1, -1], [-1, -1, 1, -1]]),
        (1, [[-1, -1, 0, 3], [1, -1, -1, 2]]),
    ):
        per = num_experts // ep_size
        mapping = torch.full((num_experts,), -1, dtype=torch.int32)
        mapping[rank * per : (rank + 1) * per] = torch.arange(
            per, dtype=torch.int32
        )  # as the dispatcher builds it
        assert _map_topk_ids_to_local_experts(ids, mapping).tolist() == want
