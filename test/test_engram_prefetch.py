"""--engram-prefetch: every Engram layer's gather issued after the hasher on a side stream.

CPU: the flag's values and refusals, the build (off / no Engram layer -> nothing; an upstream
EngramEmbedding that lost a member the gather reads -> refuses to load), which batches are
served (decode and target-verify; not extend, empty or staged batches), the rows served through
Engram.forward equal to the synchronous lookup bit for bit on upstream's EngramEmbedding, the
TP reduce kept at the layer on the main stream, check mode (serves the synchronous values,
counts differing gathers, including a deliberately corrupted one). GPU (-m gpu): upstream's
gather kernel on a device table and on a shared pinned host table, 1..64 rows, eager and
captured in a CUDA graph with work between the layers, bit for bit; check mode counts zero
differing gathers over graph replays.
"""

from __future__ import annotations

import argparse
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import HAS_CUDA, REPO, with_model

sys.path.insert(0, str(REPO / "benchmark" / "engram"))
import engram_stack as stack  # noqa: E402

from sglang.srt.layers import engram_prefetch as ep  # noqa: E402

DEV = "cuda" if HAS_CUDA else "cpu"
ROWS, DIM, COLS = 4096, 64, 6


def _same(a, b):
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def _stack(monkeypatch, layers=2, device=DEV):
    return [
        stack.EngramLookup(
            stack.device_embedding(ROWS, DIM, device, seed=i, monkeypatch=monkeypatch),
            i,
        )
        for i in range(layers)
    ]


def _extend():
    mode = SimpleNamespace(is_decode=lambda: False, is_target_verify=lambda: False)
    return SimpleNamespace(forward_mode=mode, engram_staged_rows=None)


# ------------------------------------------------------------------------------- the flag


def test_flag_values_and_errors():
    assert [ep.parse_engram_prefetch(v) for v in ("off", "ON", " check")] == [
        "off",
        "on",
        "check",
    ]
    for bad in ("yes", "1"):
        with pytest.raises(
            argparse.ArgumentTypeError,
            match="--engram-prefetch=.*accepted: off; on .* check",
        ):
            ep.parse_engram_prefetch(bad)
    from sglang.srt.arg_groups.fields.exec_ import ExecOverlap

    assert ExecOverlap().engram_prefetch == "off"


def test_flag_on_command_line():
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    assert (
        parser.parse_args(
            ["--model-path", "x", "--engram-prefetch", "check"]
        ).engram_prefetch
        == "check"
    )
    assert parser.parse_args(["--model-path", "x"]).engram_prefetch == "off"


def test_validate_refuses_where_it_would_do_nothing():
    v41 = SimpleNamespace(engram_layer_ids=[1, 14])
    cfg = dict(
        engram_prefetch="on", device="cuda", tp_size=4, attn_dp_size=1, dp_size=1
    )
    assert (
        ep.validate_engram_prefetch(
            with_model(SimpleNamespace(**cfg), "DeepseekV4ForCausalLM", v41)
        )
        == "on"
    )
    assert (
        ep.validate_engram_prefetch(
            with_model(SimpleNamespace(**{**cfg, "engram_prefetch": "off"}), "X", None)
        )
        == "off"
    )
    with pytest.raises(ValueError, match="no Engram layers"):
        ep.validate_engram_prefetch(
            with_model(
                SimpleNamespace(**cfg), "DeepseekV4ForCausalLM", SimpleNamespace()
            )
        )
    with pytest.raises(ValueError, match="no Engram layers"):
        ep.validate_engram_prefetch(
            with_model(SimpleNamespace(**cfg), "LlamaForCausalLM", v41)
        )
    with pytest.raises(ValueError, match="DP attention"):
        ep.validate_engram_prefetch(
            with_model(
                SimpleNamespace(**{**cfg, "attn_dp_size": 4}),
                "DeepseekV4ForCausalLM",
                v41,
            )
        )
    with pytest.raises(ValueError, match="--device cuda"):
        ep.validate_engram_prefetch(
            with_model(
                SimpleNamespace(**{**cfg, "device": "cpu"}),
                "DeepseekV4ForCausalLM",
                v41,
            )
        )


