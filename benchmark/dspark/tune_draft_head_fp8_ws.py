"""Tuning sweep for the warp-specialized Hopper fp8 draft head (draft_head_fp8_ws.py) at 1..128
rows: every candidate (vocab rows per consumer warpgroup, stages) at each wgmma N, on the
TP4 (32320) and TP1 (129280) shards, against cuBLAS bf16 and the one-warpgroup wgmma kernel
(draft_head_fp8_wgmma.py, up to its 64 rows), in one GPU run. Each candidate's logits are first
checked bit for bit against the wgmma kernel's, computed 32 rows at a time (the two kernels must
give the same bits, and a row's bits must not depend on the row count); a candidate that differs
is reported and not timed. Writes tune_draft_head_fp8_ws-<device>.json: every candidate's time
against both (``ratio``: cuBLAS over it, ``vs_wgmma``: the wgmma kernel over it) and, per N and
shard, the candidate whose worst ratio to cuBLAS over its row counts is best (the shipped
``CONFIGS`` are chosen from it; where it ships is decided by ``vs_wgmma`` and ``ratio``).
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
sys.path.insert(0, str(REPO / "benchmark" / "dspark"))

import draft_head_fp8_ws as ws  # noqa: E402
import harness  # noqa: E402
import torch  # noqa: E402

from sglang.kernels.ops.gemm.e4m3_to_bf16 import permute_k  # noqa: E402
from sglang.kernels.ops.speculative.dspark import draft_head_fp8 as kern  # noqa: E402
from sglang.kernels.ops.speculative.dspark import (  # noqa: E402
    draft_head_fp8_wgmma as wg,
)

K = 5120
SHAPES = ((32320, 6), (129280, 2))  # (N, copies rotated per graph)
ROWS = (1, 8, 16, 32, 33, 40, 64, 65, 96, 128)
CONSUMER_ROWS = (64, 128)
STAGES = (2, 3, 4, 5, 6)


def candidates(np_: int) -> list[tuple[int, int]]:
    return [
        (bvp, st)
        for bvp in CONSUMER_ROWS
        for st in STAGES
        if st * ws.stage_bytes(np_, bvp) <= ws._SMEM_BYTES
    ]


def _compile(job) -> str:
    m, cfg = job
    import torch as t

    sys.path.insert(0, str(REPO / "benchmark" / "dspark"))
    import draft_head_fp8_ws as w

    try:
        qp = t.zeros((512, K), dtype=t.float8_e4m3fn, device="cuda")
        s = t.ones((16, K // 32), dtype=t.float32, device="cuda")
        x = t.zeros((m, K), dtype=t.bfloat16, device="cuda")
        w.draft_head_fp8_logits_ws(x, qp, s, out_dtype=t.bfloat16, cfg=cfg)
        t.cuda.synchronize()
        return ""
    except Exception as e:  # noqa: BLE001 (reported, the config is dropped)
        return f"{job}: {type(e).__name__}: {str(e)[-400:]}"


def reference(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The wgmma kernel's logits, 32 rows a call (its bits do not depend on the row count)."""
    return torch.cat(
        [
            wg.draft_head_fp8_logits_wgmma(
                x[i : i + 32].clone(), q, s, out_dtype=torch.bfloat16
            )
            for i in range(0, x.shape[0], 32)
        ]
    )


def main() -> None:
    p = harness.arg_parser(__doc__, replays=20)
    p.add_argument("--workers", type=int, default=14)
    p.add_argument("--launch-timeout", type=float, default=120.0)
    args = p.parse_args()
    jobs = [(m, c) for m in ROWS for c in candidates(ws.padded_rows(m))]
    t0 = time.time()
    failed = set()
    with mp.get_context("spawn").Pool(args.workers) as pool:
        # each job also launches its candidate once: one that does not finish in time (a
        # deadlocked pipeline) ends the sweep, named, its workers killed, instead of hanging it
        pending = [(job, pool.apply_async(_compile, (job,))) for job in jobs]
        for job, res in pending:
            try:
                err = res.get(timeout=args.launch_timeout)
            except mp.TimeoutError:
                raise SystemExit(
                    f"{job}: no result {args.launch_timeout} s after the jobs before it: hung?"
                )
            if err:
                failed.add(job)
                print("compile failed:", err, flush=True)
    print(f"compiled {len(jobs) - len(failed)}/{len(jobs)} in {time.time() - t0:.1f} s")
    rows = []
    for n, copies in SHAPES:
        wts = [
            (torch.randn(n, K, device="cuda") * 0.02).to(torch.bfloat16)
            for _ in range(copies)
        ]
        heads = []
        for w in wts:
            q, s = kern.quantize_head_fp8(w)
            heads.append((permute_k(q), s))
        for m in ROWS:
            x = torch.randn(m, K, device="cuda").to(torch.bfloat16)
            ref = reference(x, *heads[0])
            outs = [
                torch.empty((m, n), device="cuda", dtype=torch.bfloat16) for _ in wts
            ]
            stock = harness.graph_us_per_call(
                [partial(torch.matmul, x, w.T, out=o) for w, o in zip(wts, outs)],
                args.replays,
            )
            one_wg = (
                harness.graph_us_per_call(
                    [
                        partial(wg.draft_head_fp8_logits_wgmma, x, q, s, out=o)
                        for (q, s), o in zip(heads, outs)
                    ],
                    args.replays,
                )
                if m <= wg.MAX_ROWS
                else None
            )
            for cfg in candidates(ws.padded_rows(m)):
                if (m, cfg) in failed:
                    continue
                got = ws.draft_head_fp8_logits_ws(
                    x, *heads[0], out_dtype=torch.bfloat16, cfg=cfg
                )
                same = bool(torch.equal(got, ref))
                us = (
                    harness.graph_us_per_call(
                        [
                            partial(
                                ws.draft_head_fp8_logits_ws, x, q, s, out=o, cfg=cfg
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
                        "np": ws.padded_rows(m),
                        "cfg": "x".join(map(str, cfg)),
                        "same_bits_as_wgmma": same,
                        "stock_us": stock,
                        "wgmma_us": one_wg,
                        "ws_us": us,
                        "ratio": stock / us,
                        "vs_wgmma": one_wg / us if one_wg else None,
                    }
                )
                print(rows[-1], flush=True)
        del wts, heads
        torch.cuda.empty_cache()
    # per N and shard: the configuration whose worst ratio over the row counts it serves is best
    by_cfg: dict[tuple, list[dict]] = {}
    for r in rows:
        by_cfg.setdefault((r["np"], r["N"], r["cfg"]), []).append(r)
    best = {}
    for (np_, n, cfg), rs in by_cfg.items():
        if not all(r["same_bits_as_wgmma"] for r in rs):
            continue
        worst = min(r["ratio"] for r in rs)
        key = f"{np_}/{n}"
        if key not in best or worst > best[key][1]:
            best[key] = (cfg, worst)
    harness.report(
        "tune_draft_head_fp8_ws",
        [
            "N",
            "rows",
            "np",
            "cfg",
            "same_bits_as_wgmma",
            "stock_us",
            "wgmma_us",
            "ws_us",
            "ratio",
            "vs_wgmma",
        ],
        rows,
        args.out,
        {"K": K, "best": {k: v[0] for k, v in best.items()}},
        overwrite=args.overwrite,
    )


if __name__ == "__main__":
    main()
