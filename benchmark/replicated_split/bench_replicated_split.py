"""--replicated-linear-split on TP GPUs (srt/layers/replicated_split.py): stock against split, in one
process per rank.

For each layer shape (default DeepSeek-V4.1's fused ``wqkv_a``, 5120 -> 1280 + 512, and the DSpark
draft's ``main_proj``, 5120 x target layers -> 5120) and row count M, a CUDA graph replays LAYERS
distinct bf16 layers (so weights stream from HBM) four ways: ``stock`` (the full layer on every
rank), ``split`` (this rank's 128-row tiles, the NCCL all-gather padded to the widest slice and the
concat: what the feature serves), and its two parts alone, ``gemm`` (the slice) and ``gather``.
``decision`` is what the feature's own first-call check chooses at that M (eager, CUDA events,
the ranks agreeing), and ``bitwise`` whether its self-check found the split exact. Rank 0 writes
``replicated_split-<device>.json``; ``ratio`` = split / stock (below 1: the split wins).

Needs --tp GPUs (default 2) on one host: ``python benchmark/replicated_split/bench_replicated_split.py``.
On fewer GPUs it says so and writes nothing.
"""

from __future__ import annotations

import os
import sys
import tempfile
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools" / "standins"))
sys.path.insert(0, str(REPO / "benchmark"))

import harness  # noqa: E402
import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

ROWS = (1, 2, 4, 8, 16, 32, 64, 96)


class LinearMethod:
    """UnquantizedLinearMethod.apply's plain CUDA path (cuBLAS through F.linear)."""

    def apply(self, layer, x, bias=None):
        return torch.nn.functional.linear(x, layer.weight, bias)


class Layer(torch.nn.Module):
    def __init__(self, k: int, n: int):
        super().__init__()
        self.input_size, self.output_size = k, n
        self.weight = torch.nn.Parameter(
            torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02,
            requires_grad=False,
        )
        self.bias = None
        self.quant_method = LinearMethod()


class Group:
    """What the split uses of a GroupCoordinator, over torch.distributed (NCCL + a gloo group)."""

    def __init__(self, rank: int, world: int):
        import torch.distributed as dist

        self.world_size, self.rank_in_group = world, rank
        self.cpu_group = dist.new_group(backend="gloo")

    def all_gather_into_tensor(self, output, input):
        import torch.distributed as dist

        dist.all_gather_into_tensor(output, input)


def rank_main(rank: int, world: int, store: str, args) -> None:
    import torch.distributed as dist

    try:
        torch.cuda.set_device(rank)
        dist.init_process_group(
            "nccl", init_method=f"file://{store}", rank=rank, world_size=world
        )
        from sglang.srt.layers.replicated_split import ReplicatedSplit, slice_layer

        group = Group(rank, world)
        warm = torch.zeros(world * 8, device="cuda")
        dist.all_gather_into_tensor(
            warm, torch.ones(8, device="cuda")
        )  # NCCL up before any capture
        shapes = {
            "wqkv_a": (5120, 1280 + 512),
            "main_proj": (5120 * args.main_proj_target_layers, 5120),
        }
        rows = []
        for name, (k, n) in shapes.items():
            layers = [Layer(k, n) for _ in range(harness.LAYERS)]
            splits = [
                ReplicatedSplit(layer, f"{name}[{i}]", max(ROWS), group)
                for i, layer in enumerate(layers)
            ]
            for s in splits:
                lo, hi = s.ranges[rank]
                s.sub = slice_layer(s.layer, lo, hi, s.name)
            for m in ROWS:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                y = torch.empty(
                    m, max(splits[0].widths), device="cuda", dtype=torch.bfloat16
                )
                gathered = torch.empty(
                    world * m, y.shape[1], device="cuda", dtype=torch.bfloat16
                )
                dist.barrier()
                stock = harness.graph_us_per_call(
                    [lambda s=s: s._stock(x, None) for s in splits], args.replays
                )
                dist.barrier()
                split = harness.graph_us_per_call(
                    [lambda s=s: s._split(x, None) for s in splits], args.replays
                )
                dist.barrier()
                gemm = harness.graph_us_per_call(
                    [lambda s=s: s._local(x, None) for s in splits], args.replays
                )
                dist.barrier()
                gather = harness.graph_us_per_call(
                    [lambda: dist.all_gather_into_tensor(gathered, y) for _ in splits],
                    args.replays,
                )
                probe = ReplicatedSplit(layers[0], f"{name} probe", max(ROWS), group)
                probe.apply(
                    x, None
                )  # the feature's own first call: self-check, timing, agreement
                decision = probe.decisions[m]
                exact = _bitwise(probe, x)
                times = torch.tensor([stock, split, gemm, gather], dtype=torch.float64)
                dist.all_reduce(
                    times, op=dist.ReduceOp.MAX, group=group.cpu_group
                )  # the slowest rank
                stock, split, gemm, gather = times.tolist()
                rows.append(
                    {
                        "layer": name,
                        "K": k,
                        "N": n,
                        "M": m,
                        "stock_us": stock,
                        "split_us": split,
                        "gemm_us": gemm,
                        "gather_us": gather,
                        "ratio": split / stock,
                        "bitwise": exact,
                        "decision": "split" if decision else "stock",
                    }
                )
        if rank == 0:
            harness.report(
                "replicated_split",
                [
                    "layer",
                    "M",
                    "stock_us",
                    "split_us",
                    "gemm_us",
                    "gather_us",
                    "ratio",
                    "bitwise",
                    "decision",
                ],
                rows,
                args.out,
                {
                    "tp": world,
                    "dtype": "bfloat16",
                    "layers": harness.LAYERS,
                    "main_proj_target_layers": args.main_proj_target_layers,
                    "times": "slowest rank, median of CUDA-graph replays, per layer",
                },
                overwrite=args.overwrite,
            )
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        raise


def _bitwise(probe, x) -> bool:
    """The split against the full layer on this input (every rank takes part in the gather)."""
    from sglang.srt.layers.replicated_split import _same_bits

    return bool(_same_bits(probe._split(x, None), probe._stock(x, None)))


def main() -> None:
    p = harness.arg_parser(__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument(
        "--main-proj-target-layers",
        type=int,
        default=3,
        help="the draft's target layers: main_proj's K is 5120 x this",
    )
    args = p.parse_args()
    if not torch.cuda.is_available() or torch.cuda.device_count() < args.tp:
        print(
            f"bench_replicated_split: needs {args.tp} GPUs, found "
            f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}; nothing written"
        )
        return
    store = os.path.join(tempfile.mkdtemp(), "store")
    mp.spawn(rank_main, args=(args.tp, store, args), nprocs=args.tp, join=True)


if __name__ == "__main__":
    main()
