"""Validate the fork's GB10 features against stock on your own machine, and time them.

Run on a DGX Spark (GB10, SM121) or an RTX Blackwell (SM120) with the fork installed and
``pip install b12x==1.5.1``; every feature refuses where it cannot run (the same checks the
server does). Writes benchmark/results/gb10_validate-<device>.json, the format of the fork's
other benchmarks ({"benchmark", "device", "torch", ..., "rows": [...]}), one row per feature and
shape with ``ok``, the error against stock or the reference, and times (CUDA-graph replay, median).

  python benchmark/gb10/validate.py                       # mxfp8, moe, engram on this GPU
  python benchmark/gb10/validate.py --feature mxfp8 --feature moe
  torchrun --nnodes 3 --nproc-per-node 1 --node-rank R --master-addr HEAD --master-port 29511 \\
      benchmark/gb10/validate.py --feature roce           # on each node of a RoCE-joined line

mxfp8   V4.1-Flash TP4 block-fp8 shapes (the shared expert's K = 576 down_proj included):
        b12x's block_fp8_linear (the fork's --block-fp8-mxfp8-backend b12x path) against stock's
        Triton block kernel on the same weights; both against an fp32 reference.
moe     V4.1-Flash TP4 routed experts (384 x 576, MXFP4) through the fork's b12x MoE method at
        1..64 rows and a prefill size, against a dense reference of the same experts (stock
        cannot start on 576-wide experts on SM12x: that is the feature's reason).
roce    TP all-gathers of decode-size shards through the fork's RoCE gather against NCCL's
        (bitwise), timed; needs the nodes of the line under torchrun.
engram  the Engram row store (--engram-row-store-dir) on local NVMe against the in-memory
        table: benchmark/engram/bench_engram_row_store.py with --dir (default: the current directory).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmark/: harness.py
from harness import graph_us_per_call  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from e2e.provenance import add_overwrite_arg, write_result  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--feature",
        action="append",
        choices=["mxfp8", "moe", "roce", "engram"],
        help="repeatable (default: mxfp8, moe, engram)",
    )
    p.add_argument("--out", type=Path, default=REPO / "benchmark" / "results")
    p.add_argument("--replays", type=int, default=30)
    p.add_argument(
        "--engram-dir", default=".", help="local NVMe folder for the engram benchmark"
    )
    return add_overwrite_arg(p).parse_args(argv)


# ---------------------------------------------------------------- references (CPU-testable)


def dequant_e2m1(packed: torch.Tensor, scale_e8m0: torch.Tensor) -> torch.Tensor:
    """MXFP4 bytes [..., K/2] (low nibble first) with E8M0 scales [..., K/32] -> fp32 [..., K]."""
    table = torch.tensor(
        E2M1 + tuple(-v for v in E2M1), dtype=torch.float32, device=packed.device
    )
    lo, hi = packed & 0xF, packed >> 4
    vals = table[torch.stack([lo, hi], -1).flatten(-2).long()]
    scale = torch.exp2(scale_e8m0.view(torch.uint8).float() - 127)
    return (vals.unflatten(-1, (-1, 32)) * scale.unsqueeze(-1)).flatten(-2)


def dequant_block_fp8(w: torch.Tensor, s: torch.Tensor, block=32) -> torch.Tensor:
    return (
        w.float()
        * s.float()
        .repeat_interleave(block, 0)
        .repeat_interleave(block, 1)[: w.shape[0], : w.shape[1]]
    )


def moe_reference(x, w13, w2, ids, weights, limit):
    """Dense reference of the routed experts: w13 [E, 2n, K] as [up; gate] (b12x's order)."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    n = w13.shape[1] // 2
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e < 0:
                continue
            h = w13[e] @ x[t].float()
            up, gate = h[:n], h[n:]
            if limit:
                gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
            out[t] += float(weights[t, j]) * (
                w2[e] @ (torch.nn.functional.silu(gate) * up)
            )
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


# ---------------------------------------------------------------- features


def check_b12x(flag, api, attr):
    from sglang.srt.utils.b12x_pin import b12x_refusal

    msg = b12x_refusal(flag, api, attr)
    if msg:
        raise SystemExit(msg)


def v41_block_fp8(n, k, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    w = (
        (torch.randn(n, k, generator=g, device=device) * 64)
        .clamp(-448, 448)
        .to(torch.float8_e4m3fn)
    )
    s = torch.exp2(
        torch.randint(
            -12, -4, ((n + 31) // 32, (k + 31) // 32), generator=g, device=device
        ).float()
    )
    return w, s


def run_mxfp8(args, rows_out):
    from sglang.srt.layers.quantization import b12x_block_fp8 as bf
    from sglang.srt.layers.quantization.fp8_utils import triton_w8a8_block_fp8_linear

    check_b12x("--block-fp8-mxfp8-backend b12x", "gemm.block_fp8_linear", "plan")
    dev = torch.device("cuda")
    shapes = [
        ("shared_experts.down_proj", 5120, 576),
        ("shared_experts.gate_up_proj", 1152, 5120),
        ("self_attn.wq_a", 1024, 5120),
        ("self_attn.wkv", 512, 5120),
    ]
    for name, n, k in shapes:
        w, s = v41_block_fp8(n, k, dev, n + k)
        layer = SimpleNamespace(
            weight=torch.nn.Parameter(w, requires_grad=False),
            weight_scale_inv=torch.nn.Parameter(s, requires_grad=False),
            prefix=name,
        )
        lin = bf.B12xBlockFp8Linear((32, 32), bf.plan_capacities(64, 2048))
        assert lin.prepare(layer), name
        ref_w = dequant_block_fp8(w, s)
        for m in (1, 2, 4, 8, 16, 32, 64, 2048):
            x = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
            ours = lin.apply(layer, x, None)
            stock = triton_w8a8_block_fp8_linear(
                x, w, [32, 32], s, act_scale_ue8m0=True
            )
            ref = x.float() @ ref_w.T
            row = {
                "feature": "mxfp8",
                "shape": f"{name} N{n} K{k}",
                "rows": m,
                "ours_rel_err": rel_err(ours, ref),
                "stock_rel_err": rel_err(stock, ref),
                "ours_us": graph_us_per_call(
                    [lambda: lin.apply(layer, x, None)], args.replays
                ),
                "stock_us": graph_us_per_call(
                    [
                        lambda: triton_w8a8_block_fp8_linear(
                            x, w, [32, 32], s, act_scale_ue8m0=True
                        )
                    ],
                    args.replays,
                ),
            }
            row["speedup"] = row["stock_us"] / row["ours_us"]
            # MXFP8 activations on both sides: ours within 2x stock's error of the fp32 result
            row["ok"] = row["ours_rel_err"] <= max(2 * row["stock_rel_err"], 1e-2)
            rows_out.append(row)
            print(row)


def run_moe(args, rows_out):
    from sglang.srt.layers.moe.topk import StandardTopKOutput
    from sglang.srt.layers.quantization import mxfp4_b12x_moe as bm

    check_b12x(bm.FLAG, "moe.fused_moe", "plan_execution")
    dev = torch.device("cuda")
    E, K, N, TOPK, LIMIT = 384, 5120, 576, 6, 10.0
    g = torch.Generator(device=dev).manual_seed(0)
    w13 = torch.randint(
        0, 256, (E, 2 * N, K // 2), dtype=torch.uint8, device=dev, generator=g
    )
    w2 = torch.randint(
        0, 256, (E, K, N // 2), dtype=torch.uint8, device=dev, generator=g
    )
    s13 = torch.randint(
        118, 124, (E, 2 * N, K // 32), dtype=torch.uint8, device=dev, generator=g
    )
    s2 = torch.randint(
        118, 124, (E, K, N // 32), dtype=torch.uint8, device=dev, generator=g
    )
    ref13, ref2 = dequant_e2m1(w13, s13), dequant_e2m1(w2, s2)
    P = torch.nn.Parameter
    layer = SimpleNamespace(
        w13_weight=P(w13, requires_grad=False),
        w2_weight=P(w2, requires_grad=False),
        w13_weight_scale_inv=P(s13.view(torch.float8_e8m0fnu), requires_grad=False),
        w2_weight_scale_inv=P(s2.view(torch.float8_e8m0fnu), requires_grad=False),
    )
    counts = bm.plan_token_counts([1, 2, 4, 8, 16], [1, 4], 2048)
    method = bm.Mxfp4B12xMoEMethod(
        SimpleNamespace(process_weights_after_loading=lambda layer: None),
        "model.layers.0.mlp.experts",
        counts,
    )
    method.create_moe_runner(
        layer,
        SimpleNamespace(top_k=TOPK, swiglu_limit=LIMIT, num_fused_shared_experts=0),
    )
    method.process_weights_after_loading(layer)
    for m in (1, 2, 4, 5, 8, 16, 20, 64, 512):
        x = (torch.randn(m, K, device=dev) * 0.1).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(E, device=dev)[:TOPK] for _ in range(m)]).to(
            torch.int32
        )
        w = torch.softmax(torch.randn(m, TOPK, device=dev), -1)
        d = SimpleNamespace(
            hidden_states=x, topk_output=StandardTopKOutput(w, ids, None)
        )
        ours = method.apply(None, d).hidden_states
        ref = moe_reference(x, ref13, ref2, ids, w, LIMIT) if m <= 64 else None
        row = {
            "feature": "moe",
            "shape": f"E{E} N{N} K{K} top{TOPK}",
            "rows": m,
            "ours_rel_err": None if ref is None else rel_err(ours, ref),
            "ours_us": graph_us_per_call([lambda: method.apply(None, d)], args.replays),
            "stock_us": None,
            "note": "stock cannot start on 576-wide experts on SM12x (FlashInfer CUTLASS needs % 128)",
        }
        row["ok"] = (
            row["ours_rel_err"] is None or row["ours_rel_err"] < 5e-2
        )  # MXFP8 activations
        rows_out.append(row)
        print(row)


def timed_on_roce(gather, fn, replays):
    with gather.capture():  # the runtime's graph-capture context, as GroupCoordinator.graph_capture
        return graph_us_per_call([fn], replays)


def run_roce(args, rows_out):
    import torch.distributed as dist

    from sglang.srt.distributed.device_communicators import b12x_roce_gather as rg

    check_b12x(rg.FLAG, "comm.roce", "AllReduce")
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dev = torch.device("cuda", torch.cuda.current_device())
    cpu = dist.new_group(backend="gloo")
    gather = rg.RoceGather(cpu, dev)
    for rows, hidden, dtype in (
        (1, 5120, torch.bfloat16),
        (4, 5120, torch.bfloat16),
        (16, 5120, torch.bfloat16),
        (64, 5120, torch.bfloat16),
        (20, 32320, torch.bfloat16),
        (4, 6, torch.int32),
    ):
        x = (torch.randn(rows, hidden, device=dev) * (rank + 1)).to(dtype)
        ours, stock = torch.empty(
            world * rows, hidden, dtype=dtype, device=dev
        ), torch.empty(world * rows, hidden, dtype=dtype, device=dev)
        took = gather.gather_into(ours, x)
        dist.all_gather_into_tensor(stock, x)
        torch.cuda.synchronize()
        row = {
            "feature": "roce",
            "shape": f"{rows}x{hidden} {dtype}",
            "rows": rows,
            "world": world,
            "on_roce": took,
            "bitwise": bool(torch.equal(ours, stock)) if took else None,
            "ours_us": (
                timed_on_roce(gather, lambda: gather.gather_into(ours, x), args.replays)
                if took
                else None
            ),
            "stock_us": graph_us_per_call(
                [lambda: dist.all_gather_into_tensor(stock, x)], args.replays
            ),
        }
        row["ok"] = row["bitwise"] is not False
        if row["ours_us"]:
            row["speedup"] = row["stock_us"] / row["ours_us"]
        if rank == 0:
            rows_out.append(row)
            print(row)


def run_engram(args, rows_out):
    out = args.out / "engram_row_store_gb10"
    r = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmark" / "engram" / "bench_engram_row_store.py"),
            "--dir",
            args.engram_dir,
            "--out",
            str(out),
        ],
        check=True,
    )
    for f in sorted(out.glob("engram_row_store-*.json")):
        for row in json.loads(f.read_text())["rows"]:
            rows_out.append({"feature": "engram", **row, "ok": True})
    return r


def main(argv=None):
    args = parse_args(argv)
    features = args.feature or ["mxfp8", "moe", "engram"]
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (a GB10 or an RTX Blackwell)")
    rows = []
    for f in features:
        {"mxfp8": run_mxfp8, "moe": run_moe, "roce": run_roce, "engram": run_engram}[f](
            args, rows
        )
    if os.environ.get("RANK", "0") != "0":
        return 0
    name = torch.cuda.get_device_name()
    import importlib.metadata as md

    from sglang.srt.utils.b12x_pin import B12X_VERSION

    path = write_result(
        args.out / f"gb10_validate-{name.replace(' ', '_')}.json",
        {
            "benchmark": "gb10_validate",
            "device": name,
            "torch": torch.__version__,
            "b12x": md.version("b12x"),
            "b12x_pinned": B12X_VERSION,
            "features": features,
            "all_ok": all(r.get("ok") for r in rows),
            "rows": rows,
        },
        overwrite=args.overwrite,
        default=str,
    )
    print(f"wrote {path}; all ok: {all(r.get('ok') for r in rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
