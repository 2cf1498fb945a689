"""Probe (not a fork kernel): where the wo_a twin kernel's time goes on the H200.

The twin kernel is built up from a pure read of its own tile, one feature at a time, at G = 2,
M = 4, 43 layers in a CUDA graph; grid (G*R/BR, D/KS), each CTA loads its [BR, KS] fp8 tile once:
  mode 0  pure read of the tile (int sum)
  mode 1  + dequantisation in registers (bf16(e4m3) * 2**(e-127)), float sum
  mode 2  + tensor-core dot with x, stock orientation (x [16, KS] @ w^T), partials stored
  mode 3  + the same dot swapped (w [BR, KS] @ x^T; BR = 64 takes wgmma)
  mode 4  mode 2 + the split-K reduction (last CTA of a row tile adds the partials in split order)

Measured (benchmark/results/wo_a_fp8_breakdown-NVIDIA_H200.json; stock two kernels 8.0 us, pure
read of the whole twin 3.9 us): mode 0 4.0-4.2 us for any grid from 256 to 2048 CTAs; mode 1 adds
0.9-2.0 us (best 4.91 us at BR 16, KS 256, 2048 CTAs); mode 2 adds another 2-3 us (best 7.01 us
at BR 32, KS 256); mode 3 is no better (best 7.24 us, wgmma at BR 64); the reduction adds 1.9 us
(best mode 4: 8.89 us, 1.11x slower than stock). Every step after the read runs after the CTA's
bytes arrive and is not hidden by the loads of other CTAs. The same JSON holds the session's
whole-kernel candidates (swap-AB, batched 3-D dot with one K lane per warp, 16/32 warps,
tile-contiguous twin layout, single-shot loads): none went below 8.9 us at G = 2 or 20.6 us at
G = 8 (stock 8.0 / einsum 18.9). Conclusion: with Triton's codegen (operands staged through shared
memory, dequantisation after arrival) the twin cannot beat the bf16 kernel here; the next attempt
needs MMA fragments loaded straight from global memory in a pre-permuted twin layout (no shared
memory, no barrier), e.g. in Gluon or CUDA.
Run: python3 benchmark/probe_wo_a_fp8_breakdown.py --out DIR
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from harness import LAYERS, graph_us_per_call, parse_args, report

R, D = 1024, 4096


@triton.jit
def _probe(X, W8, E, P, Y, C, M, SX, G: tl.constexpr, R: tl.constexpr, D: tl.constexpr,
           BR: tl.constexpr, KS: tl.constexpr, MODE: tl.constexpr):
    pid, ks = tl.program_id(0), tl.program_id(1)
    group = pid // (R // BR)
    r0 = (pid % (R // BR)) * BR
    r = r0 + tl.arange(0, BR)
    k = ks * KS + tl.arange(0, KS)
    t = tl.arange(0, 16)
    out_id = ks * (G * R // BR) + pid
    if MODE == 0:  # pure read of the tile
        w = tl.load(W8.to(tl.pointer_type(tl.int8), bitcast=True) + (group * R + r[:, None]) * D + k[None, :])
        tl.store(P + out_id, tl.sum(tl.sum(w.to(tl.int32), 1), 0).to(tl.float32))
    elif MODE == 1:  # + dequantisation
        w8 = tl.load(W8 + (group * R + r[:, None]) * D + k[None, :])
        e = tl.load(E + (group * (R // 32) + r0 // 32) * (D // 32) + k // 32)
        s = (e.to(tl.int16) << 7).to(tl.bfloat16, bitcast=True)
        tl.store(P + out_id, tl.sum(tl.sum((w8.to(tl.bfloat16) * s[None, :]).to(tl.float32), 1), 0))
    else:
        w8 = tl.load(W8 + (group * R + r[:, None]) * D + k[None, :])
        e = tl.load(E + (group * (R // 32) + r0 // 32) * (D // 32) + k // 32)
        s = (e.to(tl.int16) << 7).to(tl.bfloat16, bitcast=True)
        w = w8.to(tl.bfloat16) * s[None, :]
        rows = t[:, None] < M
        if MODE == 2 or MODE == 4:  # stock orientation: x [16, KS] @ w^T [KS, BR]
            x = tl.load(X + t[:, None] * SX + group * D + k[None, :], rows, 0.0)
            acc = tl.dot(x, tl.trans(w))
            out = (t[:, None] * G + group) * R + r[None, :]
        else:  # swap: w [BR, KS] @ x^T [KS, 16]
            xt = tl.load(X + t[None, :] * SX + group * D + k[:, None], t[None, :] < M, 0.0)
            acc = tl.trans(tl.dot(w, xt))
            out = (t[:, None] * G + group) * R + r[None, :]
        if MODE == 4:  # + cross-CTA reduction, split order, last arriver
            NS: tl.constexpr = D // KS
            tl.store(P + ks * M * G * R + out, acc, rows)
            tl.debug_barrier()
            arrived = tl.atomic_add(C + pid, 1, sem="acq_rel", scope="gpu")
            if arrived == NS - 1:
                tot = tl.load(P + out, rows, 0.0, cache_modifier=".cg")
                for j in tl.static_range(1, NS):
                    tot += tl.load(P + j * M * G * R + out, rows, 0.0, cache_modifier=".cg")
                tl.store(Y + out, tot.to(tl.bfloat16), rows)
                tl.atomic_xchg(C + pid, 0)
        else:
            tl.store(P + ks * M * G * R + out, acc, rows)


def main() -> None:
    args = parse_args(__doc__)
    g, m = 2, 4
    ws = [(torch.randn(g, R, D, device="cuda") * 64).clamp(-448, 448).to(torch.float8_e4m3fn) for _ in range(LAYERS)]
    es = [torch.randint(113, 121, (g, R // 32, D // 32), device="cuda", dtype=torch.uint8) for _ in range(LAYERS)]
    x = torch.randn(m, g, D, device="cuda").to(torch.bfloat16)
    part = torch.empty(16 * 16 * g * R, device="cuda")
    y = torch.empty(m, g, R, device="cuda", dtype=torch.bfloat16)
    rows = []
    for mode in (0, 1, 2, 3, 4):
        for br, ks, warps in ((16, 512, 4), (32, 512, 4), (64, 512, 4), (16, 1024, 4), (16, 256, 4), (32, 256, 4),
                              (64, 256, 4), (64, 1024, 8), (32, 1024, 8), (16, 512, 2), (32, 512, 8)):
            counters = torch.zeros(g * R // br, dtype=torch.int32, device="cuda")
            grid = (g * R // br, D // ks)
            us = graph_us_per_call(
                [lambda w=w, e=e: _probe[grid](x, w, e, part, y, counters, m, x.stride(0), g, R, D, br, ks, mode,
                                               num_warps=warps) for w, e in zip(ws, es)], args.replays)
            rows.append({"mode": mode, "BR": br, "KS": ks, "warps": warps, "ctas": grid[0] * grid[1], "us": us})
    report("wo_a_fp8_breakdown", ["mode", "BR", "KS", "warps", "ctas", "us"], rows, args.out,
           {"layers": LAYERS, "G": g, "M": m, "R": R, "D": D})


if __name__ == "__main__":
    main()
