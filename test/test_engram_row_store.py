"""The Engram NVMe row store (--engram-row-store-dir): rows bitwise the device table's, the RAM
cache's behaviour (hits, CLOCK eviction, lookups larger than the cache), the file layout
(records across 4 KiB blocks, O_DIRECT and buffered reads), the flag's refusals, and the
engine's EngramEmbedding serving from the store."""

from __future__ import annotations

import argparse
import inspect
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import with_model

from sglang.srt.layers import engram_row_store as rs

DIM = 256  # V4.1's engram head_dim: 264-byte records, which straddle 4 KiB blocks


def table(rows: int, dim: int = DIM, seed: int = 0):
    """An fp8 table with e8m0 scales: random bytes without NaN codes, scales 2**-27..2**27."""
    g = np.random.default_rng(seed)
    w = g.integers(0, 256, (rows, dim), dtype=np.uint8)
    w[(w & 0x7F) == 0x7F] = 0x11  # e4m3fn NaN codes
    s = g.integers(100, 155, (rows, dim // 32), dtype=np.uint8)
    s[g.random((rows, dim // 32)) < 0.01] = 0  # e8m0 code 0 (2**-127) too
    return (
        torch.from_numpy(w).view(torch.float8_e4m3fn),
        torch.from_numpy(s).view(torch.float8_e8m0fnu),
    )


def upstream_rows(weight, scale, row_start, rows, indices):
    """Upstream's lookup of a device-memory shard on CPU (EngramEmbedding._owned_rows)."""
    from sglang.srt.layers.engram import EngramEmbedding

    emb = object.__new__(EngramEmbedding)
    torch.nn.Module.__init__(emb)
    emb.dim, emb.tp_size, emb.row_start, emb.rows = DIM, 1, row_start, rows
    emb.host_table, emb.peer, emb.row_store = None, None, None
    emb.weight = torch.nn.Parameter(
        weight[row_start : row_start + rows].clone(), requires_grad=False
    )
    emb.scale = torch.nn.Parameter(
        scale[row_start : row_start + rows].clone(), requires_grad=False
    )
    return emb._owned_rows(indices)


def make_store(tmp_path, weight, scale, row_start, rows, cache_rows, **kw):
    st = rs.EngramRowStore(
        str(tmp_path),
        "t",
        row_start,
        rows,
        DIM,
        cache_bytes=cache_rows * (DIM + DIM // 32),
        **kw,
    )
    st.load_rows(scale, scale=True)
    st.load_rows(weight, scale=False)
    st.finish_load(share=False)
    return st


def same_bits(a, b):
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("direct", [None, False])
def test_rows_bitwise_equal_device_table(tmp_path, direct):
    """Every lookup (ids inside and outside the shard, repeats, ids at the ends of the shard) gives
    upstream's device-table rows bit for bit, through misses, hits and evictions."""
    weight, scale = table(6000)
    st = make_store(
        tmp_path, weight, scale, 1000, 4000, cache_rows=700, direct_io=direct
    )
    g = torch.Generator().manual_seed(1)
    for step in range(12):
        n = [1, 37, 500, 3000][step % 4]
        idx = torch.randint(0, 6000, (n, 4), generator=g)
        if step == 0:
            idx[0, :] = torch.tensor([999, 1000, 4999, 5000])
        assert same_bits(
            st.owned_rows(idx), upstream_rows(weight, scale, 1000, 4000, idx)
        ), step
    assert (
        st.stats["hits"] > 0 and st.stats["uncached"] > 0
    )  # the 3000 x 4 lookups overflow 700 rows


def test_file_is_the_checkpoint_bytes_in_records(tmp_path):
    weight, scale = table(300)
    st = make_store(tmp_path, weight, scale, 40, 200, cache_rows=0)
    raw = np.fromfile(st.path, np.uint8)
    assert raw.size % rs.IO_BLOCK == 0 and raw.size >= 200 * 264
    recs = raw[: 200 * 264].reshape(200, 264)
    assert np.array_equal(recs[:, :DIM], weight[40:240].view(torch.uint8).numpy())
    assert np.array_equal(recs[:, DIM:], scale[40:240].view(torch.uint8).numpy())
    # rows straddling a block boundary come back whole
    straddle = np.array([r for r in range(200) if (r * 264) % 4096 + 264 > 4096])
    assert straddle.size
    got, inv = st.read_records(straddle)
    assert np.array_equal(got[inv], recs[straddle])


def test_cache_hits_and_clock_keeps_hot_rows(tmp_path):
    weight, scale = table(5000)
    st = make_store(tmp_path, weight, scale, 0, 5000, cache_rows=100)
    assert st.capacity == 100
    hot = np.arange(0, 50)
    st.read_records(hot)
    assert (st.stats["hits"], st.stats["misses"]) == (0, 50)
    st.read_records(hot)
    assert (st.stats["hits"], st.stats["misses"]) == (50, 50)
    reads = st.stats["reads"]
    # a stream of cold rows, each seen once, interleaved with the hot set: the hot rows keep their
    # slots (their reference bits), the cold ones cycle through the rest
    for i in range(20):
        st.read_records(np.arange(1000 + 25 * i, 1025 + 25 * i))
        st.read_records(hot)
    assert np.all(st.slot_of[hot] >= 0)
    assert st.stats["reads"] > reads
    before = st.stats["hits"]
    st.read_records(hot)
    assert st.stats["hits"] - before == 50
    # the map and the slots agree
    live = st.row_of[st.row_of >= 0]
    assert np.array_equal(st.slot_of[live], np.flatnonzero(st.row_of >= 0))
    assert (st.slot_of >= 0).sum() == live.size == 100


def test_lookup_larger_than_cache_serves_every_row(tmp_path):
    weight, scale = table(3000)
    st = make_store(tmp_path, weight, scale, 0, 3000, cache_rows=64)
    ids = np.random.default_rng(3).permutation(3000)[:1000]
    got, inv = st.read_records(ids)
    ref = np.concatenate(
        [weight.view(torch.uint8).numpy(), scale.view(torch.uint8).numpy()], 1
    )
    assert np.array_equal(got[inv], ref[ids])
    assert st.stats["uncached"] == 1000 - 64
    # a lookup never evicts the rows it uses itself, even when it wraps the hand
    got, inv = st.read_records(ids[:64])
    assert np.array_equal(got[inv], ref[ids[:64]])


def test_no_cache_reads_every_row(tmp_path):
    weight, scale = table(500)
    st = make_store(tmp_path, weight, scale, 0, 500, cache_rows=0)
    idx = torch.randint(0, 500, (64, 3))
    assert same_bits(st.owned_rows(idx), upstream_rows(weight, scale, 0, 500, idx))
    assert st.stats["hits"] == 0 and st.stats["misses"] == st.stats["unique"]


def test_cache_budget_is_shared_by_row_count(tmp_path, monkeypatch):
    monkeypatch.setattr(rs, "_STORES", [])
    weight, scale = table(3000)
    offload = SimpleNamespace(
        engram_row_store_dir=str(tmp_path), engram_row_store_cache_gib=None
    )
    a = rs.maybe_engram_row_store(offload, "a", 0, 1000, DIM)
    b = rs.maybe_engram_row_store(offload, "b", 1000, 2000, DIM)
    assert a.cache_bytes == b.cache_bytes == int(rs.DEFAULT_CACHE_GIB * 2**30)
    for st in (a, b):
        st.cache_bytes = 900 * 264
        st.load_rows(weight, scale=False)
        st.load_rows(scale, scale=True)
        st.finish_load()
    assert (a.capacity, b.capacity) == (300, 600)
    offload.engram_row_store_dir = None
    assert rs.maybe_engram_row_store(offload, "c", 0, 10, DIM) is None


def test_refusals_name_what_they_found(tmp_path):
    weight, scale = table(100)
    st = rs.EngramRowStore(str(tmp_path), "L3", 0, 100, DIM, cache_bytes=0)
    st.load_rows(weight, scale=False)
    with pytest.raises(
        RuntimeError, match="L3: the checkpoint did not load the table's scale"
    ):
        st.finish_load(share=False)
    with pytest.raises(ValueError, match=r"L3: checkpoint scale \(100, 4\)"):
        st.load_rows(scale[:, :4], scale=True)
    with pytest.raises(ValueError, match="dim 100 is not a multiple of 32"):
        rs.EngramRowStore(str(tmp_path), "x", 0, 10, 100, cache_bytes=0)


ENGRAM = SimpleNamespace(engram_layer_ids=[1, 14])
NO_ENGRAM = SimpleNamespace(engram_layer_ids=[])


def cfg(**kw):
    base = dict(
        engram_row_store_dir=None,
        engram_row_store_cache_gib=None,
        enable_torch_compile=False,
        engram_prefetch="off",
    )
    base.update(kw)
    return SimpleNamespace(**base)


def test_validate(tmp_path, monkeypatch):
    rs.validate_engram_row_store(cfg())
    with pytest.raises(
        ValueError, match="cache-gib=4.0 does nothing without --engram-row-store-dir"
    ):
        rs.validate_engram_row_store(cfg(engram_row_store_cache_gib=4.0))
    with pytest.raises(ValueError, match="not a writable directory"):
        rs.validate_engram_row_store(cfg(engram_row_store_dir=str(tmp_path / "nope")))
    ok = cfg(engram_row_store_dir=str(tmp_path), engram_row_store_cache_gib=0.0)
    rs.validate_engram_row_store(with_model(ok, hf_config=ENGRAM))
    with pytest.raises(
        ValueError, match="does nothing here: the model has no Engram tables"
    ):
        rs.validate_engram_row_store(with_model(ok, hf_config=NO_ENGRAM))
    with pytest.raises(ValueError, match="--enable-torch-compile"):
        rs.validate_engram_row_store(
            with_model(
                cfg(engram_row_store_dir=str(tmp_path), enable_torch_compile=True),
                hf_config=ENGRAM,
            )
        )
    with pytest.raises(ValueError, match="cannot be used with --engram-prefetch=on"):
        rs.validate_engram_row_store(
            cfg(engram_row_store_dir=str(tmp_path), engram_prefetch="on")
        )
    with pytest.raises(
        argparse.ArgumentTypeError, match="accepted: a finite number"
    ):  # Engine(...)
        rs.validate_engram_row_store(
            cfg(engram_row_store_dir=str(tmp_path), engram_row_store_cache_gib=-1.0)
        )
    monkeypatch.setenv("SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE", "1")
    with pytest.raises(ValueError, match="SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE=1"):
        rs.validate_engram_row_store(with_model(ok, hf_config=ENGRAM))
    assert rs.parse_engram_row_store_cache_gib("2.5") == 2.5
    for bad in ("-1", "inf", "nan", "lots", None):
        with pytest.raises(
            argparse.ArgumentTypeError, match="--engram-row-store-cache-gib .*accepted"
        ):
            rs.parse_engram_row_store_cache_gib(bad)


def test_validate_through_server_args_resolution(tmp_path, llama_config):
    """The hook reads upstream's and 0015's fields by name: a renamed field fails here."""
    from conftest import resolve_server_args

    d = str(tmp_path)
    with pytest.raises(ValueError, match="cannot be used with --engram-prefetch=on"):
        resolve_server_args(llama_config, engram_row_store_dir=d, engram_prefetch="on")
    with pytest.raises(ValueError, match="--enable-torch-compile"):
        resolve_server_args(
            llama_config, engram_row_store_dir=d, enable_torch_compile=True
        )
    with pytest.raises(ValueError, match="the model has no Engram tables"):
        resolve_server_args(llama_config, engram_row_store_dir=d)
    with pytest.raises(ValueError, match="does nothing without --engram-row-store-dir"):
        resolve_server_args(llama_config, engram_row_store_cache_gib=4.0)
    resolve_server_args(llama_config)


def test_validate_on_a_release_without_peer_shards(tmp_path, monkeypatch):
    """The Engram placements the store refuses are read only where the release declares them:
    peer shards are newer than some releases the series rebases onto."""
    import sglang.srt.environ as environ

    host_table = SimpleNamespace(get=lambda: False)
    monkeypatch.setattr(
        environ,
        "envs",
        SimpleNamespace(SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE=host_table),
    )
    ok = cfg(engram_row_store_dir=str(tmp_path))
    rs.validate_engram_row_store(with_model(ok, hf_config=ENGRAM))
    host_table.get = lambda: True
    with pytest.raises(ValueError, match="SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE=1"):
        rs.validate_engram_row_store(with_model(ok, hf_config=ENGRAM))


def test_flag_on_command_line(tmp_path):
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(["--model-path", "x"])
    assert ns.engram_row_store_dir is None and ns.engram_row_store_cache_gib is None
    ns = parser.parse_args(
        [
            "--model-path",
            "x",
            "--engram-row-store-dir",
            str(tmp_path),
            "--engram-row-store-cache-gib",
            "8",
        ]
    )
    assert (
        ns.engram_row_store_dir == str(tmp_path)
        and ns.engram_row_store_cache_gib == 8.0
    )
    with pytest.raises((argparse.ArgumentError, SystemExit)):
        parser.parse_args(["--model-path", "x", "--engram-row-store-cache-gib", "-3"])


def test_engine_embedding_serves_from_the_store(tmp_path, monkeypatch):
    """EngramEmbedding with the flag on: no table in memory, the loader's rows go to the file, and
    the forward (upstream's _lookup, all-reduce path) returns the device table's bits.
    """
    from sglang.srt.layers import engram as eg

    monkeypatch.setattr(rs, "_STORES", [])
    par = SimpleNamespace(tp_size=1, tp_rank=0)
    off = SimpleNamespace(
        engram_row_store_dir=str(tmp_path), engram_row_store_cache_gib=0.001
    )
    monkeypatch.setattr(eg, "get_parallel", lambda: par)
    monkeypatch.setattr(
        eg, "get_exec", lambda: SimpleNamespace(offload=off), raising=False
    )
    weight, scale = table(2048)
    # The hash columns' bounds, where the release's constructor takes them (older releases' do not).
    bounds = (
        {"column_bounds": (0, 1024, 2048)}
        if "column_bounds" in inspect.signature(eg.EngramEmbedding).parameters
        else {}
    )
    emb = eg.EngramEmbedding(2048, DIM, 7, **bounds)
    assert emb.row_store is not None and emb.weight.numel() == 0
    emb.weight.weight_loader(emb.weight, weight)
    emb.scale.weight_loader(emb.scale, scale)
    emb.finish_load("layer 7")
    idx = torch.randint(0, 2048, (33, 16))
    assert same_bits(emb(idx), upstream_rows(weight, scale, 0, 2048, idx))
    off.engram_row_store_dir = None
    assert eg.EngramEmbedding(2048, DIM, 7, **bounds).row_store is None


@pytest.mark.gpu
def test_rows_bitwise_equal_device_table_cuda(tmp_path):
    """On the GPU: the store's rows (engram_gather over the staged records) against upstream's
    device table (engram_gather over the table), for an owned range and unowned ids."""
    from sglang.kernels.ops.embeddings.engram_gather import engram_gather

    weight, scale = table(50_000)
    st = make_store(tmp_path, weight, scale, 10_000, 30_000, cache_rows=5_000)
    w = weight[10_000:40_000].cuda()
    s = scale[10_000:40_000].cuda()
    for n in (1, 96, 4096, 40_000):
        idx = torch.randint(0, 50_000, (n,), device="cuda")
        ref = torch.empty(n, DIM, dtype=torch.bfloat16, device="cuda")
        engram_gather(
            w.data_ptr(), s.data_ptr(), idx, ref, DIM, 32, row_lo=10_000, row_hi=40_000
        )
        assert same_bits(st.owned_rows(idx), ref), n
