"""moe_fused_gate with a live length (DSpark verify cap): dead verify rows route as their anchor.

On random scores: live rows equal the stock kernel bit for bit, dead rows equal the anchor's
output (weights, ids and the packed form), and without ``live_lens`` the call is stock.
CPU: Triton interpreter, small shapes. GPU: the DeepSeek-V4 shape (384 experts, top 6).
"""

from __future__ import annotations

import pytest
import torch

from sglang.kernels.ops.moe.moe_fused_gate import moe_fused_gate


def _route(scores, bias, topk, **kw):
    # Poisoned outputs: a row the kernel forgot to write shows up.
    packed = torch.full(
        (scores.shape[0], topk), 7, dtype=torch.int32, device=scores.device
    )
    w, i = moe_fused_gate(
        scores,
        bias,
        topk,
        scoring_func="sqrtsoftplus",
        renormalize=True,
        routed_scaling_factor=1.5,
        apply_routed_scaling_factor_on_output=True,
        packed_out=packed,
        **kw,
    )
    return w, i, packed


def _check(bs, stride, n_experts, topk, device, seed=0, token_bias=False, padded=False):
    g = torch.Generator(device="cpu").manual_seed(seed)
    scores = torch.randn((bs * stride, n_experts), generator=g).to(device)
    bias = (0.1 * torch.randn((n_experts,), generator=g)).to(torch.bfloat16).to(device)
    kw = {}
    if token_bias:  # DeepSeek-V4.1 vision routing: image tokens use a second bias
        kw = dict(
            bias_alt=torch.randn((n_experts,), generator=g)
            .to(torch.bfloat16)
            .to(device),
            input_ids=torch.randint(0, 2, (bs * stride,), generator=g).to(device),
            bias_alt_token_id=1,
        )
    if padded:  # CUDA-graph padding: the last request's rows are masked (0 / -1)
        kw["num_token_non_padded"] = torch.tensor(
            [(bs - 1) * stride], dtype=torch.int32, device=device
        )
    live = torch.randint(1, stride + 1, (bs + 3,), generator=g).to(
        device
    )  # spare entries
    stock = _route(scores, bias, topk, **kw)
    ours = _route(scores, bias, topk, live_lens=live, live_stride=stride, **kw)
    rows = torch.arange(bs * stride, device=device)
    req, pos = rows // stride, rows % stride
    dead = pos >= live[req]
    src = torch.where(dead, req * stride, rows)
    assert bool(dead.any()) and bool((~dead).any())
    for s, o in zip(stock, ours):
        assert torch.equal(o[~dead], s[~dead]), "live rows differ from stock"
        assert torch.equal(o, s[src]), "dead rows differ from their anchor row"
    # All live: bitwise the stock call.
    full = torch.full_like(live, stride)
    for s, o in zip(
        stock, _route(scores, bias, topk, live_lens=full, live_stride=stride, **kw)
    ):
        assert torch.equal(o, s)
    # Experts per layer: the dead rows add none.
    ids = ours[1]
    assert set(ids.flatten().tolist()) == set(stock[1][~dead].flatten().tolist())


@pytest.mark.parametrize(
    "token_bias, padded", [(False, False), (True, False), (False, True)]
)
def test_router_live_cpu_interpreted(token_bias, padded):
    _check(
        bs=3,
        stride=4,
        n_experts=32,
        topk=4,
        device="cpu",
        token_bias=token_bias,
        padded=padded,
    )


def test_router_live_rejects_bad_layout():
    scores = torch.randn((7, 16))
    bias = torch.zeros(16)
    with pytest.raises(AssertionError, match="multiple of live_stride"):
        moe_fused_gate(
            scores,
            bias,
            2,
            scoring_func="sqrtsoftplus",
            live_lens=torch.ones(4, dtype=torch.int64),
            live_stride=2,
        )


@pytest.mark.gpu
@pytest.mark.parametrize(
    "token_bias, padded", [(False, False), (True, False), (False, True)]
)
@pytest.mark.parametrize("bs", [1, 4, 16, 64])
def test_router_live_gpu(bs, token_bias, padded):
    _check(
        bs=bs,
        stride=6,
        n_experts=384,
        topk=6,
        device="cuda",
        seed=bs,
        token_bias=token_bias,
        padded=padded and bs > 1,
    )