def test_build(monkeypatch):
    engrams = _stack(monkeypatch, device="cpu")
    layers = [
        SimpleNamespace(engram=None),
        SimpleNamespace(engram=engrams[0]),
        SimpleNamespace(),
    ]
    assert ep.build_engram_prefetch("off", layers, "cpu") is None
    assert ep.build_engram_prefetch("on", [SimpleNamespace(engram=None)], "cpu") is None
    p = ep.build_engram_prefetch("on", layers, "cpu")
    assert p.engrams == [engrams[0]] and p.stream is None
    assert ep.issue_engram_prefetch(None, None, None) is None


def test_build_refuses_a_drifted_embedding(monkeypatch):
    lookup = stack.EngramLookup(SimpleNamespace(dim=8, peer=None), 0)
    with pytest.raises(RuntimeError, match="no longer has .*_owned_rows"):
        ep.build_engram_prefetch("on", [SimpleNamespace(engram=lookup)], "cpu")


# ------------------------------------------------------------------------ serving, on CPU


def test_only_decode_and_verify_batches_are_prefetched(monkeypatch):
    p = ep.EngramPrefetch("on", _stack(monkeypatch, device="cpu"), torch.device("cpu"))
    ids = stack.hash_ids(5, 2, COLS, ROWS, "cpu")
    assert p.issue(ids, stack.decode_batch()) is not None
    verify = SimpleNamespace(
        forward_mode=SimpleNamespace(
            is_decode=lambda: False, is_target_verify=lambda: True
        ),
        engram_staged_rows=None,
    )
    assert p.issue(ids, verify) is not None
    assert p.issue(ids, _extend()) is None
    assert p.issue(ids[:0], stack.decode_batch()) is None
    assert p.issue(ids, stack.decode_batch(staged=[object()])) is None


def test_prefetched_rows_are_the_lookup_bit_for_bit(monkeypatch):
    engrams = _stack(monkeypatch, device="cpu")
    p = ep.EngramPrefetch("on", engrams, torch.device("cpu"))
    ids = stack.hash_ids(7, 2, COLS, ROWS, "cpu", seed=3)
    got = p.issue(ids, stack.decode_batch())
    for e in engrams:
        col = ids[:, e.layer_hash_index]
        assert _same(got.rows(e, col, None), e.embed(col))
    assert not got.pending  # every layer's rows handed out once


def test_engram_forward_reads_the_prefetched_rows(monkeypatch):
    """Engram.forward takes the rows from ``prefetched`` instead of looking them up."""
    from sglang.srt.layers.engram import Engram

    seen = {}

    class Rows:
        def rows(self, engram, hash_ids, forward_batch):
            seen["args"] = (engram, hash_ids, forward_batch)
            return torch.ones(*hash_ids.shape, 4, dtype=torch.float32)

    def wkv(flat):
        seen["wkv"] = flat
        return torch.zeros(flat.shape[0], 2 * 8), None

    fake = SimpleNamespace(
        embed=SimpleNamespace(staged_by_scheduler=False),
        wkv=wkv,
        q_weight=torch.ones(1, 8),
        k_weight=torch.ones(1, 8),
        eps=1e-6,
        clamp_value=1e-6,
        image_token_id=None,
        embed_rows=lambda *a: pytest.fail("looked up although prefetched"),
    )
    x, ids, fb = torch.randn(3, 1, 8), torch.zeros(3, COLS, dtype=torch.int64), object()
    Engram.forward(fake, x, ids, fb, input_ids=torch.zeros(3), prefetched=Rows())
    assert seen["args"] == (fake, ids, fb) and seen["wkv"].shape == (3, COLS * 4)


def test_tp_reduce_stays_at_the_layer(monkeypatch):
    engrams = _stack(monkeypatch, layers=1, device="cpu")
    embed = engrams[0].embed
    monkeypatch.setattr(embed, "tp_size", 2)
    reduced = []
    monkeypatch.setattr(
        embed, "_reduce_owned_rows", lambda v: reduced.append(v) or v + 0
    )
    p = ep.EngramPrefetch("on", engrams, torch.device("cpu"))
    got = p.issue(stack.hash_ids(4, 1, COLS, ROWS, "cpu"), stack.decode_batch())
    assert not reduced  # nothing reduced when the gathers are issued
    got.rows(engrams[0], stack.hash_ids(4, 1, COLS, ROWS, "cpu")[:, 0], None)
    assert len(reduced) == 1


