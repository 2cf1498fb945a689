"""Candidate for the wo_a twin's 17..32 rows (not served; branch wip/small-kernel-32-rows): the
staged small kernel with x in the weights' ring and four n8 tiles of x, against what serves those
rows now (the wgmma ``mid`` kernel at G = 2 up to 32 rows and G = 8, stock elsewhere) and einsum,
in one run: 43 layers, CUDA graph, G = 2 / 4 / 8, 17 / 24 / 32 rows.
Why it may pay: at 9..16 rows the same kernel (two n8 tiles) runs 4.93-5.03 us at G = 2 against
8.0 us for the wgmma kernel at 24 rows (benchmark/results/wo_a_fp8-NVIDIA_H200.json); each n8 tile
is its own K-order MMA chain, so the bits stay those of calls of <= 8 rows (``bitwise`` column,
and test_gpu_hopper_small_kernel_32_rows_bitwise). Shared memory: 7 ring buffers of 4 KB of
weights + 16 KB of x, one CTA per SM.
Run: TESTS='test/test_wo_a_fp8_twin.py -k 32_rows' BENCH=probe_wo_a_fp8_small32.py bash build/gpu-bundle/run.sh DIR
"""
from __future__ import annotations

import torch

from bench_wo_a_fp8 import pure_read_us, twin_exact_weight
from harness import LAYERS, graph_us_per_call, parse_args, report, tbps
from sglang.kernels.ops.gemm import dsv4_wo_a_fp8_sm90 as sm90
from sglang.srt.models.deepseek_v4_wo_a_twin import make_twin


def main() -> None:
    args = parse_args(__doc__)
    rows = []
    for g in (2, 4, 8):
        weights = [twin_exact_weight(g, i) for i in range(LAYERS)]
        twins = [make_twin(w) for w in weights]
        packed = [sm90.pack_twin(t[0]) for t in twins]
        counters = [sm90.mid_counters(g, 1024, "cuda") for _ in twins]
        nbytes = twins[0][0].numel() + twins[0][1].numel()
        read_us = pure_read_us(twins, args.replays)
        for m in (17, 24, 32):
            x = torch.randn(m, g, 4096, device="cuda").to(torch.bfloat16)
            einsum_us = graph_us_per_call(
                [lambda i=i: torch.einsum("tgd,grd->tgr", x, weights[i]) for i in range(LAYERS)], args.replays)
            mid_us = graph_us_per_call(
                [lambda i=i: sm90.wo_a_fp8_mid_sm90(x, packed[i], twins[i][1], counters[i]) for i in range(LAYERS)],
                args.replays)
            rows.append({"G": g, "M": m, "kernel": "mid", "us": mid_us, "x_einsum": einsum_us / mid_us,
                         "x_mid": 1.0, "x_pure_read": mid_us / read_us, "TB/s": tbps(nbytes, mid_us),
                         "einsum_us": einsum_us, "pure_read_us": read_us, "bitwise": None})
            want = torch.cat([sm90.wo_a_fp8_small_sm90(x[a:min(a + 8, m)], packed[0], twins[0][1])
                              for a in range(0, m, 8)])
            for stage in (4, 6, 8):
                def call(i, stage=stage):
                    return sm90.wo_a_fp8_small_sm90(x, packed[i], twins[i][1], stage=stage, x_ring=True)

                bitwise = torch.equal(call(0).view(torch.int16), want.view(torch.int16))
                us = graph_us_per_call([lambda i=i: call(i) for i in range(LAYERS)], args.replays)
                rows.append({"G": g, "M": m, "kernel": f"small_stage{stage}_xring", "us": us,
                             "x_einsum": einsum_us / us, "x_mid": mid_us / us, "x_pure_read": us / read_us,
                             "TB/s": tbps(nbytes, us), "einsum_us": einsum_us, "pure_read_us": read_us,
                             "bitwise": bitwise})
        del weights, twins, packed, counters
    report("wo_a_fp8_small32_probe", ["G", "M", "kernel", "us", "x_einsum", "x_mid", "x_pure_read", "TB/s",
                                      "bitwise"], rows, args.out, {"layers": LAYERS})


if __name__ == "__main__":
    main()
