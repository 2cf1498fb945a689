"""--engram-fused-all-reduce: one TP all-reduce for every Engram layer's lookup of a forward.

CPU, with 2 and 3 gloo ranks (spawned processes) on upstream's EngramEmbedding sharded over
the ranks (hash-column bounds where the columns divide evenly, equal rows where they do not):
the rows served through the fused path equal upstream's per-layer lookup bit for bit (random
tables with -0.0 codes, duplicate ids, ids on every rank and at every shard edge), with one
all-reduce per forward instead of one per layer, also when the fused reduction sums the ranks
in reverse order; both equal the single-table dequantization (each row owned by exactly one
rank); check mode counts zero differing layers. The flag's refusals at startup and at load;
off, the model's prefetch object is untouched (upstream's forward). GPU (-m gpu, 2 GPUs): the
same comparison over NCCL, eager and replayed from a CUDA graph.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp
from conftest import REPO, with_model

sys.path.insert(0, str(REPO / "benchmark" / "engram"))
import engram_stack as stack  # noqa: E402

from sglang.srt.layers import engram_fused_all_reduce as far  # noqa: E402

DIM, TOKENS, VOCAB = 64, 24, 97
# (max n-gram size, heads): 3 hash columns (split on column bounds at TP3, equal rows at TP2)
# and 4 (column bounds at TP2, equal rows at TP3)
SHAPES = {"cols3": (2, 3), "cols4": (3, 2)}


def engram_config(max_ngram: int, heads: int, layers=(3, 7, 11)):
    """A V4.1-shaped config: the table sizes are the sums of the layers' primes."""
    from sglang.srt.layers.engram import EngramLayout

    cfg = SimpleNamespace(
        engram_layer_ids=list(layers),
        engram_max_ngram_size=max_ngram,
        engram_n_heads=heads,
        engram_vocab_size=VOCAB,
        engram_head_dim=DIM,
        engram_num_embeddings=[0] * len(layers),
    )
    layout = EngramLayout.from_config(cfg)
    cfg.engram_num_embeddings = [
        layout.column_bounds(i)[-1] for i in range(len(layers))
    ]
    return cfg


def _cfg(**kw):
    base = dict(engram_fused_all_reduce=True, tp_size=2, engram_prefetch="on")
    base.update(kw)
    return SimpleNamespace(**base)


V41 = "DeepseekV4ForCausalLM"


# ------------------------------------------------------------------------------- the flag


def test_flag_default_and_command_line():
    from sglang.srt.arg_groups.fields.exec_ import ExecOverlap
    from sglang.srt.server_args import ServerArgs

    assert ExecOverlap().engram_fused_all_reduce is False
    parser = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    assert parser.parse_args(["--model-path", "x"]).engram_fused_all_reduce is False
    assert (
        parser.parse_args(
            ["--model-path", "x", "--engram-fused-all-reduce"]
        ).engram_fused_all_reduce
        is True
    )


def test_validate_refuses_where_it_would_do_nothing(monkeypatch):
    hf = engram_config(*SHAPES["cols4"])
    assert far.validate_engram_fused_all_reduce(with_model(_cfg(), V41, hf)) is True
    assert (
        far.validate_engram_fused_all_reduce(
            with_model(_cfg(engram_prefetch="check", tp_size=3), V41, hf)
        )
        is True
    )
    assert (
        far.validate_engram_fused_all_reduce(
            with_model(_cfg(engram_fused_all_reduce=False, tp_size=1), "X", None)
        )
        is False
    )
    with pytest.raises(
        ValueError, match="--engram-fused-all-reduce does nothing at --tp-size 1"
    ):
        far.validate_engram_fused_all_reduce(with_model(_cfg(tp_size=1), V41, hf))
    with pytest.raises(
        ValueError, match=r"this model \(LlamaForCausalLM\) has no Engram layers"
    ):
        far.validate_engram_fused_all_reduce(with_model(_cfg(), "LlamaForCausalLM", hf))
    with pytest.raises(ValueError, match="has no Engram layers"):
        far.validate_engram_fused_all_reduce(
            with_model(_cfg(), V41, SimpleNamespace(engram_layer_ids=[]))
        )
    with pytest.raises(
        ValueError, match="needs --engram-prefetch on .*got --engram-prefetch=off"
    ):
        far.validate_engram_fused_all_reduce(
            with_model(_cfg(engram_prefetch="off"), V41, hf)
        )


