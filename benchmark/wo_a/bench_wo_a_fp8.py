"""wo_a from the fp8 twin (--dsv4-wo-a-fp8-twin) against the stock path, per M and G, 43 layers in
a CUDA graph: upstream's ``wo_a_bf16_small_batch`` (G = 2, 2..8 rows; its MXFP8 variant beside the
twin's), ``torch.einsum`` (what 0.5.23 runs on Hopper for every G / row count but one decode row),
the twin kernel the dispatch serves (on Hopper the small Gluon kernel at 1..8 rows, 1..16 at G = 2 and 4,
and the wgmma kernel above; elsewhere the portable Triton kernel), and a pure read of the twin's bytes (e4m3 +
exponents) in one Triton kernel, the floor that one kernel can reach. ``served_by`` names the
lowest flag level whose dispatch sends that row count to the twin (mid only where it was measured
faster). For drop: the per-call dequantisation prefill runs, and the memory a 43-layer model
releases (``torch.cuda.memory_allocated`` around ``build_wo_a_fp8_twins``).
FORK_WO_A_SWEEP=1 also times the Triton kernel's tiles.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmark/: harness.py

from harness import (  # noqa: E402
    LAYERS,
    floor_us,
    graph_us_per_call,
    parse_args,
    report,
    tbps,
)

from sglang.kernels.ops.gemm import dsv4_wo_a as up  # noqa: E402
from sglang.kernels.ops.gemm import dsv4_wo_a_fp8 as k  # noqa: E402
from sglang.kernels.ops.gemm import dsv4_wo_a_fp8_sm90 as sm90  # noqa: E402
from sglang.srt.models import deepseek_v4_wo_a_twin as twin_mod  # noqa: E402
from sglang.srt.models.deepseek_v4_wo_a_twin import make_twin  # noqa: E402

R, D = 1024, 4096
SMALL_M = list(range(2, 9))
MID_M = [9, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192]


@triton.jit
def _pure_read(W, OUT, N, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    tl.store(OUT + pid, tl.sum(tl.load(W + offs, offs < N, 0)))


def pure_read(words: torch.Tensor, out: torch.Tensor, block: int) -> None:
    n = words.numel()
    _pure_read[(triton.cdiv(n, block),)](words, out, n, BLOCK=block, num_warps=8)


def pure_read_us(twins: list, replays: int) -> float:
    """us per layer of the fastest pure read (1024..4096 words per CTA) of the twins' bytes (e4m3 +
    exponents), one kernel per layer in a CUDA graph: the floor one kernel can reach."""
    words = [
        torch.cat([t[0].view(torch.int32).flatten(), t[1].view(torch.int32).flatten()])
        for t in twins
    ]
    return min(
        graph_us_per_call(
            [
                lambda wd=wd, s=torch.empty(
                    triton.cdiv(wd.numel(), b), dtype=torch.int32, device="cuda"
                ), b=b: pure_read(wd, s, b)
                for wd in words
            ],
            replays,
        )
        for b in (1024, 2048, 4096)
    )


def twin_exact_weight(g: int, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = (
        (torch.randn(g, R, D, device="cuda", generator=gen) * 64)
        .clamp(-448, 448)
        .to(torch.float8_e4m3fn)
    )
    e = torch.randint(-14, -6, (g, R // 32, D // 32), device="cuda", generator=gen)
    scale = torch.exp2(e.float()).repeat_interleave(32, 1).repeat_interleave(32, 2)
    return (q.float() * scale).to(torch.bfloat16)


def twin_layers(g: int) -> tuple[list, list]:
    """LAYERS twin-exact weights of G groups and their twins (e4m3, exponents), one per layer."""
    weights = [twin_exact_weight(g, i) for i in range(LAYERS)]
    return weights, [make_twin(w) for w in weights]


def hopper_layers(g: int) -> tuple[list, list, list, list]:
    """What the wo_a probes time on Hopper, one per layer: ``twin_layers``, the Hopper kernels'
    packed words and the mid kernel's counters."""
    weights, twins = twin_layers(g)
    return (
        weights,
        twins,
        [sm90.pack_twin(t[0]) for t in twins],
        [sm90.mid_counters(g, R, "cuda") for _ in twins],
    )


