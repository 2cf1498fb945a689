"""--engram-fused-all-reduce: decode step time of a V4.1-shaped stack at TP 2 (two GPUs, one
process per rank), upstream's per-layer lookups, the prefetch (--engram-prefetch on: gathers
hoisted, one all-reduce per Engram layer) and the prefetch with one fused all-reduce, timed in
one run.

The step is bench_engram_prefetch.py's (one CUDA graph, replayed: a hasher stand-in, LAYERS bf16
GEMM stand-ins with their own weights, Engram at layers 1 and 14 with upstream's
EngramEmbedding, here TP-sharded over the ranks, and a projection of its rows). ``upstream``:
the lookup and its all-reduce inline at each Engram layer; ``prefetch``: 0015's hoist;
``fused``: 0015 plus sglang.srt.layers.engram_fused_all_reduce. ``all_reduces_us``: the per-layer
all-reduces alone against the one fused all-reduce, in a graph. ``bitwise``: the fused rows equal
upstream's. The all-reduce is torch.distributed's NCCL all-reduce in all three (the engine's TP
group may use custom all-reduce instead; the stack is the same in every column, so the
difference is the number of collectives). Needs 2 GPUs; with fewer it says so and writes
nothing. Rank 0 writes ``engram_fused_all_reduce_tp2-<device>.json``.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools" / "standins"))
sys.path.insert(0, str(REPO / "benchmark"))
sys.path.insert(0, str(REPO / "benchmark" / "engram"))

import harness  # noqa: E402
import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

HIDDEN, DIM, HEADS, MAX_NGRAM = 5120, 256, 8, 3  # 16 hash columns of 256 per token
TOKENS = [1, 4, 16, 64, 128]


def _tp_engram_stack(rank, world, rows_per_column, engram_layers):
    """Upstream EngramEmbeddings sharded as at TP ``world`` (rank ``rank``), random shards."""
    import engram_stack as stack
    import torch.distributed as dist

    import sglang.srt.layers.engram as eg
    from sglang.srt import runtime_context

    par = SimpleNamespace(tp_size=world, tp_rank=rank, attn_dp_size=1, tp_group=None)
    offload = SimpleNamespace(
        engram_row_store_dir=None, engram_row_store_cache_gib=None
    )
    eg.get_parallel = runtime_context.get_parallel = lambda: par
    eg.get_exec = lambda: SimpleNamespace(offload=offload)

    def all_reduce(t):
        dist.all_reduce(t)
        return t

    eg.tensor_model_parallel_all_reduce = all_reduce
    cols = (MAX_NGRAM - 1) * HEADS
    per_layer = ((rows_per_column,) * HEADS,) * (MAX_NGRAM - 1)
    layout = eg.EngramLayout(
        max_ngram_size=MAX_NGRAM,
        layer_ids=tuple(engram_layers),
        num_embeddings=(cols * rows_per_column,) * len(engram_layers),
        primes=(per_layer,) * len(engram_layers),
        n_heads=HEADS,
        head_dim=DIM,
    )
    engrams = []
    for i, layer in enumerate(engram_layers):
        emb = eg.EngramEmbedding(
            layout.num_embeddings[i], DIM, layer, column_bounds=layout.column_bounds(i)
        )
        w, s = stack.random_table(emb.rows, DIM, "cuda", seed=1000 * rank + i)
        emb.weight.data, emb.scale.data = w, s.view(torch.float8_e8m0fnu)
        engrams.append(stack.EngramLookup(emb, i))
    return layout, engrams, cols


def rank_main(rank, world, store, args, out):
    import bench_engram_prefetch as bp
    import torch.distributed as dist

    from sglang.srt.layers import engram_fused_all_reduce as far
    from sglang.srt.layers import engram_prefetch as ep

    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl", init_method=f"file://{store}", rank=rank, world_size=world
    )
    layout, engrams, cols = _tp_engram_stack(
        rank, world, args.rows // 16, args.engram_layers
    )
    rows = layout.num_embeddings[0]
    torch.manual_seed(0)
    weights = [
        torch.randn(HIDDEN, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02
        for _ in range(args.layers)
    ]
    proj = torch.randn(cols * DIM, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.01
    layer_objs = [SimpleNamespace(engram=e) for e in engrams]
    prefetch = ep.build_engram_prefetch("on", layer_objs)
    fused = far.fuse_engram_all_reduce(
        True, ep.build_engram_prefetch("on", layer_objs), layout
    )
    results = []
    for tokens in TOKENS:
        mk = lambda p: bp.Step(
            tokens, engrams, args.engram_layers, cols, rows, weights, proj, p
        )  # noqa: E731
        up_step, pre_step, fused_step = mk(None), mk(prefetch), mk(fused)
        up_step(), pre_step(), fused_step()  # same ids: compare the first step's rows
        bitwise = all(
            torch.equal(a.view(torch.int16), b.view(torch.int16))
            for a, b in zip(up_step.gathered, fused_step.gathered)
        )
        times = {
            name: harness.graph_us_per_call([s], args.replays)
            for name, s in (
                ("upstream", up_step),
                ("prefetch", pre_step),
                ("fused", fused_step),
            )
        }
        bufs = [
            torch.zeros(tokens, cols, DIM, device="cuda", dtype=torch.bfloat16)
            for _ in engrams
        ]
        flat = torch.zeros(
            len(engrams) * tokens * cols * DIM, device="cuda", dtype=torch.bfloat16
        )
        per_layer = harness.graph_us_per_call(
            [lambda: [dist.all_reduce(b) for b in bufs]], args.replays
        )
        one = harness.graph_us_per_call([lambda: dist.all_reduce(flat)], args.replays)
        row = {
            "tokens": tokens,
            "bitwise": bitwise,
            "upstream_us": times["upstream"],
            "prefetch_us": times["prefetch"],
            "fused_us": times["fused"],
            "saved_vs_prefetch_us": times["prefetch"] - times["fused"],
            "ratio_vs_prefetch": times["prefetch"] / times["fused"],
            "ratio_vs_upstream": times["upstream"] / times["fused"],
            "per_layer_all_reduces_us": per_layer,
            "fused_all_reduce_us": one,
        }
        results.append(row)
        if rank == 0:
            print(
                " ".join(
                    f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in row.items()
                ),
                flush=True,
            )
    if rank == 0:
        harness.report(
            f"engram_fused_all_reduce_tp{world}",
            [
                "tokens",
                "bitwise",
                "upstream_us",
                "prefetch_us",
                "fused_us",
                "saved_vs_prefetch_us",
                "ratio_vs_prefetch",
                "per_layer_all_reduces_us",
                "fused_all_reduce_us",
            ],
            results,
            Path(out),
            {
                "tp": world,
                "comm": "torch.distributed NCCL all_reduce",
                "layers": args.layers,
                "engram_layers": args.engram_layers,
                "hash_cols": cols,
                "head_dim": DIM,
                "table_rows": rows,
                "hidden": HIDDEN,
            },
            overwrite=args.overwrite,
        )
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = harness.arg_parser(__doc__)
    p.add_argument("--layers", type=int, default=harness.LAYERS)
    p.add_argument(
        "--engram-layers",
        type=lambda s: [int(v) for v in s.split(",")],
        default=[1, 14],
    )
    p.add_argument(
        "--rows",
        type=int,
        default=1 << 22,
        help="table rows per Engram layer (all ranks)",
    )
    p.add_argument("--tp", type=int, default=2)
    args = p.parse_args()
    found = torch.cuda.device_count()
    if found < args.tp:
        print(
            f"bench_engram_fused_all_reduce: needs {args.tp} GPUs, found {found}; nothing measured"
        )
        return
    os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")
    store = Path(tempfile.mkdtemp()) / "store"
    mp.spawn(rank_main, args=(args.tp, str(store), args, str(args.out)), nprocs=args.tp)


if __name__ == "__main__":
    main()
