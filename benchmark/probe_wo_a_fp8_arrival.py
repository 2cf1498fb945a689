"""Probe (not a fork kernel): does the small wo_a twin kernel wait for its bytes or for its own
arithmetic, and does consuming the weights in arrival order help? G = 2 / 4 / 8, 43 layers, CUDA
graph, bits checked against the served kernel.

The served kernel as it was (stage 0: 32 LDG.64 per thread issued at entry) spent 5.2 us at G = 2
where its own loads alone take 3.8 us (``read64``; ``read128``: the same as LDG.128): its 32 loads
share ptxas's 6 scoreboards (decoded from the sm_90 SASS) and the first scale waited on the one
that held 28 of them, so all of the arithmetic ran after the bytes arrived. Variants:
  served_stageN[_xring]  the served kernel with N blocks of 32 K in flight through shared memory
                 by cp.async, waited for in order (N = 16: all at once; else a ring of N + 1;
                 _xring: x's blocks in that ring too, else all of x up front)
  copy           this file's copy of the stage-0 kernel (VAR 0; same time and bits)
  l2_weights     stage 0, every CTA reading the first two CTAs' weights (L2-resident)
  cp16_inorder   staged, from a repacked twin so each thread copies exactly what it reads
  ldg128         LDG.128 from that repacked twin (16 loads per thread) and the exponents first
  exps_first     stage 0 with the exponents loaded first
  cp16_packed    staged (16) from the served packing: this file's copy of served_stage16
  tma            the weights by TMA, two 2 KB boxes per block on the block's mbarrier
  staged_l2_weights / staged_one_wait / staged_no_reduction   cp16_packed from L2-resident
                 weights / waiting for every byte before any arithmetic / without the partials'
                 reduction (not the result): where the staged kernel's time goes
Result (wo_a_fp8_arrival_probe-NVIDIA_H200.json, the same run as wo_a_fp8-NVIDIA_H200.json):
staging pays. G = 2: 5.19-5.27 us in registers, 4.82-4.87 with 16 in flight, 4.50-4.73 with 8
and x in the ring (served); G = 4 7.42-7.59 -> 6.57-6.71 and G = 8 12.66-12.92 -> 11.38-11.46 with
8 and x up front (served; x in the ring is faster there at 2 rows, slower at 8; 16 in flight
leaves one CTA per SM: 8.4 / 14.0 us); 9..16 rows 6 in flight with x in the ring. 4 in flight
is slower (5.4 us at G = 2). Registers by LDG.128 or the exponents first change nothing (5.3
us); TMA is slower (5.1 us at G = 2, 16.1 at G = 8: Gluon puts a CTA barrier before each of the
32 copies). Where the staged kernel's time goes at G = 2: 5.45-5.56 us waiting for every byte
first, 3.37-3.52 from L2-resident weights, 4.76-4.79 without the reduction: the arithmetic fits
under a read but runs in K order (upstream's MMA chain) while a CTA's blocks arrive spread
over the whole read. A second run at G = 2 (FORK_PROBE_QUICK=1, 0.5.23+fork.7.fb95f94,
wo_a_fp8_arrival_probe_g2_depths-NVIDIA_H200.json): 10, 12 or 15 in flight with x in the ring
4.46-4.82 us against 4.58-4.71 with 8, within the runs' spread, so 8 stays.
Run: TESTS=none BENCH=probe_wo_a_fp8_arrival.py bash build/gpu-bundle/run.sh DIR (FORK_PROBE_QUICK=1: G = 2, the served kernel's stages only)
"""
from __future__ import annotations

import os

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from sglang.kernels.ops.gemm import dsv4_wo_a_fp8_sm90 as sm90
from sglang.kernels.ops.gemm.dsv4_wo_a_fp8_sm90 import SPLITS, DK, _a_operand, _dequant
from sglang.kernels.ops.gemm.e4m3_to_bf16_sm90 import bf16_pair