def test_validate_refuses_lookups_without_an_all_reduce(monkeypatch):
    hf = engram_config(*SHAPES["cols4"])
    monkeypatch.setenv("SGLANG_OPT_DSV41_ENGRAM_PEER_SHARDS", "1")
    with pytest.raises(
        ValueError,
        match="SGLANG_OPT_DSV41_ENGRAM_PEER_SHARDS=1: each rank reads its peers",
    ):
        far.validate_engram_fused_all_reduce(with_model(_cfg(), V41, hf))
    monkeypatch.delenv("SGLANG_OPT_DSV41_ENGRAM_PEER_SHARDS")
    monkeypatch.setenv("SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE", "1")
    monkeypatch.setenv(
        "SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT", "per_rank"
    )  # sharded: served
    assert far.validate_engram_fused_all_reduce(with_model(_cfg(), V41, hf)) is True
    monkeypatch.setenv("SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT", "shared")
    with pytest.raises(
        ValueError,
        match="SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE=1: every rank reads the whole",
    ):
        far.validate_engram_fused_all_reduce(with_model(_cfg(), V41, hf))


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("tp", [2, 3, 4, 8])
def test_rows_partition_holds_for_upstreams_sharding(shape, tp):
    """Both of shard_range's layouts (column bounds, equal rows) give every row one owner."""
    far.check_rows_partition(engram_config(*SHAPES[shape]), tp)


def test_an_overlapping_sharding_is_refused_at_startup(monkeypatch):
    from sglang.srt.layers import engram

    real = engram.shard_range

    def overlapping(rows, bounds, rank, size):
        start, end = real(rows, bounds, rank, size)
        return (
            max(0, start - 1),
            end,
        )  # each rank also holds its left neighbour's last row

    monkeypatch.setattr(engram, "shard_range", overlapping)
    with pytest.raises(
        ValueError,
        match=r"Engram layer 3's \d+ rows are not split into disjoint ranges over 2",
    ):
        far.check_rows_partition(engram_config(*SHAPES["cols4"]), 2)


def _engrams(monkeypatch, tp_size=2, **members):
    engrams = [
        stack.EngramLookup(
            stack.device_embedding(512, DIM, "cpu", seed=i, monkeypatch=monkeypatch), i
        )
        for i in range(2)
    ]
    for e in engrams:
        e.embed.tp_size = tp_size
        for k, v in members.items():
            setattr(e.embed, k, v)
    return engrams


def test_build_refuses_a_lookup_the_startup_check_did_not_approve(monkeypatch):
    from sglang.srt import runtime_context
    from sglang.srt.layers import engram_prefetch as ep
    from sglang.srt.layers.engram import EngramLayout

    layout = EngramLayout(
        max_ngram_size=2,
        layer_ids=(4, 9),
        num_embeddings=(512, 512),
        primes=(((512,),), ((512,),)),
        n_heads=1,
        head_dim=DIM,
    )
    monkeypatch.setattr(
        runtime_context, "get_parallel", lambda: SimpleNamespace(tp_rank=0)
    )
    with pytest.raises(RuntimeError, match="needs --engram-prefetch on"):
        far.fuse_engram_all_reduce(True, None, layout)
    # a table sharded as shard_range says (rank 0 of 2 owns rows 0..256) is served
    ok = ep.EngramPrefetch("on", _engrams(monkeypatch, rows=256), torch.device("cpu"))
    assert isinstance(
        far.fuse_engram_all_reduce(True, ok, layout), far.FusedEngramAllReduce
    )
    for members, found in (
        ({"tp_size": 1}, "tp_size=1"),
        ({"peer": object()}, "peer shards=True"),
        ({}, r"rows \(0, 512\), shard_range \(0, 256\)"),
    ):
        p = ep.EngramPrefetch(
            "on", _engrams(monkeypatch, **{"rows": 256, **members}), torch.device("cpu")
        )
        if not members:
            p.engrams[0].embed.rows = 512
        with pytest.raises(
            RuntimeError, match=f"Engram layer 4 is not looked up .*{found}"
        ):
            far.fuse_engram_all_reduce(True, p, layout)


