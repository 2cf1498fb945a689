"""--speculative-dspark-draft-head-fp8 vs the stock bf16 draft head (cuBLAS), rows 1..64.

Shapes: the TP4 shard (32320 x 5120) and TP1 (129280 x 5120). Distinct copies rotate so
the head streams from HBM (each copy is larger than the 60 MB L2). CUDA-graph replay,
median. Floors: bf16 head bytes / fp8 head + scale bytes at 4.09 TB/s. A few kernel
configurations are swept in the same run; the best per row count is reported next to the
shipped default (block_n 64, block_k 128, 4 warps, 4 stages).
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools" / "standins"))
sys.path.insert(0, str(REPO / "benchmark"))

import torch  # noqa: E402

import harness  # noqa: E402
from sglang.kernels.ops.speculative.dspark.draft_head_fp8 import (  # noqa: E402
    draft_head_fp8_logits,
    quantize_head_fp8,
)

# (block_n, block_k, num_warps, num_stages); the first is the shipped default.
CONFIGS = [(64, 128, 4, 4), (32, 128, 4, 4), (64, 128, 4, 6), (128, 128, 8, 3), (64, 256, 8, 3), (64, 32, 4, 6)]
ROWS = [1, 2, 4, 5, 8, 10, 15, 16, 20, 32, 64]


def main() -> None:
    args = harness.parse_args(__doc__)
    k = 5120
    rows_out = []
    for n, copies in ((32320, 6), (129280, 2)):
        ws = [(torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16) for _ in range(copies)]
        qs = [quantize_head_fp8(w) for w in ws]
        bf16_bytes, fp8_bytes = n * k * 2, n * k + qs[0][1].numel() * 4
        for m in ROWS:
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            outs = [torch.empty((m, n), device="cuda", dtype=torch.bfloat16) for _ in ws]
            stock = harness.graph_us_per_call(
                [partial(torch.matmul, x, w.T, out=o) for w, o in zip(ws, outs)], args.replays)
            fouts = [torch.empty((m, n), device="cuda", dtype=torch.float32) for _ in ws]
            times = {}
            for bn, bk, nw, ns in CONFIGS:
                times[(bn, bk, nw, ns)] = harness.graph_us_per_call(
                    [partial(draft_head_fp8_logits, x, q, s, out=o, block_n=bn, block_k=bk,
                             num_warps=nw, num_stages=ns) for (q, s), o in zip(qs, fouts)],
                    args.replays)
            best = min(times, key=times.get)
            ours = times[CONFIGS[0]]
            rows_out.append({
                "N": n, "rows": m, "stock_us": stock, "stock_TBps": harness.tbps(bf16_bytes, stock),
                "fp8_us": ours, "fp8_TBps": harness.tbps(fp8_bytes, ours),
                "ratio": stock / ours, "best_cfg": "x".join(map(str, best)),
                "best_us": times[best], "best_ratio": stock / times[best],
                "floor_bf16_us": harness.floor_us(bf16_bytes), "floor_fp8_us": harness.floor_us(fp8_bytes),
            })
        del ws, qs
        torch.cuda.empty_cache()
    harness.report("draft_head_fp8", ["N", "rows", "stock_us", "stock_TBps", "fp8_us", "fp8_TBps",
                                      "ratio", "best_cfg", "best_us", "best_ratio",
                                      "floor_bf16_us", "floor_fp8_us"], rows_out, args.out,
                   {"K": k, "configs": CONFIGS, "default_cfg": "x".join(map(str, CONFIGS[0]))})


if __name__ == "__main__":
    main()
