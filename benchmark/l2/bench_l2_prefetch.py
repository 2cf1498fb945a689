"""L2 prefetch at collective points (srt/distributed/l2_prefetch.py) on one GPU: decode linears
separated by stand-in collective points, cold against prefetched against warm, in one process.

A span: a stand-in collective (one CTA spinning on %globaltimer for --collective-us, where a
TP all-reduce would leave HBM idle) then a bf16 linear x [M, 5120] -> [M, N] reading a weight of
6 or 24 MB (N = bytes / 10240). A graph replays LAYERS spans, each with its own weight, so every
linear starts from cold L2 (``cold``: stock); ``prefetched``: the same graph through
L2Prefetcher (learned in the warm-up forward, replayed in the capture: at each collective point
a side-stream cp.async.bulk.prefetch.L2 of the first --budget-mb MB of
the next linear's weight, joined at the next point; by default the whole weight and, for the
24 MB one, also its first 6 MB, the budget an earlier GB10 deployment used); ``warm``: every span reads the same weight
(L2-resident). Linear time = (graph time - the spins alone) / LAYERS. Goal:
prefetched within 10 % of warm (``goal_met``: prefetched_us <= 1.10 x warm_us).
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools" / "standins"))
sys.path.insert(0, str(REPO / "benchmark"))

import harness  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from l2_prefetch_planner import L2Prefetcher, L2PrefetchPlanner  # noqa: E402

K = 5120
MB = 1 << 20


@triton.jit
def _spin_kernel(out_ptr, ns):
    t0 = tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
    )
    t = t0
    while t - t0 < ns:
        t = tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
        )
    tl.store(out_ptr, t - t0)


def spin(out, ns):
    _spin_kernel[(1,)](out, ns, num_warps=1)


def spans_us(weights, x, spin_ns, replays, prefetcher=None, key=None) -> float:
    """Median graph time of one span (spin + linear), LAYERS spans per graph."""
    scratch = torch.zeros(1, dtype=torch.int64, device="cuda")
    outs = [
        (
            None
            if w is None
            else torch.empty(
                x.shape[0], w.shape[0], device="cuda", dtype=torch.bfloat16
            )
        )
        for w in weights
    ]  # None: a span of the spin alone

    def span(i):
        if prefetcher is not None:
            if i == 0:
                prefetcher.begin(key)
            prefetcher.at_collective()
        spin(scratch, spin_ns)
        if weights[i] is not None:
            if prefetcher is not None:
                prefetcher.weight(weights[i], f"w{i}")
            torch.matmul(x, weights[i].t(), out=outs[i])
        if prefetcher is not None and i == len(weights) - 1:
            prefetcher.end()

    return harness.graph_us_per_call(
        [partial(span, i) for i in range(len(weights))], replays
    )


def measure(args) -> list[dict]:
    spin_ns = int(args.collective_us * 1000)
    rows = []
    spin_only = spans_us(
        [None] * harness.LAYERS,
        torch.zeros(1, K, device="cuda", dtype=torch.bfloat16),
        spin_ns,
        args.replays,
    )
    for mb in args.weight_mb:
        n = mb * MB // (K * 2)
        weights = [
            torch.randn(n, K, device="cuda", dtype=torch.bfloat16) * 0.02
            for _ in range(harness.LAYERS)
        ]
        for m in args.rows:
            x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
            cold = spans_us(weights, x, spin_ns, args.replays) - spin_only
            warm = (
                spans_us([weights[0]] * harness.LAYERS, x, spin_ns, args.replays)
                - spin_only
            )
            for budget in args.budget_mb or sorted({mb, min(mb, 6)}):
                pf = L2Prefetcher(L2PrefetchPlanner(budget_bytes=budget * MB))
                pre = (
                    spans_us(
                        weights, x, spin_ns, args.replays, pf, ("bench", mb, m, budget)
                    )
                    - spin_only
                )
                matched = pf.planner.mode_for(("bench", mb, m, budget)) == "apply"
                rows.append(
                    {
                        "weight_MB": mb,
                        "rows": m,
                        "budget_MB": budget,
                        "collective_us": args.collective_us,
                        "plan_matched": matched,
                        "cold_us": cold,
                        "prefetched_us": pre,
                        "warm_us": warm,
                        "prefetched_over_warm": pre / warm,
                        "cold_over_prefetched": cold / pre,
                        "goal_met": pre <= 1.10 * warm,
                        "floor_us": harness.floor_us(mb * MB),
                    }
                )
                print(
                    " ".join(
                        f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                        for k, v in rows[-1].items()
                    ),
                    flush=True,
                )
        del weights
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    p = harness.arg_parser(__doc__)
    p.add_argument("--collective-us", type=float, default=10.0)
    p.add_argument(
        "--weight-mb", type=lambda s: [int(v) for v in s.split(",")], default=[6, 24]
    )
    p.add_argument(
        "--rows", type=lambda s: [int(v) for v in s.split(",")], default=[1, 4, 16]
    )
    p.add_argument(
        "--budget-mb",
        type=lambda s: [int(v) for v in s.split(",")],
        default=None,
        help="prefetch budgets to measure (default: the whole weight, and 6 MB of larger ones)",
    )
    args = p.parse_args()
    rows = measure(args)
    harness.report(
        "l2_prefetch",
        [
            "weight_MB",
            "rows",
            "budget_MB",
            "plan_matched",
            "cold_us",
            "prefetched_us",
            "warm_us",
            "prefetched_over_warm",
            "cold_over_prefetched",
            "goal_met",
        ],
        rows,
        args.out,
        {"layers": harness.LAYERS, "K": K, "collective_us": args.collective_us},
        overwrite=args.overwrite,
    )


if __name__ == "__main__":
    main()
