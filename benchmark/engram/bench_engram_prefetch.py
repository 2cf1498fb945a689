"""--engram-prefetch: decode step time of a V4.1-shaped stack at TP1, stock lookups against
the gathers issued after the hasher on a side stream, in one process.

The step (one CUDA graph, replayed): a hasher stand-in writes fresh hash ids (an LCG over
the previous ones, so every replay gathers other rows), then LAYERS decoder stand-ins, each a
bf16 GEMM [T, 5120] x [5120, 5120] with its own weight (52 MB) (so the weights stream from HBM, as a
layer's do); at the Engram layers (V4.1: 1 and 14) the lookup of upstream's EngramEmbedding
(fp8 rows + e8m0 scales -> bf16) and a projection of its rows into the hidden state
(a bf16 stand-in for wkv). ``stock``: the lookup inline at its layer, as 0.5.23 runs it;
``ours``: the same step with sglang.srt.layers.engram_prefetch (issue after the hasher, join
at the layer). Tables: ``device`` (TP1 device table) and ``host`` (the shared host layout:
pinned host memory read through UVA, what a TP1 H200 needs for V4.1's ~100 GB tables), each
--rows rows of 256 fp8 per Engram layer. ``lookups_us``: the two lookups alone in a graph.
``bitwise``: ours' gathered rows equal stock's.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools" / "standins"))
sys.path.insert(0, str(REPO / "benchmark"))

import engram_stack as stack  # noqa: E402
import harness  # noqa: E402
import torch  # noqa: E402

from sglang.srt.layers import engram_prefetch as ep  # noqa: E402

HIDDEN, DIM = 5120, 256
TOKENS = [1, 4, 16, 64, 128]


class Step:
    """One decode step of the stand-in stack; ``prefetch`` None = upstream's inline lookups."""

    def __init__(
        self, tokens, engrams, engram_layers, cols, rows, weights, proj, prefetch
    ):
        self.engrams, self.engram_layers, self.prefetch = (
            engrams,
            engram_layers,
            prefetch,
        )
        self.weights, self.proj, self.rows = weights, proj, rows
        self.ids = stack.hash_ids(tokens, len(engrams), cols, rows, "cuda", seed=tokens)
        self.x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
        self.batch = stack.decode_batch()
        self.gathered = []

    def hasher(self):
        self.ids.mul_(1103515245).add_(12345).remainder_(self.rows)

    def __call__(self):
        self.hasher()
        got = ep.issue_engram_prefetch(self.prefetch, self.ids, self.batch)
        h, gathered = self.x, []
        for i, w in enumerate(self.weights):
            if i in self.engram_layers:
                e = self.engrams[self.engram_layers.index(i)]
                col = self.ids[:, e.layer_hash_index]
                emb = (
                    got.rows(e, col, self.batch)
                    if got is not None
                    else e.embed_rows(col, self.batch, False)
                )
                gathered.append(emb)
                h = h + emb.flatten(-2) @ self.proj
            h = torch.tanh(torch.nn.functional.linear(h, w))
        self.gathered = gathered
        return h


def lookups(step: Step):
    def call():
        step.hasher()
        return [
            e.embed_rows(step.ids[:, e.layer_hash_index], step.batch, False)
            for e in step.engrams
        ]

    return call


def measure(args) -> list[dict]:
    layers = args.layers
    weights = [
        torch.randn(HIDDEN, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02
        for _ in range(layers)
    ]
    proj = (
        torch.randn(args.cols * DIM, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.01
    )
    out = []
    for layout in args.layouts:
        if layout == "device":
            embeds = [
                stack.device_embedding(args.rows, DIM, "cuda", seed=i)
                for i in range(len(args.engram_layers))
            ]
        else:
            embeds = [
                stack.HostEmbedding(args.rows, DIM, seed=i)
                for i in range(len(args.engram_layers))
            ]
        engrams = [stack.EngramLookup(e, i) for i, e in enumerate(embeds)]
        prefetch = ep.build_engram_prefetch(
            "on", [type("L", (), {"engram": e})() for e in engrams]
        )
        for tokens in TOKENS:
            mk = lambda p: Step(
                tokens,
                engrams,
                args.engram_layers,
                args.cols,
                args.rows,
                weights,
                proj,
                p,
            )  # noqa: E731
            stock_step, our_step = mk(None), mk(prefetch)
            stock_step(), our_step()  # same ids sequence: compare the first step's rows
            bitwise = all(
                torch.equal(a.view(torch.int16), b.view(torch.int16))
                for a, b in zip(stock_step.gathered, our_step.gathered)
            )
            stock = harness.graph_us_per_call([stock_step], args.replays)
            ours = harness.graph_us_per_call([our_step], args.replays)
            gather = harness.graph_us_per_call([lookups(mk(None))], args.replays)
            out.append(
                {
                    "layout": layout,
                    "tokens": tokens,
                    "bitwise": bitwise,
                    "stock_us": stock,
                    "ours_us": ours,
                    "ratio": stock / ours,
                    "saved_us": stock - ours,
                    "lookups_us": gather,
                }
            )
            print(
                " ".join(
                    f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in out[-1].items()
                ),
                flush=True,
            )
        del embeds, engrams, prefetch
        torch.cuda.empty_cache()
    return out


def main() -> None:
    p = harness.arg_parser(__doc__)
    p.add_argument("--layers", type=int, default=harness.LAYERS)
    p.add_argument(
        "--engram-layers",
        type=lambda s: [int(v) for v in s.split(",")],
        default=[1, 14],
    )
    p.add_argument(
        "--cols",
        type=int,
        default=16,
        help="hash columns per token: (max n-gram - 1) x heads",
    )
    p.add_argument(
        "--rows", type=int, default=1 << 24, help="table rows per Engram layer"
    )
    p.add_argument("--layouts", type=lambda s: s.split(","), default=["device", "host"])
    args = p.parse_args()
    rows = measure(args)
    harness.report(
        "engram_prefetch",
        [
            "layout",
            "tokens",
            "bitwise",
            "stock_us",
            "ours_us",
            "ratio",
            "saved_us",
            "lookups_us",
        ],
        rows,
        args.out,
        {
            "layers": args.layers,
            "engram_layers": args.engram_layers,
            "hash_cols": args.cols,
            "head_dim": DIM,
            "table_rows": args.rows,
            "hidden": HIDDEN,
        },
        overwrite=args.overwrite,
    )


if __name__ == "__main__":
    main()
