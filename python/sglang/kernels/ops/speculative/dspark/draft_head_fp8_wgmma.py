"""The fp8 draft head's GEMM on Hopper (--speculative-dspark-draft-head-fp8, SM90): one wgmma
kernel for every row count the flag serves, written in Gluon (Triton's explicit-layout dialect).

Vocabulary rows are the MMA's M, draft rows its N. Why MAX_ROWS, and how: docs/draft-head-fp8.md.

EXACT and ROW INVARIANT. Dequantisation is exact (same bits as the Triton kernel's weights);
bf16 products are exact in the fp32 accumulator and K runs in one fixed order whatever N is, so
a row's logits are the same bits at every row count 1..MAX_ROWS. The order of K inside each MMA
differs from the mma.sync kernel's, so the two kernels' logits differ in the last bits: one
device must use one of them for every call.
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

# the exact e4m3 -> bf16 (cvt + bit moves + one HMUL2) and its A-fragment layout, shared with
# the wo_a twin's kernels
from sglang.kernels.ops.gemm.e4m3_to_bf16_sm90 import (
    dequant_block,
    row_bases,
    words_layout,
)

STEP_K = 128  # K per pipeline stage (4 scale blocks)
MAX_ROWS = 64
_SMEM_BYTES = (
    220 * 1024
)  # shared memory one CTA may take (227 KB per SM, less the barriers)

# wgmma N (x's rows padded to a power of two: TMA's box) -> (vocab rows per CTA, warps, pipeline
# stages at the TP4 shard, at the TP1 shard). Chosen on the H200
# (benchmark/results/archive/tune_draft_head_fp8_wgmma-NVIDIA_H200.json): at N = 64, 3 stages keep two
# CTAs per SM, which more stages or taller tiles lose. Past 64 rows the products' tensor time
# adds to the head's read instead of hiding under it, and no candidate beat cuBLAS bf16.
CONFIGS: dict[int, tuple[int, int, int, int]] = {
    8: (128, 4, 4, 3),
    16: (128, 4, 4, 3),
    32: (128, 4, 4, 3),
    64: (128, 4, 3, 3),
}


def available(device: torch.device) -> bool:
    """Hopper (SM90) only: wgmma and this kernel's TMA/mbarrier use."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def _scales_layout(bv: int, nw: int) -> gl.DistributedLinearLayout:
    """[bv, 4] fp32 scales of one step: each thread holds its rows' 4 blocks (16 bytes)."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [8, 0]] + row_bases(bv, nw),
        lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16 << i, 0] for i in range(nw.bit_length() - 1)],
        block_bases=[],
        shape=[bv, 4],
    )


_W_SMEM_LAYOUT = gl.NVMMASharedLayout(
    swizzle_byte_width=128, element_bitwidth=32, rank=2
)


@gluon.jit
def _refill(w_desc, x_desc, bar, w_s, x_s, s, v0, step, NBYTES: gl.constexpr):
    """Stage s <- the weights and x of one 128-K step, on the stage's mbarrier."""
    mbarrier.expect(bar, NBYTES)
    tma.async_copy_global_to_shared(w_desc, [v0, step * 32], bar, w_s.index(s))
    tma.async_copy_global_to_shared(x_desc, [0, step * 128], bar, x_s.index(2 * s))
    tma.async_copy_global_to_shared(
        x_desc, [0, step * 128 + 64], bar, x_s.index(2 * s + 1)
    )


