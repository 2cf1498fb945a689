"""Tuning sweep for the fp8 draft-head kernel (one GPU run): every candidate (block_n, block_k,
num_warps, num_stages, dequantization path) at 1/16 rows (one row tile) and 20/32 rows (two),
on the TP4 (32320) and TP1 (129280) shards against cuBLAS bf16, each checked against an fp64
reference first (bf16 logits, within 8e-3 of the largest). Kernels compile in parallel worker processes (Triton's disk cache) before
timing. Prints a table, writes tune_draft_head_fp8-<device>.json and, for each number of row
tiles, the config with the best worst-case ratio over both shards (best_configs.json, which
bench_draft_head_fp8.py --configs reads).
"""

from __future__ import annotations

import json
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

from sglang.kernels.ops.speculative.dspark import draft_head_fp8 as kern  # noqa: E402

K = 5120
SHAPES = ((32320, 6), (129280, 2))  # (N, copies rotated per graph): TP4 and TP1 shards
# (block_n, block_k, num_warps, num_stages[, weights by TMA])
TILES = [
    (128, 128, 8, 4),
    (128, 128, 8, 6),
    (128, 128, 4, 4),
    (128, 256, 8, 3),
    (128, 256, 8, 4),
    (128, 64, 8, 6),
    (256, 128, 8, 3),
    (256, 128, 8, 4),
    (256, 64, 8, 6),
    (256, 128, 16, 4),
    (64, 128, 4, 4),
    (64, 128, 4, 6),
    (64, 256, 4, 3),
    (64, 64, 4, 8),
    (128, 256, 4, 3),
    (256, 256, 8, 3),
    (128, 128, 8, 4, 1),
    (128, 128, 8, 6, 1),
    (256, 128, 8, 4, 1),
    (128, 256, 8, 3, 1),
    (64, 128, 4, 4, 1),
    (256, 64, 8, 6, 1),
    (128, 64, 8, 6, 1),
    (64, 128, 4, 6, 1),
]
CVT_TRITON_TILES = [(128, 128, 8, 4), (64, 128, 4, 4), (256, 128, 8, 4)]


def candidates(m_tiles: int) -> list[tuple]:
    c = [(t, kern.CVT_ASM) for t in TILES]
    if m_tiles == 1:
        c += [(t, kern.CVT_TRITON) for t in CVT_TRITON_TILES]
    return c


def _compile(job) -> str:
    (bn, bk, nw, ns, *tma), cvt, m_tiles, out_dtype = job
    import torch as t

    from sglang.kernels.ops.speculative.dspark import draft_head_fp8 as k

    try:
        w = t.float8_e4m3fn
        if tma and tma[0]:
            w = k._weight_descriptor(t.empty((256, K), dtype=w, device="cuda"), bn, bk)
        k._draft_head_fp8_kernel.warmup(
            t.bfloat16,
            w,
            t.float32,
            out_dtype,
            16 * m_tiles,
            32320,
            K,
            K,
            K,
            K // 32,
            32320,
            grid=(1,),
            BLOCK_N=bn,
            BLOCK_K=bk,
            M_TILES=m_tiles,
            CVT=cvt,
            W_TMA=bool(tma and tma[0]),
            num_warps=nw,
            num_stages=ns,
        )
        return ""
    except Exception as e:  # noqa: BLE001 (reported, the config is dropped)
        return f"{job}: {type(e).__name__}: {str(e)[-300:]}"


def precompile(jobs, workers: int) -> int:
    """Compile in parallel into Triton's disk cache; returns the number that failed."""
    t0 = time.time()
    failed = 0
    with mp.get_context("spawn").Pool(workers) as pool:
        for err in pool.imap_unordered(_compile, jobs):
            if err:
                failed += 1
                print("compile failed:", err, flush=True)
    print(
        f"compiled {len(jobs) - failed}/{len(jobs)} kernels in {time.time() - t0:.1f} s",
        flush=True,
    )
    return failed


