"""MXFP4 routed experts at decode and verify sizes: each routed expert's weights read once.

``mxfp4_verify_moe(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale)`` computes
``sum_k topk_weights[m, k] * expert_{topk_ids[m, k]}(x[m])`` on weights as MXFP4 checkpoints ship
them (e2m1 packed two per byte along K, element ``2j`` in the low nibble; one ue8m0 scale per 32;
``w13`` [E, 2I, H/2] gate rows then up rows, ``w2`` [E, H, I/2]) in four launches with no host
synchronisation: the distinct experts' segments, gate/up with the activation, down, the combine
(docs/triton-mxfp4-moe.md). Pairs with id < 0 and, with ``live_lens``, the verify cap's dead rows
read no weight and give 0.

INVARIANTS. Row invariance and determinism: one fixed BLOCK_M and K order whatever the row count,
no split-K, no atomics, a row's pairs combined in k order. Dequant is exact (e2m1 times a power of
two is a bf16 value), so against upstream's bf16 x dequantised-weight product only fp32 summation
order and the bf16 roundings of gate/up, ``h`` and the output differ. The activation is upstream's
DeepSeek-V4 SwiGLU: gate and up rounded to bf16, clamped there when ``swiglu_limit`` is set (gate
from above, up both ways), then ``silu(gate) * up`` in fp32.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

# rows x top-k whose experts one program sorts (decode and verify sizes)
MAX_PAIRS = 2048
# rows per dot: fixed, so a row's sums never depend on how many rows came
BLOCK_M = 16


@triton.jit
def _segments(
    ids_ptr,
    sorted_pair_ptr,
    seg_expert_ptr,
    seg_start_ptr,
    seg_end_ptr,
    n_seg_ptr,
    live_lens_ptr,
    T,
    E,
    TOPK: tl.constexpr,
    STRIDE: tl.constexpr,
    PAIRS: tl.constexpr,
    E_PAD: tl.constexpr,
):
    p = tl.arange(0, PAIRS)
    ids = tl.load(ids_ptr + p, mask=p < T, other=-1)
    if STRIDE > 0:  # verify rows at or past their request's live length are dead
        row = p // TOPK
        live_len = tl.load(live_lens_ptr + row // STRIDE, mask=p < T, other=0)
        ids = tl.where(row % STRIDE < live_len, ids, -1)
    expert = tl.where(ids >= 0, ids, E)
    key = tl.sort(expert * PAIRS + p)
    tl.store(sorted_pair_ptr + p, key % PAIRS)
    count = tl.histogram(expert, E_PAD)  # bin E and up: dead and padding pairs
    e = tl.arange(0, E_PAD)
    start = tl.cumsum(count, axis=0) - count
    active = (count > 0) & (e < E)
    slot = tl.cumsum(active.to(tl.int32), axis=0) - 1
    tl.store(seg_expert_ptr + slot, e, mask=active)
    tl.store(seg_start_ptr + slot, start, mask=active)
    tl.store(seg_end_ptr + slot, start + count, mask=active)
    tl.store(n_seg_ptr, tl.sum(active.to(tl.int32), axis=0))


@triton.jit
def _e2m1_dequant(wp, sc, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Packed e2m1 ``wp`` [BLOCK_N, BLOCK_K/2] uint8 with ue8m0 ``sc`` [BLOCK_N, BLOCK_K/32]
    as exact bf16 [BLOCK_N, BLOCK_K], built from the fp32 bit fields (the in-register path).
    """
    code = tl.join(wp & 15, wp >> 4).to(
        tl.int32
    )  # [N, K/2, 2]: element 2j in the low nibble
    code = tl.reshape(code, (BLOCK_N, BLOCK_K))
    s = tl.broadcast_to(sc.to(tl.int32)[:, :, None], (BLOCK_N, BLOCK_K // 32, 32))
    s = tl.reshape(s, (BLOCK_N, BLOCK_K))
    e = (code >> 1) & 3
    m = code & 1
    exp = tl.where(e == 0, tl.where(m == 1, s - 1, 0), e - 1 + s)
    bits = ((code & 8) << 28) | (exp << 23) | tl.where(e == 0, 0, m << 22)
    return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)


@triton.jit
def _dot_mxfp4(wp, sc, xt, acc, DOT_SCALED: tl.constexpr, BLOCK_K: tl.constexpr):
    """``acc + dequant(wp, sc) @ xt``: the weight tile [N, K/2] is the MMA's M side (16 rows
    of x are too few for it), by Triton's mixed-input dot or the in-register decode."""
    if DOT_SCALED:
        return tl.dot_scaled(wp, sc, "e2m1", xt, None, "bf16", acc)
    return tl.dot(_e2m1_dequant(wp, sc, wp.shape[0], BLOCK_K), xt, acc)


@triton.jit
def _gate_up(
    x_ptr,
    w_ptr,
    s_ptr,
    h_ptr,
    sorted_pair_ptr,
    seg_expert_ptr,
    seg_start_ptr,
    seg_end_ptr,
    n_seg_ptr,
    stride_xm,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_hm,
    swiglu_limit,
    I: tl.constexpr,
    TOPK: tl.constexpr,
    H: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_MM: tl.constexpr,
    DOT_SCALED: tl.constexpr,
):
    seg = tl.program_id(0)
    if seg >= tl.load(n_seg_ptr):
        return
    n0 = tl.program_id(1) * BLOCK_N
    expert = tl.load(seg_expert_ptr + seg).to(tl.int64)
    start = tl.load(seg_start_ptr + seg)
    end = tl.load(seg_end_ptr + seg)
    rn = n0 + tl.arange(0, BLOCK_N)
    n_mask = rn < I
    rk = tl.arange(0, BLOCK_K)
    rk2 = tl.arange(0, BLOCK_K // 2)
    rks = tl.arange(0, BLOCK_K // 32)
    w_gate = w_ptr + expert * stride_we + rn[:, None] * stride_wn + rk2[None, :]
    w_up = w_gate + I * stride_wn
    s_gate = s_ptr + expert * stride_se + rn[:, None] * stride_sn + rks[None, :]
    s_up = s_gate + I * stride_sn
    m0 = start
    while m0 < end:  # a while: the interpreter's scalar loads are 1-element arrays
        rm = m0 + tl.arange(0, BLOCK_MM)
        m_mask = rm < end
        pair = tl.load(sorted_pair_ptr + rm, mask=m_mask, other=0)
        x_cols = x_ptr + (pair // TOPK).to(tl.int64)[None, :] * stride_xm + rk[:, None]
        acc_g = tl.zeros((BLOCK_N, BLOCK_MM), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_MM), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            xt = tl.load(x_cols + k0, mask=m_mask[None, :], other=0.0)
            wg = tl.load(w_gate + k0 // 2, mask=n_mask[:, None], other=0)
            wu = tl.load(w_up + k0 // 2, mask=n_mask[:, None], other=0)
            sg = tl.load(s_gate + k0 // 32, mask=n_mask[:, None], other=0)
            su = tl.load(s_up + k0 // 32, mask=n_mask[:, None], other=0)
            acc_g = _dot_mxfp4(wg, sg, xt, acc_g, DOT_SCALED, BLOCK_K)
            acc_u = _dot_mxfp4(wu, su, xt, acc_u, DOT_SCALED, BLOCK_K)
        g = acc_g.to(tl.bfloat16).to(tl.float32)
        u = acc_u.to(tl.bfloat16).to(tl.float32)
        if (
            HAS_LIMIT
        ):  # swiglu_limit is a bf16 value: clamping the fp32 of bf16s is bf16's
            g = tl.minimum(g, swiglu_limit)
            u = tl.minimum(tl.maximum(u, -swiglu_limit), swiglu_limit)
        h = g / (1.0 + tl.exp(-g)) * u
        tl.store(
            h_ptr + pair.to(tl.int64)[None, :] * stride_hm + rn[:, None],
            h.to(tl.bfloat16),
            mask=m_mask[None, :] & n_mask[:, None],
        )
        m0 += BLOCK_MM


@triton.jit
def _down(
    h_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    sorted_pair_ptr,
    seg_expert_ptr,
    seg_start_ptr,
    seg_end_ptr,
    n_seg_ptr,
    stride_hm,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_ym,
    I: tl.constexpr,
    H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_MM: tl.constexpr,
    DOT_SCALED: tl.constexpr,
):
    seg = tl.program_id(0)
    if seg >= tl.load(n_seg_ptr):
        return
    n0 = tl.program_id(1) * BLOCK_N
    expert = tl.load(seg_expert_ptr + seg).to(tl.int64)
    start = tl.load(seg_start_ptr + seg)
    end = tl.load(seg_end_ptr + seg)
    rn = n0 + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    rk2 = tl.arange(0, BLOCK_K // 2)
    rks = tl.arange(0, BLOCK_K // 32)
    w_rows = w_ptr + expert * stride_we + rn[:, None] * stride_wn + rk2[None, :]
    s_rows = s_ptr + expert * stride_se + rn[:, None] * stride_sn + rks[None, :]
    m0 = start
    while m0 < end:
        rm = m0 + tl.arange(0, BLOCK_MM)
        m_mask = rm < end
        pair = tl.load(sorted_pair_ptr + rm, mask=m_mask, other=0).to(tl.int64)
        h_cols = h_ptr + pair[None, :] * stride_hm + rk[:, None]
        acc = tl.zeros((BLOCK_N, BLOCK_MM), dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            k_ok = k0 + rk < I
            ht = tl.load(h_cols + k0, mask=m_mask[None, :] & k_ok[:, None], other=0.0)
            w = tl.load(w_rows + k0 // 2, mask=(k0 + 2 * rk2 < I)[None, :], other=0)
            s = tl.load(s_rows + k0 // 32, mask=(k0 + 32 * rks < I)[None, :], other=0)
            acc = _dot_mxfp4(w, s, ht, acc, DOT_SCALED, BLOCK_K)
        tl.store(
            y_ptr + pair[None, :] * stride_ym + rn[:, None], acc, mask=m_mask[None, :]
        )
        m0 += BLOCK_MM


@triton.jit
def _combine(
    y_ptr,
    ids_ptr,
    weights_ptr,
    out_ptr,
    stride_ym,
    stride_om,
    live_lens_ptr,
    H,
    TOPK: tl.constexpr,
    STRIDE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    m = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < H
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k in tl.static_range(TOPK):
        pair = m * TOPK + k
        w = tl.load(weights_ptr + pair).to(tl.float32)
        live = tl.load(ids_ptr + pair) >= 0
        if STRIDE > 0:
            live = live & ((m % STRIDE) < tl.load(live_lens_ptr + m // STRIDE))
        if live:
            acc += w * tl.load(y_ptr + pair.to(tl.int64) * stride_ym + rn, mask=n_mask)
    tl.store(
        out_ptr + m.to(tl.int64) * stride_om + rn,
        acc.to(out_ptr.dtype.element_ty),
        mask=n_mask,
    )


DEFAULT_CONFIG = {
    # Triton's mixed-input dot on a GPU; the in-register decode elsewhere (the interpreter has
    # no dot_scaled). The two give the same bits (test_mxfp4_verify_moe.py, on the GPU).
    "dot_scaled": None,
    "gate_up_block_n": 64,
    "gate_up_block_k": 256,
    "gate_up_warps": 4,
    "gate_up_stages": 4,
    "down_block_n": 128,
    "down_block_k": 128,
    "down_warps": 4,
    "down_stages": 4,
}


@functools.lru_cache(maxsize=None)
def bf16_limit(swiglu_limit: float) -> float:
    """The SwiGLU limit as the bf16 value upstream clamps with (silu_and_mul_clamp clamps in
    bf16); computed once per value, not on every call."""
    return float(torch.tensor(swiglu_limit).bfloat16())


def mxfp4_verify_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    swiglu_limit: Optional[float] = None,
    live_lens: Optional[torch.Tensor] = None,
    live_stride: int = 0,
    config: Optional[dict] = None,
) -> torch.Tensor:
    """The routed experts' weighted sum for ``x`` [M, H] bf16. Up to ``MAX_PAIRS`` (row,
    expert) pairs one program compacts the distinct experts; past it (prefill) a stable sort
    does, with a program per expert. Either way a row gets the same bits.

    ``live_lens`` [>= M / live_stride] (read on the device, so a captured graph sees each
    replay's): rows are request-major, ``live_stride`` per request, and a row at or past its
    request's live length is dead (no expert read, output 0)."""
    m, hidden = x.shape
    experts, two_inter, half_hidden = w13.shape
    inter = two_inter // 2
    topk = topk_ids.shape[1]
    cfg = {**DEFAULT_CONFIG, **(config or {})}
    if cfg["dot_scaled"] is None:
        cfg["dot_scaled"] = x.is_cuda
    assert x.dtype == torch.bfloat16 and x.stride(1) == 1, "x: bf16, rows contiguous"
    assert topk_ids.shape == topk_weights.shape == (m, topk), "topk ids/weights: [M, k]"
    assert w13.dtype == w2.dtype == torch.uint8, "weights: packed e2m1 as uint8"
    assert w13_scale.dtype == w2_scale.dtype == torch.uint8, "scales: ue8m0 as uint8"
    assert (
        half_hidden * 2 == hidden and hidden % cfg["gate_up_block_k"] == 0
    ), "w13: [E, 2I, H/2]"
    assert hidden % cfg["down_block_n"] == 0, "H % the down tile"
    assert w2.shape == (experts, hidden, inter // 2), "w2: [E, H, I/2]"
    assert w13_scale.shape == (
        experts,
        two_inter,
        hidden // 32,
    ), "w13 scale: [E, 2I, H/32]"
    assert w2_scale.shape == (experts, hidden, inter // 32), "w2 scale: [E, H, I/32]"
    assert inter % 32 == 0, "I % 32: one scale per 32 along K"
    for t in (w13, w13_scale, w2, w2_scale):
        assert t.stride(2) == 1, "weights and scales: K contiguous"
    assert (live_lens is None) == (live_stride == 0), "live_lens with its live_stride"
    assert (
        live_stride == 0 or m % live_stride == 0
    ), f"{m} rows, live stride {live_stride}"
    limit = 0.0 if swiglu_limit is None else bf16_limit(swiglu_limit)
    dev = x.device
    pairs = m * topk
    ids = topk_ids.to(torch.int32).contiguous()
    lens = (
        ids if live_lens is None else live_lens
    )  # any pointer: read only with a stride
    if (
        pairs <= MAX_PAIRS
    ):  # decode and verify: the distinct experts, compacted on the GPU
        pairs_pad = max(16, triton.next_power_of_2(pairs))
        sorted_pair = torch.empty(pairs_pad, dtype=torch.int32, device=dev)
        seg = torch.empty((3, min(pairs, experts)), dtype=torch.int32, device=dev)
        n_seg = torch.empty(1, dtype=torch.int32, device=dev)
        _segments[(1,)](
            ids,
            sorted_pair,
            seg[0],
            seg[1],
            seg[2],
            n_seg,
            lens,
            pairs,
            experts,
            TOPK=topk,
            STRIDE=live_stride,
            PAIRS=pairs_pad,
            E_PAD=triton.next_power_of_2(experts + 1),
        )
        max_seg = min(pairs, experts)
    else:  # prefill: one segment per expert (an empty one returns at once)
        seg, sorted_pair, n_seg = _all_expert_segments(
            ids, experts, live_lens, live_stride
        )
        max_seg = experts
    h = torch.empty((pairs, inter), dtype=torch.bfloat16, device=dev)
    bn1 = cfg["gate_up_block_n"]
    _gate_up[(max_seg, triton.cdiv(inter, bn1))](
        x,
        w13,
        w13_scale,
        h,
        sorted_pair,
        seg[0],
        seg[1],
        seg[2],
        n_seg,
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        w13_scale.stride(0),
        w13_scale.stride(1),
        h.stride(0),
        limit,
        I=inter,
        TOPK=topk,
        H=hidden,
        HAS_LIMIT=swiglu_limit is not None,
        BLOCK_N=bn1,
        BLOCK_K=cfg["gate_up_block_k"],
        BLOCK_MM=BLOCK_M,
        DOT_SCALED=cfg["dot_scaled"],
        num_warps=cfg["gate_up_warps"],
        num_stages=cfg["gate_up_stages"],
    )
    y = torch.empty((pairs, hidden), dtype=torch.float32, device=dev)
    bn2 = cfg["down_block_n"]
    _down[(max_seg, hidden // bn2)](
        h,
        w2,
        w2_scale,
        y,
        sorted_pair,
        seg[0],
        seg[1],
        seg[2],
        n_seg,
        h.stride(0),
        w2.stride(0),
        w2.stride(1),
        w2_scale.stride(0),
        w2_scale.stride(1),
        y.stride(0),
        I=inter,
        H=hidden,
        BLOCK_N=bn2,
        BLOCK_K=cfg["down_block_k"],
        BLOCK_MM=BLOCK_M,
        DOT_SCALED=cfg["dot_scaled"],
        num_warps=cfg["down_warps"],
        num_stages=cfg["down_stages"],
    )
    out = torch.empty_like(x)
    _combine[(m, triton.cdiv(hidden, 1024))](
        y,
        ids,
        topk_weights.contiguous(),
        out,
        y.stride(0),
        out.stride(0),
        lens,
        hidden,
        TOPK=topk,
        STRIDE=live_stride,
        BLOCK_N=1024,
    )
    return out


def _all_expert_segments(
    ids: torch.Tensor, experts: int, live_lens: Optional[torch.Tensor], live_stride: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``_segments``' outputs for any number of pairs, by a stable sort on the GPU, with a
    segment for every expert (no host synchronisation: the segment count is fixed)."""
    dev = ids.device
    key = torch.where(ids >= 0, ids, experts)
    if live_stride:
        row = torch.arange(ids.shape[0], device=dev)
        dead = row % live_stride >= live_lens[row // live_stride]
        key = torch.where(dead[:, None], experts, key)
    sorted_key, order = torch.sort(key.flatten(), stable=True)
    bounds = torch.searchsorted(
        sorted_key, torch.arange(experts + 1, device=dev, dtype=sorted_key.dtype)
    ).to(torch.int32)
    seg = torch.stack(
        (torch.arange(experts, device=dev, dtype=torch.int32), bounds[:-1], bounds[1:])
    )
    n_seg = torch.full((1,), experts, dtype=torch.int32, device=dev)
    return seg, order.to(torch.int32), n_seg


def dequant_mxfp4(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Exact float32 values of packed e2m1 ``w`` [..., K/2] with ue8m0 ``scale`` [..., K/32]."""
    lut = torch.tensor(
        [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6],
        dtype=torch.float32,
        device=w.device,
    )
    vals = torch.stack((lut[(w & 15).long()], lut[(w >> 4).long()]), dim=-1)
    vals = vals.reshape(*w.shape[:-1], w.shape[-1] * 2)
    return vals * torch.exp2(scale.float() - 127).repeat_interleave(32, dim=-1)


def mxfp4_moe_reference(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    swiglu_limit: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same computation expert by expert in torch (fp32 sums, the same bf16 roundings),
    and beside it the magnitude ``sum_k |w_k| sum_i |h_i W2_ji|`` that ``BOUND`` scales.
    """
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    mag = torch.zeros_like(out)
    xf = x.float()
    for e in sorted(set(topk_ids[topk_ids >= 0].tolist())):
        rows, ks = (topk_ids == e).nonzero(as_tuple=True)
        gu = xf[rows] @ dequant_mxfp4(w13[e], w13_scale[e]).T
        gate, up = gu[:, :inter].bfloat16().float(), gu[:, inter:].bfloat16().float()
        if swiglu_limit is not None:
            limit = bf16_limit(swiglu_limit)
            gate = gate.clamp(max=limit)
            up = up.clamp(-limit, limit)
        h = (gate / (1 + torch.exp(-gate)) * up).bfloat16().float()
        w_down = dequant_mxfp4(w2[e], w2_scale[e]).T
        weight = topk_weights[rows, ks].float()[:, None]
        out.index_add_(0, rows, weight * (h @ w_down))
        mag.index_add_(0, rows, weight.abs() * (h.abs() @ w_down.abs()))
    return out.to(x.dtype), mag


# |fork - reference| <= BOUND * magnitude + 2 bf16 ulps of the reference, per element. Against
# the reference the fork differs by fp32 summation order and, through it, by a bf16 rounding of
# gate, up or h that lands the other way (one bf16 ulp, 2^-8 relative, each): 2^-6 covers two
# such flips on every term at once; the output's own rounding is the ulps.
BOUND = 2.0**-6


def within_bound(
    out: torch.Tensor, ref: torch.Tensor, mag: torch.Tensor
) -> torch.Tensor:
    """Per element: is ``out`` within the stated bound of the reference ``(ref, mag)``?"""
    ulp = torch.exp2(
        torch.floor(torch.log2(ref.float().abs().clamp(min=2.0**-126))) - 7
    )
    return (out.float() - ref.float()).abs() <= BOUND * mag + 2 * ulp
