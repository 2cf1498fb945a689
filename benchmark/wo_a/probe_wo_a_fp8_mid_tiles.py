"""The Hopper mid kernel of the wo_a twin (``wo_a_fp8_mid_sm90``) past 32 rows of x: tiles of x's
rows (NP < M: several CTAs share a weight tile, each a slice of x, so no wgmma N of 256 and less
of x per CTA) and 128 weight rows per CTA (two warpgroups share each x tile: half of x's traffic
per weight byte), against the served configuration (``mid_config``), the small kernel and einsum
(43 layers, CUDA graph). Every configuration is checked against the exact result (fp32 bound) and
for determinism at the row count it is timed at (``ok`` column).
FORK_PROBE_G, FORK_PROBE_M (comma lists), FORK_PROBE_BUDGET_S (default 480) stops early and
still writes what it has. Run: TESTS=none BENCH=probe_wo_a_fp8_mid_tiles.py bash build/gpu-bundle/run.sh DIR
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmark/: harness.py

from bench_wo_a_fp8 import hopper_layers, outside_fp32_bound, pure_read_us  # noqa: E402
from harness import LAYERS, graph_us_per_call, parse_args, report  # noqa: E402

from sglang.kernels.ops.gemm import dsv4_wo_a_fp8_sm90 as sm90  # noqa: E402

R, D = 1024, 4096


def configs(m: int, g: int, sms: int) -> list[tuple[int, int, int, int, int]]:
    """(weight rows per CTA, warps, K splits, NP, stages): 64 or 128 weight rows, x's rows in tiles
    of 32..NP(m), every split with 64..2048 CTAs whose pipeline is at least 2 deep."""
    full = max(16, 1 << (m - 1).bit_length())
    out = []
    for bv, nw in ((64, 4), (128, 8)):
        for np_ in sorted({n for n in (32, 64, 128, full) if n <= full}):
            nt = -(-m // np_)
            for split in (1, 2, 4, 8, 16):
                ctas = g * R // bv * nt * split
                st = sm90.mid_stages(g, R, split, np_, sms, bv, nt)
                if 64 <= ctas <= 2048 and st >= 2 and nt <= sm90.MAX_X_TILES:
                    out.append((bv, nw, split, np_, st))
    return out


def main() -> None:
    args = parse_args(__doc__)
    budget = float(os.environ.get("FORK_PROBE_BUDGET_S", "480"))
    t0 = time.time()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    cols = ["G", "M", "kernel", "us", "x_einsum", "x_served", "x_pure_read", "ok"]
    for g in tuple(int(v) for v in os.environ.get("FORK_PROBE_G", "2,8,4").split(",")):
        if time.time() - t0 > budget:
            break
        weights, twins, packed, counters = hopper_layers(g)
        read_us = pure_read_us(twins, args.replays)
        ms = tuple(
            int(v)
            for v in os.environ.get("FORK_PROBE_M", "48,64,96,128,192").split(",")
        )
        xs = {m: torch.randn(m, g, D, device="cuda").to(torch.bfloat16) for m in ms}

        def warm(
            job,
        ):  # compile in threads (ptxas runs outside the GIL); errors are measured below
            m, cfg = job
            try:
                sm90.wo_a_fp8_mid_sm90(xs[m], packed[0], twins[0][1], counters[0], cfg)
            except Exception:
                pass

        with ThreadPoolExecutor(12) as pool:
            list(pool.map(warm, [(m, c) for m in ms for c in configs(m, g, sms)]))
        torch.cuda.synchronize()
        for m in ms:
            if time.time() - t0 > budget:
                break
            x = xs[m]
            base = {"G": g, "M": m, "pure_read_us": read_us}
            einsum_us = graph_us_per_call(
                [
                    lambda i=i: torch.einsum("tgd,grd->tgr", x, weights[i])
                    for i in range(LAYERS)
                ],
                args.replays,
            )
            served = sm90.mid_config(m, g, R, sms)
            cands = [("served " + str(served), served)] + [
                (str(c), c) for c in configs(m, g, sms) if c != served
            ]
            served_us = None
            if m <= sm90.MAX_RING_ROWS:
                cands.append(("small", None))
            for name, cfg in cands:

                def call(i, cfg=cfg):
                    if cfg is None:
                        return sm90.wo_a_fp8_small_sm90(x, packed[i], twins[i][1])
                    return sm90.wo_a_fp8_mid_sm90(
                        x, packed[i], twins[i][1], counters[i], cfg
                    )

                try:
                    y = call(0)
                    ok = outside_fp32_bound(y, x, weights[0]) == 0 and torch.equal(
                        y.view(torch.int16), call(0).view(torch.int16)
                    )
                    us = graph_us_per_call(
                        [lambda i=i: call(i) for i in range(LAYERS)], args.replays
                    )
                except (
                    Exception
                ) as e:  # noqa: BLE001 - a candidate that does not build is a result
                    rows.append(
                        {
                            **base,
                            "kernel": name,
                            "us": None,
                            "x_einsum": None,
                            "x_served": None,
                            "x_pure_read": None,
                            "ok": f"error: {str(e)[:160]}",
                        }
                    )
                    continue
                served_us = served_us or us
                rows.append(
                    {
                        **base,
                        "kernel": name,
                        "us": us,
                        "einsum_us": einsum_us,
                        "x_einsum": einsum_us / us,
                        "x_served": served_us / us,
                        "x_pure_read": us / read_us,
                        "ok": ok,
                    }
                )
            best = min(
                (
                    r
                    for r in rows
                    if r["G"] == g and r["M"] == m and r["us"] and r["ok"] is True
                ),
                key=lambda r: r["us"],
            )
            print(
                f"G={g} M={m} einsum {einsum_us:.2f} served {served_us:.2f} best {best['us']:.2f} "
                f"{best['kernel']} ({best['x_einsum']:.2f}x einsum) at {time.time() - t0:.0f} s",
                flush=True,
            )
        del weights, twins, packed, counters, xs
        torch.cuda.empty_cache()
        report(
            os.environ.get("FORK_PROBE_NAME", "wo_a_fp8_mid_tiles_probe"),
            cols,
            [{c: r.get(c) for c in cols} | r for r in rows],
            args.out,
            {"layers": LAYERS, "budget_s": budget},
            overwrite=args.overwrite,
        )


if __name__ == "__main__":
    main()