_L4 = gl.BlockedLayout([1, 1, 4], [1, 32, 1], [8, 1, 1], [2, 1, 0])  # [split, lane, 4 words]: 16 B per thread
_E_L = gl.BlockedLayout([1, 4], [32, 1], [8, 1], [1, 0])  # [split, 4 words]: a warp's 16 exponent bytes
_W4_SMEM = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[2, 1, 0])
# [lo/hi piece, split, lane, word] of one block as copied: 16 B (two lanes' words) per thread
_CP_L = gl.BlockedLayout([1, 4], [1, 32], [2, 4], [1, 0])  # [lo/hi piece, 512 words]
_W8_SMEM = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
_R_L = gl.BlockedLayout([1, 2], [1, 32], [1, 8], [1, 0])  # [1, 512] words of a piece as read: thread 32 s + lane
# [2, 256] words of one TMA box (a 2 KB piece) as read back: warp s owns words 64 s .. 64 s + 63
_T_L = gl.BlockedLayout([1, 2], [1, 32], [2, 4], [1, 0])
_T_SMEM = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
VARIANTS = {"copy": 0, "l2_weights": 2, "cp16_inorder": 3, "ldg128": 4, "exps_first": 5, "read128": 6,
            "read64": 7, "cp16_packed": 8, "tma": 9, "staged_l2_weights": 10, "staged_one_wait": 11,
            "staged_no_reduction": 12}


def pack16(packed: torch.Tensor) -> torch.Tensor:
    """``pack_twin`` words with each thread's rows 0..7 and 8..15 of a block adjacent (16 B):
    [G, R/16, chunk 4, block 4, split 8, row 8, quad 4, half 2, word 2]."""
    g, r8 = packed.shape[:2]
    return packed.view(g, r8 // 2, 2, 4, 4, 8, 8, 4, 2).permute(0, 1, 3, 4, 5, 6, 7, 2, 8).contiguous()


@gluon.jit
def _split_halves(w4):
    """[S, 32, 4] words (lo word 0, 1, hi word 0, 1) -> rows 0..7 and 8..15 as [S, 8, 8] each."""
    w = gl.permute(gl.reshape(w4, [SPLITS, 32, 2, 2]), [0, 1, 3, 2])  # [S, lane, word, half]
    lo, hi = gl.split(w)
    return gl.reshape(lo, [SPLITS, 8, 8]), gl.reshape(hi, [SPLITS, 8, 8])


@gluon.jit
def _dequant_full(w32, sb):
    """``_dequant`` (PRMT) with the scale word given per word of ``w32`` ([S, 8, 8])."""
    o0, o1 = gl.inline_asm_elementwise(sm90._E4M3X4_TO_BF16_PRMT_ASM, "=r,=r,r,r,r", [w32, sb, sb],
                                       dtype=(gl.int32, gl.int32), is_pure=True, pack=1)
    w = gl.join(bf16_pair(o0), bf16_pair(o1))
    return gl.reshape(gl.permute(gl.reshape(w, [SPLITS, 8, 4, 2, 2, 2]), [0, 1, 3, 5, 2, 4]), [SPLITS, 8, 32])


@gluon.jit
def _read_kernel(W, O, LD_L: gl.constexpr, L4: gl.constexpr, WIDE: gl.constexpr):
    """The small kernel's weight loads alone (LDG.128 from ``pack16`` or 2 x LDG.64), XOR-folded."""
    pid = gl.program_id(0)
    if WIDE:
        qs = gl.arange(0, SPLITS, layout=gl.SliceLayout(1, gl.SliceLayout(2, L4)))
        ql = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, L4)))
        qj = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, L4)))
        off = (gl.expand_dims(gl.expand_dims(qs * 128, 1), 2) + gl.expand_dims(gl.expand_dims(ql * 4, 0), 2)
               + gl.expand_dims(gl.expand_dims(qj, 0), 1))
        ws = ()
        for i in gl.static_range(16):
            ws = ws + (gl.load(W + (pid * 16 + i) * 1024 + off),)
    else:
        ls = gl.arange(0, SPLITS, layout=gl.SliceLayout(1, gl.SliceLayout(2, LD_L)))
        ll = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, LD_L)))
        lj = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, LD_L)))
        off = (gl.expand_dims(gl.expand_dims(ls * 64, 1), 2) + gl.expand_dims(gl.expand_dims(ll * 2, 0), 2)
               + gl.expand_dims(gl.expand_dims(lj, 0), 1))
        ws = ()
        for i in gl.static_range(32):
            ws = ws + (gl.load(W + (pid * 32 + i) * 512 + off),)
    gl.thread_barrier()  # every load issued before the first use (ptxas sinks them otherwise)
    k = gl.load(O + pid * 1024 + off)  # after the barrier: no use of a weight word moves above it
    fold = ws[0] * k
    for i in gl.static_range(1, len(ws)):
        fold = (fold + ws[i]) * k
    gl.store(O + pid * 1024 + off, fold)