def main() -> None:
    p = harness.arg_parser(__doc__, replays=20)
    p.add_argument("--workers", type=int, default=14)
    p.add_argument(
        "--rows", default="1,16:20,32:48:64"
    )  # rows per m_tiles group, ':' separated
    p.add_argument(
        "--time-limit", type=float, default=120.0, help="stop timing after this many s"
    )
    args = p.parse_args()
    t_start = time.time()
    groups = [[int(r) for r in g.split(",")] for g in args.rows.split(":")]
    jobs = []
    for rows in groups:
        mt = kern.triton.cdiv(max(rows), kern.ROW_TILE)
        jobs += [(t, cvt, mt, torch.bfloat16) for t, cvt in candidates(mt)]
    if (
        precompile(jobs, args.workers) > len(jobs) // 2
    ):  # serial compiles would eat the GPU budget
        global TILES, CVT_TRITON_TILES
        TILES, CVT_TRITON_TILES = TILES[:4] + TILES[16:18], []
        print(f"parallel compile failed: sweeping only {TILES}", flush=True)

    results = []
    for n, copies in SHAPES:
        ws = [
            (torch.randn(n, K, device="cuda") * 0.02).to(torch.bfloat16)
            for _ in range(copies)
        ]
        qs = [kern.quantize_head_fp8(w) for w in ws]
        fp8_bytes = n * K + qs[0][1].numel() * 4
        deq = kern.dequantize_head_fp8(*qs[0]).double()
        for rows in groups:
            mt = kern.triton.cdiv(max(rows), kern.ROW_TILE)
            for m in rows:
                x = torch.randn(m, K, device="cuda").to(torch.bfloat16)
                exact = x.double() @ deq.T
                souts = [
                    torch.empty((m, n), device="cuda", dtype=torch.bfloat16) for _ in ws
                ]
                stock = harness.graph_us_per_call(
                    [partial(torch.matmul, x, w.T, out=o) for w, o in zip(ws, souts)],
                    args.replays,
                )
                for tile, cvt in candidates(mt):
                    if time.time() - t_start > args.time_limit:
                        print(
                            f"time limit: N={n} rows={m} {tile} not timed", flush=True
                        )
                        continue
                    try:
                        # bf16 logits (what the sweep times): a wrong kernel is far off; the
                        # fp32 exactness of the chosen configs is tested in test_draft_head_fp8
                        got = kern.draft_head_fp8_logits(
                            x, *qs[0], config=tile, cvt=cvt, out_dtype=torch.bfloat16
                        )
                        err = float(
                            (got.double() - exact).abs().max() / exact.abs().max()
                        )
                        outs = [
                            torch.empty((m, n), device="cuda", dtype=torch.bfloat16)
                            for _ in qs
                        ]
                        us = harness.graph_us_per_call(
                            [
                                partial(
                                    kern.draft_head_fp8_logits,
                                    x,
                                    q,
                                    s,
                                    out=o,
                                    config=tile,
                                    cvt=cvt,
                                )
                                for (q, s), o in zip(qs, outs)
                            ],
                            args.replays,
                        )
                    except Exception as e:  # noqa: BLE001
                        print(
                            f"N={n} rows={m} {tile} cvt={cvt}: {type(e).__name__} {str(e)[-200:]}",
                            flush=True,
                        )
                        continue
                    r = {
                        "N": n,
                        "rows": m,
                        "m_tiles": mt,
                        "cfg": "x".join(map(str, tile)),
                        "cvt": cvt,
                        "stock_us": stock,
                        "fp8_us": us,
                        "ratio": stock / us,
                        "fp8_TBps": harness.tbps(fp8_bytes, us),
                        "rel_err": err,
                    }
                    results.append(r)
                    print(
                        " ".join(
                            f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                            for k, v in r.items()
                        ),
                        flush=True,
                    )
        del ws, qs, deq, exact
        torch.cuda.empty_cache()

    best = {}
    for rows in groups:
        mt = kern.triton.cdiv(max(rows), kern.ROW_TILE)
        by_cfg: dict[str, list[float]] = {}
        for r in results:
            if r["m_tiles"] == mt and r["cvt"] == kern.CVT_ASM and r["rel_err"] < 8e-3:
                by_cfg.setdefault(r["cfg"], []).append(r["ratio"])
        full = {
            c: min(v) for c, v in by_cfg.items() if len(v) == 2 * len(rows)
        }  # both shards, every row
        if full:
            ranked = sorted(full.items(), key=lambda kv: -kv[1])
            best[mt] = [int(v) for v in ranked[0][0].split("x")]
            print(f"m_tiles={mt}: best worst-case ratios {ranked[:6]}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "best_configs.json").write_text(  # not a result: --configs input
        json.dumps(best) + "\n"
    )  # the result (its "best" too) is the report below
    harness.report(
        "tune_draft_head_fp8",
        [
            "N",
            "rows",
            "m_tiles",
            "cfg",
            "cvt",
            "stock_us",
            "fp8_us",
            "ratio",
            "fp8_TBps",
            "rel_err",
        ],
        results,
        args.out,
        {"K": K, "best": best},
        overwrite=args.overwrite,
    )


if __name__ == "__main__":
    main()
