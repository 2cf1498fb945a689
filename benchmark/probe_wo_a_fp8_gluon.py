"""Probe (not a fork kernel yet): the wo_a twin with its MMA operands loaded straight from global
memory into registers, written in Gluon (Triton's explicit-layout dialect).

Swap-AB: 8 or 16 weight rows are the MMA's M, the <= 8 tokens its N (mma m16n8k16, no padding of
the tokens). K is cut into NW lanes, one per warp (a 3-D batched MMA layout); each warp walks its
lane in 32-wide chunks (one scale block): the chunk's partial starts from zero, is scaled by the
block's power of two in fp32 and added; the lanes are summed once at the end. No shared memory in
the main loop, no barrier; the chunks' loads are issued before the first MMA (a tuple of PF
prefetched chunks; ptxas keeps them early only with maxnreg high enough).

Measured on the H200 (benchmark/results/wo_a_fp8_gluon_probe-NVIDIA_H200.json, two runs): the first
twin kernel faster than stock: G = 2, 2..8 rows 6.5-7.4 us against 8.0-8.2 us for upstream's
wo_a_bf16_small_batch (1.1-1.2x; pure read of the twin 3.8-3.9 us); G = 8 17.7-18.4 us against
einsum's 18.8-19.2 us (only with maxnreg 128, one wave). Outputs within 0.5-0.9 ulp of the fp64
product, 0-9 of 4096-16384 differ from stock, deterministic. With ptxas free to sink the loads
(no maxnreg) the same kernel takes 10.5 us: issuing every load before the first MMA is what counts.
Not in the series: far from the goal (<= 1.15x the pure read), runs only on the GPU (Gluon has no
interpreter, so CI could not execute it), and the gain is 1-1.5 us per layer.
Run: python3 benchmark/probe_wo_a_fp8_gluon.py OUT_DIR (prints per G, M the stock, einsum and pure-read times
and each configuration (nw, kw, pf, maxnreg, br) with its error, determinism and time).
"""

from __future__ import annotations

import json
import sys
import time

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from harness import LAYERS, graph_us_per_call

from sglang.kernels.ops.gemm import dsv4_wo_a as up
from sglang.srt.models.deepseek_v4_wo_a_twin import make_twin


@gluon.jit
def _replace(t, i: gl.constexpr, v):
    out = ()
    for j in gl.static_range(len(t)):
        if j == i:
            out = out + (v,)
        else:
            out = out + (t[j],)
    return out


