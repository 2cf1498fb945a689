"""--moe-runner-backend triton_mxfp4 (DeepSeek-V4 MXFP4 experts on the fork's Triton MoE): the
startup refusals, the dispatch choosing it exactly for MXFP4 experts under the flag, the
checkpoint's FC1 landing as [gate; up] bytes unchanged, the check on the live weights passing
and refusing a corrupted layer by name, and a call serving the kernel's bits (CPU, interpreted)."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
import torch
from test_mxfp4_verify_moe import experts, inputs, patch_interpreter_bf16_dot

from sglang.kernels.ops.moe import mxfp4_verify_moe as mv
from sglang.srt.layers.quantization import mxfp4_triton_moe as tm

PREFIX = "model.layers.3.mlp.experts"


@pytest.fixture(autouse=True)
def bf16_dot_in_interpreter(monkeypatch):
    patch_interpreter_bf16_dot(monkeypatch)


def vcfg(**kw):
    return SimpleNamespace(
        **{"moe_runner_backend": "triton_mxfp4", "moe_a2a_backend": "none", **kw}
    )


def test_validate(monkeypatch):
    from sglang.srt.arg_groups import model_override_base

    arch = ["DeepseekV4ForCausalLM"]
    monkeypatch.setattr(
        model_override_base,
        "model_config_of",
        lambda sa: SimpleNamespace(hf_config=SimpleNamespace(architectures=arch)),
    )
    tm.validate_triton_mxfp4_moe(vcfg(moe_runner_backend="auto"))  # off: nothing asked
    tm.validate_triton_mxfp4_moe(vcfg())
    with pytest.raises(
        ValueError, match="--moe-a2a-backend deepep: .*use --moe-a2a-backend none"
    ):
        tm.validate_triton_mxfp4_moe(vcfg(moe_a2a_backend="deepep"))
    tm.validate_triton_mxfp4_moe(vcfg(moe_a2a_backend="none"))  # the advised value
    arch[0] = "LlamaForCausalLM"
    with pytest.raises(
        ValueError, match="would do nothing; use --moe-runner-backend auto"
    ):
        tm.validate_triton_mxfp4_moe(vcfg())
    tm.validate_triton_mxfp4_moe(vcfg(moe_runner_backend="auto"))  # the advised value


def test_flag_on_command_line():
    from sglang.srt.layers.moe.utils import MoeRunnerBackend
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    args = ["--model-path", "x", "--moe-runner-backend", "triton_mxfp4"]
    assert parser.parse_args(args).moe_runner_backend == "triton_mxfp4"
    assert MoeRunnerBackend("triton_mxfp4") is MoeRunnerBackend.TRITON_MXFP4


def test_dispatch_chooses_it_exactly_for_mxfp4_experts_under_the_flag():
    assert tm.wants_triton_mxfp4_moe(True, "triton_mxfp4", PREFIX)
    for backend in ("auto", "flashinfer_mxfp4", "marlin", "b12x"):
        assert not tm.wants_triton_mxfp4_moe(True, backend, PREFIX)
    with pytest.raises(
        ValueError, match=f"layer {PREFIX} has experts that are not MXFP4"
    ):
        tm.wants_triton_mxfp4_moe(False, "triton_mxfp4", PREFIX)


def test_fp8_config_returns_the_method(monkeypatch):
    from test_b12x_moe import fp8_config_for_fp4_experts

    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.layers.moe.utils import MoeRunnerBackend
    from sglang.srt.layers.quantization import fp8 as fp8_mod

    monkeypatch.setattr(
        fp8_mod, "Fp8MoEMethod", lambda cfg: SimpleNamespace(kind="fp8")
    )
    monkeypatch.setattr(fp8_mod, "is_npu", lambda: False, raising=False)
    layer = object.__new__(FusedMoE)
    cfg = fp8_config_for_fp4_experts()
    backend = MoeRunnerBackend.TRITON_MXFP4
    monkeypatch.setattr(fp8_mod, "get_moe_runner_backend", lambda: backend)
    assert isinstance(cfg.get_quant_method(layer, PREFIX), tm.Mxfp4TritonMoEMethod)
    backend = MoeRunnerBackend.AUTO
    assert cfg.get_quant_method(layer, PREFIX).kind == "fp8"


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_checkpoint_fc1_lands_as_gate_then_up_bitwise(tp_rank):
    """The loader asked by the method writes each expert's FC1 as the checkpoint's [w1 (gate);
    w3 (up)], TP-sliced, bytes unchanged: the kernel reads the checkpoint's layout."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    method = object.__new__(tm.Mxfp4TritonMoEMethod)
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
        w13 = torch.zeros(n_full, cols, dtype=torch.uint8)
        for shard, w in (("w1", gate), ("w3", up)):
            FusedMoE._load_w13(
                layer, expert_data=w13, shard_dim=0, shard_id=shard, loaded_weight=w
            )
        sl = slice(tp_rank * 576, (tp_rank + 1) * 576)
        assert torch.equal(w13, torch.cat([gate[sl], up[sl]]))


