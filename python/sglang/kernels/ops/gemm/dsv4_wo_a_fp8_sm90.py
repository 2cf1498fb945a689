"""WO-A (``einsum('tgd,grd->tgr')``) from the fp8 twin on Hopper, 2..8 rows: one Gluon kernel,
bitwise identical to upstream's ``wo_a_bf16_small_batch`` (and, through ``partials``, to its MXFP8
variant).

HOW (H200, benchmark/results/wo_a_fp8-NVIDIA_H200.json).
- Grid G * R / 8: one CTA per 8 weight rows of one group and all of K (256 CTAs at G = 2, 1024 at
  G = 8); 8 warps, warp s owns upstream's K split s (K 512 s .. 512 s + 511). No split-K across
  CTAs, so no second kernel and no reduction through L2 (the earlier Triton twin lost 1.9 us there).
- The twin is stored fragment-major (``pack_twin``): K permuted inside each 32-block and each
  warp's A fragment of one 32-K block contiguous, so each thread's 8 bytes of a block are one
  LDG.64 and a warp reads 256 contiguous bytes. All 16 loads per thread (the CTA's 32 KB) issue at
  entry; a CTA barrier sits between them and the first MMA, because ptxas otherwise sinks each
  load to its use (then 7 of 16 were in flight).
- x goes to shared memory by cp.async (rows past M are zero-filled without traffic), one group per
  128-K chunk, and comes back by ldmatrix. Loading x into registers with 4-byte loads made the
  time grow with M (5.7 us at M = 1, 8.4 us at M = 8), TMA for x cost 6.0-6.2 us flat.
- The e4m3 -> bf16 asm (exact, the power-of-two scale in one HMUL2) runs right before each MMA;
  swap-AB mma.sync m16n8k16 with the 8 weight rows as M (rows 8..15 zero) and <= 8 rows of x as N.
- 64 registers, 64 KB of shared memory: 3 CTAs per SM.
Measured against upstream in one run (43 layers, CUDA graph): G = 2, 2..8 rows 5.84-5.97 us
against 8.08-8.13 us for ``wo_a_bf16_small_batch`` (1.37-1.38x) and 8.9-9.0 us for einsum (what
Hopper runs for 2..8 rows in 0.5.23); a pure read of the twin's bytes takes 3.87 us, so the
kernel is at 1.51x of it, not yet at the 1.15x goal. G = 8: 15.1-15.3 us against einsum's
18.5-18.9 (1.22-1.24x; pure read 9.34 us). The MXFP8 epilogue (upstream's ``_quantize_partial`` on
these partials) 7.60-7.67 us against 8.23-8.32 us.

EXACT. Each warp's MMA chain is upstream's ``_wo_a_partial`` for its split: the same bf16 operand
values (the twin is exact), k_width 2 operands so every product sits in the same slot of the same
m16n8k16 (swap-AB does not change the bits), 32 MMAs per split from zero in K order. The partials
are then added as ``_wo_a_reduce``'s ``tl.sum`` adds them: its [8, 256] blocked layout keeps
splits (0, 2, 4, 6) in one thread and (1, 3, 5, 7) in another, summed in order, then the two
sums. Measured on the H200: 0 of 4096..16384 outputs differ from upstream at M = 2, 4, 8, the
partials are bit-identical, and so are the MXFP8 bytes and scales.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from sglang.kernels.ops.speculative.dspark.draft_head_fp8 import _E4M3X4_TO_BF16_ASM as _ASM
from sglang.kernels.ops.speculative.dspark.draft_head_fp8_wgmma import _bf16_pair, permute_k

N_SPLITS = 8  # upstream's split of K = 4096 into 8 x 512, one warp each
SPLITS = gl.constexpr(N_SPLITS)
ROWS = 8  # weight rows per CTA: the live half of the MMA's M = 16
D = 4096
DK = gl.constexpr(D)
MAX_ROWS = 8
# the dequantisation's bf16 scale word carries 2**112: 2**(e - 127 + 112) must stay finite
MAX_BIASED_EXP = 142

__all__ = ["available", "pack_twin", "wo_a_fp8_small_sm90"]


def available(device: torch.device) -> bool:
    """Hopper (SM90): this kernel's layouts are tuned and checked there."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def pack_twin(weight8: torch.Tensor) -> torch.Tensor:
    """e4m3 [G, R, 4096] -> int32 words in the kernel's fragment-major order
    [G, R/8, chunk 4, block 4, split 8, row 8, quad thread 4, word 2]: K permuted inside each
    32-block (``permute_k``) and each warp's A fragment of one 32-K block contiguous (256 B),
    so a thread loads its 8 bytes of one block with one LDG.64 and a warp reads whole lines."""
    g, r, d = weight8.shape
    assert d == D and r % ROWS == 0, (g, r, d)
    wp = permute_k(weight8.reshape(g * r, d)).view(torch.int32)
    return wp.view(g, r // 8, 8, 8, 4, 4, 4, 2).permute(0, 1, 4, 5, 3, 2, 6, 7).contiguous()


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
# x staged by cp.async: [split, 8 rows of x, 64 K] bf16 tiles, 16 B per thread and copy
_XC_LAYOUT = gl.BlockedLayout([1, 1, 8], [1, 4, 8], [8, 1, 1], [2, 1, 0])
_X_SMEM = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3)
_MMA = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[8, 1, 1], instr_shape=[1, 16, 8])
_P_SMEM = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
# [8, 8] fp32 (rows x x-rows) of one split's partial, one element per thread (4 warps)
_OUT_LAYOUT = gl.BlockedLayout(size_per_thread=[1, 1], threads_per_warp=[4, 8], warps_per_cta=[2, 4], order=[1, 0])