def test_check_mode_serves_the_lookup_and_counts_differing_gathers(monkeypatch, caplog):
    engrams = _stack(monkeypatch, device="cpu")
    p = ep.EngramPrefetch("check", engrams, torch.device("cpu"))
    ids = stack.hash_ids(6, 2, COLS, ROWS, "cpu", seed=9)
    got = p.issue(ids, stack.decode_batch())
    for e in engrams:
        got.rows(e, ids[:, e.layer_hash_index], None)
    assert p.report() == (2, 0)
    real = ep._local_rows

    def corrupt(embed, col):
        # a whole gathered row replaced by a value no table row holds: differs on any machine
        rows, reduce = real(embed, col)
        rows[0] = 1000.0
        return rows, reduce

    monkeypatch.setattr(ep, "_local_rows", corrupt)
    got = p.issue(ids, stack.decode_batch())
    served = got.rows(engrams[0], ids[:, 0], None)
    assert _same(
        served, engrams[0].embed(ids[:, 0])
    )  # the synchronous values are served
    with caplog.at_level("ERROR", logger=ep.__name__):
        assert p.report() == (3, 1)
    assert "1 of 3 gathers differed" in caplog.text


# ------------------------------------------------------------------------------------ GPU


def _work(x, w):
    return torch.tanh(x @ w)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["device", "host"])
@pytest.mark.parametrize("tokens", [1, 6, 64])
def test_gpu_prefetch_bitwise_eager_and_graph(monkeypatch, layout, tokens):
    rows = 1 << 20
    embeds = (
        [
            stack.device_embedding(rows, 256, "cuda", seed=i, monkeypatch=monkeypatch)
            for i in range(2)
        ]
        if layout == "device"
        else [stack.HostEmbedding(rows, 256, seed=i) for i in range(2)]
    )
    engrams = [stack.EngramLookup(e, i) for i, e in enumerate(embeds)]
    ids = stack.hash_ids(tokens, 2, 16, rows, "cuda", seed=tokens)
    stock = [e.embed(ids[:, i]) for i, e in enumerate(engrams)]
    p = ep.build_engram_prefetch("check", [SimpleNamespace(engram=e) for e in engrams])
    x = torch.randn(tokens, 4096, device="cuda", dtype=torch.bfloat16)
    ws = [
        torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) * 0.01
        for _ in range(4)
    ]

    def step():
        got = p.issue(ids, stack.decode_batch())
        h, out = x, []
        for i, w in enumerate(
            ws
        ):  # layer work between the Engram layers, as in the model
            h = _work(h, w)
            if i in (1, 3):
                e = engrams[len(out)]
                out.append(got.rows(e, ids[:, e.layer_hash_index], None))
        return out

    for a, b in zip(step(), stock):
        assert _same(a, b)
    torch.cuda.synchronize()
    assert p.report() == (2, 0)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(outs, stock):
        assert _same(a, b)
    checked, differing = p.report()
    assert (
        differing == 0 and checked == 2 + 2 + 2 * 5
    )  # eager, warm-up, replays (capture runs nothing)


@pytest.mark.gpu
def test_gpu_on_mode_serves_prefetched_rows(monkeypatch):
    rows = 1 << 20
    engrams = [
        stack.EngramLookup(
            stack.device_embedding(rows, 256, "cuda", seed=i, monkeypatch=monkeypatch),
            i,
        )
        for i in range(2)
    ]
    ids = stack.hash_ids(16, 2, 16, rows, "cuda", seed=1)
    p = ep.build_engram_prefetch("on", [SimpleNamespace(engram=e) for e in engrams])
    got = p.issue(ids, stack.decode_batch())
    for e in engrams:
        assert _same(
            got.rows(e, ids[:, e.layer_hash_index], None),
            e.embed(ids[:, e.layer_hash_index]),
        )
