"""Where the wo_a twin kernel's time goes, for Nsight Compute (not a benchmark: run under ncu).

Runs upstream's ``wo_a_bf16_small_batch`` (partial + reduce) and the fork's
``wo_a_fp8_matmul`` (one kernel, in-kernel reduction) at M = 4, G = 2 on one random layer whose
bf16 weight has an exact fp8 twin, a few times each, so ncu can compare the two kernels'
throughput, occupancy and warp stalls:

  ncu --clock-control none --kernel-name regex:wo_a --launch-skip 6 --launch-count 6 \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
      python3 benchmark/probe_wo_a_fp8_ncu.py
"""

import torch

from sglang.kernels.ops.gemm.dsv4_wo_a import wo_a_bf16_small_batch
from sglang.kernels.ops.gemm.dsv4_wo_a_fp8 import counters_for, wo_a_fp8_matmul
from sglang.srt.models.deepseek_v4_wo_a_twin import make_twin

torch.manual_seed(0)
w8 = torch.randn(2, 1024, 4096, device="cuda").clamp(-448, 448).to(torch.float8_e4m3fn)
exp = torch.randint(115, 125, (2, 32, 128), device="cuda", dtype=torch.uint8)
scale = torch.exp2(exp.float() - 127).repeat_interleave(32, 1).repeat_interleave(32, 2)
weight = (w8.float() * scale).to(torch.bfloat16)
twin = make_twin(weight)
assert twin is not None, "the random weight has no exact twin"
x = torch.randn(4, 2, 4096, device="cuda", dtype=torch.bfloat16)
counters = counters_for(twin[0])
for _ in range(3):
    wo_a_bf16_small_batch(x, weight)
    wo_a_fp8_matmul(x, twin[0], twin[1], counters)
torch.cuda.synchronize()
print("ok")
