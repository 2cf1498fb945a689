"""Probe (not yet a fork kernel): wo_a at 2..8 rows from the fp8 twin as a CUDA-core GEMV.

The tensor-core twin kernel (patch 0004) is latency-bound on the H200 (ncu: 17 % DRAM, 0.55
waves). This probe tries the other design: each program owns BN weight rows and walks K in
BK-wide slabs, rebuilds the bf16-exact weight in fp32 (e4m3 * 2**(e-127)), and accumulates
x * w elementwise in registers ([MP, BN, BK]), reducing over K once at the end. fp32
accumulation in another order than stock's MMA: the bf16 result may differ by 1 ulp (counted).
Prints, per config and M: time per layer (43 layers, CUDA graph), ratio to stock, TB/s, and the
fraction of outputs that differ from stock and the max difference in ulps.

Measured on the H200 (benchmark/results/wo_a_fp8_gemv_probe-NVIDIA_H200.json): a dead end.
Best 7.50 us at M = 2 (BN 8, BK 512, 8 warps: 1.07x stock's 8.05 us), 9.0 us at M = 4 (0.90x),
13.3 us at M = 8 (0.61x): the fp32 FMAs (M x 16 MB of weight per layer) cost more than the
bytes saved, so the twin needs the tensor-core path with more bytes in flight, not CUDA cores.
Outputs within 1 bf16 ulp of stock (at most 0.09 % of them differ).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from harness import LAYERS, graph_us_per_call, parse_args, report, tbps

G, R, D = 2, 1024, 4096


@triton.jit
def _wo_a_fp8_gemv(X, W8, E, Y, M, SX, G: tl.constexpr, R: tl.constexpr, D: tl.constexpr,
                   MP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr):
    nb, g = tl.program_id(0), tl.program_id(1)
    n = nb * BN + tl.arange(0, BN)
    m = tl.arange(0, MP)
    erow = g * (R // 32) + (nb * BN) // 32  # BN <= 32: one exponent row per program
    acc = tl.zeros((MP, BN, BK), tl.float32)
    for k0 in tl.range(0, D, BK, num_stages=STAGES):
        k = k0 + tl.arange(0, BK)
        w8 = tl.load(W8 + (g * R + n[:, None]) * D + k[None, :])
        e = tl.load(E + erow * (D // 32) + k // 32)
        scale = (e.to(tl.int32) << 23).to(tl.float32, bitcast=True)
        w = w8.to(tl.float32) * scale[None, :]
        x = tl.load(X + m[:, None] * SX + g * D + k[None, :], m[:, None] < M, 0.0).to(tl.float32)
        acc += x[:, None, :] * w[None, :, :]
    y = tl.sum(acc, axis=2)
    tl.store(Y + (m[:, None] * G + g) * R + n[None, :], y.to(tl.bfloat16), m[:, None] < M)


def gemv(x, w8, e, cfg):
    bn, bk, warps, stages = cfg
    m = x.shape[0]
    y = torch.empty((m, G, R), dtype=torch.bfloat16, device=x.device)
    _wo_a_fp8_gemv[(R // bn, G)](x, w8, e, y, m, x.stride(0), G, R, D, triton.next_power_of_2(m),
                                bn, bk, stages, num_warps=warps)
    return y


def twin_layer(seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w8 = (torch.randn(G, R, D, device="cuda", generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    e = torch.randint(113, 121, (G, R // 32, D // 32), device="cuda", generator=gen, dtype=torch.uint8)
    scale = torch.exp2(e.float() - 127).repeat_interleave(32, 1).repeat_interleave(32, 2)
    return w8, e, (w8.float() * scale).to(torch.bfloat16)


def ulps(a, b):
    ai, bi = a.view(torch.int16).int(), b.view(torch.int16).int()
    return (ai - bi).abs()


def main():
    from sglang.kernels.ops.gemm.dsv4_wo_a import wo_a_bf16_small_batch

    args = parse_args(__doc__)
    layers = [twin_layer(s) for s in range(LAYERS)]
    twin_bytes = G * R * D + G * (R // 32) * (D // 32)
    configs = [(2, 1024, 4, 1), (4, 512, 4, 2), (4, 1024, 8, 2), (8, 256, 4, 3), (8, 512, 8, 3),
               (16, 256, 8, 3), (8, 128, 4, 4), (16, 128, 4, 4)]
    rows = []
    for m in (2, 4, 8):
        x = torch.randn(m, 3, D, device="cuda", dtype=torch.bfloat16)[:, :G]
        stock = graph_us_per_call([lambda w=w: wo_a_bf16_small_batch(x, w) for _, _, w in layers], args.replays)
        ref = wo_a_bf16_small_batch(x, layers[0][2])
        for cfg in configs:
            if cfg[0] * cfg[1] * triton.next_power_of_2(m) > 128 * 32 * cfg[2]:
                continue  # accumulator over 128 fp32 registers per thread
            try:
                out = gemv(x, layers[0][0], layers[0][1], cfg)
                d = ulps(out, ref)
                us = graph_us_per_call([lambda a=a, b=b: gemv(x, a, b, cfg) for a, b, _ in layers], args.replays)
            except Exception as exc:  # a config that does not compile is a data point too
                print(f"M={m} cfg={cfg}: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            rows.append({"M": m, "BN": cfg[0], "BK": cfg[1], "warps": cfg[2], "stages": cfg[3],
                         "stock_us": stock, "gemv_us": us, "speedup": stock / us,
                         "gemv_TBps": tbps(twin_bytes, us), "ulp_diff_frac": float((d > 0).float().mean()),
                         "ulp_max": int(d.max())})
    report("wo_a_fp8_gemv_probe", list(rows[0]), rows, args.out,
           {"layers": LAYERS, "twin_bytes_per_layer": twin_bytes, "what": "probe, not in the series"})


if __name__ == "__main__":
    main()
