"""Baseline of the wo_a projection on this GPU, before any fork kernel: upstream's
``wo_a_bf16_small_batch`` (partial + reduce, G = 2 hard-coded), ``torch.einsum`` and a pure
read of the same bf16 bytes in one Triton kernel, per layer at M = 2..8 rows, 43 layers in a
CUDA graph. The fp8 twin (`--dsv4-wo-a-fp8-twin`) is measured against these same three references.
"""

from __future__ import annotations

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

from sglang.kernels.ops.gemm.dsv4_wo_a import wo_a_bf16_small_batch  # noqa: E402

G, R, D = 2, 1024, 4096


@triton.jit
def _pure_read(W, OUT, N, BLOCK: tl.constexpr):
    """Reads BLOCK elements per program and keeps one sum, so no load can be elided."""
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    tl.store(OUT + pid, tl.sum(tl.load(W + offs, offs < N, 0.0).to(tl.float32)))


def pure_read(weight: torch.Tensor, out: torch.Tensor, block: int = 8192) -> None:
    n = weight.numel()
    _pure_read[(triton.cdiv(n, block),)](weight, out, n, BLOCK=block, num_warps=8)


def main() -> None:
    args = parse_args(__doc__)
    torch.manual_seed(0)
    weights = [
        torch.randn(G, R, D, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)
    ]
    sink = torch.empty(triton.cdiv(G * R * D, 8192), device="cuda")
    nbytes = G * R * D * 2
    read_us = graph_us_per_call(
        [lambda w=w: pure_read(w, sink) for w in weights], args.replays
    )
    rows = []
    for m in range(2, 9):
        x = torch.randn(m, G, D, device="cuda", dtype=torch.bfloat16)
        stock = graph_us_per_call(
            [lambda w=w: wo_a_bf16_small_batch(x, w) for w in weights], args.replays
        )
        einsum = graph_us_per_call(
            [lambda w=w: torch.einsum("tgd,grd->tgr", x, w) for w in weights],
            args.replays,
        )
        rows.append(
            {
                "M": m,
                "G": G,
                "stock_us": stock,
                "einsum_us": einsum,
                "pure_read_us": read_us,
                "floor_us": floor_us(nbytes),
                "stock_TBps": tbps(nbytes, stock),
                "stock_over_read": stock / read_us,
            }
        )
    report(
        "wo_a_stock",
        list(rows[0]),
        rows,
        args.out,
        {
            "layers": LAYERS,
            "weight_bytes_per_layer": nbytes,
            "what": "upstream 0.5.23 kernels, no fork code",
        },
        overwrite=args.overwrite,
    )


if __name__ == "__main__":
    main()
