"""What the wo_a twin's mid goals (2x stock at 9..64 rows, 1.5x at 65..192; stock is
einsum there) ask of this GPU, measured in one run. Per G and M:
- ``goal_us``: einsum's time (43 layers, CUDA graph) / 2 or / 1.5;
- ``goal_TFLOPs``: the bf16 MMA rate that time needs for 2 M G R D FLOPs. x is bf16 and has no
  exact fp8 form, so any exact kernel does stock's MMA work (plus the dequantisation);
  ``of_ceiling`` divides it by this card's bf16 GEMM ceiling, measured in the same run
  (8192^3 random bf16 matmul, the mean of 10 after 3 warm-ups);
- ``read_us``: a pure read of the twin's bytes in one kernel, the floor one kernel reaches;
- ``l2_model_us``: a lower bound for any kernel without thread-block clusters (a model, not a
  kernel). Every SM owns a rectangle of Wr weight rows x Kc columns of its share Bw of the twin,
  reads x's M rows at its columns from L2 (2 M Kc bytes) and, where K is split across SMs, writes
  and reads back fp32 partials (8 M Wr bytes): at best 8 M sqrt(Bw) bytes per SM beside the twin's,
  at the L2 read bandwidth measured here (an L2-resident buffer read by every SM, best of 3 sizes);
- ``verdict``: "no kernel" where goal_TFLOPs exceeds the ceiling; "needs clusters" where
  l2_model_us exceeds goal_us (TMA multicast of x and DSMEM split-K, which Gluon 3.6 does not
  expose: a native sm_90a kernel); else "open".
Run: TESTS=none BENCH=probe_wo_a_fp8_goals.py bash build/gpu-bundle/run.sh DIR
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmark/: harness.py

from bench_wo_a_fp8 import MID_M, pure_read, pure_read_us, twin_layers  # noqa: E402
from harness import LAYERS, graph_us_per_call, parse_args, report  # noqa: E402

R, D = 1024, 4096


def gemm_ceiling_tflops(n: int = 8192) -> float:
    a, b = (torch.randn(n, n, device="cuda").to(torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
        enable_timing=True
    )
    start.record()
    for _ in range(10):
        a @ b
    end.record()
    end.synchronize()
    return 2 * n**3 * 10 / (start.elapsed_time(end) * 1e-3) / 1e12


def l2_read_tbps(replays: int) -> float:
    """Best read rate of one L2-resident buffer (8..24 MB, the H200's L2 is 60 MB) by all SMs."""
    best = 0.0
    for mb in (8, 16, 24):
        words = torch.randint(
            0, 2**31 - 1, (mb * 2**18,), dtype=torch.int32, device="cuda"
        )
        for block in (1024, 2048, 4096):
            out = torch.empty(
                -(-words.numel() // block), dtype=torch.int32, device="cuda"
            )
            us = graph_us_per_call(
                [lambda: pure_read(words, out, block)] * LAYERS, replays
            )
            best = max(best, words.numel() * 4 / us / 1e6)
    return best


def main() -> None:
    args = parse_args(__doc__)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ceiling, l2 = gemm_ceiling_tflops(), l2_read_tbps(args.replays)
    print(
        f"bf16 GEMM ceiling {ceiling:.0f} TFLOP/s, L2 read {l2:.2f} TB/s, {sms} SMs",
        flush=True,
    )
    rows = []
    for g in (2, 4, 8):
        weights, twins = twin_layers(g)
        read_us = pure_read_us(twins, args.replays)
        twin_bytes = g * R * D + g * (R // 32) * (D // 32)
        for m in MID_M:
            x = torch.randn(m, g, D, device="cuda").to(torch.bfloat16)
            einsum_us = graph_us_per_call(
                [lambda w=w: torch.einsum("tgd,grd->tgr", x, w) for w in weights],
                args.replays,
            )
            goal_us = einsum_us / (2 if m <= 64 else 1.5)
            goal_tflops = 2 * m * g * R * D / goal_us / 1e6
            l2_model_us = (
                (twin_bytes + sms * 8 * m * math.sqrt(twin_bytes / sms)) / l2 / 1e6
            )
            verdict = (
                "no kernel"
                if goal_tflops > ceiling
                else "needs clusters" if l2_model_us > goal_us else "open"
            )
            rows.append(
                {
                    "G": g,
                    "M": m,
                    "einsum_us": einsum_us,
                    "goal_us": goal_us,
                    "goal_TFLOPs": goal_tflops,
                    "of_ceiling": goal_tflops / ceiling,
                    "read_us": read_us,
                    "l2_model_us": l2_model_us,
                    "verdict": verdict,
                }
            )
        del weights, twins
        torch.cuda.empty_cache()
    cols = [
        "G",
        "M",
        "einsum_us",
        "goal_us",
        "goal_TFLOPs",
        "of_ceiling",
        "read_us",
        "l2_model_us",
        "verdict",
    ]
    report(
        "wo_a_fp8_goals",
        cols,
        rows,
        args.out,
        {
            "layers": LAYERS,
            "R": R,
            "D": D,
            "gemm_ceiling_TFLOPs": ceiling,
            "l2_read_TBps": l2,
            "sms": sms,
        },
        overwrite=args.overwrite,
    )


if __name__ == "__main__":
    main()
