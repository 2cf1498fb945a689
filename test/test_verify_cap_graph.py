"""DSpark verify cap at model level, the closest to a server run the H200 allows (sglang's
binary deps do not load there): the cap's live-length buffer is allocated before capture, the
stopping rule writes it inside the CUDA graph (``VerifyCap.begin_step``), and the router call
site DeepSeek-V4 takes (``topk.biased_topk_jit_kernel_impl`` under ``verify_cap_router_scope``
of a target-verify batch, padded rows and the packed form included) reads it by address.
Each replay with new draft confidences must give: live rows = the stock router, dead rows =
their anchor's output, live lengths = ``drafts_from_confidence`` + 1; a decode batch in the same
process must stay stock. CPU: the same without the graph (Triton interpreter).
"""

from __future__ import annotations

import types

import pytest
import torch

from sglang.kernels.ops.moe.moe_fused_gate import moe_fused_gate
from sglang.srt.layers.moe import router_live_rows as lr
from sglang.srt.speculative.dspark_components import dspark_verify_cap as vc

GAMMA, STRIDE = 5, 6


def _batch(verify: bool):
    mode = types.SimpleNamespace(is_target_verify=lambda: verify)
    return types.SimpleNamespace(forward_mode=mode)


def _stock(scores, bias, topk, non_padded, packed):
    return moe_fused_gate(
        scores,
        bias,
        topk,
        scoring_func="sqrtsoftplus",
        renormalize=True,
        routed_scaling_factor=1.5,
        apply_routed_scaling_factor_on_output=True,
        num_token_non_padded=non_padded,
        packed_out=packed,
    )


