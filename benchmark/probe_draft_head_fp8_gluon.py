"""Probe (not a fork kernel): two Gluon designs for the fp8 draft head at 17..32 rows, where the
shipped mma.sync kernel adds ~15 us per extra 16-row tile (1.30x stock at 20 rows, goal 1.6x).

1. ``mma``: swap-AB mma.sync (vocab rows = M, draft rows = N padded to 8/16/32), both operands
   loaded from global memory straight into registers (k_width 8 or 4), PF chunks in flight.
2. ``wgmma``: swap-AB wgmma m64nNk16, the dequantized weights as the register A operand, the draft
   rows staged through shared memory as B. The head copy is stored with K permuted inside each
   32-block (``permute_k``) so each thread loads its A fragment as int32 words, 8 bytes per row;
   dequantized by the shipped kernel's asm (cvt + shifts + one HMUL2, no byte PRMTs: 2.6
   instructions per weight in the SASS) and put back in K order by renaming registers.

Measured on the H200 (benchmark/results/draft_head_fp8_gluon_probe-NVIDIA_H200.json; cuBLAS bf16 and
the shipped kernel in the same runs; TP4 shard 32320 x 5120, TP1 129280 x 5120):
- both are exact (|err| <= 3.1e-5 vs fp64), deterministic and row invariant (each row alone
  gives the same bits as in the batch); ``mma`` with k_width 4 is bit-identical to the shipped
  Triton kernel (0 of 32320 / 258560 outputs differ at 1 and 8 rows): swapping the operands
  does not change the bits, the order of K inside the MMA does.
- ``mma``: 77-81 us at 1..8 rows, 87 at 16, 101-115 at 20..32 (shipped 51-65): 255 registers,
  2 CTAs per SM, and each warp re-reads x from L2.
- ``wgmma``: first form 81-131 us (x loaded one step ahead: an L2 round trip per 32-K step; each
  of the 505 CTAs reads all of x). With x prefetched PF steps ahead: TP4 66.7-72.5 us flat over
  1..32 rows (BV 64, PF 8, 4 warps), TP1 242-275 us; with N = 8 at <= 8 rows 57.4-62.5 us. At
  20 rows: 68.7 us against 65.8 shipped and 86.4 stock (TP4), 260 vs 250 vs 337 (TP1). The
  32-K step's barrier and the wgmma wait keep it latency bound: not faster than shipped.
Neither went into the series. What did: the same wgmma form with the weights and x brought in
by TMA (python/sglang/kernels/ops/speculative/dspark/draft_head_fp8_wgmma.py; its sweeps are
the last runs in the JSON): 49-55 us flat over 1..32 rows at TP4, 172-198 us at TP1.
Run: python3 benchmark/probe_draft_head_fp8_gluon.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
import time
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmark"))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.ampere import mma_v2  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

import harness  # noqa: E402
from sglang.kernels.ops.speculative.dspark import draft_head_fp8 as kern  # noqa: E402
from sglang.kernels.ops.gemm.e4m3_to_bf16 import E4M3X4_TO_BF16_ASM as _ASM  # noqa: E402
from sglang.kernels.ops.gemm.e4m3_to_bf16_sm90 import bf16_pair as _bf16_pair  # noqa: E402
from probe_wo_a_fp8_gluon import _replace  # noqa: E402  (tuple slot update, shared)


@gluon.jit
def _chunk(acc, w8, xb, s, zk):
    sb = gl.expand_dims((s * 5.192296858534828e33).to(gl.bfloat16), 1) + zk  # * 2**112, exact
    w = gl.inline_asm_elementwise(_ASM, "=r,=r,r,r,r", [w8.to(gl.uint8, bitcast=True), sb],
                                  dtype=gl.bfloat16, is_pure=True, pack=4)
    return mma_v2(w, xb, acc)


@gluon.jit
def _head_kernel(X, W8, S, OUT, M, V, SX, SO,
                 K: gl.constexpr, NW: gl.constexpr, MT: gl.constexpr, NP: gl.constexpr,
                 KW: gl.constexpr, PF: gl.constexpr):
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1], instr_shape=[16, 8])
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=KW)
    B_L: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=KW)
    BV: gl.constexpr = NW * 16 * MT
    NC: gl.constexpr = K // 32
    v0 = gl.program_id(0) * BV
    ar = gl.arange(0, BV, layout=gl.SliceLayout(1, A_L))
    ak = gl.arange(0, 32, layout=gl.SliceLayout(0, A_L))
    rows = v0 + ar
    rmask = rows < V
    a_off = gl.expand_dims(rows * K, 1) + gl.expand_dims(ak, 0)
    a_mask = gl.expand_dims(rmask, 1) & gl.expand_dims(ak >= 0, 0)
    s_off = (rows // 32) * NC
    bk = gl.arange(0, 32, layout=gl.SliceLayout(1, B_L))
    bn = gl.arange(0, NP, layout=gl.SliceLayout(0, B_L))
    b_off = gl.expand_dims(bk, 1) + gl.expand_dims(bn * SX, 0)
    b_mask = gl.expand_dims(bk >= 0, 1) & gl.expand_dims(bn < M, 0)
    zk = gl.zeros([BV, 32], gl.bfloat16, layout=A_L)
    acc = gl.zeros([BV, NP], gl.float32, layout=MMA)
    ws = ()
    xs = ()
    ss = ()
    for c in gl.static_range(PF):
        ws = ws + (gl.load(W8 + a_off + c * 32, a_mask, 0.0),)
        xs = xs + (gl.load(X + b_off + c * 32, b_mask, 0.0),)
        ss = ss + (gl.load(S + s_off + c, rmask, 1.0),)
    # one group of PF chunks per iteration: chunk c of the next group is loaded before chunk
    # c of this one is used (PF chunks in flight per warp); the last group is peeled
    for g in range(NC // PF - 1):
        for c in gl.static_range(PF):
            w8 = ws[c]
            xb = xs[c]
            s = ss[c]
            nxt = (g + 1) * PF + c
            ws = _replace(ws, c, gl.load(W8 + a_off + nxt * 32, a_mask, 0.0))
            xs = _replace(xs, c, gl.load(X + b_off + nxt * 32, b_mask, 0.0))
            ss = _replace(ss, c, gl.load(S + s_off + nxt, rmask, 1.0))
            acc = _chunk(acc, w8, xb, s, zk)
    for c in gl.static_range(PF):
        acc = _chunk(acc, ws[c], xs[c], ss[c], zk)
    OUT_L: gl.constexpr = MMA
    orow = gl.arange(0, BV, layout=gl.SliceLayout(1, OUT_L)) + v0
    on = gl.arange(0, NP, layout=gl.SliceLayout(0, OUT_L))
    o_off = gl.expand_dims(on * SO, 0) + gl.expand_dims(orow, 1)
    o_mask = gl.expand_dims(on < M, 0) & gl.expand_dims(orow < V, 1)
    gl.store(OUT + o_off, acc, o_mask)


def mma_head_logits(x, q, scales, out=None, nw=4, mt=2, kw=8, pf=4, maxnreg=None, np_=None):
    m, k = x.shape
    v = q.shape[0]
    np_ = np_ or max(8, triton.next_power_of_2(m))
    if out is None:
        out = torch.empty((m, v), dtype=torch.float32, device=x.device)
    bv = nw * 16 * mt
    _head_kernel[(triton.cdiv(v, bv),)](x, q, scales, out, m, v, x.stride(0), out.stride(0), k, nw, mt, np_, kw, pf,
                                        num_warps=nw, **({"maxnreg": maxnreg} if maxnreg else {}))
    return out


def permute_k(q: torch.Tensor) -> torch.Tensor:
    """[V, K] e4m3 -> the same with K permuted inside each 32-block: physical 8t + 2j + e holds
    logical 8j + 2t + e (t = thread in quad, j = k8 step, e = pair element)."""
    v, k = q.shape
    return q.view(v, k // 32, 4, 4, 2).permute(0, 1, 3, 2, 4).reshape(v, k).contiguous()


def _phys_layout(bv, nw=4):
    """[bv, 8] int32 words: 2 consecutive words (8 bytes) per thread and row."""
    reg = [[0, 1], [8, 0]]
    r = 16 * nw
    while r < bv:
        reg.append([r, 0]); r *= 2
    return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
                                      warp_bases=[[16 << i, 0] for i in range(nw.bit_length() - 1)], block_bases=[], shape=[bv, 8])


@gluon.jit
def _step_a(w32, s, A_L: gl.constexpr, BV: gl.constexpr):
    """[BV, 8] words of the K-permuted e4m3 tile + per-row scale -> logical [BV, 32] bf16 in the
    wgmma A layout. Each word is two logical pairs: the asm turns it into two bf16x2 words; the
    K permutation is undone by renaming registers (join, reshape, permute)."""
    sb = (s * 5.192296858534828e33).to(gl.bfloat16).to(gl.uint16, bitcast=True).to(gl.int32)
    sb = gl.expand_dims(sb | (sb << 16), 1) + gl.zeros_like(w32)
    o0, o1 = gl.inline_asm_elementwise(_ASM, "=r,=r,r,r,r", [w32, sb, sb], dtype=(gl.int32, gl.int32),
                                       is_pure=True, pack=1)
    w = gl.join(_bf16_pair(o0), _bf16_pair(o1))  # [BV, 8 (t, w), 2 (e), 2 (o)]
    w = gl.reshape(w, [BV, 4, 2, 2, 2])  # [BV, t, w, e, o]
    w = gl.permute(w, [0, 2, 4, 1, 3])  # [BV, w, o, t, e]: logical k = 16w + 8o + 2t + e
    return gl.convert_layout(gl.reshape(w, [BV, 32]), A_L)


@gluon.jit
def _wg_head_kernel(X, W8, S, OUT, M, V, SX, SO, K: gl.constexpr, NP: gl.constexpr, BV: gl.constexpr,
                    PF: gl.constexpr, P_L: gl.constexpr, NW: gl.constexpr, XS: gl.constexpr):
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, NP, 16])
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    X_L: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [NW, 1], [1, 0])
    X_S: gl.constexpr = gl.NVMMASharedLayout.get_default_for([NP, 32], gl.bfloat16)
    NC: gl.constexpr = K // 32
    v0 = gl.program_id(0) * BV
    # weights: physical tiles [BV, 32] in P_L (8 contiguous bytes per thread and row)
    pr = v0 + gl.arange(0, BV, layout=gl.SliceLayout(1, P_L))
    pk = gl.arange(0, 8, layout=gl.SliceLayout(0, P_L))
    w_off = gl.expand_dims(pr * (K // 4), 1) + gl.expand_dims(pk, 0)
    w_mask = gl.expand_dims(pr < V, 1) & gl.expand_dims(pk >= 0, 0)
    # scales: one per row and 32-block, in the A layout's row slice
    sr = v0 + gl.arange(0, BV, layout=gl.SliceLayout(1, P_L))
    s_off = (sr // 32) * NC
    s_mask = sr < V
    # draft rows: [NP, 32] chunks of x, staged through shared memory (rows >= M are zero)
    xr = gl.arange(0, NP, layout=gl.SliceLayout(1, X_L))
    xk = gl.arange(0, 32, layout=gl.SliceLayout(0, X_L))
    x_off = gl.expand_dims(xr * SX, 1) + gl.expand_dims(xk, 0)
    x_mask = gl.expand_dims(xr < M, 1) & gl.expand_dims(xk >= 0, 0)
    xs = gl.allocate_shared_memory(gl.bfloat16, [2 * XS, NP, 32], X_S)

    acc = gl.zeros([BV, NP], gl.float32, layout=MMA)
    ws = ()
    ss = ()
    xv = ()
    for c in gl.static_range(PF):
        ws = ws + (gl.load(W8 + w_off + c * 8, w_mask, 0),)
        ss = ss + (gl.load(S + s_off + c, s_mask, 1.0),)
        xv = xv + (gl.load(X + x_off + c * 32, x_mask, 0.0),)
    for g in range(NC // PF):
        for c in gl.static_range(PF):
            i = g * PF + c
            if c % XS == 0:  # XS chunks of x per barrier (buffers reused two groups later)
                for u in gl.static_range(XS):
                    xs.index(((c // XS) % 2) * XS + u).store(xv[c + u])
                fence_async_shared()
                gl.thread_barrier()
            buf = xs.index(((c // XS) % 2) * XS + c % XS)
            a = _step_a(ws[c], ss[c], A_L, BV)
            nxt = gl.minimum(i + PF, NC - 1)  # PF steps ahead (the last steps reload the last chunk)
            ws = _replace(ws, c, gl.load(W8 + w_off + nxt * 8, w_mask, 0))
            ss = _replace(ss, c, gl.load(S + s_off + nxt, s_mask, 1.0))
            xv = _replace(xv, c, gl.load(X + x_off + nxt * 32, x_mask, 0.0))
            acc = warpgroup_mma(a, buf.permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])
    acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    orow = v0 + gl.arange(0, BV, layout=gl.SliceLayout(1, MMA))
    on = gl.arange(0, NP, layout=gl.SliceLayout(0, MMA))
    o_off = gl.expand_dims(on * SO, 0) + gl.expand_dims(orow, 1)
    o_mask = gl.expand_dims(on < M, 0) & gl.expand_dims(orow < V, 1)
    gl.store(OUT + o_off, acc.to(OUT.dtype.element_ty), o_mask)


def wg_head_logits(x, qp, scales, out=None, bv=128, pf=4, np_=32, maxnreg=None, nw=4, xs=1):
    m, k = x.shape
    v = qp.shape[0]
    if out is None:
        out = torch.empty((m, v), dtype=torch.float32, device=x.device)
    _wg_head_kernel[(triton.cdiv(v, bv),)](x, qp.view(torch.int32), scales, out, m, v, x.stride(0), out.stride(0), k, np_, bv, pf,
                                           _phys_layout(bv, nw), nw, xs, num_warps=nw, **({"maxnreg": maxnreg} if maxnreg else {}))
    return out

K = 5120
# (nw, mt, kw, pf, maxnreg) for mma; (bv, pf, N fixed at 32, maxnreg, warps, x chunks per barrier) for wgmma
MMA_CFGS = [(4, 1, 8, 4, None), (4, 2, 8, 4, None), (4, 2, 8, 2, None), (8, 1, 8, 4, None), (8, 1, 8, 2, None),
            (4, 1, 8, 8, None), (8, 2, 8, 2, None), (4, 2, 4, 4, None), (2, 2, 8, 4, None), (4, 4, 8, 2, None)]
WG_CFGS = [(64, 8, 1, None, 4, 1), (64, 8, 1, None, 4, 2), (64, 8, 1, None, 4, 4), (64, 16, 1, None, 4, 2),
           (64, 16, 1, None, 4, 4), (64, 16, 1, None, 4, 8), (64, 8, 1, 128, 4, 4), (64, 4, 1, None, 4, 2),
           (128, 8, 1, None, 8, 4), (64, 8, 0, None, 4, 4)]


def _candidates():
    for c in MMA_CFGS:
        nw, mt, kw, pf, mr = c
        yield f"mma{c}", False, lambda x, q, s, out=None, nw=nw, mt=mt, kw=kw, pf=pf, mr=mr: mma_head_logits(
            x, q, s, out=out, nw=nw, mt=mt, kw=kw, pf=pf, maxnreg=mr)
    for c in WG_CFGS:
        bv, pf, fixed, mr, nw, xs = c
        yield f"wgmma{c}", True, lambda x, q, s, out=None, bv=bv, pf=pf, fixed=fixed, mr=mr, nw=nw, xs=xs: wg_head_logits(
            x, q, s, out=out, bv=bv, pf=pf, np_=32 if fixed else max(8, triton.next_power_of_2(x.shape[0])),
            maxnreg=mr, nw=nw, xs=xs)


def main():
    out_dir, res, t0 = Path(sys.argv[1]), [], time.time()
    for n, copies, rows_list in ((32320, 6, (1, 8, 16, 20, 32)), (129280, 2, (1, 20, 32))):
        ws = [(torch.randn(n, K, device="cuda") * 0.02).to(torch.bfloat16) for _ in range(copies)]
        qs = [kern.quantize_head_fp8(w) for w in ws]
        qps = [(permute_k(q), s) for q, s in qs]
        deq = kern.dequantize_head_fp8(*qs[0]).double()
        for m in rows_list:
            x = torch.randn(m, K, device="cuda").to(torch.bfloat16)
            ref = x.double() @ deq.T
            outs = [torch.empty((m, n), device="cuda", dtype=torch.float32) for _ in qs]
            bf16_outs = [torch.empty((m, n), device="cuda", dtype=torch.bfloat16) for _ in ws]
            row = {"N": n, "rows": m,
                   "stock_us": harness.graph_us_per_call([partial(torch.matmul, x, w.T, out=o) for w, o in zip(ws, bf16_outs)]),
                   "shipped_us": harness.graph_us_per_call([partial(kern.draft_head_fp8_logits, x, q, s, out=o) for (q, s), o in zip(qs, outs)]),
                   "cands": {}}
            shipped = kern.draft_head_fp8_logits(x, *qs[0])
            for name, permuted, f in _candidates():
                heads = qps if permuted else qs
                try:
                    y = f(x, *heads[0])
                    inv = all(torch.equal(f(x[r:r + 1], *heads[0])[0], y[r]) for r in sorted({0, m // 2, m - 1}))
                    c = {"err": (y.double() - ref).abs().max().item(), "inv": inv, "det": bool(torch.equal(y, f(x, *heads[0]))),
                         "neq_shipped": int((y != shipped).sum())}
                    c["us"] = harness.graph_us_per_call([partial(f, x, q, s, out=o) for (q, s), o in zip(heads, outs)])
                except Exception as ex:  # a configuration that does not compile or fit
                    c = {"error": repr(ex)[:400]}
                row["cands"][name] = c
            res.append(row)
            (out_dir / "draft_head_fp8_gluon_probe.json").write_text(json.dumps(res, indent=0))
            print(f"N={n} rows={m}: stock {row['stock_us']:.1f} shipped {row['shipped_us']:.1f}  t={time.time() - t0:.0f}s", flush=True)
            for k, v in sorted(row["cands"].items(), key=lambda kv: kv[1].get("us", 1e9))[:6]:
                print(f"   {k}: {v}", flush=True)


if __name__ == "__main__":
    main()
