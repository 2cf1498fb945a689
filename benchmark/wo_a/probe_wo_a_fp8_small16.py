"""Candidates for the wo_a twin's Hopper small kernel against what served before, in one run (H200):
- ``rows_per_cta=16``: a CTA per 16 weight rows instead of 8, so the m16n8k16's A operand is full
  (no zero rows to build), x is read from shared memory once per 16 rows, and there are half the
  MMAs and ldmatrix per weight; 128 CTAs at G = 2 (one per SM), 121 registers;
- ``cvt=CVT_PRMT``: the e4m3 -> bf16 conversion by PRMT / shift / mask + the scale's HMUL2, 4
  instructions per pair of weights instead of 5 (no F2FP);
- 9..16 rows (16 rows of x per CTA, two n8 tiles) against the ``mid`` kernel that served them.
All keep the small kernel's MMA chains and reduction order, so they give its bits
(test_gpu_hopper_small_candidates_bitwise_to_shipped checks that, every e4m3 code and M included;
rows 9..16 give the bits of two calls of <= 8 rows); ``bitwise_to_small`` re-checks it here.
Result (wo_a_fp8_small16_probe-NVIDIA_H200.json): 16 rows + PRMT is fastest at every G and M,
5.22-5.24 us against 5.63-5.64 at G = 2 (1.36x a pure read), and at G = 2 it beats the mid kernel
at 9..16 rows (5.9 against 7.3 us); both serve since 0.5.23+fork.7.7a2225f. That JSON also holds
two variants measured at commit 157a1a3 and removed after (slower or even): the weights staged by
cp.async (``_wcp``: 5.6 us at G = 2, 18.5 at G = 8) and one wait for all of x (``_xw1``).
Not run by the GPU bundle by default: BENCH=probe_wo_a_fp8_small16.py bash build/gpu-bundle/run.sh DIR
(the GPU tests, which include the candidates' exactness, then this probe).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmark/: harness.py

from bench_wo_a_fp8 import hopper_layers, pure_read_us  # noqa: E402
from harness import LAYERS, graph_us_per_call, parse_args, report, tbps  # noqa: E402
from sglang.kernels.ops.gemm import dsv4_wo_a as up  # noqa: E402
from sglang.kernels.ops.gemm import dsv4_wo_a_fp8_sm90 as sm90  # noqa: E402
from sglang.srt.models.deepseek_v4_wo_a_twin import mid_rows_faster  # noqa: E402

CONFIGS = {  # name: (rows_per_cta, cvt); "small" served up to 0.5.23+fork.7.71e3af7, "small_rows16_prmt" since
    "small": (8, sm90.CVT_F16),
    "small_rows16": (16, sm90.CVT_F16),
    "small_prmt": (8, sm90.CVT_PRMT),
    "small_rows16_prmt": (16, sm90.CVT_PRMT),
}


def main() -> None:
    args = parse_args(__doc__)
    rows = []
    for g in (2, 4, 8):
        weights, twins, packed, counters = hopper_layers(g)
        assert all(t is not None and int(t[1].max()) <= sm90.max_biased_exp(sm90.CVT_PRMT) for t in twins)
        nbytes = twins[0][0].numel() + twins[0][1].numel()
        read_us = pure_read_us(twins, args.replays)
        for m in (1, 2, 4, 8, 12, 16):
            x = torch.randn(m, g, 4096, device="cuda").to(torch.bfloat16)
            if g == 2 and 2 <= m <= 8:  # upstream's small-batch kernel takes 2..8 rows; else einsum
                stock_name, stock = "wo_a_bf16_small_batch", lambda i: up.wo_a_bf16_small_batch(x, weights[i])
            else:
                stock_name, stock = "einsum", lambda i: torch.einsum("tgd,grd->tgr", x, weights[i])
            stock_us = graph_us_per_call([lambda i=i: stock(i) for i in range(LAYERS)], args.replays)
            served = ("stock (small under drop)" if m == 1 else "small" if m <= 8
                      else "mid" if m <= mid_rows_faster(g) else "stock")  # by 0.5.23+fork.7.71e3af7
            ref = sm90.wo_a_fp8_small_sm90(x, packed[0], twins[0][1], rows_per_cta=8, cvt=sm90.CVT_F16) if m <= 8 else None
            served_us = None
            if m > 8:  # what serves these rows now: the mid kernel
                mid = [lambda i=i: sm90.wo_a_fp8_mid_sm90(x, packed[i], twins[i][1], counters[i]) for i in range(LAYERS)]
                served_us = graph_us_per_call(mid, args.replays)
                rows.append({"G": g, "M": m, "kernel": "mid", "us": served_us, "x_before": 1.0,
                             "x_pure_read": served_us / read_us, "x_stock": stock_us / served_us,
                             "TB/s": tbps(nbytes, served_us), "pure_read_us": read_us, "stock": stock_name,
                             "stock_us": stock_us, "bitwise_to_small": None, "served_before": served})
            for name, (rb, cvt) in CONFIGS.items():
                def call(i, rb=rb, cvt=cvt):
                    return sm90.wo_a_fp8_small_sm90(x, packed[i], twins[i][1], rows_per_cta=rb, cvt=cvt)

                if m <= 8:
                    bitwise = torch.equal(call(0).view(torch.int16), ref.view(torch.int16))
                else:  # rows 9..16 against two calls of <= 8 rows of the small kernel
                    halves = [sm90.wo_a_fp8_small_sm90(x[a:b], packed[0], twins[0][1], rows_per_cta=8, cvt=sm90.CVT_F16)
                              for a, b in ((0, 8), (8, m))]
                    bitwise = torch.equal(call(0).view(torch.int16), torch.cat(halves).view(torch.int16))
                us = graph_us_per_call([lambda i=i: call(i) for i in range(LAYERS)], args.replays)
                served_us = served_us or us
                rows.append({"G": g, "M": m, "kernel": name, "us": us, "x_before": served_us / us,
                             "x_pure_read": us / read_us, "x_stock": stock_us / us, "TB/s": tbps(nbytes, us),
                             "pure_read_us": read_us, "stock": stock_name, "stock_us": stock_us,
                             "bitwise_to_small": bitwise, "served_before": served})
        del weights, twins, packed, counters
    report("wo_a_fp8_small16_probe", ["G", "M", "kernel", "us", "x_before", "x_pure_read", "x_stock", "TB/s",
                                      "bitwise_to_small"], rows, args.out,
           {"layers": LAYERS, "configs": {k: list(v) for k, v in CONFIGS.items()}})


if __name__ == "__main__":
    main()
