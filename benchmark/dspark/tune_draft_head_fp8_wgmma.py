"""Tuning sweep for the Hopper fp8 draft head (draft_head_fp8_wgmma.py) past 32 rows: every
candidate (vocab rows per CTA, warps, stages) at wgmma N 64 and 128, on the TP4 (32320)
and TP1 (129280) shards against cuBLAS bf16, in one GPU run. Each candidate's logits are first
checked bit for bit against the same rows computed 8 at a time (the head's row invariance);
a candidate that differs is reported and not timed. Writes
tune_draft_head_fp8_wgmma-<device>.json with, per N and shard, the fastest candidate (the
shipped ``CONFIGS`` are chosen from it).
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import time
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools" / "standins"))
sys.path.insert(0, str(REPO / "benchmark"))

import harness  # noqa: E402
import torch  # noqa: E402

from sglang.kernels.ops.gemm.e4m3_to_bf16 import permute_k  # noqa: E402
from sglang.kernels.ops.speculative.dspark import draft_head_fp8 as kern  # noqa: E402
from sglang.kernels.ops.speculative.dspark import (  # noqa: E402
    draft_head_fp8_wgmma as wg,
)

K = 5120
SHAPES = ((32320, 6), (129280, 2))  # (N, copies rotated per graph)
ROWS = (40, 64, 128)  # the wgmma N past 32: 64 and 128
TILES = ((128, 4), (128, 8), (256, 8), (64, 4))  # (vocab rows per CTA, warps)
STAGES = (2, 3, 4, 5)


def candidates(np_: int) -> list[tuple[int, int, int]]:
    out = []
    for bv, nw in TILES:
        for st in STAGES:
            if st * (bv * wg.STEP_K + np_ * wg.STEP_K * 2) <= wg._SMEM_BYTES:
                out.append((bv, nw, st))
    return out


def _compile(job) -> str:
    m, cfg = job
    import torch as t

    from sglang.kernels.ops.speculative.dspark import draft_head_fp8_wgmma as w

    try:
        qp = t.zeros((256, K), dtype=t.float8_e4m3fn, device="cuda")
        s = t.ones((8, K // 32), dtype=t.float32, device="cuda")
        x = t.zeros((m, K), dtype=t.bfloat16, device="cuda")
        w.draft_head_fp8_logits_wgmma(x, qp, s, out_dtype=t.bfloat16, cfg=cfg)
        t.cuda.synchronize()
        return ""
    except Exception as e:  # noqa: BLE001 (reported, the config is dropped)
        return f"{job}: {type(e).__name__}: {str(e)[-400:]}"


def main() -> None:
    p = harness.arg_parser(__doc__, replays=20)
    p.add_argument("--workers", type=int, default=14)
    args = p.parse_args()
    jobs = [(m, c) for m in ROWS for c in candidates(wg.padded_rows(m))]
    t0 = time.time()
    failed = set()
    with mp.get_context("spawn").Pool(args.workers) as pool:
        for job, err in zip(jobs, pool.map(_compile, jobs)):
            if err:
                failed.add(job)
                print("compile failed:", err, flush=True)
    print(f"compiled {len(jobs) - len(failed)}/{len(jobs)} in {time.time() - t0:.1f} s")
    rows = []
    for n, copies in SHAPES:
        ws = [
            (torch.randn(n, K, device="cuda") * 0.02).to(torch.bfloat16)
            for _ in range(copies)
        ]
        heads = []
        for w in ws:
            q, s = kern.quantize_head_fp8(w)
            heads.append((permute_k(q), s))
        for m in ROWS:
            x = torch.randn(m, K, device="cuda").to(torch.bfloat16)
            ref = torch.cat(
                [
                    wg.draft_head_fp8_logits_wgmma(
                        x[i : i + 8].clone(), *heads[0], out_dtype=torch.bfloat16
                    )
                    for i in range(0, m, 8)
                ]
            )
            outs = [
                torch.empty((m, n), device="cuda", dtype=torch.bfloat16) for _ in ws
            ]
            stock = harness.graph_us_per_call(
                [partial(torch.matmul, x, w.T, out=o) for w, o in zip(ws, outs)],
                args.replays,
            )
            for cfg in candidates(wg.padded_rows(m)):
                if (m, cfg) in failed:
                    continue
                got = wg.draft_head_fp8_logits_wgmma(
                    x, *heads[0], out_dtype=torch.bfloat16, cfg=cfg
                )
                same = bool(torch.equal(got, ref))
                us = (
                    harness.graph_us_per_call(
                        [
                            partial(
                                wg.draft_head_fp8_logits_wgmma,
                                x,
                                q,
                                s,
                                out=o,
                                cfg=cfg,
                            )
                            for (q, s), o in zip(heads, outs)
                        ],
                        args.replays,
                    )
                    if same
                    else float("nan")
                )
                rows.append(
                    {
                        "N": n,
                        "rows": m,
                        "np": wg.padded_rows(m),
                        "cfg": "x".join(map(str, cfg)),
                        "row_invariant": same,
                        "stock_us": stock,
                        "fp8_us": us,
                        "ratio": stock / us,
                    }
                )
                print(rows[-1], flush=True)
        del ws, heads
        torch.cuda.empty_cache()
    best = {}
    for r in rows:
        key = f"{r['np']}/{r['N']}"
        if r["row_invariant"] and (key not in best or r["ratio"] > best[key]["ratio"]):
            best[key] = r
    harness.report(
        "tune_draft_head_fp8_wgmma",
        ["N", "rows", "np", "cfg", "row_invariant", "stock_us", "fp8_us", "ratio"],
        rows,
        args.out,
        {"K": K, "best": {k: v["cfg"] for k, v in best.items()}},
        overwrite=args.overwrite,
    )


if __name__ == "__main__":
    main()