@gluon.jit
def _probe_kernel(W, W_DESC, X, E, Y, O, M, SX, G: gl.constexpr, R: gl.constexpr, LD_L: gl.constexpr,
                  X_L: gl.constexpr, MMA: gl.constexpr, P_SMEM: gl.constexpr, OUT_L: gl.constexpr,
                  XC_L: gl.constexpr, X_SMEM: gl.constexpr, L4: gl.constexpr, E_L: gl.constexpr,
                  W4_SMEM: gl.constexpr, CP_L: gl.constexpr, W8_SMEM: gl.constexpr, T_L: gl.constexpr, R_L: gl.constexpr,
                  BIAS: gl.constexpr, VAR: gl.constexpr):
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_L: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    NB: gl.constexpr = 16
    RB: gl.constexpr = 16
    XN: gl.constexpr = 8
    pid = gl.program_id(0)
    group = pid // (R // RB)
    r0 = (pid % (R // RB)) * RB
    wpid = pid % 2 if VAR == 2 else pid
    ls = gl.arange(0, SPLITS, layout=gl.SliceLayout(1, gl.SliceLayout(2, LD_L)))
    ll = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, LD_L)))
    lj = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, LD_L)))
    w_off = (gl.expand_dims(gl.expand_dims(ls * 64, 1), 2) + gl.expand_dims(gl.expand_dims(ll * 2, 0), 2)
             + gl.expand_dims(gl.expand_dims(lj, 0), 1))
    qs = gl.arange(0, SPLITS, layout=gl.SliceLayout(1, gl.SliceLayout(2, L4)))
    ql = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, L4)))
    qj = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, L4)))
    q_off = (gl.expand_dims(gl.expand_dims(qs * 128, 1), 2) + gl.expand_dims(gl.expand_dims(ql * 4, 0), 2)
             + gl.expand_dims(gl.expand_dims(qj, 0), 1))
    e_base = E + (group * (R // 32) + r0 // 32) * (DK // 32) + ls * NB
    ew = ()
    if VAR >= 3 and VAR != 6 and VAR != 7:  # the exponents first, one LDG.128 per thread (a warp's 16 bytes, E as int32 words)
        e4 = gl.load(E.to(gl.pointer_type(gl.int32), bitcast=True)
                     + ((group * (R // 32) + r0 // 32) * (DK // 32)) // 4 + (q_off // 128) * 4 + (q_off % 4))
        a, b = gl.split(gl.reshape(e4, [SPLITS, 32, 2, 2]))  # words 2a + 0, 2a + 1
        w0, w2 = gl.split(a)
        w1, w3 = gl.split(b)
        ew = (w0, w1, w2, w3)
        gl.thread_barrier()  # ptxas would sink it below the weights, behind 64 KB of them
    ws = ()
    wh = ()
    if VAR <= 2 or VAR == 5 or VAR == 7:
        for i in gl.static_range(NB):
            ws = ws + (gl.load(W + (wpid * 2 * NB + i) * 512 + w_off),)
            wh = wh + (gl.load(W + (wpid * 2 * NB + NB + i) * 512 + w_off),)
    if VAR == 4 or VAR == 6:
        for i in gl.static_range(NB):
            ws = ws + (gl.load(W + (pid * NB + i) * 1024 + q_off),)
    x_s = ()
    cs = gl.arange(0, SPLITS, layout=gl.SliceLayout(1, gl.SliceLayout(2, XC_L)))
    ct = gl.arange(0, XN, layout=gl.SliceLayout(0, gl.SliceLayout(2, XC_L)))
    ck = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(1, XC_L)))
    c_off = (gl.expand_dims(gl.expand_dims(cs * 512 + group * DK, 1), 2)
             + gl.expand_dims(gl.expand_dims(ct * SX, 0), 2) + gl.expand_dims(gl.expand_dims(ck, 0), 1))
    c_mask = gl.expand_dims(gl.expand_dims(ct < M, 0), 2) & (c_off >= 0)
    for kc in gl.static_range(8):
        x_s = x_s + (gl.allocate_shared_memory(gl.bfloat16, [SPLITS, XN, 64], X_SMEM),)
        async_copy.async_copy_global_to_shared(x_s[kc], X + c_off + 64 * kc, c_mask)
        if kc % 2 == 1:
            async_copy.commit_group()
    w_s = ()
    if VAR == 8 or VAR >= 10:  # pack_twin's words by cp.async, 16 B per thread: a thread copies what two threads read
        ps = gl.arange(0, 2, layout=gl.SliceLayout(1, CP_L))
        pw = gl.arange(0, 512, layout=gl.SliceLayout(0, CP_L))
        p_off = gl.expand_dims(ps * (NB * 512), 1) + gl.expand_dims(pw, 0)
        for i in gl.static_range(NB):
            buf = gl.allocate_shared_memory(gl.int32, [2, 512], W8_SMEM)
            async_copy.async_copy_global_to_shared(buf, W + ((pid % 2 if VAR == 10 else pid) * 2 * NB + i) * 512 + p_off)
            async_copy.commit_group()
            w_s = w_s + (buf,)
    bars = ()
    if VAR == 9:  # pack_twin's words by TMA: two 2 KB boxes per block on the block's mbarrier
        for i in gl.static_range(NB):
            bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            mbarrier.init(bar, count=1)
            bars = bars + (bar,)
        fence_async_shared()
        for i in gl.static_range(NB):
            lo_s = gl.allocate_shared_memory(gl.int32, [2, 256], W_DESC.layout)
            hi_s = gl.allocate_shared_memory(gl.int32, [2, 256], W_DESC.layout)
            mbarrier.expect(bars[i], 4096)
            tma.async_copy_global_to_shared(W_DESC, [(pid * 2 * NB + i) * 2, 0], bars[i], lo_s)
            tma.async_copy_global_to_shared(W_DESC, [(pid * 2 * NB + NB + i) * 2, 0], bars[i], hi_s)
            w_s = w_s + (lo_s, hi_s)
    if VAR == 3:  # one allocation and one copy group per block, after x's 4 groups
        for i in gl.static_range(NB):
            buf = gl.allocate_shared_memory(gl.int32, [SPLITS, 32, 4], W4_SMEM)
            async_copy.async_copy_global_to_shared(buf, W + (pid * NB + i) * 1024 + q_off)
            async_copy.commit_group()
            w_s = w_s + (buf,)
    elif VAR != 8 and VAR != 9 and VAR < 10:
        gl.thread_barrier()
    es = ()
    if VAR <= 2:
        for i in gl.static_range(NB):
            es = es + (gl.load(e_base + i).to(gl.int32),)
    if VAR == 1:
        fold = gl.zeros([SPLITS, 32, 2], gl.int32, layout=LD_L)
        for i in gl.static_range(NB):
            fold = fold ^ ws[i] ^ wh[i] ^ gl.expand_dims(gl.expand_dims(es[i], 1), 2)
        async_copy.wait_group(0)
        gl.thread_barrier()
        for kc in gl.static_range(8):
            xv = x_s[kc].load(XC_L).to(gl.int16, bitcast=True).to(gl.int32)
            fold = fold ^ gl.sum(gl.sum(gl.sum(xv, 2), 1), 0)
        gl.store(O + pid * 512 + w_off, fold)
    else:
        acc = gl.zeros([SPLITS, 16, XN], gl.float32, layout=MMA)
        for i in gl.static_range(NB):
            if VAR == 3:
                async_copy.wait_group(NB - 1 - i)
                lo32, hi32 = _split_halves(w_s[i].load(L4))
            elif VAR == 8 or VAR >= 10:
                if VAR != 11:
                    async_copy.wait_group(NB - 1 - i)
                elif i == 0:  # every byte first, then all of the arithmetic
                    async_copy.wait_group(0)
                lo32 = gl.reshape(gl.convert_layout(gl.reshape(w_s[i].slice(0, 1, dim=0).load(R_L), [SPLITS, 32, 2]), LD_L), [SPLITS, 8, 8])
                hi32 = gl.reshape(gl.convert_layout(gl.reshape(w_s[i].slice(1, 1, dim=0).load(R_L), [SPLITS, 32, 2]), LD_L), [SPLITS, 8, 8])
            elif VAR == 9:
                if i % 4 == 0:
                    async_copy.wait_group(3 - i // 4)
                    gl.thread_barrier()
                mbarrier.wait(bars[i], 0)
                lo32 = gl.reshape(gl.convert_layout(gl.reshape(w_s[2 * i].load(T_L), [SPLITS, 32, 2]), LD_L), [SPLITS, 8, 8])
                hi32 = gl.reshape(gl.convert_layout(gl.reshape(w_s[2 * i + 1].load(T_L), [SPLITS, 32, 2]), LD_L), [SPLITS, 8, 8])
            else:
                if i % 4 == 0:
                    async_copy.wait_group(3 - i // 4)
                    gl.thread_barrier()
                if VAR == 4:
                    lo32, hi32 = _split_halves(ws[i])
                elif VAR == 5:
                    lo32 = gl.reshape(ws[i], [SPLITS, 8, 8])
                    hi32 = gl.reshape(wh[i], [SPLITS, 8, 8])
                else:
                    lo32 = gl.reshape(ws[i], [SPLITS, 8, 8])
                    hi32 = gl.reshape(wh[i], [SPLITS, 8, 8])
            xb = x_s[i // 2].slice(32 * (i % 2), 32, dim=2).load(X_L)
            if VAR >= 3:  # the scale word of every (split, lane), then as the halves' words
                sb = (((ew[i // 4] >> (8 * (i % 4))) & 255) + BIAS) << 7
                sb = gl.reshape(gl.join(sb | (sb << 16), sb | (sb << 16)), [SPLITS, 8, 8])
                sb = gl.convert_layout(sb, lo32.type.layout)
                a = _a_operand(_dequant_full(lo32, sb), _dequant_full(hi32, sb), A_L)
            else:
                sb = (es[i] + BIAS) << 7
                sb = gl.convert_layout(sb | (sb << 16), gl.SliceLayout(1, gl.SliceLayout(2, lo32.type.layout)))
                a = _a_operand(_dequant(lo32, sb, 1), _dequant(hi32, sb, 1), A_L)
            acc = mma_v2(a, gl.convert_layout(gl.permute(xb, (0, 2, 1)), B_L), acc)
        if VAR == 12:  # the split partials stored as they are, no reduction (not the result)
            ps = gl.arange(0, SPLITS, layout=gl.SliceLayout(1, gl.SliceLayout(2, MMA)))
            pr = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, MMA)))
            pt = gl.arange(0, XN, layout=gl.SliceLayout(0, gl.SliceLayout(1, MMA)))
            off = (gl.expand_dims(gl.expand_dims(ps * 128, 1), 2) + gl.expand_dims(gl.expand_dims(pr * 8, 0), 2)
                   + gl.expand_dims(gl.expand_dims(pt, 0), 1))
            gl.store(O.to(gl.pointer_type(gl.float32), bitcast=True) + pid * 1024 + off, acc)
            return
        p_s = gl.allocate_shared_memory(gl.float32, [SPLITS * 16, XN], P_SMEM)
        p_s.store(gl.reshape(acc, [SPLITS * 16, XN]))
        gl.thread_barrier()
        even = p_s.slice(0, RB).load(OUT_L)
        odd = p_s.slice(16, RB).load(OUT_L)
        for s in gl.static_range(1, SPLITS // 2):
            even = even + p_s.slice(32 * s, RB).load(OUT_L)
            odd = odd + p_s.slice(32 * s + 16, RB).load(OUT_L)
        total = even + odd
        orow = gl.arange(0, RB, layout=gl.SliceLayout(1, OUT_L))
        otok = gl.arange(0, XN, layout=gl.SliceLayout(0, OUT_L))
        o_off = (gl.expand_dims(otok, 0) * G + group) * R + r0 + gl.expand_dims(orow, 1)
        gl.store(Y + o_off, total.to(gl.bfloat16), gl.expand_dims(otok < M, 0) & gl.expand_dims(orow >= 0, 1))


def probe(x: torch.Tensor, words: torch.Tensor, exp: torch.Tensor, var: int) -> torch.Tensor:
    """One call of variant ``var`` on ``words`` (``pack_twin``'s for VAR <= 2, ``pack16``'s above)."""
    m, g = x.shape[0], x.shape[1]
    r = words.numel() * 4 // (g * 4096)
    if var in (6, 7):
        o = torch.empty(g * r // 16 * 1024, dtype=torch.int32, device=x.device)
        _read_kernel[(g * r // 16,)](words, o, sm90._LD_LAYOUT, _L4, var == 6, num_warps=8)
        return o
    assert m <= 8 and exp.data_ptr() % 16 == 0
    y = torch.empty((m, g, r), dtype=torch.bfloat16, device=x.device)
    grid = g * r // 16
    o = torch.empty(grid * 1024 if var in (1, 6, 7, 12) else 1, dtype=torch.int32, device=x.device)
    desc = TensorDescriptor.from_tensor(words.view(-1, 256), [2, 256], _T_SMEM)
    _probe_kernel[(grid,)](words, desc, x, exp, y, o, m, x.stride(0), g, r, sm90._LD_LAYOUT, sm90._X_LAYOUT, sm90._MMA,
                           sm90._P_SMEM, sm90._OUT16_LAYOUT, sm90._XC_LAYOUT, sm90._X_SMEM, _L4, _E_L, _W4_SMEM,
                           _CP_L, _W8_SMEM, _T_L, _R_L, sm90._SCALE_BIAS[sm90.CVT_PRMT], var, num_warps=8)
    return o if var in (1, 6, 7) else y


def main() -> None:
    from bench_wo_a_fp8 import pure_read_us, twin_exact_weight
    from harness import LAYERS, graph_us_per_call, parse_args, report, tbps
    from sglang.srt.models.deepseek_v4_wo_a_twin import make_twin

    args = parse_args(__doc__)
    rows = []
    quick = os.environ.get("FORK_PROBE_QUICK") == "1"  # G = 2, 2 and 8 rows, the served kernel's stages
    for g in (2,) if quick else (2, 4, 8):
        twins = [make_twin(twin_exact_weight(g, i)) for i in range(LAYERS)]
        packed = [sm90.pack_twin(t[0]) for t in twins]
        packed16 = [pack16(p) for p in packed]
        nbytes = twins[0][0].numel() + twins[0][1].numel()
        read_us = pure_read_us(twins, args.replays)
        for m in (2, 8) if quick else (2, 8, 12, 16):
            x = torch.randn(m, g, 4096, device="cuda").to(torch.bfloat16)
            ref = sm90.wo_a_fp8_small_sm90(x, packed[0], twins[0][1])
            served_us = graph_us_per_call(
                [lambda i=i: sm90.wo_a_fp8_small_sm90(x, packed[i], twins[i][1]) for i in range(LAYERS)], args.replays)
            rows.append({"G": g, "M": m, "variant": "served", "us": served_us, "x_served": 1.0,
                         "x_pure_read": served_us / read_us, "TB/s": tbps(nbytes, served_us), "pure_read_us": read_us,
                         "bitwise_to_served": True})
            # blocks in flight of the served kernel (0: registers), x up front or in the ring
            for stage, xr in ((0, False), (4, False), (8, False), (12, False), (16, False), (4, True), (6, True),
                              (8, True), (10, True), (12, True), (15, True)):
                out = sm90.wo_a_fp8_small_sm90(x, packed[0], twins[0][1], stage=stage, x_ring=xr)
                us = graph_us_per_call(
                    [lambda i=i: sm90.wo_a_fp8_small_sm90(x, packed[i], twins[i][1], stage=stage, x_ring=xr)
                     for i in range(LAYERS)], args.replays)
                rows.append({"G": g, "M": m, "variant": f"served_stage{stage}" + "_xring" * xr, "us": us,
                             "x_served": served_us / us,
                             "x_pure_read": us / read_us, "TB/s": tbps(nbytes, us), "pure_read_us": read_us,
                             "bitwise_to_served": torch.equal(out.view(torch.int16), ref.view(torch.int16))})
            for name, var in VARIANTS.items() if m <= 8 and g != 4 and not quick else ():
                wds = packed16 if var in (3, 4, 6) else packed
                out = probe(x, wds[0], twins[0][1], var)
                bitwise = None if var in (1, 2, 6, 7, 10, 12) else torch.equal(out.view(torch.int16), ref.view(torch.int16))
                us = graph_us_per_call([lambda i=i: probe(x, wds[i], twins[i][1], var) for i in range(LAYERS)],
                                       args.replays)
                rows.append({"G": g, "M": m, "variant": name, "us": us, "x_served": served_us / us,
                             "x_pure_read": us / read_us, "TB/s": tbps(nbytes, us), "pure_read_us": read_us,
                             "bitwise_to_served": bitwise})
        del twins, packed, packed16
    report("wo_a_fp8_arrival_probe", ["G", "M", "variant", "us", "x_served", "x_pure_read", "TB/s",
                                      "bitwise_to_served"], rows, args.out, {"layers": LAYERS})


if __name__ == "__main__":
    main()