@gluon.jit
def _draft_head_fp8_wgmma_kernel(
    w_desc,
    x_desc,
    S,
    OUT,
    M,
    V,
    SO,
    K: gl.constexpr,
    NP: gl.constexpr,
    BV: gl.constexpr,
    ST: gl.constexpr,
    W_L: gl.constexpr,
    S_L: gl.constexpr,
    NW: gl.constexpr,
):
    MMA: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, NP, 16]
    )
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    NSTEP: gl.constexpr = K // 128
    NBYTES: gl.constexpr = BV * 128 + NP * 128 * 2
    v0 = gl.program_id(0) * BV
    w_s = gl.allocate_shared_memory(gl.int32, [ST, BV, 32], w_desc.layout)
    x_s = gl.allocate_shared_memory(gl.bfloat16, [2 * ST, NP, 64], x_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [ST, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(ST):
        mbarrier.init(bars.index(s), count=1)
    fence_async_shared()
    for s in gl.static_range(ST - 1):
        _refill(w_desc, x_desc, bars.index(s), w_s, x_s, s, v0, s, NBYTES)
    # scales [N/32, K/32]: each thread loads its rows' 4 blocks of a step (the next step's early)
    sr = v0 + gl.arange(0, BV, layout=gl.SliceLayout(1, S_L))
    sk = gl.arange(0, 4, layout=gl.SliceLayout(0, S_L))
    s_off = gl.expand_dims((sr // 32) * (K // 32), 1) + gl.expand_dims(sk, 0)
    s_mask = gl.expand_dims(sr < V, 1) & gl.expand_dims(sk >= 0, 0)
    s_next = gl.load(S + s_off, s_mask, 1.0)
    acc = gl.zeros([BV, NP], gl.float32, layout=MMA)
    for i in range(NSTEP):
        st = i % ST
        s4 = s_next
        s_next = gl.load(S + s_off + gl.minimum(i + 1, NSTEP - 1) * 4, s_mask, 1.0)
        s02, s13 = gl.split(
            gl.reshape(s4, [BV, 2, 2])
        )  # split takes the last dim: blocks (0, 2), (1, 3)
        s0, s2 = gl.split(s02)
        s1, s3 = gl.split(s13)
        scales = (s0, s1, s2, s3)
        mbarrier.wait(bars.index(st), (i // ST) & 1)
        for kb in gl.static_range(4):
            w32 = w_s.index(st).slice(8 * kb, 8, dim=1).load(W_L)
            a = dequant_block(
                w32, gl.convert_layout(scales[kb], gl.SliceLayout(1, W_L)), A_L, BV
            )
            xb = x_s.index(2 * st + kb // 2).slice(32 * (kb % 2), 32, dim=1)
            acc = warpgroup_mma(a, xb.permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
        gl.thread_barrier()  # every warp is done with stage (i - 1) % ST: refill it
        nxt = i + ST - 1
        if nxt < NSTEP:
            sn = nxt % ST
            _refill(w_desc, x_desc, bars.index(sn), w_s, x_s, sn, v0, nxt, NBYTES)
    for s in gl.static_range(ST):
        mbarrier.invalidate(bars.index(s))
    orow = v0 + gl.arange(0, BV, layout=gl.SliceLayout(1, MMA))
    on = gl.arange(0, NP, layout=gl.SliceLayout(0, MMA))
    o_off = gl.expand_dims(on * SO, 0) + gl.expand_dims(orow, 1)
    o_mask = gl.expand_dims(on < M, 0) & gl.expand_dims(orow < V, 1)
    gl.store(OUT + o_off, acc.to(OUT.dtype.element_ty), o_mask)


def _weight_descriptor(qp: torch.Tensor, bv: int) -> TensorDescriptor:
    """Built once per head and tile height (the head is persistent; the cache lives on the tensor)."""
    key = f"_draft_head_fp8_wgmma_tma_{bv}"
    desc = qp.__dict__.get(key)
    if desc is None:
        desc = TensorDescriptor.from_tensor(
            qp.view(torch.int32), [bv, 32], _W_SMEM_LAYOUT
        )
        qp.__dict__[key] = desc
    return desc


def padded_rows(m: int) -> int:
    """wgmma N for ``m`` rows: a power of two from 8 (the bits do not depend on it)."""
    return max(8, triton.next_power_of_2(m))


def config(m: int, n: int) -> tuple[int, int, int, int]:
    """(wgmma N, vocab rows per CTA, warps, stages) for ``m`` rows of an ``n``-row head."""
    np_ = padded_rows(m)
    bv, nw, st_tp4, st_tp1 = CONFIGS[np_]
    st = st_tp4 if n <= 65536 else st_tp1
    stage_bytes = bv * STEP_K + np_ * STEP_K * 2
    return np_, bv, nw, max(2, min(st, _SMEM_BYTES // stage_bytes))


def draft_head_fp8_logits_wgmma(
    x: torch.Tensor,
    qp: torch.Tensor,
    scales: torch.Tensor,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
    cfg: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """logits [M, N] = x [M, K] (bf16) @ dequant(qp, scales)^T for 1 <= M <= MAX_ROWS (``qp``:
    ``permute_k`` of the e4m3 head); ``cfg`` overrides ``CONFIGS`` (tuning only)."""
    m, k = x.shape
    n = qp.shape[0]
    assert 1 <= m <= MAX_ROWS, f"{m} rows: the wgmma head serves 1..{MAX_ROWS}"
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
    np_, bv, nw, st = config(m, n)
    if cfg is not None:
        bv, nw, st = cfg
    assert bv % (16 * nw) == 0 and bv // (16 * nw) in (1, 2), (bv, nw)
    x_layout = gl.NVMMASharedLayout.get_default_for([np_, 64], gl.bfloat16)
    x_desc = TensorDescriptor.from_tensor(
        x, [np_, 64], x_layout
    )  # rows >= M read as zeros
    w_l, s_l = _layouts(bv, nw)
    _draft_head_fp8_wgmma_kernel[(triton.cdiv(n, bv),)](
        _weight_descriptor(qp, bv),
        x_desc,
        scales,
        out,
        m,
        n,
        out.stride(0),
        k,
        np_,
        bv,
        st,
        w_l,
        s_l,
        nw,
        num_warps=nw,
    )
    return out


@functools.cache
def _layouts(bv: int, nw: int):
    return words_layout(bv, nw), _scales_layout(bv, nw)
