"""The fp8 draft head's GEMM on Hopper for 1..MAX_ROWS rows, warp-specialized (Gluon): one TMA
warp fills a ring of stages, and two consumer warpgroups each dequantize and multiply half of the
CTA's vocabulary rows, so one warpgroup's e4m3 -> bf16 runs while the other's wgmma does.

A candidate, outside the wheel: tune_draft_head_fp8_ws.py measures it against cuBLAS bf16 and
draft_head_fp8_wgmma.py, test/test_draft_head_fp8_ws.py checks its bits; it joins the flag's
kernels (sglang/kernels/ops/speculative/dspark/) at the row counts where it wins.

Why: every CTA re-reads x, so at 128 rows and 128 vocabulary rows per CTA (the wgmma kernel's
tile) x's bytes are twice the head's. Tiles of 256 rows halve that, but a single warpgroup holding
one alternates dequantization and MMA; two consumers let the two overlap, and the loader warp keeps
the ring full without a CTA-wide barrier per step (which may also help at 1..32 rows, where the
wgmma kernel streams the head below HBM speed: draft_head_fp8-NVIDIA_H200.json).

EXACT and ROW INVARIANT, and the same bits as draft_head_fp8_wgmma.py: each consumer runs that
kernel's per-warpgroup sequence (same dequantization, same 32-K blocks in the same order, one
wgmma accumulator per 16 rows), so a row's logits do not depend on the row count, the tile
height or which kernel served it.

STAGE PROTOCOL: ``ready[s]`` completes when TMA has written stage s (one expect-tx arrival);
``empty[s]`` needs one arrival per consumer, given after the consumer's last wgmma reading stage
s retired and all its warps are past their shared-memory loads (a named barrier first), so the
loader never overwrites a stage a warp still reads.
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from sglang.kernels.ops.gemm.e4m3_to_bf16_sm90 import dequant_block, words_layout
from sglang.kernels.ops.speculative.dspark.draft_head_fp8_wgmma import (
    _SMEM_BYTES,
    STEP_K,
    _scales_layout,
    _weight_descriptor,
    available,
    padded_rows,
)

MAX_ROWS = 128
CONSUMERS = 2  # warpgroups multiplying; the CTA's tile is CONSUMERS x their rows
_NC = gl.constexpr(CONSUMERS)
_REGS = 240  # the worker consumer's setmaxnreg; the default consumer gets what is left: also 240
_MAXNREG = (
    168  # the budget setmaxnreg shares: 12 warps x 168 = 2 x 4 x 240 + 4 x 24 (loader)
)

# wgmma N (x's rows padded to a power of two) -> (vocab rows per consumer, stages)
CONFIGS: dict[int, tuple[int, int]] = {
    8: (128, 6),
    16: (128, 6),
    32: (128, 5),
    64: (128, 4),
    128: (128, 3),
}

__all__ = ["available", "config", "draft_head_fp8_logits_ws", "MAX_ROWS"]


@gluon.jit
def _load(
    a,
    P: gl.constexpr,
    K: gl.constexpr,
    NP: gl.constexpr,
    BVP: gl.constexpr,
    ST: gl.constexpr,
    W_L: gl.constexpr,
    S_L: gl.constexpr,
):
    """The loader warp: stage s <- 128 K of the tile's weights and of x, when both consumers freed it."""
    w_desc, x_desc, w_s, x_s, ready, empty, S, OUT, M, V, SO, v0 = a
    NSTEP: gl.constexpr = K // 128
    NBYTES: gl.constexpr = _NC * BVP * 128 + NP * 128 * 2
    for i in range(NSTEP):
        s = i % ST
        mbarrier.wait(empty.index(s), ((i // ST) & 1) ^ 1)  # the first round passes
        bar = ready.index(s)
        mbarrier.expect(bar, NBYTES)
        tma.async_copy_global_to_shared(w_desc, [v0, i * 32], bar, w_s.index(s))
        tma.async_copy_global_to_shared(x_desc, [0, i * 128], bar, x_s.index(2 * s))
        tma.async_copy_global_to_shared(
            x_desc, [0, i * 128 + 64], bar, x_s.index(2 * s + 1)
        )


@gluon.jit
def _consume(
    a,
    P: gl.constexpr,
    K: gl.constexpr,
    NP: gl.constexpr,
    BVP: gl.constexpr,
    ST: gl.constexpr,
    W_L: gl.constexpr,
    S_L: gl.constexpr,
):
    """Consumer P: rows v0 + P * BVP .. + BVP of the tile, the wgmma kernel's loop, then its store."""
    w_desc, x_desc, w_s, x_s, ready, empty, S, OUT, M, V, SO, v0 = a
    MMA: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, NP, 16]
    )
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    NSTEP: gl.constexpr = K // 128
    r0 = v0 + P * BVP
    sr = r0 + gl.arange(0, BVP, layout=gl.SliceLayout(1, S_L))
    sk = gl.arange(0, 4, layout=gl.SliceLayout(0, S_L))
    s_off = gl.expand_dims((sr // 32) * (K // 32), 1) + gl.expand_dims(sk, 0)
    s_mask = gl.expand_dims(sr < V, 1) & gl.expand_dims(sk >= 0, 0)
    s_next = gl.load(S + s_off, s_mask, 1.0)
    acc = gl.zeros([BVP, NP], gl.float32, layout=MMA)
    for i in range(NSTEP):
        st = i % ST
        s4 = s_next
        s_next = gl.load(S + s_off + gl.minimum(i + 1, NSTEP - 1) * 4, s_mask, 1.0)
        s02, s13 = gl.split(gl.reshape(s4, [BVP, 2, 2]))  # blocks (0, 2), (1, 3)
        s0, s2 = gl.split(s02)
        s1, s3 = gl.split(s13)
        scales = (s0, s1, s2, s3)
        mbarrier.wait(ready.index(st), (i // ST) & 1)
        w_rows = w_s.index(st).slice(P * BVP, BVP, dim=0)
        for kb in gl.static_range(4):
            w32 = w_rows.slice(8 * kb, 8, dim=1).load(W_L)
            w = dequant_block(
                w32, gl.convert_layout(scales[kb], gl.SliceLayout(1, W_L)), A_L, BVP
            )
            xb = x_s.index(2 * st + kb // 2).slice(32 * (kb % 2), 32, dim=1)
            acc = warpgroup_mma(w, xb.permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])
            if kb == 0:
                # the previous step's last wgmma retired: free its stage
                gl.thread_barrier()
                fence_async_shared()
                mbarrier.arrive(empty.index((i + ST - 1) % ST), count=1, pred=i > 0)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    orow = r0 + gl.arange(0, BVP, layout=gl.SliceLayout(1, MMA))
    on = gl.arange(0, NP, layout=gl.SliceLayout(0, MMA))
    o_off = gl.expand_dims(on * SO, 0) + gl.expand_dims(orow, 1)
    o_mask = gl.expand_dims(on < M, 0) & gl.expand_dims(orow < V, 1)
    gl.store(OUT + o_off, acc.to(OUT.dtype.element_ty), o_mask)


@gluon.jit(
    do_not_specialize=["M"]
)  # one compile per configuration, whatever the row count
def _draft_head_fp8_ws_kernel(
    w_desc,
    x_desc,
    S,
    OUT,
    M,
    V,
    SO,
    K: gl.constexpr,
    NP: gl.constexpr,
    BVP: gl.constexpr,
    ST: gl.constexpr,
    W_L: gl.constexpr,
    S_L: gl.constexpr,
    REGS: gl.constexpr,
):
    w_s = gl.allocate_shared_memory(gl.int32, [ST, _NC * BVP, 32], w_desc.layout)
    x_s = gl.allocate_shared_memory(gl.bfloat16, [2 * ST, NP, 64], x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [ST, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [ST, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(ST):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=_NC)
    fence_async_shared()
    v0 = gl.program_id(0) * (_NC * BVP)
    a = (w_desc, x_desc, w_s, x_s, ready, empty, S, OUT, M, V, SO, v0)
    gl.warp_specialize(
        [
            (_consume, (a, 0, K, NP, BVP, ST, W_L, S_L)),
            (_consume, (a, 1, K, NP, BVP, ST, W_L, S_L)),
            (_load, (a, 0, K, NP, BVP, ST, W_L, S_L)),
        ],
        [4, 1],
        [REGS, 24],
    )
    for s in gl.static_range(ST):
        mbarrier.invalidate(ready.index(s))
        mbarrier.invalidate(empty.index(s))


def config(m: int) -> tuple[int, int, int]:
    """(wgmma N, vocab rows per consumer, stages) for ``m`` rows."""
    np_ = padded_rows(m)
    bvp, st = CONFIGS[np_]
    return np_, bvp, st


def stage_bytes(np_: int, bvp: int) -> int:
    return CONSUMERS * bvp * STEP_K + np_ * STEP_K * 2


def draft_head_fp8_logits_ws(
    x: torch.Tensor,
    qp: torch.Tensor,
    scales: torch.Tensor,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
    cfg: tuple[int, int] | None = None,
) -> torch.Tensor:
    """logits [M, N] = x [M, K] (bf16) @ dequant(qp, scales)^T for 1 <= M <= MAX_ROWS (``qp``:
    ``permute_k`` of the e4m3 head); ``cfg`` (rows per consumer, stages) overrides ``CONFIGS``.
    """
    m, k = x.shape
    n = qp.shape[0]
    assert (
        1 <= m <= MAX_ROWS
    ), f"{m} rows: the warp-specialized head serves 1..{MAX_ROWS}"
    assert x.dtype == torch.bfloat16 and x.is_contiguous() and x.data_ptr() % 16 == 0, (
        x.dtype,
        x.stride(),
        x.data_ptr() % 16,
    )  # TMA reads x: contiguous rows, 16-byte aligned
    assert (
        qp.dtype == torch.float8_e4m3fn
        and qp.is_contiguous()
        and qp.shape[1] == k
        and k % STEP_K == 0
    )
    assert scales.dtype == torch.float32 and scales.shape == (
        triton.cdiv(n, 32),
        k // 32,
    )
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    assert out.shape == (m, n) and out.stride(1) == 1, (out.shape, out.stride())
    assert out.dtype in (torch.float32, torch.bfloat16, torch.float16), out.dtype
    np_, bvp, st = config(m)
    if cfg is not None:
        bvp, st = cfg
    assert bvp in (64, 128) and st >= 2, (bvp, st)
    assert st * stage_bytes(np_, bvp) <= _SMEM_BYTES, (np_, bvp, st)
    x_desc = TensorDescriptor.from_tensor(
        x, [np_, 64], gl.NVMMASharedLayout.get_default_for([np_, 64], gl.bfloat16)
    )  # rows >= M read as zeros
    _draft_head_fp8_ws_kernel[(triton.cdiv(n, CONSUMERS * bvp),)](
        _weight_descriptor(qp, CONSUMERS * bvp),
        x_desc,
        scales,
        out,
        m,
        n,
        out.stride(0),
        k,
        np_,
        bvp,
        st,
        *_layouts(bvp),
        _REGS,
        num_warps=4,
        maxnreg=_MAXNREG,
    )
    return out


@functools.cache
def _layouts(bvp: int):
    return words_layout(bvp, 4), _scales_layout(bvp, 4)
