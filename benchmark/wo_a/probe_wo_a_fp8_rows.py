"""Candidates for the wo_a twin's small kernel, in one run against what serves (43 layers, CUDA
graph, G = 2 / 4 / 8): the ring 2 and 4 blocks shallower and deeper, against the wgmma ``mid``
kernel and einsum. Every candidate gives each row the bits of a call of <= 8 rows of the served kernel
(``bitwise`` column). A variant that does not fit the SM is listed with the error.
FORK_PROBE_BUDGET_S (default 480) stops early and still writes what it has.
Earlier runs (their JSON kept under benchmark/results/archive/): wo_a_fp8_rows_probe-NVIDIA_H200.json
(build 0.5.23+fork.7.288a10a, before small_config served its choices) measured 32 weight rows
per CTA (two m16 A operands share each B fragment of x: half the CTAs and half of x's L2 and
shared-memory traffic per weight byte; now served at G = 4 / 8) and 17..64 rows of x (4 or 8
n8 tiles, x in the ring; now served up to 32 rows), and ``_la`` rows: block i + 1's raw shared-memory loads
issued before block i's conversion and MMAs, within 1% of the same kernel without, so removed.
wo_a_fp8_rows_probe_rb8-NVIDIA_H200.json (FORK_PROBE_G=2,4,8 FORK_PROBE_M=2,8,16) has 8 weight
rows per CTA staged (8-byte copies; twice the CTAs, two or more per SM to hide each other's block
barriers): 5.0-5.9 us at G = 2 against 4.50-4.52 served, slower at every shape, so removed.
wo_a_fp8_wait_probe-NVIDIA_H200.json (FORK_PROBE_NAME=wo_a_fp8_wait_probe, build 7e7051b) has
the block waits in pairs at the served depth +- 2, and 64 weight rows per CTA at G = 8, whose
``rb64`` rows are wrong bits (rows 32..63 took rows 0..31's exponents) and not faster (10.9-11.4
us against 10.6-11.0 served), so removed; the paired waits were not faster than the depth alone
(wo_a_fp8_depth_probe-NVIDIA_H200.json, build bcb7ef0: depth +- 1 / 2 and paired waits at G = 2
and 8), so removed too.
Run: TESTS=none BENCH=probe_wo_a_fp8_rows.py bash build/gpu-bundle/run.sh DIR
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmark/: harness.py

from bench_wo_a_fp8 import hopper_layers, pure_read_us  # noqa: E402
from harness import LAYERS, graph_us_per_call, parse_args, report, tbps  # noqa: E402

from sglang.kernels.ops.gemm import dsv4_wo_a_fp8_sm90 as sm90  # noqa: E402


def variants(g: int, m: int) -> list[tuple[str, dict]]:
    """(name, small-kernel keyword arguments) measured at G = g and m rows of x: what serves, and
    the ring 2 and 4 blocks shallower and deeper (as shared memory allows)."""
    rb, stage, _ = sm90.small_config(m, g, 1024, 132)
    out = [("served", {})]
    for st in (stage - 4, stage - 2, stage + 2, stage + 4):
        if 2 <= st <= min(sm90.ring_fit(rb, m), 15):
            out.append(
                (f"rb{rb}_s{st}_xr", {"rows_per_cta": rb, "stage": st, "x_ring": True})
            )
    return out


def main() -> None:
    args = parse_args(__doc__)
    budget = float(os.environ.get("FORK_PROBE_BUDGET_S", "480"))
    t0 = time.time()
    rows = []
    cols = [
        "G",
        "M",
        "kernel",
        "us",
        "x_einsum",
        "x_served",
        "x_pure_read",
        "TB/s",
        "bitwise",
    ]
    for g in tuple(int(v) for v in os.environ.get("FORK_PROBE_G", "2,8,4").split(",")):
        weights, twins, packed, counters = hopper_layers(g)
        nbytes = twins[0][0].numel() + twins[0][1].numel()
        read_us = pure_read_us(twins, args.replays)
        ms = tuple(
            int(v) for v in os.environ.get("FORK_PROBE_M", "2,8,16,32").split(",")
        )
        xs = {m: torch.randn(m, g, 4096, device="cuda").to(torch.bfloat16) for m in ms}

        def warm(
            job,
        ):  # compile in threads (ptxas runs outside the GIL); errors are measured below
            m, kw = job
            try:
                sm90.wo_a_fp8_small_sm90(xs[m], packed[0], twins[0][1], **kw)
            except Exception:
                pass

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(warm, [(m, kw) for m in ms for _, kw in variants(g, m)]))
        torch.cuda.synchronize()
        for m in ms:
            if time.time() - t0 > budget:
                break
            x = xs[m]
            einsum_us = graph_us_per_call(
                [
                    lambda i=i: torch.einsum("tgd,grd->tgr", x, weights[i])
                    for i in range(LAYERS)
                ],
                args.replays,
            )
            want = torch.cat(
                [
                    sm90.wo_a_fp8_small_sm90(
                        x[a : min(a + 8, m)], packed[0], twins[0][1]
                    )
                    for a in range(0, m, 8)
                ]
            )
            base = {"G": g, "M": m, "einsum_us": einsum_us, "pure_read_us": read_us}
            served_us = None
            mid_us = None
            if m > 8:  # the wgmma kernel, for comparison (x_served filled in below)
                mid_us = graph_us_per_call(
                    [
                        lambda i=i: sm90.wo_a_fp8_mid_sm90(
                            x, packed[i], twins[i][1], counters[i]
                        )
                        for i in range(LAYERS)
                    ],
                    args.replays,
                )
            for name, kw in variants(g, m):

                def call(i, kw=kw):
                    return sm90.wo_a_fp8_small_sm90(x, packed[i], twins[i][1], **kw)

                try:
                    bitwise = torch.equal(
                        call(0).view(torch.int16), want.view(torch.int16)
                    )
                    us = graph_us_per_call(
                        [lambda i=i: call(i) for i in range(LAYERS)], args.replays
                    )
                except (
                    Exception
                ) as e:  # noqa: BLE001 - a candidate that does not fit is a result
                    rows.append(
                        {
                            **base,
                            "kernel": name,
                            "us": None,
                            "x_einsum": None,
                            "x_served": None,
                            "x_pure_read": None,
                            "TB/s": None,
                            "bitwise": f"error: {str(e)[:120]}",
                        }
                    )
                    continue
                if served_us is None and name == "served":
                    served_us = us
                rows.append(
                    {
                        **base,
                        "kernel": name,
                        "us": us,
                        "x_einsum": einsum_us / us,
                        "x_served": served_us / us,
                        "x_pure_read": us / read_us,
                        "TB/s": tbps(nbytes, us),
                        "bitwise": bitwise,
                    }
                )
            if mid_us is not None:
                rows.append(
                    {
                        **base,
                        "kernel": "mid",
                        "us": mid_us,
                        "x_einsum": einsum_us / mid_us,
                        "x_served": served_us / mid_us if served_us else None,
                        "x_pure_read": mid_us / read_us,
                        "TB/s": tbps(nbytes, mid_us),
                        "bitwise": None,
                    }
                )
            print(f"G={g} M={m} done at {time.time() - t0:.0f} s", flush=True)
        del weights, twins, packed, counters, xs
        torch.cuda.empty_cache()
        report(
            os.environ.get("FORK_PROBE_NAME", "wo_a_fp8_rows_probe"),
            cols,
            [{c: r.get(c) for c in cols} | r for r in rows],
            args.out,
            {"layers": LAYERS, "budget_s": budget},
            overwrite=args.overwrite,
        )


if __name__ == "__main__":
    main()