def test_flag_off_keeps_the_prefetch_and_upstreams_lookup(monkeypatch):
    """Off: the model keeps the prefetch object it built (None without --engram-prefetch), so
    Engram.forward runs the release's lookup or 0015's prefetch unchanged."""
    from sglang.srt.layers import engram_prefetch as ep

    p = ep.EngramPrefetch("on", _engrams(monkeypatch, tp_size=1), torch.device("cpu"))
    assert far.fuse_engram_all_reduce(False, p, None) is p
    assert far.fuse_engram_all_reduce(False, None, None) is None


def test_batches_the_prefetch_does_not_serve_keep_the_per_layer_lookup(monkeypatch):
    from sglang.srt.layers import engram_prefetch as ep

    fused = far.FusedEngramAllReduce(
        ep.EngramPrefetch("on", _engrams(monkeypatch), torch.device("cpu"))
    )
    ids = stack.hash_ids(4, 2, 3, 512, "cpu")
    extend = SimpleNamespace(
        forward_mode=SimpleNamespace(
            is_decode=lambda: False, is_target_verify=lambda: False
        ),
        engram_staged_rows=None,
    )
    assert fused.issue(ids, extend) is None
    assert fused.issue(ids[:0], stack.decode_batch()) is None
    assert fused.issue(ids, stack.decode_batch(staged=[object()])) is None


@pytest.mark.e2e
def test_launch_server_refuses_it_at_tp1(tmp_path):
    """A real launch_server start (tiny Llama on CPU, as tools/e2e's refusal rows on the GPU)."""
    from e2e.checkpoints import write_tiny_llama
    from e2e.server import refusal

    args = [
        "--device",
        "cpu",
        "--attention-backend",
        "torch_native",
        "--sampling-backend",
        "pytorch",
        "--disable-cuda-graph",
        "--load-format",
        "dummy",
        "--engram-fused-all-reduce",
    ]
    env = {
        "SGLANG_USE_CPU_ENGINE": "1",
        "PYTHONPATH": os.pathsep.join(
            [str(REPO / "tools" / "standins"), os.environ.get("PYTHONPATH", "")]
        ),
    }
    r = refusal(write_tiny_llama(tmp_path), args, env=env, timeout=240)
    assert (
        r.returncode != 0
        and "--engram-fused-all-reduce does nothing at --tp-size 1" in r.stdout
    ), r.stdout[-3000:]


# ----------------------------------------------------------------- TP ranks (gloo, CPU)


