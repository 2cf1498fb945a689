"""One launch of each served wo_a twin kernel shape for Nsight Compute (not a benchmark: no JSON),
to see where the kernel waits: the small kernel at G = 2 / 4 / 8 with 2 and 8 rows of x and G = 2
with 32 rows; FORK_PROFILE_SHAPES="2:8,8:8" picks G:M pairs, FORK_PROFILE_KERNEL=mid launches the
wgmma mid kernel in its served configuration instead. Run on the GPU machine (see
tools/gpu_bundle_run.sh for the environment), e.g.
  ncu --kernel-name _wo_a_fp8_small_kernel --section WarpStateStats --section SchedulerStats \
      --section SpeedOfLight python3 benchmark/profile_wo_a_fp8.py
"""
from __future__ import annotations

import os

import torch

from bench_wo_a_fp8 import twin_exact_weight
from sglang.kernels.ops.gemm import dsv4_wo_a_fp8_sm90 as sm90
from sglang.srt.models.deepseek_v4_wo_a_twin import make_twin


def main() -> None:
    shapes = os.environ.get("FORK_PROFILE_SHAPES", "2:2,2:8,2:32,4:2,4:8,8:2,8:8")
    pick = [tuple(map(int, pair.split(":"))) for pair in shapes.split(",")]
    mid = os.environ.get("FORK_PROFILE_KERNEL") == "mid"
    for g in dict.fromkeys(g for g, _ in pick):
        w8, e = make_twin(twin_exact_weight(g, 0))
        packed, counters = sm90.pack_twin(w8), sm90.mid_counters(g, 1024, "cuda")
        for m in (m for gg, m in pick if gg == g):
            x = torch.randn(m, g, 4096, device="cuda").to(torch.bfloat16)
            sms = sm90._sm_count(x.device)
            if mid:
                print(f"G={g} M={m} mid config {sm90.mid_config(m, g, 1024, sms)}", flush=True)
                sm90.wo_a_fp8_mid_sm90(x, packed, e, counters)
            else:
                print(f"G={g} M={m} config {sm90.small_config(m, g, 1024, sms)}", flush=True)
                sm90.wo_a_fp8_small_sm90(x, packed, e)
            torch.cuda.synchronize()


if __name__ == "__main__":
    main()
