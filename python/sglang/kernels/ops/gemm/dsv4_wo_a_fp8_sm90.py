"""WO-A (``einsum('tgd,grd->tgr')``) from the fp8 twin on Hopper: two Gluon kernels reading
``pack_twin``'s words. ``wo_a_fp8_small_sm90`` is bitwise upstream's ``wo_a_bf16_small_batch``;
``wo_a_fp8_mid_sm90`` (wgmma) is within the fp32 bound of the exact result. How and why, with
figures: docs/wo-a-fp8-twin.md.

SMALL: EXACT. Each warp's MMA chain and the partials' reduction reproduce upstream's
``_wo_a_partial`` and ``_wo_a_reduce`` operand for operand and in order (what must not change:
docs/wo-a-fp8-twin.md; the GPU test compares every bit).

FORWARD PROGRESS (mid): each CTA of a tile spins until the tile's S split partials arrived, so
it relies on a tile's S CTAs being consecutive in the grid (split = pid % S) and on the block
scheduler's in-order dispatch (which CUB's decoupled look-back relies on too): at most one tile
per launch is partly resident while its CTAs wait, even with the target's and the draft's
launches side by side. Keep the grid one wave on an idle GPU and the split the fastest-varying
index.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from sglang.kernels.ops.gemm.e4m3_to_bf16 import permute_k
from sglang.kernels.ops.gemm.e4m3_to_bf16_sm90 import (
    bf16_pair,
    dequant_block,
    words_layout,
)

N_SPLITS = 8  # upstream's split of K = 4096 into 8 x 512, one warp each
SPLITS = gl.constexpr(N_SPLITS)
ROWS = 8  # packing unit: weight rows per fragment-major piece (the live half of the MMA's M = 16)
D = 4096
DK = gl.constexpr(D)
MAX_ROWS = 16  # rows of x one small-kernel call takes with x up front (8 per n8 tile of the MMA)
_SM_SMEM = 227 * 1024  # shared memory one SM gives its CTAs (H100 / H200)
MAX_RING_ROWS = (
    64  # with x in the ring (x up front would not fit shared memory): 8 n8 tiles
)

# The small kernel's e4m3 -> bf16 conversion (exact: the twin's scale is a power of two): each
# byte sign-extended into a 16-bit half by PRMT, shifted so that e4m3's exponent and mantissa land
# in bf16's low exponent bits and the sign copies between them are masked off (q * 2**-120; e4m3
# subnormals become bf16 subnormals, which the HMUL2 by 2**(e - 127 + 120) takes exactly): 4
# instructions per pair. (The mid kernel converts through f16, q * 2**-112: e4m3_to_bf16_sm90.)
PRMT_SCALE_BIAS = 120
_E4M3X4_TO_BF16_PRMT_ASM = gl.constexpr(
    """{
.reg .b32 t0, t1;
prmt.b32 t0, $2, 0, 0x9180;
prmt.b32 t1, $2, 0, 0xB3A2;
shl.b32 t0, t0, 4;
shl.b32 t1, t1, 4;
and.b32 t0, t0, 0x87F087F0;
and.b32 t1, t1, 0x87F087F0;
mul.rn.bf16x2 $0, t0, $3;
mul.rn.bf16x2 $1, t1, $4;
}"""
)


# Largest ue8m0 exponent the small kernel's bf16 scale word 2**(e - 127 + 120) can carry: 134.
MAX_BIASED_EXP = 254 - PRMT_SCALE_BIAS
_PRMT_BIAS = gl.constexpr(PRMT_SCALE_BIAS)

__all__ = [
    "available",
    "pack_twin",
    "small_config",
    "ring_fit",
    "wo_a_fp8_small_sm90",
    "wo_a_fp8_mid_sm90",
    "mid_counters",
]


def available(device: torch.device) -> bool:
    """Hopper (SM90): this kernel's layouts are tuned and checked there."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def pack_twin(weight8: torch.Tensor) -> torch.Tensor:
    """e4m3 [G, R, 4096] -> int32 words in the kernels' fragment-major order (``permute_k``)."""
    g, r, d = weight8.shape
    assert d == D and r % ROWS == 0, (g, r, d)
    wp = permute_k(weight8.reshape(g * r, d)).view(torch.int32)
    return (
        wp.view(g, r // 8, 8, 8, 4, 4, 4, 2)
        .permute(0, 1, 4, 5, 3, 2, 6, 7)
        .contiguous()
    )


# [SPLITS, 8 rows, 8 words] of one 32-K block as loaded: warp = split, lane = 4 row + t, 2 words
_LD_LAYOUT = gl.BlockedLayout([1, 1, 2], [1, 32, 1], [8, 1, 1], [2, 1, 0])
# [SPLITS, 8 rows of x, 32 K] bf16 as ldmatrix gives it: the m16n8k16 B fragment of two K steps
_X_LAYOUT = gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 1], [0, 0, 8], [0, 0, 16]],
    lane_bases=[[0, 0, 2], [0, 0, 4], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
    warp_bases=[[1, 0, 0], [2, 0, 0], [4, 0, 0]],
    block_bases=[],
    shape=[8, 8, 32],
)
# the same for 16 rows of x (two n8 tiles of the MMA): the candidate for 9..16 rows
_X16_LAYOUT = gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 1], [0, 0, 8], [0, 0, 16], [0, 8, 0]],
    lane_bases=[[0, 0, 2], [0, 0, 4], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
    warp_bases=[[1, 0, 0], [2, 0, 0], [4, 0, 0]],
    block_bases=[],
    shape=[8, 16, 32],
)
# the same for 32 rows of x (four n8 tiles; x in the ring only): the candidate for 17..32 rows
_X32_LAYOUT = gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 1], [0, 0, 8], [0, 0, 16], [0, 8, 0], [0, 16, 0]],
    lane_bases=[[0, 0, 2], [0, 0, 4], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
    warp_bases=[[1, 0, 0], [2, 0, 0], [4, 0, 0]],
    block_bases=[],
    shape=[8, 32, 32],
)
_X64_LAYOUT = gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 1], [0, 0, 8], [0, 0, 16], [0, 8, 0], [0, 16, 0], [0, 32, 0]],
    lane_bases=[[0, 0, 2], [0, 0, 4], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
    warp_bases=[[1, 0, 0], [2, 0, 0], [4, 0, 0]],
    block_bases=[],
    shape=[8, 64, 32],
)
_X_LAYOUTS = {8: _X_LAYOUT, 16: _X16_LAYOUT, 32: _X32_LAYOUT, 64: _X64_LAYOUT}
# x staged by cp.async: [split, 8 rows of x, 64 K] bf16 tiles, 16 B per thread and copy
_XC_LAYOUT = gl.BlockedLayout([1, 1, 8], [1, 4, 8], [8, 1, 1], [2, 1, 0])
_X_SMEM = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3)
# weights staged by cp.async (STAGE): [rows 0..7 / 8..15, 512 words] of one 32-K block, 16 B per
# thread and copy (a thread copies what two read), and one piece as read back: [1, 512] words,
# thread 32 s + lane holding the two words ``_LD_LAYOUT`` gives it
_WC_LAYOUT = gl.BlockedLayout([1, 4], [1, 32], [2, 4], [1, 0])
_WS_LAYOUT = gl.BlockedLayout([1, 2], [1, 32], [1, 8], [1, 0])
_W_SMEM = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
# x in the ring (x_ring): [split, rows of x, 32 K] of one block, 16 B per thread and copy
_XB_LAYOUT = gl.BlockedLayout([1, 1, 8], [1, 8, 4], [8, 1, 1], [2, 1, 0])
_XB_SMEM = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=3)
_MMA = gl.NVMMADistributedLayout(
    version=[2, 0], warps_per_cta=[8, 1, 1], instr_shape=[1, 16, 8]
)
_P_SMEM = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
# [8, 8] fp32 (rows x x-rows) of one split's partial, one element per thread (4 warps)
_OUT16_LAYOUT = gl.BlockedLayout(
    size_per_thread=[1, 1], threads_per_warp=[4, 8], warps_per_cta=[4, 2], order=[1, 0]
)