def random_table(rows: int, seed: int):
    """fp8 rows (every finite code, -0.0 included and forced on some) and e8m0 scales."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(0, 256, (rows, DIM), dtype=torch.uint8, generator=g)
    w[(w & 0x7F) == 0x7F] = 0x80  # NaN codes -> -0.0
    w[::7, :5] = 0x80
    s = torch.randint(110, 135, (rows, DIM // 32), dtype=torch.uint8, generator=g)
    return w.view(torch.float8_e4m3fn), s.view(torch.float8_e8m0fnu)


def hash_ids(layout, seed: int, tp: int):
    """[T, layers, cols] ids as the hasher makes them (column c in its own segment), with
    repeated tokens and every shard's edges."""
    from sglang.srt.layers.engram import shard_range

    g = torch.Generator().manual_seed(seed)
    cols = []
    for i in range(len(layout.layer_ids)):
        b = layout.column_bounds(i)
        col = torch.stack(
            [
                torch.randint(b[c], b[c + 1], (TOKENS,), generator=g)
                for c in range(len(b) - 1)
            ],
            -1,
        )
        edges = {x for r in range(tp) for x in shard_range(b[-1], b, r, tp)}
        for t, x in enumerate(sorted(edges)):
            c = next((c for c in range(len(b) - 1) if b[c] <= x < b[c + 1]), None)
            if c is not None:
                col[t % TOKENS, c] = x
        col[TOKENS // 2 :] = col[: TOKENS - TOKENS // 2].clone()  # duplicate tokens
        cols.append(col)
    return torch.stack(cols, 1)


def _same(a, b):
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def rank_main(rank: int, world: int, store: str, out: str, device: str) -> None:
    sys.path.insert(0, str(REPO / "tools" / "standins"))
    sys.path.insert(0, str(REPO / "benchmark" / "engram"))
    try:
        import engram_stack as stk
        import torch.distributed as dist

        import sglang.srt.layers.engram as eg
        from sglang.srt import runtime_context
        from sglang.srt.layers import engram_fused_all_reduce as fused_mod
        from sglang.srt.layers import engram_prefetch as ep

        if device == "cuda":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            "nccl" if device == "cuda" else "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=world,
        )
        par = SimpleNamespace(
            tp_size=world, tp_rank=rank, attn_dp_size=1, tp_group=None
        )
        offload = SimpleNamespace(
            engram_row_store_dir=None, engram_row_store_cache_gib=None
        )
        eg.get_parallel = runtime_context.get_parallel = lambda: par
        eg.get_exec = lambda: SimpleNamespace(offload=offload)
        calls, order = [], {"reverse": False}

        def all_reduce(
            t,
        ):  # the TP group's all-reduce (on CPU: torch.distributed's, in place)
            calls.append(t.numel())
            if not order["reverse"]:
                dist.all_reduce(t)
                return t
            parts = [
                torch.empty_like(t) for _ in range(world)
            ]  # sum the ranks last to first
            dist.all_gather(parts, t)
            acc = parts[-1].clone()
            for p in reversed(parts[:-1]):
                acc += p
            return acc

        eg.tensor_model_parallel_all_reduce = all_reduce
        results = {}
        for name, (max_ngram, heads) in SHAPES.items():
            hf = engram_config(max_ngram, heads)
            layout = eg.EngramLayout.from_config(hf)
            engrams, tables = [], []
            for i, layer in enumerate(layout.layer_ids):
                rows = layout.num_embeddings[i]
                emb = eg.EngramEmbedding(
                    rows, DIM, layer, column_bounds=layout.column_bounds(i)
                )
                w, s = random_table(rows, seed=100 * i + max_ngram)
                if device == "cuda":
                    emb.weight.data, emb.scale.data = (
                        emb.weight.data.cuda(),
                        emb.scale.data.cuda(),
                    )
                emb.weight.weight_loader(emb.weight, w.to(device))
                emb.scale.weight_loader(emb.scale, s.to(device))
                engrams.append(stk.EngramLookup(emb, i))
                tables.append((w, s))
            ids = hash_ids(layout, seed=world, tp=world).to(device)
            cols = [ids[:, i] for i in range(len(engrams))]
            del calls[:]
            stock = [e.embed(c) for e, c in zip(engrams, cols)]
            stock_calls = len(calls)
            r = {
                "layers": len(engrams),
                "stock_all_reduces": stock_calls,
                "owned_rows": [e.embed.rows for e in engrams],
            }
            # the single-table dequantization: what the sum of the shards must be (-0 -> +0)
            ref = []
            for (w, s), c in zip(tables, cols):
                c = c.cpu()
                v = (
                    w[c].float().unflatten(-1, (-1, 32)) * s[c].float().unsqueeze(-1)
                ).flatten(-2)
                ref.append(v.to(torch.bfloat16) + 0.0)
            r["stock_is_the_table"] = all(_same(a.cpu(), b) for a, b in zip(stock, ref))
            for mode in ("on", "check"):
                for reverse in (False, True):
                    order["reverse"] = reverse
                    p = ep.EngramPrefetch(mode, engrams, torch.device(device))
                    f = fused_mod.fuse_engram_all_reduce(True, p, layout)
                    del calls[:]
                    got = f.issue(ids, stk.decode_batch())
                    served = [got.rows(e, c, None) for e, c in zip(engrams, cols)]
                    key = f"{mode}{'_reverse' if reverse else ''}"
                    if mode == "on":
                        r[f"{key}_all_reduces"] = len(calls)
                    else:
                        r[f"{key}_report"] = list(p.report())
                    r[f"{key}_bitwise"] = all(
                        _same(a, b) for a, b in zip(served, stock)
                    )
            order["reverse"] = False
            if device == "cuda":  # the fused path replayed from a CUDA graph
                p = ep.EngramPrefetch("on", engrams, torch.device(device))
                f = fused_mod.fuse_engram_all_reduce(True, p, layout)

                def step():
                    got = f.issue(ids, stk.decode_batch())
                    return [got.rows(e, c, None) for e, c in zip(engrams, cols)]

                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    step()
                torch.cuda.current_stream().wait_stream(s)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    outs = step()
                for _ in range(3):
                    graph.replay()
                torch.cuda.synchronize()
                r["graph_bitwise"] = all(_same(a, b) for a, b in zip(outs, stock))
            results[name] = r
        Path(out).write_text(json.dumps(results))
        dist.destroy_process_group()
    except BaseException:
        Path(out).write_text(json.dumps({"error": traceback.format_exc()}))
        raise


