"""Probe (not a bench_*: the GPU bundle does not run it): forms of the live-aware router
against stock moe_fused_gate at the DeepSeek-V4 routing shape (384 experts, top 6,
sqrtsoftplus), M = 6 bs, 43 layers in a CUDA graph, 3 interleaved repeats (median); every
form is checked bitwise (live rows = stock, dead rows = anchor, packed ids included) first.

Forms (copies of moe_fused_gate.py under probe_router_live_forms/):
  f0  the first 0002: load the live length, then the anchor's scores through it
      (a dependent live -> address -> scores chain, runtime stride division)
  f1  f0 with a constexpr stride (mul-shift instead of a division)
  f2  the anchor's scores load beside the row's own, then a select on the live length
  f10 the series' kernel (sglang's moe_fused_gate): stock routing code; the live length
      loads beside the scores and only the stores read it (a dead row stores nothing,
      its anchor stores over it)
H200 round 1 (benchmark/results/router_live_forms-NVIDIA_H200.json; in that run f2 was the
overlaid module and f10 a copy): f0 1.06-1.08x, f1 1.04-1.06x, f2 1.00-1.02x, f10 0.98-1.00x
stock at bs 1..64 (stock 2.93-3.30 us a call). ptxas (sm_90a) holds every form at 64
registers, so it sinks some loads (f2: the bias; f10: the live length, consumed last).
Run: cd benchmark && python probe_router_live_forms.py OUT_DIR
"""
import json, statistics, sys
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parent / "probe_router_live_forms"))
from harness import LAYERS, graph_us_per_call
import mfg_stock, mfg_f0, mfg_f1, mfg_f2
from sglang.kernels.ops.moe import moe_fused_gate as mfg_f10

N, TOPK, STRIDE = 384, 6, 6
VARS = {"stock": (mfg_stock, False), "f10_nolive": (mfg_f10, False), "f0": (mfg_f0, True),
        "f1": (mfg_f1, True), "f2": (mfg_f2, True), "f10": (mfg_f10, True)}


def gate(mod, scores, bias, live=None, packed=None):
    kw = dict(live_lens=live, live_stride=STRIDE) if live is not None else {}
    return mod.moe_fused_gate(scores, bias, TOPK, scoring_func="sqrtsoftplus", renormalize=True,
                              routed_scaling_factor=1.5, apply_routed_scaling_factor_on_output=True,
                              packed_out=packed, **kw)


def main(out):
    torch.manual_seed(0)
    bias = (0.1 * torch.randn(N, device="cuda")).to(torch.bfloat16)
    rows = []
    for bs in (1, 2, 4, 8, 16, 32, 64):
        m = bs * STRIDE
        scores = [torch.randn(m, N, device="cuda") for _ in range(LAYERS)]
        live = torch.randint(2, STRIDE + 1, (1024,), device="cuda")
        packs = [torch.empty(m, TOPK, dtype=torch.int32, device="cuda") for _ in range(LAYERS)]
        # exactness of every form on layer 0
        ref = gate(mfg_stock, scores[0], bias, packed=packs[0]); ref = (*ref, packs[0].clone())
        r = torch.arange(m, device="cuda"); src = torch.where(r % STRIDE >= live[r // STRIDE], r // STRIDE * STRIDE, r)
        for name, (mod, use) in VARS.items():
            p = torch.empty_like(packs[0]); o = gate(mod, scores[0], bias, live if use else None, p)
            want = [t[src] for t in ref] if use else ref
            assert all(torch.equal(a, b) for a, b in zip((*o, p), want)), (name, bs)
        t = {k: [] for k in VARS}
        for rep in range(3):
            for name, (mod, use) in VARS.items():
                lv = live if use else None
                t[name].append(graph_us_per_call(
                    [lambda s=s: gate(mod, s, bias, lv) for s in scores], 60))
        med = {k: statistics.median(v) for k, v in t.items()}
        row = {"bs": bs, "M": m, **{f"{k}_us": v for k, v in med.items()},
               **{f"{k}_ratio": med[k] / med["stock"] for k in VARS if k != "stock"}, "raw": t}
        rows.append(row)
        print(bs, " ".join(f"{k}={v:.3f}" for k, v in med.items()),
              " ".join(f"{k}/stock={med[k]/med['stock']:.3f}" for k in VARS if k != "stock"), flush=True)
    json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, open(f"{out}/router_live_forms-{torch.cuda.get_device_name().replace(' ', '_')}.json", "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
