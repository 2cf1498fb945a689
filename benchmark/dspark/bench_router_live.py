"""The DSpark verify cap's live-aware router (moe_fused_gate(live_lens=...)) against stock
moe_fused_gate at the DeepSeek-V4 routing shape (384 experts, top 6, sqrtsoftplus, bf16 bias),
M = 6 * bs verify rows, 43 layers (distinct scores) in a CUDA graph. Goal: within 5 % of stock.
H200: the first form (live length -> anchor address -> scores) was 1.06-1.10x stock; the
series' form (routing runs stock's code, only the stores read the live length) 0.98-1.01x
at bs 1..64 (every form tried: benchmark/results/archive/router_live_forms-NVIDIA_H200.json).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmark/: harness.py

from harness import (  # noqa: E402
    LAYERS,
    floor_us,
    graph_us_per_call,
    parse_args,
    report,
    tbps,
)

from sglang.kernels.ops.moe.moe_fused_gate import moe_fused_gate  # noqa: E402

N, TOPK, STRIDE = 384, 6, 6
REPEATS = 5


def gate(scores, bias, **kw):
    return moe_fused_gate(
        scores,
        bias,
        TOPK,
        scoring_func="sqrtsoftplus",
        renormalize=True,
        routed_scaling_factor=1.5,
        apply_routed_scaling_factor_on_output=True,
        **kw,
    )


def main() -> None:
    args = parse_args(__doc__)
    torch.manual_seed(0)
    bias = (0.1 * torch.randn(N, device="cuda")).to(torch.bfloat16)
    rows = []
    for bs in (1, 2, 4, 8, 16, 32, 64):
        m = bs * STRIDE
        scores = [torch.randn(m, N, device="cuda") for _ in range(LAYERS)]
        live = torch.randint(2, STRIDE + 1, (1024,), device="cuda")
        # Interleaved repeats, median: at ~3 us a call, drift between two runs is ~2 %.
        times = {"stock": [], "live": []}
        for _ in range(REPEATS):
            times["stock"].append(
                graph_us_per_call(
                    [lambda s=s: gate(s, bias) for s in scores], args.replays
                )
            )
            times["live"].append(
                graph_us_per_call(
                    [
                        lambda s=s: gate(s, bias, live_lens=live, live_stride=STRIDE)
                        for s in scores
                    ],
                    args.replays,
                )
            )
        stock, ours = (statistics.median(times[k]) for k in ("stock", "live"))
        nbytes = m * N * 4 + m * TOPK * 8
        rows.append(
            {
                "bs": bs,
                "M": m,
                "stock_us": stock,
                "live_us": ours,
                "ratio": ours / stock,
                "floor_us": floor_us(nbytes),
                "stock_TBps": tbps(nbytes, stock),
                "per_step_delta_us_43_layers": (ours - stock) * LAYERS,
            }
        )
    report(
        "router_live",
        list(rows[0]),
        rows,
        args.out,
        {
            "layers": LAYERS,
            "experts": N,
            "topk": TOPK,
            "stride": STRIDE,
            "repeats": REPEATS,
            "what": "stock moe_fused_gate vs the same kernel with live_lens (random live lengths 2..6)",
        },
        overwrite=args.overwrite,
    )


if __name__ == "__main__":
    main()
