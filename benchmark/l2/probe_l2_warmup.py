"""Probe: how much of the cold-to-warm gap of a decode linear can any side-stream warm-up recover?

bench_l2_prefetch.py found the prefetched linears still 7 to 20 % over their warm-L2 time on the
H200, whatever the collective's length. This probe separates the causes. Each span is the
bench's: a stand-in collective (one CTA spinning) then a bf16 linear on its own weight, LAYERS
spans in one CUDA graph. During the spin a side stream warms the weight the linear reads next,
joined before the linear, in one of these ways:

  cold       nothing (stock)
  bulk-32    the fork's kernel: cp.async.bulk.prefetch.L2, 16 KiB per lane, 32 lanes per CTA
  bulk-1     the same instruction, one lane per CTA (the chunks spread over every SM)
  read       a full read of the weight by an ordinary reduction (every SM loads every line
             through L2: the best any prefetch can leave behind, address translations included)
  warm       every span reads the same weight (L2-resident: the bench's target)

If ``read`` reaches ``warm`` and ``bulk-*`` do not, the prefetch instruction leaves the gap; if
``read`` does not either, the gap is not L2 residency a prefetch can give. Prints a table and
writes l2_warmup_probe-<device>.json under --out.
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
from bench_l2_prefetch import MB, K, spin  # noqa: E402
from l2_prefetch_kernel import _l2_prefetch_kernel, chunk_table  # noqa: E402

MODES = ("cold", "bulk-32", "bulk-1", "read", "warm")


def spans_us(weights, x, spin_ns, replays, mode) -> float:
    scratch = torch.zeros(1, dtype=torch.int64, device="cuda")
    sink = torch.zeros((), dtype=torch.float32, device="cuda")
    outs = [
        (
            None
            if w is None
            else torch.empty(
                x.shape[0], w.shape[0], device="cuda", dtype=torch.bfloat16
            )
        )
        for w in weights
    ]
    tables = [
        (
            chunk_table([(w.data_ptr(), w.numel() * w.element_size())], w.device)
            if w is not None and mode.startswith("bulk")
            else None
        )
        for w in weights
    ]
    side = torch.cuda.Stream()

    def span(i):
        main = torch.cuda.current_stream()
        warming = weights[i] is not None and mode not in ("cold", "warm")
        if warming:
            side.wait_stream(main)
            with torch.cuda.stream(side):
                if mode == "read":
                    torch.sum(weights[i].view(-1), dim=0, dtype=torch.float32, out=sink)
                else:
                    addrs, sizes = tables[i]
                    lanes = 32 if mode == "bulk-32" else 1
                    n = addrs.numel()
                    _l2_prefetch_kernel[((n + lanes - 1) // lanes,)](
                        addrs, sizes, n, LANES=lanes, num_warps=1
                    )
        spin(scratch, spin_ns)
        if warming:
            main.wait_stream(side)
        if weights[i] is not None:
            torch.matmul(x, weights[i].t(), out=outs[i])

    return harness.graph_us_per_call(
        [partial(span, i) for i in range(len(weights))], replays
    )


def main() -> None:
    p = harness.arg_parser(__doc__)
    p.add_argument("--collective-us", type=float, default=10.0)
    p.add_argument(
        "--weight-mb", type=lambda s: [int(v) for v in s.split(",")], default=[6, 24]
    )
    p.add_argument(
        "--rows", type=lambda s: [int(v) for v in s.split(",")], default=[1, 4, 16]
    )
    args = p.parse_args()
    spin_ns = int(args.collective_us * 1000)
    x0 = torch.zeros(1, K, device="cuda", dtype=torch.bfloat16)
    spin_only = spans_us([None] * harness.LAYERS, x0, spin_ns, args.replays, "cold")
    rows = []
    for mb in args.weight_mb:
        n = mb * MB // (K * 2)
        weights = [
            torch.randn(n, K, device="cuda", dtype=torch.bfloat16) * 0.02
            for _ in range(harness.LAYERS)
        ]
        for m in args.rows:
            x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
            us = {}
            for mode in MODES:
                ws = [weights[0]] * harness.LAYERS if mode == "warm" else weights
                us[mode] = spans_us(ws, x, spin_ns, args.replays, mode) - spin_only
            row = {
                "weight_MB": mb,
                "rows": m,
                **{f"{k}_us": v for k, v in us.items()},
                **{f"{k}_over_warm": us[k] / us["warm"] for k in MODES if k != "warm"},
            }
            rows.append(row)
            print(
                " ".join(
                    f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in row.items()
                ),
                flush=True,
            )
        del weights
        torch.cuda.empty_cache()
    harness.report(
        "l2_warmup_probe",
        [
            "weight_MB",
            "rows",
            *[f"{k}_us" for k in MODES],
            *[f"{k}_over_warm" for k in MODES if k != "warm"],
        ],
        rows,
        args.out,
        {"layers": harness.LAYERS, "K": K, "collective_us": args.collective_us},
        overwrite=args.overwrite,
    )


if __name__ == "__main__":
    main()