def test_create_weights_refuses_what_the_kernel_cannot():
    calls = []
    fp8 = SimpleNamespace(create_weights=lambda *a, **kw: calls.append((a, kw)))
    m = tm.Mxfp4TritonMoEMethod(fp8, PREFIX)
    m.create_weights(None, 384, 5120, 576, torch.bfloat16)
    assert (
        calls[0][1]["fp4_scale_dtype"] is torch.float8_e8m0fnu and calls[0][0][3] == 576
    )
    with pytest.raises(
        ValueError, match=f"layer {PREFIX}: .*found hidden=5120, .*=560"
    ):
        m.create_weights(None, 384, 5120, 560, torch.bfloat16)
    with pytest.raises(ValueError, match="fuses shared experts"):
        m.create_moe_runner(None, SimpleNamespace(num_fused_shared_experts=1))


def loaded(weights):
    w13, s13, w2, s2 = weights
    p = torch.nn.Parameter
    return SimpleNamespace(
        w13_weight=p(w13.view(torch.int8), requires_grad=False),
        w13_weight_scale_inv=p(s13.view(torch.float8_e8m0fnu), requires_grad=False),
        w2_weight=p(w2.view(torch.int8), requires_grad=False),
        w2_weight_scale_inv=p(s2.view(torch.float8_e8m0fnu), requires_grad=False),
    )


def method(limit=None):
    fp8 = SimpleNamespace(process_weights_after_loading=lambda layer: None)
    m = tm.Mxfp4TritonMoEMethod(fp8, PREFIX)
    m.create_moe_runner(
        None, SimpleNamespace(num_fused_shared_experts=0, top_k=3, swiglu_limit=limit)
    )
    return m


def test_live_weights_checked_and_a_call_serves_the_kernel():
    from sglang.srt.layers.moe.token_dispatcher.standard import StandardCombineInput

    weights = experts()
    layer, m = loaded(weights), method(limit=10.0)
    m.process_weights_after_loading(layer)
    x, ids, tw = inputs(5)
    topk = SimpleNamespace(topk_ids=ids, topk_weights=tw)
    out = m.apply(layer, SimpleNamespace(hidden_states=x, topk_output=topk))
    assert isinstance(out, StandardCombineInput)
    want = mv.mxfp4_verify_moe(x, ids, tw, *weights, swiglu_limit=10.0)
    assert torch.equal(out.hidden_states, want)


def test_inside_the_verify_caps_scope_dead_rows_read_no_expert():
    """In a target verify under the cap (live_rows_scope), the method hands the live lengths to
    the kernel: a dead row's output is 0 (no expert read), live rows are the plain call's.
    """
    from sglang.srt.layers.moe.router_live_rows import LiveRows, live_rows_scope

    weights = experts()
    layer, m = loaded(weights), method(limit=10.0)
    m.process_weights_after_loading(layer)
    x, ids, tw = inputs(6)  # two requests of 3 verify rows
    topk = SimpleNamespace(topk_ids=ids, topk_weights=tw)
    call = SimpleNamespace(hidden_states=x, topk_output=topk)
    plain = m.apply(layer, call).hidden_states
    live = LiveRows(lens=torch.tensor([2, 3]), stride=3, owner="--test")
    with live_rows_scope(live):
        capped = m.apply(layer, call).hidden_states
    assert torch.equal(capped[[0, 1, 3, 4, 5]], plain[[0, 1, 3, 4, 5]])
    assert torch.count_nonzero(capped[2]) == 0 and torch.count_nonzero(plain[2]) > 0


def test_a_corrupted_layer_refuses_to_start_naming_itself(monkeypatch):
    """The fault: the kernel reads every down scale one step high (each value doubled), as a
    kernel that misreads the layout would; the check compares it with the exact product of
    the weights as loaded."""
    weights = experts()
    layer, m = loaded(weights), method()
    real = mv.mxfp4_verify_moe

    def off_by_one_scale(x, ids, tw, w13, s13, w2, s2, **kw):
        return real(x, ids, tw, w13, s13, w2, s2 + 1, **kw)

    monkeypatch.setattr(tm, "mxfp4_verify_moe", off_by_one_scale)
    with pytest.raises(
        RuntimeError, match=f"layer {PREFIX} failed its check on the live"
    ):
        m.process_weights_after_loading(layer)