def _run(device: str, bs: int, n_experts: int, topk: int, graph: bool, steps: int = 3):
    from sglang.srt.layers.moe.topk import (
        _fused_gate_masks_padded_rows,
        biased_topk_jit_kernel_impl,
    )

    g = torch.Generator(device="cpu").manual_seed(bs)
    cap = vc.VerifyCap(
        spec=vc.verify_cap_spec("conf:0.3"), gamma=GAMMA, k_min=1, device=device
    )  # before capture, as the worker builds it
    m = bs * STRIDE
    bias = (0.1 * torch.randn((n_experts,), generator=g)).to(torch.bfloat16).to(device)
    scores = torch.zeros((m, n_experts), device=device)
    conf = torch.zeros((bs, GAMMA), device=device)
    non_padded = torch.tensor(
        [m - STRIDE if bs > 1 else m], dtype=torch.int32, device=device
    )
    packed = torch.empty((m, topk), dtype=torch.int32, device=device)
    masks = _fused_gate_masks_padded_rows(
        "sqrtsoftplus"
    )  # CUDA: the router masks padding
    ref_pad = non_padded if masks else None
    out = {}

    def step():
        cap.begin_step(bs, conf)
        with vc.verify_cap_router_scope(cap, _batch(True)):
            w, i = biased_topk_jit_kernel_impl(
                scores,
                scores,
                bias,
                topk,
                True,
                scoring_func="sqrtsoftplus",
                routed_scaling_factor=1.5,
                num_token_non_padded=non_padded,
                apply_routed_scaling_factor_on_output=True,
                packed_out=packed,
            )
        out["w"], out["i"] = w, i

    if graph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()  # compile outside the capture
        torch.cuda.current_stream().wait_stream(side)
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            step()
    seen_dead = False
    for _ in range(steps):
        scores.copy_(torch.randn((m, n_experts), generator=g))
        conf.copy_(torch.rand((bs, GAMMA), generator=g) ** 0.5)
        cuda_graph.replay() if graph else step()
        live = vc.drafts_from_confidence(conf, cap.thresholds, 1) + 1
        assert torch.equal(cap.live[:bs], live)
        ref_packed = torch.empty_like(packed)
        ref = (*_stock(scores, bias, topk, ref_pad, ref_packed), ref_packed)
        rows = torch.arange(m, device=device)
        dead = rows % STRIDE >= live[rows // STRIDE]
        src = torch.where(dead, rows // STRIDE * STRIDE, rows)
        seen_dead |= bool(dead.any())
        for got, want in zip((out["w"], out["i"], packed), ref):
            assert torch.equal(
                got, want[src]
            ), "live rows stock, dead rows = their anchor"
        # Padded rows (the last request when bs > 1) stay masked as in stock.
        if masks:
            assert bool((out["i"][non_padded.item() :] == -1).all())
    assert seen_dead
    # A decode forward in the same process: no live lengths, the stock call.
    with vc.verify_cap_router_scope(cap, _batch(False)):
        w, i = biased_topk_jit_kernel_impl(
            scores,
            scores,
            bias,
            topk,
            True,
            scoring_func="sqrtsoftplus",
            routed_scaling_factor=1.5,
            num_token_non_padded=non_padded,
            apply_routed_scaling_factor_on_output=True,
        )
    ws, is_ = _stock(scores, bias, topk, ref_pad, None)
    assert torch.equal(w, ws) and torch.equal(i, is_)


def test_cap_router_call_site_cpu_interpreted():
    _run("cpu", bs=3, n_experts=32, topk=4, graph=False, steps=2)


@pytest.mark.gpu
@pytest.mark.parametrize("bs", [1, 4, 16])
def test_cap_router_call_site_in_a_cuda_graph(bs):
    _run("cuda", bs=bs, n_experts=384, topk=6, graph=True)


# ------------------------------------------------- hash-routed layers and refused routes


def _hash_route(logits, input_ids, tid2eid):
    """HashTopK._forward_torch without shared slots: ids from the token, weights renormalized."""
    ids = tid2eid[input_ids]
    w = torch.nn.functional.softplus(logits).sqrt().gather(1, ids.long())
    return w / (w.sum(-1, keepdim=True) + 1e-20), ids


def _run_hash(device: str, bs: int, graph: bool):
    g = torch.Generator(device="cpu").manual_seed(100 + bs)
    cap = vc.VerifyCap(spec=vc.verify_cap_spec("conf:0.3"), gamma=GAMMA, device=device)
    m, n_experts, vocab = bs * STRIDE, 64, 50
    tid2eid = torch.randint(
        0, n_experts, (vocab, 6), generator=g, dtype=torch.int32
    ).to(device)
    logits = torch.zeros((m, n_experts), device=device)
    ids_in = torch.zeros((m,), dtype=torch.int64, device=device)
    conf = torch.zeros((bs, GAMMA), device=device)
    out = {}

    def step():
        cap.begin_step(bs, conf)
        with vc.verify_cap_router_scope(cap, _batch(True)):
            w, i = _hash_route(logits, ids_in, tid2eid)
            lr.anchor_dead_rows_(w, i)  # the hash_topk.py call site
        out["w"], out["i"] = w, i

    if graph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            step()
    seen_dead = False
    for _ in range(3):
        logits.copy_(torch.randn((m, n_experts), generator=g))
        ids_in.copy_(torch.randint(0, vocab, (m,), generator=g))
        conf.copy_(torch.rand((bs, GAMMA), generator=g) ** 0.5)
        cuda_graph.replay() if graph else step()
        live = cap.live[:bs]
        rows = torch.arange(m, device=device)
        dead = rows % STRIDE >= live[rows // STRIDE]
        src = torch.where(dead, rows // STRIDE * STRIDE, rows)
        seen_dead |= bool(dead.any())
        ref_w, ref_i = _hash_route(logits, ids_in, tid2eid)
        assert torch.equal(out["w"], ref_w[src]) and torch.equal(out["i"], ref_i[src])
        assert set(out["i"].flatten().tolist()) == set(ref_i[~dead].flatten().tolist())
    assert seen_dead


def test_hash_layer_anchor_rows_cpu_interpreted():
    _run_hash("cpu", bs=3, graph=False)


@pytest.mark.gpu
@pytest.mark.parametrize("bs", [1, 16])
def test_hash_layer_anchor_rows_in_a_cuda_graph(bs):
    _run_hash("cuda", bs=bs, graph=True)


def test_routes_without_the_live_length_refuse_a_capped_verify():
    from sglang.srt.layers.moe.topk import TopKConfig, select_experts

    cap = vc.VerifyCap(spec=vc.verify_cap_spec("2"), gamma=GAMMA, device="cpu")
    logits = torch.randn((STRIDE, 16))
    config = TopKConfig(
        top_k=2,
        scoring_func="sqrtsoftplus",
        torch_native=True,
        correction_bias=torch.zeros(16),
    )
    # Outside a target verify (decode, prefill) every route runs as upstream's.
    with vc.verify_cap_router_scope(cap, _batch(False)):
        select_experts(logits, logits, config)
        lr.refuse_dead_rows("x", 3)
    with vc.verify_cap_router_scope(cap, _batch(True)):
        with pytest.raises(RuntimeError, match="cannot take the live length"):
            select_experts(logits, logits, config)
        with pytest.raises(
            RuntimeError, match="MoE layer 3 runs the DeepGEMM mega gate"
        ):
            lr.refuse_dead_rows("the DeepGEMM mega gate", 3)
    with vc.verify_cap_router_scope(None, _batch(True)):  # cap off: nothing refused
        select_experts(logits, logits, config)


def test_mega_gate_predicate_answers_and_the_gate_itself_refuses(monkeypatch):
    """`should_use_mega_gate` is a predicate (callers probe it; it never raises); running the
    mega gate in a capped target verify is what is refused."""
    from sglang.srt.layers.moe import mega_gate as mg

    monkeypatch.setattr(mg.envs.SGLANG_OPT_DEEPGEMM_MEGA_GATE, "get", lambda: True)
    monkeypatch.setattr(
        mg, "get_forward", lambda: types.SimpleNamespace(sp_active=False)
    )
    mode = types.SimpleNamespace(is_target_verify=lambda: True, is_decode=lambda: False)
    batch = types.SimpleNamespace(forward_mode=mode)
    topk = types.SimpleNamespace(routing_inputs=lambda: (None, None))
    moe = types.SimpleNamespace(
        mega_gate_supported=True, layer_id=3, is_hash=False, topk=topk
    )
    hidden = torch.zeros((4, 8), dtype=torch.bfloat16)
    cap = vc.VerifyCap(spec=vc.verify_cap_spec("2"), gamma=GAMMA, device="cpu")
    with vc.verify_cap_router_scope(cap, batch):
        assert mg.should_use_mega_gate(moe, hidden, batch) is True
        with pytest.raises(
            RuntimeError, match="MoE layer 3 runs the DeepGEMM mega gate"
        ):
            mg.run_mega_gate(moe, hidden, None, forward_batch=batch)