def outside_fp32_bound(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> int:
    """Outputs of ``einsum('tgd,grd->tgr', x, w)`` farther from the exact result than one bf16 ulp
    plus the fp32 accumulation bound (K * 2**-24 * sum |x w|): the twin kernels' error budget.
    """
    ref = torch.einsum("tgd,grd->tgr", x.double(), w.double())
    mag = torch.einsum("tgd,grd->tgr", x.double().abs(), w.double().abs())
    ulp = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(1e-30))) - 7)
    return int(((y.double() - ref).abs() > ulp + x.shape[-1] * 2.0**-24 * mag).sum())


class _Attn(torch.nn.Module):
    def __init__(self, w: torch.Tensor):
        super().__init__()
        self.n_local_groups, self.o_lora_rank = w.shape[0], w.shape[1]
        self.wo_a = torch.nn.Module()
        self.wo_a.weight = torch.nn.Parameter(
            w.reshape(-1, w.shape[2]).clone(), requires_grad=False
        )
        self.wo_a_twin = None


def drop_memory(weights: list) -> dict:
    """Device memory that --dsv4-wo-a-fp8-twin=drop gives back for these layers, net of the twins."""
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    model = torch.nn.ModuleList(_Attn(w) for w in weights)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    made, _ = twin_mod.build_wo_a_fp8_twins(model, "drop", "bench")
    torch.cuda.synchronize()
    freed = before - torch.cuda.memory_allocated()
    bf16 = sum(w.numel() * w.element_size() for w in weights)
    return {
        "layers": made,
        "bf16_MiB": bf16 / 2**20,
        "model_MiB": (before - start) / 2**20,
        "released_net_MiB": freed / 2**20,
        "released_net_MiB_per_layer": freed / 2**20 / max(made, 1),
    }


