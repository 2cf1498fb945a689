"""--speculative-dspark-draft-head-fp8 vs the stock bf16 draft head (cuBLAS), rows 1..128.

Shapes: the TP4 shard (32320 x 5120) and TP1 (129280 x 5120). Distinct copies rotate so
the head streams from HBM (each copy is larger than the 60 MB L2). CUDA-graph replay,
median; both write bf16 logits, as the draft's call site does. Floors: bf16 head bytes /
fp8 head + scale bytes at 4.09 TB/s. ``served`` says whether the flag's row gate
(``DraftHeadFp8.serves``) sends that row count to the fp8 kernel; ``fp8_us`` is the kernel the
flag serves on this device (``kernel``: wgmma on SM90, mma.sync elsewhere, through DraftHeadFp8
as the call site does; where it does not serve, stock), ``mma_us`` the portable mma.sync kernel
up to its 64 rows (with its shipped CONFIGS unless --configs names a JSON {m_tiles: [block_n,
block_k, num_warps, num_stages]}: tuning), all in the same run.
"""

from __future__ import annotations

import json
import sys
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools" / "standins"))
sys.path.insert(0, str(REPO / "benchmark"))

import harness  # noqa: E402
import torch  # noqa: E402

from sglang.kernels.ops.speculative.dspark import draft_head_fp8 as kern  # noqa: E402
from sglang.srt.speculative.dspark_components.dspark_draft_head_fp8 import (  # noqa: E402
    MAX_ROWS,
    DraftHeadFp8,
)

MMA_MAX_ROWS = kern.ROW_TILE * kern.MAX_M_TILES

K = 5120
SHAPES = ((32320, 6), (129280, 2))  # (N, copies rotated per graph)
ROWS = [1, 2, 4, 5, 8, 16, 17, 20, 32, 33, 40, 48, 64, 65, 80, 96, 112, 128]


def heads(n: int, copies: int):
    ws = [
        (torch.randn(n, K, device="cuda") * 0.02).to(torch.bfloat16)
        for _ in range(copies)
    ]
    return ws, [kern.quantize_head_fp8(w) for w in ws]


def fp8_us(x, qs, configs, replays: int) -> float:
    m, n = x.shape[0], qs[0][0].shape[0]
    cfg = configs.get(kern.triton.cdiv(m, kern.ROW_TILE)) if configs else None
    outs = [torch.empty((m, n), device="cuda", dtype=torch.bfloat16) for _ in qs]
    return harness.graph_us_per_call(
        [
            partial(kern.draft_head_fp8_logits, x, q, s, out=o, config=cfg)
            for (q, s), o in zip(qs, outs)
        ],
        replays,
    )


def served_us(x, served, replays: int) -> float:
    return harness.graph_us_per_call([partial(head, x) for head in served], replays)


def stock_us(x, ws, replays: int) -> float:
    outs = [
        torch.empty((x.shape[0], w.shape[0]), device="cuda", dtype=torch.bfloat16)
        for w in ws
    ]
    return harness.graph_us_per_call(
        [partial(torch.matmul, x, w.T, out=o) for w, o in zip(ws, outs)], replays
    )


def measure(configs: dict[int, tuple] | None, replays: int, rows=ROWS) -> list[dict]:
    out = []
    for n, copies in SHAPES:
        ws, qs = heads(n, copies)
        served = [DraftHeadFp8(w) for w in ws]
        bf16_bytes, fp8_bytes = n * K * 2, n * K + qs[0][1].numel() * 4
        for m in rows:
            x = torch.randn(m, K, device="cuda").to(torch.bfloat16)
            serves = served[0].serves(m)
            stock = stock_us(x, ws, replays)
            mma = fp8_us(x, qs, configs, replays) if m <= MMA_MAX_ROWS else None
            ours = served_us(x, served, replays) if serves else stock
            cfg = (
                (configs or {}).get(kern.triton.cdiv(m, kern.ROW_TILE))
                or kern.CONFIGS[kern.triton.cdiv(m, kern.ROW_TILE)]
                if m <= MMA_MAX_ROWS
                else ()
            )
            out.append(
                {
                    "N": n,
                    "rows": m,
                    "served": serves,
                    "kernel": served[0].kernel if serves else "stock",
                    "cfg": "x".join(map(str, cfg)),
                    "mma_us": mma,
                    "stock_us": stock,
                    "stock_TBps": harness.tbps(bf16_bytes, stock),
                    "fp8_us": ours,
                    "fp8_TBps": harness.tbps(fp8_bytes, ours),
                    "ratio": stock / ours,
                    "floor_bf16_us": harness.floor_us(bf16_bytes),
                    "floor_fp8_us": harness.floor_us(fp8_bytes),
                }
            )
            print(
                " ".join(
                    f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in out[-1].items()
                ),
                flush=True,
            )
        del ws, qs, served
        torch.cuda.empty_cache()
    return out


def main() -> None:
    p = harness.arg_parser(__doc__)
    p.add_argument("--configs", type=Path, default=None)
    args = p.parse_args()
    configs = None
    if args.configs:
        configs = {
            int(k): tuple(v) for k, v in json.loads(args.configs.read_text()).items()
        }
    rows = measure(configs, args.replays)
    shipped = configs or kern.CONFIGS
    harness.report(
        "draft_head_fp8",
        [
            "N",
            "rows",
            "served",
            "kernel",
            "cfg",
            "mma_us",
            "stock_us",
            "stock_TBps",
            "fp8_us",
            "fp8_TBps",
            "ratio",
            "floor_bf16_us",
            "floor_fp8_us",
        ],
        rows,
        args.out,
        {
            "K": K,
            "max_rows_served": MAX_ROWS,
            "configs": {str(k): list(v) for k, v in shipped.items()},
        },
        overwrite=args.overwrite,
    )


if __name__ == "__main__":
    main()
