"""Distinct routed experts per MoE layer in a DSpark verify batch as the verified drafts k go
1..5 (live length k + 1 of 6 rows, dead rows routed as their anchor by the live-aware router).
Routing comes from real router logits of RANDOM weights (hidden 7168, 384 experts, top 6,
sqrtsoftplus, 43 layers, random hidden states): trained routers are more concentrated, so
the saving on a real checkpoint differs. MoE weight bytes per layer scale with the distinct
experts (each expert's weights are streamed once per layer at decode batch sizes).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmark/: harness.py

from harness import LAYERS, parse_args, report  # noqa: E402

from sglang.kernels.ops.moe.moe_fused_gate import moe_fused_gate  # noqa: E402

HIDDEN, N, TOPK, STRIDE = 7168, 384, 6, 6


def main() -> None:
    args = parse_args(__doc__)
    torch.manual_seed(0)
    gates = [
        torch.randn(N, HIDDEN, device="cuda", dtype=torch.bfloat16) / HIDDEN**0.5
        for _ in range(LAYERS)
    ]
    bias = torch.zeros(N, device="cuda", dtype=torch.bfloat16)
    rows = []
    for bs in (1, 4, 16, 64):
        hidden = [
            torch.randn(bs * STRIDE, HIDDEN, device="cuda", dtype=torch.bfloat16)
            for _ in range(LAYERS)
        ]
        base = None
        for k in range(1, STRIDE):
            live = torch.full((1024,), k + 1, device="cuda")
            distinct = []
            for w, h in zip(gates, hidden):
                scores = (h @ w.t()).float()
                _, ids = moe_fused_gate(
                    scores,
                    bias,
                    TOPK,
                    scoring_func="sqrtsoftplus",
                    live_lens=live,
                    live_stride=STRIDE,
                )
                distinct.append(int(torch.unique(ids).numel()))
            mean = sum(distinct) / len(distinct)
            base = mean if k == STRIDE - 1 else base
            rows.append(
                {"bs": bs, "k": k, "rows_live": bs * (k + 1), "distinct_experts": mean}
            )
        for r in rows:
            if r["bs"] == bs:
                r["moe_bytes_vs_k5"] = r["distinct_experts"] / base
    report(
        "verify_cap_experts",
        list(rows[0]),
        rows,
        args.out,
        {
            "layers": LAYERS,
            "hidden": HIDDEN,
            "experts": N,
            "topk": TOPK,
            "routing": "random router weights and hidden states (not a checkpoint)",
        },
        overwrite=args.overwrite,
    )


if __name__ == "__main__":
    main()