def main() -> None:
    args = parse_args(__doc__)
    logging.basicConfig(
        level=logging.INFO, format="%(message)s"
    )  # the twin's build line for drop
    sweep = os.environ.get("FORK_WO_A_SWEEP") == "1"
    rows, sweep_rows, drop_rows = [], [], []
    for g in (2, 4, 8):
        weights = [twin_exact_weight(g, i) for i in range(LAYERS)]
        twins = []
        for w in weights:
            t = make_twin(w)
            assert t is not None
            twins.append((*t, k.counters_for(t[0])))
        twin_bytes = twins[0][0].numel() + twins[0][1].numel()
        read_us = pure_read_us(twins, args.replays)

        hopper = sm90.available(torch.device("cuda"))
        packed = [sm90.pack_twin(t[0]) for t in twins] if hopper else []
        mid_cnt = [sm90.mid_counters(g, R, "cuda") for _ in twins] if hopper else []

        def t_twin(x, cfg=None):
            if hopper and cfg is None and x.shape[0] <= twin_mod.small_kernel_rows(g):
                return graph_us_per_call(
                    [
                        lambda i=i: sm90.wo_a_fp8_small_sm90(x, packed[i], twins[i][1])
                        for i in range(LAYERS)
                    ],
                    args.replays,
                )
            if hopper and cfg is None:
                return graph_us_per_call(
                    [
                        lambda i=i: sm90.wo_a_fp8_mid_sm90(
                            x, packed[i], twins[i][1], mid_cnt[i]
                        )
                        for i in range(LAYERS)
                    ],
                    args.replays,
                )
            return graph_us_per_call(
                [
                    lambda t=t: k.wo_a_fp8_matmul(x, t[0], t[1], t[2], cfg)
                    for t in twins
                ],
                args.replays,
            )

        if sweep:
            for m in (2, 8):
                x = torch.randn(m, g, D, device="cuda").to(torch.bfloat16)
                for bn in (16, 32):
                    for warps in (1, 2, 4, 8):
                        cfg = (8, 16, bn, warps, 1)
                        sweep_rows.append(
                            {"G": g, "M": m, "cfg": str(cfg), "us": t_twin(x, cfg)}
                        )
            for m in (16, 64, 192):
                x = torch.randn(m, g, D, device="cuda").to(torch.bfloat16)
                for split in (2, 4, 8):
                    for bm in (16, 32, 64):
                        if bm > max(16, triton.next_power_of_2(m)):
                            continue
                        for bn in (16, 32):
                            for warps in (4, 8):
                                cfg = (split, bm, bn, warps, 1)
                                sweep_rows.append(
                                    {
                                        "G": g,
                                        "M": m,
                                        "cfg": str(cfg),
                                        "us": t_twin(x, cfg),
                                    }
                                )
            best = {}
            for r in sweep_rows:
                if r["G"] == g:
                    key = r["M"]
                    if key not in best or r["us"] < best[key]["us"]:
                        best[key] = r
            for m, r in sorted(best.items()):
                print(f"sweep best G={g} M={m}: {r['cfg']} {r['us']:.2f} us")

        for m in SMALL_M + MID_M:
            x = torch.randn(m, g, D, device="cuda").to(torch.bfloat16)
            einsum = graph_us_per_call(
                [lambda w=w: torch.einsum("tgd,grd->tgr", x, w) for w in weights],
                args.replays,
            )
            small_stock = g == 2 and m <= 8
            stock = (
                graph_us_per_call(
                    [lambda w=w: up.wo_a_bf16_small_batch(x, w) for w in weights],
                    args.replays,
                )
                if small_stock
                else einsum
            )
            twin = t_twin(x)
            served = (
                "small"
                if m <= 8
                else (
                    "mid"
                    if (m <= twin_mod.mid_rows_faster(g) or not hopper)
                    else "drop"
                )
            )
            row = {
                "G": g,
                "M": m,
                "stock": "wo_a_bf16_small_batch" if small_stock else "einsum",
                "kernel": (
                    (
                        "gluon_sm90_small"
                        if m <= twin_mod.small_kernel_rows(g)
                        else "gluon_sm90_mid"
                    )
                    if hopper
                    else "triton"
                ),
                "served_by": served,
                "stock_us": stock,
                "einsum_us": einsum,
                "twin_us": twin,
                "read_us": read_us,
                "twin_over_read": twin / read_us,
                "speedup": stock / twin,
                "over_einsum": einsum / twin,
                "twin_TBps": tbps(twin_bytes, twin),
                "floor_us": floor_us(twin_bytes),
                "stock_mx_us": float("nan"),
                "twin_mx_us": float("nan"),
            }
            if small_stock:
                row["stock_mx_us"] = graph_us_per_call(
                    [lambda w=w: up.wo_a_bf16_small_batch_mxfp8(x, w) for w in weights],
                    args.replays,
                )
                row["twin_mx_us"] = graph_us_per_call(
                    (
                        [
                            lambda i=i: up._quantize_partial(
                                sm90.wo_a_fp8_small_sm90(
                                    x, packed[i], twins[i][1], partials=True
                                )
                            )
                            for i in range(LAYERS)
                        ]
                        if hopper
                        else [
                            lambda t=t: up._quantize_partial(
                                k.wo_a_fp8_partial(x, t[0], t[1], t[2])
                            )
                            for t in twins
                        ]
                    ),
                    args.replays,
                )
            rows.append(row)
        dequant_us = graph_us_per_call(
            (
                [
                    lambda i=i: k.wo_a_fp8_dequant_packed(packed[i], twins[i][1])
                    for i in range(LAYERS)
                ]
                if hopper
                else [lambda t=t: k.wo_a_fp8_dequant(t[0], t[1]) for t in twins]
            ),
            args.replays,
        )
        drop_rows.append({"G": g, "dequant_us": dequant_us, **drop_memory(weights)})
        del weights, twins, packed, mid_cnt
        torch.cuda.empty_cache()
    cols = [
        "G",
        "M",
        "kernel",
        "served_by",
        "stock",
        "stock_us",
        "einsum_us",
        "twin_us",
        "read_us",
        "twin_over_read",
        "speedup",
        "over_einsum",
        "twin_TBps",
        "floor_us",
        "stock_mx_us",
        "twin_mx_us",
    ]
    meta = {
        "layers": LAYERS,
        "R": R,
        "D": D,
        "small_cfg": [
            k.SMALL_SPLIT,
            k.SMALL_BM,
            k.SMALL_BN,
            k.SMALL_WARPS,
            k.SMALL_STAGES,
        ],
        "mid_cfg": [list(c) for c in k._MID],
        "sweep": sweep_rows,
        "drop": drop_rows,
        "what": "stock vs fp8 twin vs pure read of the twin's bytes; speedup = stock_us / twin_us; "
        "kernel = the twin kernel the dispatch serves at that row count on this device",
    }
    for d in drop_rows:
        print(
            f"drop G={d['G']}: {d['layers']} layers, {d['bf16_MiB']:.0f} MiB of bf16, released net of the twins "
            f"{d['released_net_MiB']:.0f} MiB ({d['released_net_MiB_per_layer']:.2f} MiB per layer); "
            f"prefill dequantisation {d['dequant_us']:.2f} us per layer"
        )
    report("wo_a_fp8", cols, rows, args.out, meta, overwrite=args.overwrite)


if __name__ == "__main__":
    main()