@gluon.jit
def _dequant(w32, sb):
    """Words of a K-permuted e4m3 32-block + scale words -> logical [S, 8, 32] bf16 rows."""
    sb = gl.expand_dims(gl.expand_dims(sb, 1), 2) + gl.zeros_like(w32)
    o0, o1 = gl.inline_asm_elementwise(
        _E4M3X4_TO_BF16_PRMT_ASM,
        "=r,=r,r,r,r",
        [w32, sb, sb],
        dtype=(gl.int32, gl.int32),
        is_pure=True,
        pack=1,
    )
    w = gl.join(
        bf16_pair(o0), bf16_pair(o1)
    )  # [S, 8, 8 (2t + w), 2 (e), 2 (o)]: j = 2w + o
    return gl.reshape(
        gl.permute(gl.reshape(w, [SPLITS, 8, 4, 2, 2, 2]), [0, 1, 3, 5, 2, 4]),
        [SPLITS, 8, 32],
    )


@gluon.jit
def _a_operand(lo, hi, A_L: gl.constexpr):
    """Rows 0..7 and 8..15 ([S, 8, 32] each) -> the [S, 16, 32] A operand of the m16n8k16."""
    w = gl.permute(gl.join(lo, hi), [0, 3, 1, 2])  # [S, row + 8, 8, 32]
    return gl.convert_layout(gl.reshape(w, [SPLITS, 16, 32]), A_L)