@gluon.jit
def _twin_gluon_kernel(X, W8, E, Y, M, SX,
                       G: gl.constexpr, R: gl.constexpr, D: gl.constexpr, NW: gl.constexpr, KW: gl.constexpr,
                       PF: gl.constexpr, BR: gl.constexpr = 16):
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1, 1], instr_shape=[1, 16, 8])
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=KW)
    B_L: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=KW)
    KL: gl.constexpr = D // NW  # K per lane (warp)
    pid = gl.program_id(0)
    group = pid // (R // BR)
    r0 = (pid % (R // BR)) * BR

    # A [NW, 16, 32]: lane b, row r, k
    ab = gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(2, A_L)))
    ar = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, A_L)))
    ak = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, A_L)))
    a_off = (gl.expand_dims(gl.expand_dims(ab * KL, 1), 2)
             + gl.expand_dims(gl.expand_dims((group * R + r0 + ar) * D, 0), 2)
             + gl.expand_dims(gl.expand_dims(ak, 0), 1))
    a_mask = gl.expand_dims(gl.expand_dims(ar < BR, 0), 2) & (a_off >= 0)
    # B [NW, 32, 8]: lane b, k, token t
    bb = gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(2, B_L)))
    bk = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, B_L)))
    bt = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, B_L)))
    b_off = (gl.expand_dims(gl.expand_dims(bb * KL, 1), 2) + gl.expand_dims(gl.expand_dims(bk, 0), 2)
             + gl.expand_dims(gl.expand_dims(bt * SX + group * D, 0), 1))
    b_mask = gl.expand_dims(gl.expand_dims(bt < M, 0), 1) & (b_off >= 0)
    # scale exponent per (lane, chunk): [NW] in the accumulator's batch slice
    eb = gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(2, MMA)))
    e_base = E + (group * (R // 32) + r0 // 32) * (D // 32) + eb * (KL // 32)

    acc = gl.zeros([NW, 16, 8], gl.float32, layout=MMA)
    zero = gl.zeros([NW, 16, 8], gl.float32, layout=MMA)
    NC: gl.constexpr = KL // 32
    # every load of the CTA is issued before the first MMA: PF chunks in flight per warp
    ws = ()
    xs = ()
    es = ()
    for c in gl.static_range(PF):
        ws = ws + (gl.load(W8 + a_off + c * 32, a_mask, 0.0),)
        xs = xs + (gl.load(X + b_off + c * 32, b_mask, 0.0),)
        es = es + (gl.load(e_base + c),)
    for c in gl.static_range(NC):
        w8 = ws[c % PF]
        xb = xs[c % PF]
        e = es[c % PF]
        if c + PF < NC:
            ws = _replace(ws, c % PF, gl.load(W8 + a_off + (c + PF) * 32, a_mask, 0.0))
            xs = _replace(xs, c % PF, gl.load(X + b_off + (c + PF) * 32, b_mask, 0.0))
            es = _replace(es, c % PF, gl.load(e_base + c + PF))
        s = (e.to(gl.int32) << 23).to(gl.float32, bitcast=True)
        part = mma_v2(w8.to(gl.bfloat16), xb, zero)
        acc = acc + part * gl.expand_dims(gl.expand_dims(s, 1), 2)
    y = gl.sum(acc, axis=0)  # [16, 8] rows x tokens
    OUT_L: gl.constexpr = gl.SliceLayout(0, MMA)
    orow = gl.arange(0, 16, layout=gl.SliceLayout(1, OUT_L))
    otok = gl.arange(0, 8, layout=gl.SliceLayout(0, OUT_L))
    o_off = (gl.expand_dims(otok, 0) * G + group) * R + r0 + gl.expand_dims(orow, 1)
    o_mask = gl.expand_dims(otok < M, 0) & gl.expand_dims(orow < BR, 1)
    gl.store(Y + o_off, y.to(gl.bfloat16), o_mask)


def gluon_matmul(x, weight8, exp, nw=8, kw=8, pf=16, maxnreg=None, br=16):
    m = x.shape[0]
    g, r, d = weight8.shape
    assert 2 <= m <= 8 and r % 16 == 0 and d % (32 * nw) == 0
    y = torch.empty((m, g, r), dtype=torch.bfloat16, device=x.device)
    _twin_gluon_kernel[(g * r // br,)](x, weight8, exp, y, m, x.stride(0), g, r, d, nw, kw, pf, br, num_warps=nw, **({"maxnreg": maxnreg} if maxnreg else {}))
    return y


R, D = 1024, 4096
CONFIGS = [(8, 4, 16, 255, 16), (8, 4, 16, 128, 8), (8, 8, 16, 128, 8), (4, 8, 32, 255, 8), (4, 4, 32, 255, 8),
           (8, 4, 8, 128, 8), (16, 4, 8, 128, 16), (8, 2, 16, 255, 16), (4, 4, 32, 255, 16), (8, 8, 16, 255, 16),
           (8, 8, 16, 128, 16), (8, 8, 16, None, 16)]  # nw, kw, pf, maxnreg, br


@triton.jit
def _pure_read(W, OUT, N, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    tl.store(OUT + pid, tl.sum(tl.load(W + offs, offs < N, 0)))


def _weight(g, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = (torch.randn(g, R, D, device="cuda", generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    e = torch.randint(-14, -6, (g, R // 32, D // 32), device="cuda", generator=gen)
    s = torch.exp2(e.float()).repeat_interleave(32, 1).repeat_interleave(32, 2)
    return (q.float() * s).to(torch.bfloat16)


def _ulps(y, ref):
    ulp = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(1e-30))) - 7)
    return ((y.double() - ref).abs() / ulp).max().item()


def _candidate(x, twins, ref, stock_out, cfg):
    nw, kw, pf, mr, br = cfg

    def fn(i):
        return gluon_matmul(x, twins[i][0], twins[i][1], nw, kw, pf, mr, br)

    y = fn(0)
    c = {"max_ulp": _ulps(y, ref), "det": bool(torch.equal(y, fn(0))),
         "neq_stock": int((y.view(torch.int16) != stock_out.view(torch.int16)).sum()) if stock_out is not None else -1}
    c["us"] = graph_us_per_call([lambda i=i: fn(i) for i in range(LAYERS)])
    return c


def main():
    out, res, t0 = sys.argv[1], [], time.time()
    for g in (2, 8):
        ws = [_weight(g, i) for i in range(LAYERS)]
        twins = [make_twin(w) for w in ws]
        words = [torch.cat([t[0].view(torch.int32).flatten(), t[1].view(torch.int32).flatten()]) for t in twins]
        read_us = min(graph_us_per_call(
            [lambda wd=wd, b=b, s=torch.empty(triton.cdiv(wd.numel(), b), dtype=torch.int32, device="cuda"):
             _pure_read[(triton.cdiv(wd.numel(), b),)](wd, s, wd.numel(), BLOCK=b, num_warps=8) for wd in words])
            for b in (1024, 2048, 4096))
        for m in (2, 4, 8):
            x = torch.randn(m, g, D, device="cuda").to(torch.bfloat16)
            ref = torch.einsum("tgd,grd->tgr", x.double(), ws[0].double())
            row = {"G": g, "M": m, "read_us": read_us,
                   "einsum_us": graph_us_per_call([lambda w=w: torch.einsum("tgd,grd->tgr", x, w) for w in ws])}
            stock_out = None
            if g == 2:
                row["stock_us"] = graph_us_per_call([lambda w=w: up.wo_a_bf16_small_batch(x, w) for w in ws])
                stock_out = up.wo_a_bf16_small_batch(x, ws[0])
            else:
                row["stock_us"] = row["einsum_us"]
            row["cands"] = {}
            for cfg in CONFIGS:
                try:
                    row["cands"][str(cfg)] = _candidate(x, twins, ref, stock_out, cfg)
                except Exception as ex:
                    row["cands"][str(cfg)] = {"error": str(ex)[:400]}
            res.append(row)
            json.dump(res, open(f"{out}/wo_a_fp8_gluon_probe.json", "w"), indent=0)
            print(f"G={g} M={m}: stock {row['stock_us']:.2f} einsum {row['einsum_us']:.2f} read {read_us:.2f}"
                  f"  t={time.time() - t0:.0f}s", flush=True)
            for k, v in sorted(row["cands"].items(), key=lambda kv: kv[1].get("us", 1e9)):
                print(f"    {k}: {v}", flush=True)


if __name__ == "__main__":
    main()
