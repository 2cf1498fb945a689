"""Hyper-connection mix statistics in one pass over K: each row tile walks every K slice of
upstream's split-K kernels in order and adds the slice partials in registers, so the sums are
upstream's, bit for bit, without the [slices, M, MIX] partials round trip.
The one slice returned (``0 + p0 + p1 + ...`` in slice order) goes to upstream's own reduce
(docs/hc_fused.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _hc_mix_one_pass_bf16x3_kernel(
    X,
    W_HI,
    W_MID,
    W_LO,
    MIX,
    SQ,
    M,
    K: tl.constexpr,
    K_PER_SLICE: tl.constexpr,
    SLICES: tl.constexpr,
    MIX_COLS: tl.constexpr,
    MIX_PAD: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, MIX_PAD)
    total = tl.zeros((BLOCK_M, MIX_PAD), tl.float32)
    sq_total = tl.zeros((BLOCK_M,), tl.float32)
    for s in range(SLICES):
        ks = s * K_PER_SLICE + tl.arange(0, BLOCK_K)
        hi = tl.zeros((BLOCK_M, MIX_PAD), tl.float32)
        mid = tl.zeros((BLOCK_M, MIX_PAD), tl.float32)
        lo = tl.zeros((BLOCK_M, MIX_PAD), tl.float32)
        sq = tl.zeros((BLOCK_M,), tl.float32)
        for block in range(K_PER_SLICE // BLOCK_K):
            k = ks + block * BLOCK_K
            x = tl.load(
                X + rows[:, None].to(tl.int64) * K + k[None, :],
                rows[:, None] < M,
                0,
            )
            offsets = cols[None, :] * K + k[:, None]
            w_hi = tl.load(W_HI + offsets, cols[None, :] < MIX_COLS, 0)
            w_mid = tl.load(W_MID + offsets, cols[None, :] < MIX_COLS, 0)
            w_lo = tl.load(W_LO + offsets, cols[None, :] < MIX_COLS, 0)
            hi = tl.dot(x, w_hi, hi)
            mid = tl.dot(x, w_mid, mid)
            lo = tl.dot(x, w_lo, lo)
            xf = x.to(tl.float32)
            sq += tl.sum(xf * xf, 1)
        # upstream stores (hi + mid) + lo per slice and its reduce adds the slices in order
        total += (hi + mid) + lo
        sq_total += sq
    tl.store(
        MIX + rows[:, None] * MIX_COLS + cols[None, :],
        total,
        (rows[:, None] < M) & (cols[None, :] < MIX_COLS),
    )
    tl.store(SQ + rows, sq_total, rows < M)


@triton.jit
def _hc_mix_one_pass_kernel(
    x_ptr,
    w_ptr,
    mix_ptr,
    sq_ptr,
    M,
    K,
    x_stride_m,
    w_stride_n,
    MIX: tl.constexpr,
    MIX_PAD: tl.constexpr,
    NUM_SLICES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, MIX_PAD)
    mask_m = offs_m < M
    mask_n = offs_n < MIX
    k_per_slice = K // NUM_SLICES
    total = tl.zeros([BLOCK_M, MIX_PAD], dtype=tl.float32)
    sq_total = tl.zeros([BLOCK_M], dtype=tl.float32)
    for pid_s in range(NUM_SLICES):
        k_start = pid_s * k_per_slice
        acc = tl.zeros([BLOCK_M, MIX_PAD], dtype=tl.float32)
        sq = tl.zeros([BLOCK_M], dtype=tl.float32)
        for kb in range(0, k_per_slice, BLOCK_K):
            offs_k = k_start + kb + tl.arange(0, BLOCK_K)
            mask_k = offs_k < k_start + k_per_slice
            x_tile = tl.load(
                x_ptr + offs_m[:, None] * x_stride_m + offs_k[None, :],
                mask=mask_m[:, None] & mask_k[None, :],
                other=0.0,
            ).to(tl.float32)
            w_tile = tl.load(
                w_ptr + offs_n[None, :] * w_stride_n + offs_k[:, None],
                mask=mask_n[None, :] & mask_k[:, None],
                other=0.0,
            ).to(tl.float32)
            acc += tl.dot(x_tile, w_tile, input_precision=DOT_PRECISION)
            sq += tl.sum(x_tile * x_tile, axis=1)
        total += acc
        sq_total += sq
    tl.store(
        mix_ptr + offs_m[:, None] * MIX + offs_n[None, :],
        total,
        mask=mask_m[:, None] & mask_n[None, :],
    )
    tl.store(sq_ptr + offs_m, sq_total, mask=mask_m)


def hc_mix_one_pass_bf16x3(
    x: torch.Tensor, weight_parts, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16x3 route: (mix [1, M, MIX], sq [1, M]) fp32, upstream's 16 slices summed in order."""
    from sglang.kernels.ops.layernorm import mhc

    m, k = x.shape
    slices = mhc._HC_MIX_COMPENSATED_SLICES
    mix = weight_parts[0].shape[0]
    assert x.is_contiguous() and x.dtype == torch.bfloat16, (x.dtype, x.stride())
    assert k % (slices * mhc._HC_MIX_BLOCK_K) == 0, k
    assert len(weight_parts) == 3 and all(
        w.shape == (mix, k) and w.dtype == torch.bfloat16 and w.is_contiguous()
        for w in weight_parts
    )
    out = torch.empty((1, m, mix), device=x.device, dtype=torch.float32)
    sq = torch.empty((1, m), device=x.device, dtype=torch.float32)
    _hc_mix_one_pass_bf16x3_kernel[(triton.cdiv(m, block_m),)](
        x,
        *weight_parts,
        out,
        sq,
        m,
        K=k,
        K_PER_SLICE=k // slices,
        SLICES=slices,
        MIX_COLS=mix,
        MIX_PAD=triton.next_power_of_2(mix),
        BLOCK_K=mhc._HC_MIX_BLOCK_K,
        BLOCK_M=block_m,
        num_warps=4,
        num_stages=3,
    )
    return out, sq


def hc_mix_one_pass(
    x_flat: torch.Tensor, hc_fn: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """tf32x3 route: (mix [1, M, MIX], sq [1, M]) fp32, upstream's slices summed in order."""
    from sglang.kernels.ops.layernorm import mhc

    assert x_flat.dim() == 2 and hc_fn.dim() == 2
    assert x_flat.stride(1) == 1 and hc_fn.stride(1) == 1
    assert hc_fn.dtype == torch.float32
    m, k = x_flat.shape
    mix = hc_fn.shape[0]
    assert hc_fn.shape[1] == k
    out = torch.empty((1, m, mix), dtype=torch.float32, device=x_flat.device)
    sq = torch.empty((1, m), dtype=torch.float32, device=x_flat.device)
    block_m = mhc._block_m_for(m)
    _hc_mix_one_pass_kernel[(triton.cdiv(m, block_m),)](
        x_flat,
        hc_fn,
        out,
        sq,
        m,
        k,
        x_flat.stride(0),
        hc_fn.stride(0),
        MIX=mix,
        MIX_PAD=max(16, triton.next_power_of_2(mix)),
        NUM_SLICES=mhc._num_slices_for(k),
        BLOCK_M=block_m,
        BLOCK_K=mhc._HC_MIX_BLOCK_K,
        DOT_PRECISION=mhc._HC_MIX_DOT_PRECISION,
        num_warps=mhc._HC_MIX_NUM_WARPS,
        num_stages=mhc._HC_MIX_NUM_STAGES,
    )
    return out, sq