@gluon.jit
def _dequant(w32, sb, A_L: gl.constexpr):
    """[S, 8, 8] words of a K-permuted e4m3 32-block + per-split bf16x2 scale words -> the
    logical [S, 16, 32] bf16 A operand (rows 8..15 zero), the permutation undone by renaming."""
    sb = gl.expand_dims(gl.expand_dims(sb, 1), 2) + gl.zeros_like(w32)
    o0, o1 = gl.inline_asm_elementwise(_ASM, "=r,=r,r,r,r", [w32, sb, sb], dtype=(gl.int32, gl.int32),
                                       is_pure=True, pack=1)
    w = gl.join(_bf16_pair(o0), _bf16_pair(o1))  # [S, 8, 8 (2t + w), 2 (e), 2 (o)]: j = 2w + o
    w = gl.reshape(gl.permute(gl.reshape(w, [SPLITS, 8, 4, 2, 2, 2]), [0, 1, 3, 5, 2, 4]), [SPLITS, 8, 32])
    w = gl.permute(gl.join(w, gl.zeros_like(w)), [0, 3, 1, 2])  # [S, row + 8, 8, 32]
    return gl.convert_layout(gl.reshape(w, [SPLITS, 16, 32]), A_L)


@gluon.jit
def _wo_a_fp8_small_kernel(W, X, E, Y, P, M, SX, G: gl.constexpr, R: gl.constexpr,
                           PARTIALS: gl.constexpr, LD_L: gl.constexpr, X_L: gl.constexpr,
                           MMA: gl.constexpr, P_SMEM: gl.constexpr, OUT_L: gl.constexpr,
                           XC_L: gl.constexpr, X_SMEM: gl.constexpr):
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_L: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    NB: gl.constexpr = 16  # 32-K blocks per split
    pid = gl.program_id(0)
    group = pid // (R // 8)
    r0 = (pid % (R // 8)) * 8
    # every weight byte of the CTA first: 16 LDG.64 per thread, 32 KB per CTA in flight
    ls = gl.arange(0, SPLITS, layout=gl.SliceLayout(1, gl.SliceLayout(2, LD_L)))
    ll = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, LD_L)))
    lj = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, LD_L)))
    w_off = (gl.expand_dims(gl.expand_dims(ls * 64, 1), 2) + gl.expand_dims(gl.expand_dims(ll * 2, 0), 2)
             + gl.expand_dims(gl.expand_dims(lj, 0), 1))
    ws = ()
    for i in gl.static_range(NB):
        ws = ws + (gl.load(W + (pid * NB + i) * 512 + w_off),)
    # x by cp.async into shared memory (rows past M are zero-filled, no traffic), one group per
    # 128-K chunk, read back by ldmatrix in the B fragment layout
    x_s = gl.allocate_shared_memory(gl.bfloat16, [8, SPLITS, 8, 64], X_SMEM)
    cs = gl.arange(0, SPLITS, layout=gl.SliceLayout(1, gl.SliceLayout(2, XC_L)))
    ct = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, XC_L)))
    ck = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(1, XC_L)))
    c_off = (gl.expand_dims(gl.expand_dims(cs * 512 + group * DK, 1), 2)
             + gl.expand_dims(gl.expand_dims(ct * SX, 0), 2) + gl.expand_dims(gl.expand_dims(ck, 0), 1))
    c_mask = gl.expand_dims(gl.expand_dims(ct < M, 0), 2) & (c_off >= 0)
    for kc in gl.static_range(8):
        async_copy.async_copy_global_to_shared(x_s.index(kc), X + c_off + 64 * kc, c_mask)
        if kc % 2 == 1:
            async_copy.commit_group()
    # ptxas moves loads neither across a barrier nor the MMAs above the exponent loads they need:
    # so every weight load of the CTA issues before the first MMA waits for its bytes
    gl.thread_barrier()
    # biased exponents of this CTA's 32-row block: split s, 32-K block 16 s + i
    es = ()
    e_base = E + (group * (R // 32) + r0 // 32) * (DK // 32) + ls * NB
    for i in gl.static_range(NB):
        es = es + (gl.load(e_base + i).to(gl.int32),)
    acc = gl.zeros([SPLITS, 16, 8], gl.float32, layout=MMA)
    for i in gl.static_range(NB):
        if i % 4 == 0:
            async_copy.wait_group(3 - i // 4)
            gl.thread_barrier()
        xb = x_s.index(i // 2).slice(32 * (i % 2), 32, dim=2).load(X_L)
        w32 = gl.reshape(ws[i], [SPLITS, 8, 8])
        sb = (es[i] + 112) << 7  # bf16 bits of 2**(e - 127) * 2**112
        a = _dequant(w32, gl.convert_layout(sb | (sb << 16), gl.SliceLayout(1, gl.SliceLayout(2, w32.type.layout))), A_L)
        acc = mma_v2(a, gl.convert_layout(gl.permute(xb, (0, 2, 1)), B_L), acc)
    if PARTIALS:  # upstream's partial layout [8, M, G, R] for its MXFP8 epilogue
        ps = gl.arange(0, SPLITS, layout=gl.SliceLayout(1, gl.SliceLayout(2, MMA)))
        pr = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, MMA)))
        pt = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, MMA)))
        s3 = gl.expand_dims(gl.expand_dims(ps, 1), 2)
        r3 = gl.expand_dims(gl.expand_dims(pr, 0), 2)
        t3 = gl.expand_dims(gl.expand_dims(pt, 0), 1)
        off = ((s3 * M + t3) * G + group) * R + r0 + r3
        gl.store(P + off, acc, (t3 < M) & (r3 < 8) & (s3 >= 0))
    else:
        # the split partials meet in shared memory and are added as _wo_a_reduce's tl.sum adds them
        p_s = gl.allocate_shared_memory(gl.float32, [SPLITS * 16, 8], P_SMEM)
        p_s.store(gl.reshape(acc, [SPLITS * 16, 8]))
        gl.thread_barrier()
        even = p_s.slice(0, 8).load(OUT_L)
        odd = p_s.slice(16, 8).load(OUT_L)
        for s in gl.static_range(1, SPLITS // 2):
            even = even + p_s.slice(32 * s, 8).load(OUT_L)
            odd = odd + p_s.slice(32 * s + 16, 8).load(OUT_L)
        total = even + odd
        orow = gl.arange(0, 8, layout=gl.SliceLayout(1, OUT_L))
        otok = gl.arange(0, 8, layout=gl.SliceLayout(0, OUT_L))
        o_off = (gl.expand_dims(otok, 0) * G + group) * R + r0 + gl.expand_dims(orow, 1)
        gl.store(Y + o_off, total.to(gl.bfloat16), gl.expand_dims(otok < M, 0) & gl.expand_dims(orow >= 0, 1))


def wo_a_fp8_small_sm90(x: torch.Tensor, packed: torch.Tensor, exp: torch.Tensor,
                        partials: bool = False) -> torch.Tensor:
    """``einsum('tgd,grd->tgr', x, twin)`` for 1..8 rows from ``pack_twin``'s words: bf16
    [M, G, R], or with ``partials`` the fp32 split partials [8, M, G, R] of ``_wo_a_partial``."""
    m = x.shape[0]
    g, r = packed.shape[0], packed.shape[1] * ROWS
    assert 1 <= m <= MAX_ROWS and x.shape[1:] == (g, D) and x.dtype == torch.bfloat16
    assert x.stride(2) == 1 and x.stride(1) == D
    y = torch.empty((m, g, r), dtype=torch.bfloat16, device=x.device)
    p = torch.empty((N_SPLITS, m, g, r), dtype=torch.float32, device=x.device) if partials else y
    _wo_a_fp8_small_kernel[(g * r // ROWS,)](
        packed, x, exp, y, p, m, x.stride(0), g, r, partials, _LD_LAYOUT, _X_LAYOUT, _MMA, _P_SMEM,
        _OUT_LAYOUT, _XC_LAYOUT, _X_SMEM, num_warps=N_SPLITS,
    )
    return p if partials else y
