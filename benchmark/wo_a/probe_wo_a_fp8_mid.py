"""The Hopper mid kernel of the wo_a twin (dsv4_wo_a_fp8_sm90.wo_a_fp8_mid_sm90, 9..192 rows): every
K split that fits one wave, checked (fp32 bound of the exact result, deterministic, arrivals
counted) and timed against einsum at G = 2 / 4 / 8 (43 layers, CUDA graph). Its JSON
(results/wo_a_fp8_mid_sweep-<device>.json) is where the kernel's split table comes from.
Not run by the GPU bundle: python3 benchmark/wo_a/probe_wo_a_fp8_mid.py RESULTS_DIR [--overwrite]
(``--overwrite``: replace another build's cited sweep, tools/e2e/provenance.py)."""

import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmark/: harness.py

from bench_wo_a_fp8 import outside_fp32_bound as bound_bad  # noqa: E402
from bench_wo_a_fp8 import twin_exact_weight as weight
from harness import LAYERS, graph_us_per_call  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from e2e.provenance import write_result  # noqa: E402

from sglang.kernels.ops.gemm import dsv4_wo_a_fp8_sm90 as k  # noqa: E402
from sglang.srt.models.deepseek_v4_wo_a_twin import make_twin  # noqa: E402

R, D = 1024, 4096


def cfgs(m, g):
    np_ = max(16, 1 << (m - 1).bit_length())
    out = []
    for split in (1, 2, 4, 8, 16):
        ctas = g * R // 64 * split
        st = k.mid_stages(
            g, R, split, np_, torch.cuda.get_device_properties(0).multi_processor_count
        )
        if 64 <= ctas <= 1024 and st >= 2:
            out.append((64, 4, split, np_, st))
    return out


def main():
    out, res, t0 = Path(sys.argv[1]), {"check": [], "time": []}, time.time()
    overwrite = "--overwrite" in sys.argv[2:]
    path = (
        out
        / f"wo_a_fp8_mid_sweep-{torch.cuda.get_device_name().replace(' ', '_')}.json"
    )
    # correctness: every row count class, G = 2/4/8, default config and each swept config at a few M
    for g in (2, 4, 8):
        w = weight(g, 100 + g)
        q, e = make_twin(w)
        packed = k.pack_twin(q)
        cnt = k.mid_counters(g, R, "cuda")
        for m in (9, 16, 33, 64, 100, 192):
            big = torch.randn(m, g + 1, D, device="cuda").to(torch.bfloat16)
            for name, x in (
                ("contig", big[:, :g].contiguous()),
                ("strided", big[:, 1:]),
            ):
                for cfg in [None] + (
                    cfgs(m, g) if m in (16, 64, 192) and name == "contig" else []
                ):
                    try:
                        y1 = k.wo_a_fp8_mid_sm90(x, packed, e, cnt, cfg)
                        y2 = k.wo_a_fp8_mid_sm90(x, packed, e, cnt, cfg)
                        ein = torch.einsum("tgd,grd->tgr", x, w)
                        r = {
                            "G": g,
                            "M": m,
                            "x": name,
                            "cfg": str(cfg or k.mid_config(m, g, R)),
                            "bad": bound_bad(y1, x, w),
                            "det": bool(
                                torch.equal(y1.view(torch.int16), y2.view(torch.int16))
                            ),
                            "neq_einsum": int(
                                (y1.view(torch.int16) != ein.view(torch.int16)).sum()
                            ),
                            "cnt_ok": bool((cnt % 16 == 0).all()),
                        }
                    except Exception as ex:
                        r = {
                            "G": g,
                            "M": m,
                            "x": name,
                            "cfg": str(cfg),
                            "error": repr(ex)[:300],
                        }
                        traceback.print_exc()
                    res["check"].append(r)
                    if r.get("error") or r["bad"] or not r["det"] or not r["cnt_ok"]:
                        print("CHECK FAIL", r, flush=True)
        print(f"checked G={g} {time.time()-t0:.0f}s", flush=True)
    write_result(path, res, overwrite=overwrite)
    for g in (2, 4, 8):
        ws = [weight(g, i) for i in range(LAYERS)]
        tw = [make_twin(w) for w in ws]
        pk = [k.pack_twin(t[0]) for t in tw]
        cn = [k.mid_counters(g, R, "cuda") for _ in tw]
        for m in (9, 16, 24, 32, 48, 64, 96, 128, 160, 192):
            x = torch.randn(m, g, D, device="cuda").to(torch.bfloat16)
            ein = graph_us_per_call(
                [lambda w=w: torch.einsum("tgd,grd->tgr", x, w) for w in ws]
            )
            row = {"G": g, "M": m, "einsum_us": ein, "cfgs": {}}
            for cfg in cfgs(m, g):
                try:
                    row["cfgs"][str(cfg)] = graph_us_per_call(
                        [
                            lambda i=i: k.wo_a_fp8_mid_sm90(
                                x, pk[i], tw[i][1], cn[i], cfg
                            )
                            for i in range(LAYERS)
                        ]
                    )
                except Exception as ex:
                    row["cfgs"][str(cfg)] = repr(ex)[:200]
            best = min((v, c) for c, v in row["cfgs"].items() if isinstance(v, float))
            row["best"], row["default"] = best, str(k.mid_config(m, g, R))
            res["time"].append(row)
            print(
                f"G={g} M={m} einsum {ein:.2f} best {best[0]:.2f} {best[1]} ({ein/best[0]:.2f}x) default {row['cfgs'].get(row['default'])} [{time.time()-t0:.0f}s]",
                flush=True,
            )
            write_result(path, res, overwrite=overwrite, quiet=True)
        del ws, tw, pk, cn
        torch.cuda.empty_cache()


main()