@gluon.jit
def _x_tiles(L: gl.constexpr, XN: gl.constexpr, KW: gl.constexpr, group, SX, M):
    """Offsets into x of its copy tiles and their mask (cp.async zero-fills rows past M)."""
    s = gl.arange(0, SPLITS, layout=gl.SliceLayout(1, gl.SliceLayout(2, L)))
    t = gl.arange(0, XN, layout=gl.SliceLayout(0, gl.SliceLayout(2, L)))
    k = gl.arange(0, KW, layout=gl.SliceLayout(0, gl.SliceLayout(1, L)))
    off = (
        gl.expand_dims(gl.expand_dims(s * 512 + group * DK, 1), 2)
        + gl.expand_dims(gl.expand_dims(t * SX, 0), 2)
        + gl.expand_dims(gl.expand_dims(k, 0), 1)
    )
    return off, gl.expand_dims(gl.expand_dims(t < M, 0), 2) & (off >= 0)


@gluon.jit
def _wo_a_fp8_small_kernel(
    W,
    X,
    E,
    Y,
    P,
    M,
    SX,
    G: gl.constexpr,
    R: gl.constexpr,
    PARTIALS: gl.constexpr,
    LD_L: gl.constexpr,
    X_L: gl.constexpr,
    MMA: gl.constexpr,
    P_SMEM: gl.constexpr,
    OUT_L: gl.constexpr,
    XC_L: gl.constexpr,
    X_SMEM: gl.constexpr,
    RB: gl.constexpr,
    XN: gl.constexpr,
    STAGE: gl.constexpr,
    WC_L: gl.constexpr,
    WS_L: gl.constexpr,
    W_SMEM: gl.constexpr,
    XRING: gl.constexpr,
    XB_L: gl.constexpr,
    XB_SMEM: gl.constexpr,
):
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_L: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    NB: gl.constexpr = 16  # 32-K blocks per split
    NPC: gl.constexpr = RB // 8  # fragment-major pieces of 8 weight rows per CTA
    NA: gl.constexpr = RB // 16  # A operands (m16) per block
    pid = gl.program_id(0)
    group = pid // (R // RB)
    r0 = (pid % (R // RB)) * RB
    ls = gl.arange(0, SPLITS, layout=gl.SliceLayout(1, gl.SliceLayout(2, LD_L)))
    # biased exponents of this CTA's 32-row block: split s, 32-K block 16 s + i
    es = ()
    e_base = E + (group * (R // 32) + r0 // 32) * (DK // 32) + ls * NB
    NBUF: gl.constexpr = (
        STAGE + 1 if STAGE < NB else NB
    )  # ring buffers (1 <= STAGE <= 16: the wrapper)
    # the exponents first: issued behind the CTA's 64 KB of weights they would arrive last
    for i in gl.static_range(NB):
        es = es + (gl.load(e_base + i).to(gl.int32),)
    gl.thread_barrier()  # ptxas would sink them
    # x by cp.async into shared memory (rows past M are zero-filled, no traffic), one group per
    # 128-K chunk, read back by ldmatrix in the B fragment layout
    x_s = ()  # one allocation per chunk: copies into slices of one buffer get a barrier each
    if not XRING:
        c_off, c_mask = _x_tiles(XC_L, XN, 64, group, SX, M)
        for kc in gl.static_range(8):
            x_s = x_s + (
                gl.allocate_shared_memory(gl.bfloat16, [SPLITS, XN, 64], X_SMEM),
            )
            async_copy.async_copy_global_to_shared(x_s[kc], X + c_off + 64 * kc, c_mask)
            if kc % 2 == 1:
                async_copy.commit_group()
    else:  # x's 32-K block i travels with the weights' block i, in their ring (less shared memory)
        b_off, b_mask = _x_tiles(XB_L, XN, 32, group, SX, M)
    # the weights by cp.async, 16 B per thread, one group per 32-K block (after x's 4, or
    # holding x's block under XRING): block i is waited for by cp.async.wait_group
    # (DEPBAR.LE, in order), not a shared scoreboard;
    # STAGE blocks in flight, in a ring of STAGE + 1 buffers (all 16 at once: no reuse)
    w_s = ()
    cp = gl.arange(0, NPC, layout=gl.SliceLayout(1, WC_L))
    cw = gl.arange(0, 512, layout=gl.SliceLayout(0, WC_L))
    cp_off = gl.expand_dims(cp * (NB * 512), 1) + gl.expand_dims(
        cw, 0
    )  # rows 0..7, 8..15, ..
    for j in gl.static_range(NBUF):
        w_s = w_s + (
            gl.allocate_shared_memory(gl.int32, [NPC, 512], W_SMEM),
        )  # one each, as for x
        if XRING:
            x_s = x_s + (
                gl.allocate_shared_memory(gl.bfloat16, [SPLITS, XN, 32], XB_SMEM),
            )
    for j in gl.static_range(STAGE):
        if XRING:
            async_copy.async_copy_global_to_shared(x_s[j], X + b_off + 32 * j, b_mask)
        async_copy.async_copy_global_to_shared(
            w_s[j], W + (pid * NPC * NB + j) * 512 + cp_off
        )
        async_copy.commit_group()
    accs = ()
    for h in gl.static_range(NA):
        accs = accs + (gl.zeros([SPLITS, 16, XN], gl.float32, layout=MMA),)
    for i in gl.static_range(NB):
        # x and blocks 0..i landed (Gluon adds the CTA barrier: every thread is past block i - 1)
        async_copy.wait_group(NB - 1 - i if STAGE == NB else STAGE - 1)
        if STAGE < NB:
            if i + STAGE < NB:  # into block i - 1's buffer
                if XRING:
                    async_copy.async_copy_global_to_shared(
                        x_s[(i + STAGE) % NBUF], X + b_off + 32 * (i + STAGE), b_mask
                    )
                async_copy.async_copy_global_to_shared(
                    w_s[(i + STAGE) % NBUF],
                    W + (pid * NPC * NB + i + STAGE) * 512 + cp_off,
                )
            async_copy.commit_group()  # possibly empty: keeps the wait count uniform
        wb = w_s[i % NBUF]
        wp = ()
        for q in gl.static_range(NPC):
            wp = wp + (
                gl.convert_layout(
                    gl.reshape(wb.slice(q, 1, dim=0).load(WS_L), [SPLITS, 32, 2]), LD_L
                ),
            )
        if XRING:
            xb = x_s[i % NBUF].load(X_L)
        else:
            xb = x_s[i // 2].slice(32 * (i % 2), 32, dim=2).load(X_L)
        w32 = gl.reshape(wp[0], [SPLITS, 8, 8])
        sb = (
            es[i] + _PRMT_BIAS
        ) << 7  # bf16 bits of 2**(e - 127) * 2**120, the conversion's offset
        sb = gl.convert_layout(
            sb | (sb << 16), gl.SliceLayout(1, gl.SliceLayout(2, w32.type.layout))
        )
        lo = _dequant(w32, sb)
        b = gl.convert_layout(gl.permute(xb, (0, 2, 1)), B_L)
        nxt = ()
        for h in gl.static_range(
            NA
        ):  # 32 rows: both A operands take the same B fragment of x
            if h > 0:
                lo = _dequant(gl.reshape(wp[2 * h], [SPLITS, 8, 8]), sb)
            a = _a_operand(
                lo, _dequant(gl.reshape(wp[2 * h + 1], [SPLITS, 8, 8]), sb), A_L
            )
            nxt = nxt + (mma_v2(a, b, accs[h]),)
        accs = nxt
    if PARTIALS:  # upstream's partial layout [8, M, G, R] for its MXFP8 epilogue
        ps = gl.arange(0, SPLITS, layout=gl.SliceLayout(1, gl.SliceLayout(2, MMA)))
        pr = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, MMA)))
        pt = gl.arange(0, XN, layout=gl.SliceLayout(0, gl.SliceLayout(1, MMA)))
        s3 = gl.expand_dims(gl.expand_dims(ps, 1), 2)
        r3 = gl.expand_dims(gl.expand_dims(pr, 0), 2)
        t3 = gl.expand_dims(gl.expand_dims(pt, 0), 1)
        for h in gl.static_range(NA):
            off = ((s3 * M + t3) * G + group) * R + r0 + 16 * h + r3
            gl.store(P + off, accs[h], (t3 < M) & (r3 < RB) & (s3 >= 0))
    else:
        # the split partials meet in shared memory and are added as _wo_a_reduce's tl.sum adds them
        p_s = gl.allocate_shared_memory(gl.float32, [NA * SPLITS * 16, XN], P_SMEM)
        for h in gl.static_range(NA):
            p_s.slice(h * SPLITS * 16, SPLITS * 16).store(
                gl.reshape(accs[h], [SPLITS * 16, XN])
            )
        gl.thread_barrier()
        otok = gl.arange(0, XN, layout=gl.SliceLayout(0, OUT_L))
        for h in gl.static_range(NA):
            even = p_s.slice(h * SPLITS * 16, 16).load(OUT_L)
            odd = p_s.slice(h * SPLITS * 16 + 16, 16).load(OUT_L)
            for s in gl.static_range(1, SPLITS // 2):
                even = even + p_s.slice(h * SPLITS * 16 + 32 * s, 16).load(OUT_L)
                odd = odd + p_s.slice(h * SPLITS * 16 + 32 * s + 16, 16).load(OUT_L)
            total = even + odd
            orow = gl.arange(0, 16, layout=gl.SliceLayout(1, OUT_L))
            o_off = (
                (gl.expand_dims(otok, 0) * G + group) * R
                + r0
                + 16 * h
                + gl.expand_dims(orow, 1)
            )
            gl.store(
                Y + o_off,
                total.to(gl.bfloat16),
                gl.expand_dims(otok < M, 0) & gl.expand_dims(orow >= 0, 1),
            )


def small_config(
    m: int, g: int, r: int, sms: int, rows_per_cta: int | None = None
) -> tuple[int, int, bool]:
    """(rows per CTA, stage, x_ring) for ``m`` rows: the fastest measured (docs/wo-a-fp8-twin.md)."""
    rows = rows_per_cta or (16 if g * r // 16 <= sms else 32)
    one_per_sm = g * r // rows <= sms
    if m <= 8:
        stage = (10 if rows == 16 else 8) if one_per_sm else 4
    else:
        stage = 6 if one_per_sm else 4
    return rows, min(stage, ring_fit(rows, m)), True


def _x_rows(m: int) -> int:
    """Rows of x the small kernel's tiles hold for ``m`` rows: 8 per n8 tile, a power of two."""
    return max(8, 1 << (m - 1).bit_length())


def ring_fit(rows_per_cta: int, m: int) -> int:
    """Most 32-K blocks in flight that shared memory holds with x in the ring."""
    return (_SM_SMEM - 1024) // (rows_per_cta * 256 + _x_rows(m) * 512) - 1


def wo_a_fp8_small_sm90(
    x: torch.Tensor,
    packed: torch.Tensor,
    exp: torch.Tensor,
    partials: bool = False,
    *,
    rows_per_cta: int | None = None,
    stage: int | None = None,
    x_ring: bool | None = None,
) -> torch.Tensor:
    """``einsum('tgd,grd->tgr', x, twin)`` for 1..64 rows: bf16 [M, G, R], or with ``partials``
    ``_wo_a_partial``'s; every configuration, the same bits (docs/wo-a-fp8-twin.md)."""
    m = x.shape[0]
    g, r = packed.shape[0], packed.shape[1] * ROWS
    assert (
        x.shape[1:] == (g, D)
        and x.dtype == torch.bfloat16
        and x.stride(2) == 1
        and x.stride(1) == D
    )
    if stage is None:
        rows_per_cta, stage, x_ring = small_config(
            m, g, r, _sm_count(x.device), rows_per_cta
        )
    rows_per_cta = rows_per_cta or 16
    assert 1 <= m <= (MAX_RING_ROWS if x_ring else MAX_ROWS), (m, x_ring)
    assert rows_per_cta in (16, 32) and r % rows_per_cta == 0, (rows_per_cta, r)
    xn = _x_rows(m)
    assert 1 <= stage <= 16, ("1..16 weight blocks in flight", stage)
    x_ring = bool(x_ring)
    assert not x_ring or 0 < stage < 16, ("x travels in the weights' ring", stage)
    y = torch.empty((m, g, r), dtype=torch.bfloat16, device=x.device)
    p = (
        torch.empty((N_SPLITS, m, g, r), dtype=torch.float32, device=x.device)
        if partials
        else y
    )
    _wo_a_fp8_small_kernel[(g * r // rows_per_cta,)](
        packed,
        x,
        exp,
        y,
        p,
        m,
        x.stride(0),
        g,
        r,
        partials,
        _LD_LAYOUT,
        _X_LAYOUTS[xn],
        _MMA,
        _P_SMEM,
        _OUT16_LAYOUT,
        _XC_LAYOUT,
        _X_SMEM,
        rows_per_cta,
        xn,
        stage,
        _WC_LAYOUT,
        _WS_LAYOUT,
        _W_SMEM,
        x_ring,
        _XB_LAYOUT,
        _XB_SMEM,
        num_warps=N_SPLITS,
    )
    return p if partials else y


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


# ---------------------------------------------------------------- mid rows (9..192): wgmma

MAX_SPLITS = gl.constexpr(16)  # K splits of the mid kernel: a power of two up to this


def mid_stages(
    g: int, r: int, split: int, np_: int, sms: int, bv: int = 64, ntiles: int = 1
) -> int:
    """Pipeline depth keeping every CTA resident at once (the split-K wait needs it), 2..8 steps."""
    ctas_per_sm = -(-(g * r // bv * split * ntiles) // sms)
    stage = 4 * bv * 8 * 4 + np_ * 128 * 2
    fit = (_SM_SMEM // ctas_per_sm - 1024) // stage
    return min(D // split // 128, 8, fit)


# (G, x's rows rounded up to a power of two NP) -> (K splits, rows of x per CTA): the best of the
# H200 sweeps (64 weight rows per CTA, as deep a pipeline as one wave allows;
# wo_a_fp8_mid_sweep- and wo_a_fp8_mid_tiles_probe-NVIDIA_H200.json). More CTAs win until x's
# share per split grows; past 64 rows, x's rows in tiles of 64 (128 at G = 8 and G = 4 past 128)
# with a CTA each beat one tile of NP.
_MID_TILES = {
    (2, 16): (16, 16),
    (2, 32): (8, 32),
    (2, 64): (8, 64),
    (2, 128): (4, 64),
    (2, 256): (4, 64),
    (4, 16): (16, 16),
    (4, 32): (8, 32),
    (4, 64): (8, 64),
    (4, 128): (4, 64),
    (4, 256): (1, 128),
    (8, 16): (8, 16),
    (8, 32): (4, 32),
    (8, 64): (4, 64),
    (8, 128): (1, 128),
    (8, 256): (1, 128),
}


def mid_config(
    m: int, g: int, r: int, sms: int = 132
) -> tuple[int, int, int, int, int]:
    """(weight rows per CTA, warps, K splits, rows of x per CTA, stages) for ``m`` rows, ``sms`` SMs."""
    full = max(16, 1 << (m - 1).bit_length())
    split, np_ = _MID_TILES.get((g, full), (None, full)) if r == 1024 else (None, full)
    if (
        split is None
    ):  # unmeasured shapes: ~512 CTAs up to 64 x rows, ~128 above (a power of two)
        split = 1 << (
            max(1, min(16, (512 if full <= 64 else 128) // (g * r // 64))).bit_length()
            - 1
        )
    nt = -(-m // np_)
    while split > 1 and mid_stages(g, r, split, np_, sms, 64, nt) < 2:
        split //= 2
    # one split and still more than one wave (no shape measured): 2 steps deep, no split-K wait
    return 64, 4, split, np_, max(2, mid_stages(g, r, split, np_, sms, 64, nt))


MAX_X_TILES = (
    16  # tiles of x's rows one mid launch may split them into (NP >= 16: 256 rows)
)


def mid_counters(g: int, r: int, device) -> torch.Tensor:
    """Arrival counters of one twin's split-K tiles (weight tile x tile of x's rows): each launch
    adds MAX_SPLITS per tile (MAX_SPLITS / S per CTA, whatever S the row count picks) and waits for
    the next multiple of it, so they are never reset (int64: no wrap)."""
    return torch.zeros(g * r // 64 * MAX_X_TILES, dtype=torch.int64, device=device)


@gluon.jit
def _mid_refill(
    W, w_off, x_desc, bar, w_s, x_s, st, kg, n0, xcol, XBYTES: gl.constexpr
):
    """Stage st <- 128-K step kg: weights by cp.async (256-byte pieces, no TMA box), x by TMA."""
    # packed [.., row group, chunk c, block b, split s, 64 words]: step kg = 4 s + c
    async_copy.async_copy_global_to_shared(
        w_s.index(st), W + w_off + (kg % 4) * 2048 + (kg // 4) * 64
    )
    mbarrier.expect(bar, XBYTES)
    tma.async_copy_global_to_shared(
        x_desc, [n0, xcol + kg * 128], bar, x_s.index(2 * st)
    )
    tma.async_copy_global_to_shared(
        x_desc, [n0, xcol + kg * 128 + 64], bar, x_s.index(2 * st + 1)
    )


@gluon.jit
def _wo_a_fp8_mid_kernel(
    W,
    x_desc,
    E,
    Y,
    P,
    C,
    M,
    NT,
    G: gl.constexpr,
    R: gl.constexpr,
    S: gl.constexpr,
    BV: gl.constexpr,
    NP: gl.constexpr,
    ST: gl.constexpr,
    NW: gl.constexpr,
    W_L: gl.constexpr,
    WC_L: gl.constexpr,
    W_SMEM: gl.constexpr,
    OUT_L: gl.constexpr,
    RED_L: gl.constexpr,
):
    MMA: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, NP, 16]
    )
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    KS: gl.constexpr = DK // S
    NSTEP: gl.constexpr = KS // 128
    XBYTES: gl.constexpr = NP * 128 * 2
    pid = gl.program_id(0)
    split = pid % S
    xt = (pid // S) % NT  # the tile of x's rows, NP of them from n0
    tile = pid // S // NT
    n0 = xt * NP
    group = tile // (R // BV)
    r0 = (tile % (R // BV)) * BV
    kg0 = split * NSTEP
    w_s = gl.allocate_shared_memory(
        gl.int32, [ST, 4 * BV, 8], W_SMEM
    )  # [block b, row] x word
    x_s = gl.allocate_shared_memory(gl.bfloat16, [2 * ST, NP, 64], x_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [ST, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(ST):
        mbarrier.init(bars.index(s), count=1)
    fence_async_shared()
    # cp.async sources of one step: [block b x row, word] of this CTA's rows (16 B per copy)
    cq = gl.arange(0, 4 * BV, layout=gl.SliceLayout(1, WC_L))
    cw = gl.arange(0, 8, layout=gl.SliceLayout(0, WC_L))
    cr = cq % BV
    w_off = gl.expand_dims(
        (cq // BV) * 512 + ((group * R + r0) // 8 + cr // 8) * 8192 + (cr % 8) * 8, 1
    ) + gl.expand_dims(cw, 0)
    xcol = group * DK
    for j in gl.static_range(ST - 1):
        if j < NSTEP:
            _mid_refill(
                W, w_off, x_desc, bars.index(j), w_s, x_s, j, kg0 + j, n0, xcol, XBYTES
            )
        async_copy.commit_group()
    # biased exponents of this thread's rows: block (row // 32, k // 32)
    rows = r0 + gl.arange(0, BV, layout=gl.SliceLayout(1, W_L))
    e_base = E + (group * (R // 32) + rows // 32) * (DK // 32) + kg0 * 4
    acc = gl.zeros([BV, NP], gl.float32, layout=MMA)
    for i in range(NSTEP):
        st = i % ST
        es = (
            gl.load(e_base + 4 * i),
            gl.load(e_base + 4 * i + 1),
            gl.load(e_base + 4 * i + 2),
            gl.load(e_base + 4 * i + 3),
        )
        async_copy.wait_group(ST - 2)
        mbarrier.wait(bars.index(st), (i // ST) & 1)
        gl.thread_barrier()  # every thread's weight copies landed; every warp is done with step i - 1
        nxt = i + ST - 1
        if nxt < NSTEP:
            sn = nxt % ST
            _mid_refill(
                W,
                w_off,
                x_desc,
                bars.index(sn),
                w_s,
                x_s,
                sn,
                kg0 + nxt,
                n0,
                xcol,
                XBYTES,
            )
        async_copy.commit_group()  # possibly empty: keeps the wait count above uniform
        for kb in gl.static_range(4):
            w32 = w_s.index(st).slice(kb * BV, BV, dim=0).load(W_L)
            sc = (es[kb].to(gl.int32) << 23).to(gl.float32, bitcast=True)
            a = dequant_block(w32, sc, A_L, BV)
            xb = x_s.index(2 * st + kb // 2).slice(32 * (kb % 2), 32, dim=1)
            acc = warpgroup_mma(a, xb.permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    for s in gl.static_range(ST):
        mbarrier.invalidate(bars.index(s))
    orow = gl.arange(0, BV, layout=gl.SliceLayout(1, OUT_L))
    otok = n0 + gl.arange(0, NP, layout=gl.SliceLayout(0, OUT_L))
    y_off = (gl.expand_dims(otok, 0) * G + group) * R + r0 + gl.expand_dims(orow, 1)
    y_mask = gl.expand_dims(otok < M, 0) & gl.expand_dims(orow >= 0, 1)
    if S == 1:
        gl.store(Y + y_off, gl.convert_layout(acc.to(gl.bfloat16), OUT_L), y_mask)
    else:
        # split-K: every CTA stores its partial and waits for the S CTAs of its tile (one wave, all
        # resident), then adds its RC rows of the S partials in split order 0..S-1 (every CTA
        # shares the adding; one last CTA adding the whole tile is slower).
        prow = gl.arange(0, BV, layout=gl.SliceLayout(1, MMA))
        pcol = gl.arange(0, NP, layout=gl.SliceLayout(0, MMA))
        p_off = gl.expand_dims(prow * NP, 1) + gl.expand_dims(pcol, 0)
        pt = tile * NT + xt  # the split-K tile: weight tile x tile of x's rows
        gl.store(P + (pt * S + split) * (BV * NP) + p_off, acc)
        gl.thread_barrier()
        # each launch adds MAX_SPLITS per tile whatever its S, so a launch starts at a multiple of it
        arrived = gl.atomic_add(C + pt, MAX_SPLITS // S, sem="acq_rel", scope="gpu")
        target = (arrived // MAX_SPLITS + 1) * MAX_SPLITS
        seen = arrived + MAX_SPLITS // S
        while seen < target:
            seen = gl.atomic_add(C + pt, 0, sem="acquire", scope="gpu")
        gl.thread_barrier()
        RC: gl.constexpr = BV // S
        rr = gl.arange(0, RC, layout=gl.SliceLayout(1, RED_L))
        rc = gl.arange(0, NP, layout=gl.SliceLayout(0, RED_L))
        r_off = gl.expand_dims((split * RC + rr) * NP, 1) + gl.expand_dims(rc, 0)
        total = gl.load(P + pt * S * (BV * NP) + r_off, cache_modifier=".cg")
        for s in gl.static_range(1, S):
            total += gl.load(P + (pt * S + s) * (BV * NP) + r_off, cache_modifier=".cg")
        y2 = (
            ((n0 + gl.expand_dims(rc, 0)) * G + group) * R
            + r0
            + split * RC
            + gl.expand_dims(rr, 1)
        )
        gl.store(
            Y + y2,
            total.to(gl.bfloat16),
            gl.expand_dims(n0 + rc < M, 0) & gl.expand_dims(rr >= 0, 1),
        )


@functools.cache
def _mid_layouts(bv: int, nw: int, np_: int):
    wc = gl.BlockedLayout([1, 4], [16, 2], [nw, 1], [1, 0])
    w_smem = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    out = gl.BlockedLayout([2, 1], [32, 1], [1, nw], [0, 1])
    tn = min(32, np_ // 4)
    red = gl.BlockedLayout(
        [1, 4], [32 // tn, tn], [nw, 1], [1, 0]
    )  # 16-byte loads of a partial's rows
    return words_layout(bv, nw), wc, w_smem, out, red


def wo_a_fp8_mid_sm90(
    x: torch.Tensor,
    packed: torch.Tensor,
    exp: torch.Tensor,
    counters: torch.Tensor,
    cfg: tuple | None = None,
) -> torch.Tensor:
    """``einsum('tgd,grd->tgr', x, twin)`` for 9..192 rows; ``counters`` never shared by streams."""
    m = x.shape[0]
    g, r = packed.shape[0], packed.shape[1] * ROWS
    assert 1 <= m <= 256 and x.shape[1:] == (g, D) and x.dtype == torch.bfloat16
    assert x.stride(2) == 1 and x.stride(1) == D
    bv, nw, split, np_, st = cfg or mid_config(m, g, r, _sm_count(x.device))
    nt = -(-m // np_)  # tiles of x's rows
    assert nt <= MAX_X_TILES and r % bv == 0 and counters.dtype == torch.int64
    assert counters.numel() >= g * r // bv * nt, "counters: mid_counters of this twin"
    assert split in (1, 2, 4, 8, 16) and bv % split == 0 and st >= 2, (split, st)
    if x.data_ptr() % 16 or x.stride(0) % 8:
        x = x.clone()  # TMA reads x: 16-byte aligned rows
    x2 = x.as_strided((m, g * D), (x.stride(0), 1))
    x_desc = TensorDescriptor.from_tensor(
        x2, [np_, 64], gl.NVMMASharedLayout.get_default_for([np_, 64], gl.bfloat16)
    )
    y = torch.empty((m, g, r), dtype=torch.bfloat16, device=x.device)
    p = torch.empty(
        g * r * split * np_ * nt if split > 1 else 1,
        dtype=torch.float32,
        device=x.device,
    )
    _wo_a_fp8_mid_kernel[(g * r // bv * nt * split,)](
        packed,
        x_desc,
        exp,
        y,
        p,
        counters,
        m,
        nt,
        g,
        r,
        split,
        bv,
        np_,
        st,
        nw,
        *_mid_layouts(bv, nw, np_),
        num_warps=nw,
    )
    return y