def run_ranks(tmp_path, world: int, device: str = "cpu") -> list[dict]:
    ctx = mp.get_context("spawn")
    outs = [tmp_path / f"out{r}.json" for r in range(world)]
    procs = [
        ctx.Process(
            target=rank_main,
            args=(r, world, str(tmp_path / "store"), str(outs[r]), device),
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(240)
    for p in procs:
        if p.is_alive():
            p.kill()
    results = [
        json.loads(o.read_text()) if o.exists() else {"error": "no output"}
        for o in outs
    ]
    for r in results:
        assert "error" not in r, r["error"]
    return results


@pytest.mark.parametrize("world", [2, 3])
def test_fused_all_reduce_is_the_per_layer_lookup_bit_for_bit(tmp_path, world):
    results = run_ranks(tmp_path, world)
    for rank, per_shape in enumerate(results):
        for name, r in per_shape.items():
            where = f"rank {rank}/{world}, {name}"
            layers = r["layers"]
            assert r["stock_all_reduces"] == layers, where
            assert r["on_all_reduces"] == r["on_reverse_all_reduces"] == 1, where
            assert r["stock_is_the_table"], where
            for key in ("on", "on_reverse", "check", "check_reverse"):
                assert r[f"{key}_bitwise"], f"{where}: {key}"
            assert r["check_report"] == r["check_reverse_report"] == [layers, 0], where
    # both of shard_range's layouts ran: hash-column bounds (columns divide evenly) and equal rows
    assert sorted(((n - 1) * h) % world == 0 for n, h in SHAPES.values()) == [
        False,
        True,
    ]


@pytest.mark.gpu
def test_gpu_two_ranks_nccl_eager_and_graph(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")
    for r in run_ranks(tmp_path, 2, device="cuda"):
        for name, res in r.items():
            assert (
                res["on_bitwise"]
                and res["check_report"][1] == 0
                and res["graph_bitwise"]
            ), (name, res)
            assert res["on_all_reduces"] == 1
