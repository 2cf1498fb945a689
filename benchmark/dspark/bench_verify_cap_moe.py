"""MoE kernel time the DSpark verify cap buys: the routed-expert GEMMs of one verify step
(M = 6 bs rows, 43 layers in a CUDA graph) at the routing of a verify with the cap (rows past
1 + k routed as their anchor by the live-aware router) against the same rows each routed on
its own (no cap), bs = 1, 4, 16, k = 1..5.

Kernel: on Hopper upstream serves DeepSeek-V4's MXFP4 routed experts with flashinfer_mxfp4
(CUDA, not runnable on the torch + triton test machine); the pure-Triton kernel that serves
them is sglang's fused_moe_triton (``fused_moe_kernel``) on the FP8 block-scale layout
(SGLANG_DSV4_FP4_DEQUANT=1 or an FP8 checkpoint, --moe-runner-backend triton): w13 then w2,
fp8 e4m3 with 128x128 block scales, activations pre-quantized per 128-group (outside the
graph, as SGLANG_OPT_MOE_QUANT_ONCE does), block alignment precomputed. Only the two GEMM
launches are timed, so the difference comes from the distinct experts (each streamed once per
layer). Shapes: hidden 7168, 384 experts, top 6, moe_intermediate 3072 at TP4 (768 per rank);
routing from random router weights (as bench_verify_cap_experts.py), the 43 layers cycle over
WEIGHT_SETS distinct weight copies (each far above the 60 MB L2, so weights stream from HBM).
H200 round 1, MoE GEMM time per layer without the cap -> with it (k = 1 / 2 / 3 / 4):
bs 1: 161 us -> 83 / 102 / 120 / 142 (1.94 / 1.58 / 1.35 / 1.13x); bs 4: 480 us -> 218 / 283 /
352 / 423 (2.20 / 1.70 / 1.36 / 1.14x); bs 16: 1140 us -> 608 / 793 / 944 / 1055 (1.88 / 1.44 /
1.21 / 1.08x), tracking the distinct experts (bs 16: 299 -> 153 / 205 / 245 / 275 of 384).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmark/: harness.py

from harness import LAYERS, graph_us_per_call, parse_args, report  # noqa: E402

from sglang.kernels.ops.moe.fused_moe_triton_kernels import (  # noqa: E402
    invoke_fused_moe_kernel,
)
from sglang.kernels.ops.moe.moe_fused_gate import moe_fused_gate  # noqa: E402

HIDDEN, N, TOPK, STRIDE = 7168, 384, 6, 6
INTER_RANK = 3072 // 4  # moe_intermediate_size 3072 at TP4
WEIGHT_SETS = 4
BLOCK = [128, 128]
CONFIG = {
    "BLOCK_SIZE_M": 16,
    "BLOCK_SIZE_N": 128,
    "BLOCK_SIZE_K": 128,
    "GROUP_SIZE_M": 1,
    "num_warps": 4,
    "num_stages": 3,
}


def align(ids: torch.Tensor, block_m: int):
    """moe_align_block_size's output (per-expert blocks of block_m pair indices, pad = numel)."""
    flat = ids.flatten().cpu()
    numel = flat.numel()
    cap = numel + N * (block_m - 1)
    sorted_ids = torch.full((cap,), numel, dtype=torch.int32)
    expert_ids = torch.full(((cap + block_m - 1) // block_m,), -1, dtype=torch.int32)
    pos = 0
    for e in torch.unique(flat).tolist():
        pairs = (flat == e).nonzero().flatten().to(torch.int32)
        sorted_ids[pos : pos + pairs.numel()] = pairs
        nblk = (pairs.numel() + block_m - 1) // block_m
        expert_ids[pos // block_m : pos // block_m + nblk] = e
        pos += nblk * block_m
    dev = ids.device
    return (
        sorted_ids.to(dev),
        expert_ids.to(dev),
        torch.tensor([pos], dtype=torch.int32, device=dev),
    )


def fp8(shape, dev):
    return (
        torch.empty(shape, dtype=torch.uint8, device=dev)
        .random_(0, 120)
        .view(torch.float8_e4m3fn)
    )


def main() -> None:
    args = parse_args(__doc__)
    torch.manual_seed(0)
    dev = "cuda"
    gates = [
        torch.randn(N, HIDDEN, device=dev, dtype=torch.bfloat16) / HIDDEN**0.5
        for _ in range(LAYERS)
    ]
    bias = torch.zeros(N, device=dev, dtype=torch.bfloat16)
    w13 = [fp8((N, 2 * INTER_RANK, HIDDEN), dev) for _ in range(WEIGHT_SETS)]
    w2 = [fp8((N, HIDDEN, INTER_RANK), dev) for _ in range(WEIGHT_SETS)]
    s13 = [
        torch.rand(N, 2 * INTER_RANK // 128, HIDDEN // 128, device=dev) * 1e-3
        for _ in range(WEIGHT_SETS)
    ]
    s2 = [
        torch.rand(N, HIDDEN // 128, INTER_RANK // 128, device=dev) * 1e-3
        for _ in range(WEIGHT_SETS)
    ]
    rows = []
    for bs in (1, 4, 16):
        m = bs * STRIDE
        hidden = [
            torch.randn(m, HIDDEN, device=dev, dtype=torch.bfloat16)
            for _ in range(LAYERS)
        ]
        scores = [(h @ w.t()).float() for h, w in zip(hidden, gates)]
        a1, a1s = fp8((m, HIDDEN), dev), torch.rand(m, HIDDEN // 128, device=dev) * 1e-2
        a2, a2s = fp8((m * TOPK, INTER_RANK), dev), torch.rand(
            m * TOPK, INTER_RANK // 128, device=dev
        )
        c1 = torch.empty(m, TOPK, 2 * INTER_RANK, device=dev, dtype=torch.bfloat16)
        c2 = torch.empty(m, TOPK, HIDDEN, device=dev, dtype=torch.bfloat16)

        def plan(live):
            out = []
            for s in scores:
                kw = {} if live is None else dict(live_lens=live, live_stride=STRIDE)
                w, ids = moe_fused_gate(
                    s,
                    bias,
                    TOPK,
                    scoring_func="sqrtsoftplus",
                    routed_scaling_factor=1.5,
                    apply_routed_scaling_factor_on_output=True,
                    **kw,
                )
                out.append(
                    (
                        w,
                        ids,
                        *align(ids, CONFIG["BLOCK_SIZE_M"]),
                        int(torch.unique(ids).numel()),
                    )
                )
            return out

        def calls(routing):
            fns = []
            for layer, (w, ids, sorted_ids, expert_ids, npad, _) in enumerate(routing):
                j = layer % WEIGHT_SETS

                def fn(
                    w=w,
                    ids=ids,
                    sorted_ids=sorted_ids,
                    expert_ids=expert_ids,
                    npad=npad,
                    j=j,
                ):
                    invoke_fused_moe_kernel(
                        a1,
                        w13[j],
                        None,
                        c1,
                        a1s,
                        s13[j],
                        None,
                        w,
                        ids,
                        sorted_ids,
                        expert_ids,
                        npad,
                        False,
                        TOPK,
                        CONFIG,
                        tl.bfloat16,
                        True,
                        False,
                        False,
                        False,
                        False,
                        BLOCK,
                    )
                    invoke_fused_moe_kernel(
                        a2,
                        w2[j],
                        None,
                        c2,
                        a2s,
                        s2[j],
                        None,
                        w,
                        ids,
                        sorted_ids,
                        expert_ids,
                        npad,
                        True,
                        1,
                        CONFIG,
                        tl.bfloat16,
                        True,
                        False,
                        False,
                        False,
                        False,
                        BLOCK,
                    )

                fns.append(fn)
            return fns

        free = plan(None)
        t_free = graph_us_per_call(calls(free), args.replays)
        if bs == 1:  # the launch computes the GEMM it claims: layer 42, token 0, slot 0
            calls(free)[-1]()
            e = int(free[-1][1][0, 0])
            j = (LAYERS - 1) % WEIGHT_SETS
            a = a1[0].float() * a1s[0].repeat_interleave(128)
            wt = w13[j][e].float() * s13[j][e].repeat_interleave(
                128, 0
            ).repeat_interleave(128, 1)
            ref, got = wt @ a, c1[0, 0].float()
            err = float((got - ref).abs().max() / ref.abs().max())
            print(f"GEMM1 check: max rel err {err:.2e}", flush=True)
            assert (
                err < 2e-2
            ), "fused_moe_kernel output does not match the dequantized GEMM"
        e_free = sum(r[-1] for r in free) / LAYERS
        for k in range(1, STRIDE):
            capped = plan(torch.full((1024,), k + 1, device=dev))
            t_cap = graph_us_per_call(calls(capped), args.replays)
            e_cap = sum(r[-1] for r in capped) / LAYERS
            rows.append(
                {
                    "bs": bs,
                    "k": k,
                    "experts_no_cap": e_free,
                    "experts_cap": e_cap,
                    "moe_us_no_cap": t_free,
                    "moe_us_cap": t_cap,
                    "speedup": t_free / t_cap,
                    "saved_us_per_step_43_layers": (t_free - t_cap) * LAYERS,
                }
            )
            print(rows[-1], flush=True)
    report(
        "verify_cap_moe",
        list(rows[0]),
        rows,
        args.out,
        {
            "layers": LAYERS,
            "hidden": HIDDEN,
            "experts": N,
            "topk": TOPK,
            "inter_per_rank": INTER_RANK,
            "weight_sets": WEIGHT_SETS,
            "config": CONFIG,
            "kernel": "sglang fused_moe_kernel, fp8 w8a8 128x128 block scales, w13 + w2",
            "routing": "random router weights and hidden states (not a checkpoint)",
        },
        overwrite=args.overwrite,
    )


if __name__ == "__main__":
    main()
