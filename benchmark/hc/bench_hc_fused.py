"""--dsv4-hc-fused-stats: the one-pass mix statistics against upstream's split-K kernels, and
the row threshold each route should serve from on this GPU.

DeepSeek-V4.1's shape: x [M, 4 x 5120] bf16 against the 24-row mixing weight. Routes:
``bf16x3`` (hc_mix_stats_sinkhorn_bf16x3, 16 slices: SM90's default for V4.1 prefill) and
``tf32x3`` (hc_mix_stats, 80 slices: the route without the bf16 weight parts). ``stock`` is
upstream's function with the feature off, ``ours`` the same call served by the feature (its
self-check runs on the first eager call and sets ``bitwise``). Distinct x copies rotate so at
least 120 MB stream per graph (the H200's L2 is 60 MB); CUDA-graph replay, median per call.
``min_rows`` per route: the smallest measured row count from which ours is at least
MARGIN x faster at every larger measured row count (None: never); that is the number
MEASURED_MIN_ROWS in sglang/srt/models/deepseek_v4_hc_fused.py takes for this GPU.
"""

from __future__ import annotations

import math
import sys
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools" / "standins"))
sys.path.insert(0, str(REPO / "benchmark"))

import harness  # noqa: E402
import torch  # noqa: E402

from sglang.kernels.ops.layernorm import mhc  # noqa: E402
from sglang.srt.models import deepseek_v4_hc_fused as hcf  # noqa: E402

K = 4 * 5120
HC = 4
MIX = (2 + HC) * HC
ROWS = [512, 1024, 2048, 4096, 8192, 16384, 32768, 65536]
MARGIN = 1.03
STREAM_BYTES = 120e6


def _weights():
    gen = torch.Generator().manual_seed(0)
    fn = (torch.randn(MIX, K, generator=gen) * 0.02).cuda()
    scale = (torch.rand(3, generator=gen) + 0.5).cuda()
    base = (torch.randn(MIX, generator=gen) * 0.1).cuda()
    return fn, mhc.split_bf16_hc_weight(fn.contiguous()), scale, base


def _calls(route, xs, fn, parts, scale, base, feature=None):
    """Upstream's function of the route over each input; handed ``feature``, ours."""
    if route == "bf16x3":
        return [
            partial(
                mhc.hc_mix_stats_sinkhorn_bf16x3,
                x,
                parts,
                scale,
                base,
                20,
                1e-6,
                1e-6,
                fused_stats=feature,
            )
            for x in xs
        ]
    return [partial(mhc.hc_mix_stats, x, fn, 1e-6, fused_stats=feature) for x in xs]


def measure(replays: int) -> tuple[list[dict], dict]:
    fn, parts, scale, base = _weights()
    rows_out = []
    for route in hcf.ROUTES:
        for m in ROWS:
            x_bytes = m * K * 2
            copies = max(2, math.ceil(STREAM_BYTES / x_bytes))
            xs = [
                (torch.randn(m, K, device="cuda") * 3).to(torch.bfloat16)
                for _ in range(copies)
            ]
            stock = harness.graph_us_per_call(
                _calls(route, xs, fn, parts, scale, base), replays
            )
            feature = hcf.HcFusedStats("1", torch.cuda.get_device_name())
            calls = _calls(route, xs, fn, parts, scale, base, feature)
            calls[0]()  # the self-check, eagerly, before any capture
            bitwise = set(feature.state.values()) == {"verified"}
            ours = harness.graph_us_per_call(calls, replays) if bitwise else None
            rows_out.append(
                {
                    "route": route,
                    "rows": m,
                    "copies": copies,
                    "bitwise": bitwise,
                    "stock_us": stock,
                    "ours_us": ours,
                    "ratio": stock / ours if ours else None,
                    "stock_TBps": harness.tbps(x_bytes, stock),
                    "ours_TBps": harness.tbps(x_bytes, ours) if ours else None,
                    "floor_us": harness.floor_us(x_bytes),
                }
            )
            print(
                " ".join(
                    f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in rows_out[-1].items()
                ),
                flush=True,
            )
            del xs, calls
            torch.cuda.empty_cache()
    return rows_out, {route: min_rows(rows_out, route) for route in hcf.ROUTES}


def min_rows(rows: list[dict], route: str):
    """Smallest row count from which every measured row count has ratio >= MARGIN."""
    found = None
    for r in sorted((r for r in rows if r["route"] == route), key=lambda r: -r["rows"]):
        if not r["bitwise"] or r["ratio"] is None or r["ratio"] < MARGIN:
            break
        found = r["rows"]
    return found


def main() -> None:
    args = harness.parse_args(__doc__)
    rows, thresholds = measure(args.replays)
    print(f"min_rows (ours >= {MARGIN}x from there on): {thresholds}")
    harness.report(
        "hc_fused",
        [
            "route",
            "rows",
            "copies",
            "bitwise",
            "stock_us",
            "ours_us",
            "ratio",
            "stock_TBps",
            "ours_TBps",
            "floor_us",
        ],
        rows,
        args.out,
        {
            "K": K,
            "margin": MARGIN,
            "min_rows": thresholds,
            "device_name": torch.cuda.get_device_name(),
        },
        overwrite=args.overwrite,
    )


if __name__ == "__main__":
    main()
