"""Probe (not a fork kernel): the fp8 draft head with the weights as the MMA's M side.

BLOCK_N >= 64 vocab rows make Triton use wgmma (m64n32k16, the dequantized weights from
registers), the draft rows are N, padded to a fixed 32 for every call so a row's logits never
depend on the others. The idea was to serve 17..32 rows at the 1-tile speed (the shipped
mma.sync kernel adds ~15 us per extra 16-row tile).

Measured on the H200 (benchmark/results/draft_head_fp8_wgmma_probe-NVIDIA_H200.json): row
invariant and exact (|err| <= 2.8e-5 vs fp64), but slower: TP4 shard 69-98 us at 1..32 rows
(best 256x128, 8 warps, TMA: 69.2-81.1 us) against 51.4-67.8 us for the shipped kernel and
85-89 us for cuBLAS bf16; TP1 267-424 us against 182-255 us. Not pursued.
Run: python3 benchmark/probe_draft_head_fp8_wgmma.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
import time

import torch
import triton
import triton.language as tl

from harness import graph_us_per_call

from sglang.kernels.ops.speculative.dspark import draft_head_fp8 as h


@triton.jit(do_not_specialize=["M"])
def _head_swap_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K: tl.constexpr,
                      stride_xm, stride_wn, stride_sn, stride_om,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MP: tl.constexpr, CVT: tl.constexpr,
                      W_TMA: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = tl.arange(0, MP)
    offs_kb = tl.arange(0, BLOCK_K // 32)
    acc = tl.zeros((BLOCK_N, MP), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if W_TMA:
            q = w_ptr.load([pid * BLOCK_N, k0])
        else:
            q = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :], mask=n_mask[:, None], other=0.0)
        s = tl.load(s_ptr + (offs_n // 32)[:, None] * stride_sn + (k0 // 32 + offs_kb)[None, :],
                    mask=n_mask[:, None], other=1.0)
        w = tl.reshape(h._dequant_bf16(tl.reshape(q, (BLOCK_N, BLOCK_K // 32, 32)), s, CVT), (BLOCK_N, BLOCK_K))
        xt = tl.load(x_ptr + rows[None, :] * stride_xm + offs_k[:, None], mask=rows[None, :] < M, other=0.0)
        if CVT == 2:
            acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, xt, acc)
    tl.store(out_ptr + rows[None, :] * stride_om + offs_n[:, None], acc.to(out_ptr.dtype.element_ty),
             mask=(rows[None, :] < M) & n_mask[:, None])


def head_swap_logits(x, q, scales, out=None, out_dtype=torch.float32, config=(128, 128, 4, 3, 0), mp=32, cvt=None):
    m, k = x.shape
    n = q.shape[0]
    assert 1 <= m <= mp
    block_n, block_k, num_warps, num_stages, w_tma = config
    w_tma = bool(w_tma) and not h._interpreting()
    if cvt is None:
        cvt = h.CVT_EMULATED if h._interpreting() else h.CVT_ASM
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    w = h._weight_descriptor(q, block_n, block_k) if w_tma else q
    _head_swap_kernel[(triton.cdiv(n, block_n),)](
        x, w, scales, out, m, n, k, x.stride(0), q.stride(0), scales.stride(0), out.stride(0),
        BLOCK_N=block_n, BLOCK_K=block_k, MP=mp, CVT=cvt, W_TMA=w_tma, num_warps=num_warps, num_stages=num_stages)
    return out


def main():
    out = sys.argv[1]
    K = 5120
    ROWS = (1, 2, 4, 5, 8, 16, 20, 32)
    CFGS = [(128, 128, 4, 3, 0), (128, 128, 4, 3, 1), (128, 256, 8, 3, 1), (128, 256, 8, 3, 0), (256, 128, 8, 3, 1),
            (64, 256, 4, 3, 1), (128, 128, 4, 4, 1), (256, 256, 8, 2, 1), (128, 256, 4, 3, 1), (64, 128, 4, 4, 1)]
    res = {"benchmark": "draft_head_fp8_wgmma_probe", "device": torch.cuda.get_device_name(), "rows": []}
    t0 = time.time()
    for n in (32320, 129280):
        torch.manual_seed(0)
        w = (torch.randn(n, K, device="cuda") * 0.02).to(torch.bfloat16)
        q, s = h.quantize_head_fp8(w)
        xs = (torch.randn(32, K, device="cuda")).to(torch.bfloat16)
        # invariance reference: every row alone, per config
        for cfg in CFGS:
            try:
                alone = torch.cat([head_swap_logits(xs[i:i + 1], q, s, config=cfg) for i in range(32)])
                inv = all(torch.equal(head_swap_logits(xs[:m], q, s, config=cfg), alone[:m]) for m in ROWS)
                exact = float((alone.double() - xs.double() @ h.dequantize_head_fp8(q, s).double().T).abs().max())
            except Exception as ex:
                print("ERR", n, cfg, str(ex)[:300], flush=True); continue
            for m in ROWS:
                x = xs[:m]
                o = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                us = graph_us_per_call([lambda: head_swap_logits(x, q, s, out=o, config=cfg)] * 4)
                res["rows"].append({"N": n, "rows": m, "cfg": list(cfg), "us": us, "invariant": inv, "max_abs_err": exact})
            print(n, cfg, "inv", inv, "err", exact, [round(r["us"], 1) for r in res["rows"][-len(ROWS):]], f"t={time.time()-t0:.0f}", flush=True)
        for m in ROWS:
            x = xs[:m]
            o = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            st = graph_us_per_call([lambda: torch.matmul(x, w.T, out=o)] * 4)
            sh = graph_us_per_call([lambda: h.draft_head_fp8_logits(x, q, s, out=o)] * 4)
            res["rows"].append({"N": n, "rows": m, "stock_us": st, "shipped_us": sh})
            print(n, m, "stock", round(st, 1), "shipped", round(sh, 1), flush=True)
        json.dump(res, open(f"{out}/draft_head_fp8_wgmma_probe.json", "w"), indent=0)


if __name__ == "__main__":
    main()
