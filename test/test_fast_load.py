"""--weight-loader-fast-load: the checkpoint read by a pread pool, only what this rank keeps.

On a synthetic safetensors checkpoint (bf16, fp32, e4m3, e8m0, uint8, int8 and F4 over four
shards with an index, named like DeepSeek-V4's):

* every tensor a rank receives is bitwise the tensor upstream's ``safe_open`` returns, for
  several thread counts and slab sizes (slabs smaller than a tensor included);
* an EP rank never reads another rank's experts: every pread lies inside a kept tensor, and
  the bytes read are exactly the kept tensors' bytes;
* a TP rank's contiguous slice is read alone and handed over as a stand-in whose one
  permitted access is that narrow (every other access raises, naming the tensor);
* the draft reads only ``mtp.*``, and with the index opens only the shards holding them;
* slab memory is bounded by the budget while the model holds tensors, and released after;
* bad checkpoints (truncated shard, a header lying about sizes or offsets, a missing shard,
  a shard shrinking during the load) raise naming the file and the tensor;
* the flags: accepted forms, and the combinations the model namespace refuses.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import struct
import threading
import time
import types
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from sglang.srt.model_loader import fast_load as fl
from sglang.srt.model_loader.fast_load import (
    KEEP_ALL,
    CheckpointError,
    CheckpointOwner,
    FastLoader,
    RankSlice,
    RankSliceAccessError,
    RankSliceTensor,
)

N_EXPERTS, N_LAYERS, EP = 8, 2, 4


def _rand(shape, dtype, g):
    n = 1
    for d in shape:
        n *= d
    raw = torch.randint(
        0,
        256,
        (n * torch.empty((), dtype=dtype).element_size(),),
        dtype=torch.uint8,
        generator=g,
    )
    return raw.view(dtype).view(shape)


def _tensors(g):
    """name -> tensor, V4-style names; every dtype the issue names, shapes not multiples of 64."""
    t = {
        "embed.weight": _rand((96, 40), torch.bfloat16, g),
        "head.weight": _rand((96, 40), torch.bfloat16, g),
    }
    for layer in range(N_LAYERS):
        p = f"layers.{layer}"
        t[f"{p}.attn_norm.weight"] = _rand((40,), torch.float32, g)
        t[f"{p}.attn.wq_a.weight"] = _rand((24, 40), torch.bfloat16, g)
        t[f"{p}.attn.wo_a.weight"] = _rand((32, 40), torch.float8_e4m3fn, g)
        t[f"{p}.attn.wo_a.scale"] = _rand((1, 2), torch.float8_e8m0fnu, g)
        t[f"{p}.ffn.gate.weight"] = _rand((N_EXPERTS, 40), torch.float32, g)
        t[f"{p}.ffn.gate.tid2eid"] = _rand((7, 3), torch.int32, g)
        for e in range(N_EXPERTS):
            q = f"{p}.ffn.experts.{e}"
            t[f"{q}.w1.weight"] = _rand((48, 20), torch.uint8, g)  # fp4 packed
            t[f"{q}.w3.weight"] = _rand((48, 20), torch.int8, g)
            t[f"{q}.w2.weight"] = _rand((40, 24), torch.uint8, g)
            t[f"{q}.w1.scale"] = _rand((48, 2), torch.float8_e8m0fnu, g)
            t[f"{q}.w3.scale"] = _rand((48, 2), torch.float8_e8m0fnu, g)
            t[f"{q}.w2.scale"] = _rand((40, 4), torch.float8_e8m0fnu, g)
    t["mtp.0.attn.wq_a.weight"] = _rand((24, 40), torch.bfloat16, g)
    t["mtp.0.enorm.weight"] = _rand((40,), torch.float32, g)
    for e in range(N_EXPERTS):
        t[f"mtp.0.ffn.experts.{e}.w1.weight"] = _rand((48, 20), torch.uint8, g)
        t[f"mtp.0.ffn.experts.{e}.w1.scale"] = _rand((48, 2), torch.float8_e8m0fnu, g)
    t["layers.0.ffn.f4_probe"] = _rand((6, 5), getattr(torch, "float4_e2m1fn_x2"), g)
    t["layers.0.empty"] = torch.empty((0, 4), dtype=torch.bfloat16)
    t["layers.0.scalar"] = _rand((), torch.float32, g)
    return t


def _write_checkpoint(folder: Path, tensors: dict, n_shards: int = 4) -> list[str]:
    """Shards as a real checkpoint has them: layer-major, mtp in the last shard, with an index."""
    names = sorted(tensors, key=lambda n: (n.startswith("mtp."), n))
    shards = [names[i :: n_shards - 1] for i in range(n_shards - 1)]
    shards = [[n for n in s if not n.startswith("mtp.")] for s in shards] + [
        [n for n in names if n.startswith("mtp.")]
    ]
    files, weight_map = [], {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        save_file({n: tensors[n] for n in shard}, str(folder / fname))
        files.append(str(folder / fname))
        weight_map.update({n: fname for n in shard})
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    return files


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fast_load_ckpt")
    tensors = _tensors(torch.Generator().manual_seed(0))
    files = _write_checkpoint(folder, tensors)
    stock = {}
    for f in files:
        with safe_open(f, framework="pt", device="cpu") as h:
            for k in h.keys():
                stock[k] = h.get_tensor(k).clone()
    return types.SimpleNamespace(
        folder=folder,
        files=files,
        stock=stock,
        index=str(folder / "model.safetensors.index.json"),
    )


def _bits(t: torch.Tensor) -> bytes:
    return (
        t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        if t.numel()
        else b""
    )


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and _bits(a) == _bits(b)


def _expert(name: str):
    parts = name.split(".")
    return int(parts[parts.index("experts") + 1]) if "experts" in parts else None


class EPOwner(CheckpointOwner):
    """EP rank r of EP keeps the experts e with e * EP // N_EXPERTS == r (and no mtp.*)."""

    def __init__(self, rank):
        self.rank = rank

    def keeps(self, name):
        e = _expert(name)
        return not name.startswith("mtp.") and (
            e is None or e * EP // N_EXPERTS == self.rank
        )


class TPOwner(CheckpointOwner):
    """TP rank r of 4 narrows w1/w3 (and their scales) on dim 0, w2 on dim 1."""

    def __init__(self, rank, tp=4):
        self.rank, self.tp = rank, tp

    def keeps(self, name):
        return not name.startswith("mtp.")

    def rank_slice(self, name, shape, dtype):
        if _expert(name) is None:
            return None
        dim = 1 if ".w2." in name else 0
        n = shape[dim] // self.tp
        return RankSlice(dim, n * self.rank, n)


class DraftOwner(CheckpointOwner):
    def keeps(self, name):
        return name.startswith("mtp.")


class _Reads:
    """Records every pread (path, offset, length) the loader issues, and every os.open."""

    def __init__(self, monkeypatch):
        self.reads, self.opened = [], []
        self._lock = threading.Lock()
        real_preadv, real_open = os.preadv, os.open

        def preadv(fd, bufs, offset):
            n = real_preadv(fd, bufs, offset)
            with self._lock:
                self.reads.append((os.readlink(f"/proc/self/fd/{fd}"), offset, n))
            return n

        def open_(path, *a, **k):
            self.opened.append(os.path.realpath(path))
            return real_open(path, *a, **k)

        monkeypatch.setattr(fl.os, "preadv", preadv)
        monkeypatch.setattr(fl.os, "open", open_)


def _spans(files, keep):
    """path -> [(begin, end)] of the tensors ``keep(name)`` accepts, from the real headers."""
    out = {}
    for f in files:
        entries, _ = fl.read_header(f)
        out[os.path.realpath(f)] = [
            (e.begin, e.end, e.name) for e in entries if keep(e.name)
        ]
    return out


def _assert_reads_within(reads, spans):
    """Every byte read lies in a kept tensor (adjacent kept tensors are read together)."""
    merged = {}
    for path, s in spans.items():
        runs = []
        for b, e, _ in sorted(s):
            if runs and runs[-1][1] == b:
                runs[-1][1] = e
            else:
                runs.append([b, e])
        merged[path] = runs
    for path, off, n in reads:
        assert any(
            b <= off and off + n <= e for b, e in merged.get(path, [])
        ), f"read {path}@{off}+{n} is outside every kept tensor"


def _load(files, owner=KEEP_ALL, **kw):
    """Every tensor into a dict: a model keeping them all (see the pacing tests)."""
    kw.setdefault("head_wait_s", 0.02)
    loader = FastLoader(files, owner, **kw)
    return loader, dict(loader)


# --------------------------------------------------------------------------- bitwise


@pytest.mark.parametrize("threads,slab", [(1, 1 << 20), (4, 4096), (16, 777), (3, 64)])
def test_every_tensor_is_bitwise_safe_open(ckpt, threads, slab):
    loader, got = _load(ckpt.files, num_threads=threads, slab_bytes=slab)
    assert set(got) == set(ckpt.stock)
    for name, t in got.items():
        assert _same(t, ckpt.stock[name]), name
    dtypes = {t.dtype for t in got.values()}
    assert {
        torch.bfloat16,
        torch.float32,
        torch.float8_e4m3fn,
        torch.float8_e8m0fnu,
        torch.uint8,
    } <= dtypes
    assert loader.stats.bytes_read == loader.stats.checkpoint_bytes


def test_order_is_file_then_offset(ckpt):
    names = [n for n, _ in FastLoader(ckpt.files, slab_bytes=1000)]
    expected = [e.name for f in ckpt.files for e in fl.read_header(f)[0]]
    assert names == expected


# --------------------------------------------------------------------------- ownership


def test_ep_ranks_read_only_their_experts(ckpt, monkeypatch):
    seen = {}
    for rank in range(EP):
        owner = EPOwner(rank)
        spans = _spans(ckpt.files, owner.keeps)
        rec = _Reads(monkeypatch)
        loader, got = _load(
            ckpt.files, owner, num_threads=4, slab_bytes=2048, index_path=ckpt.index
        )
        for name, t in got.items():
            assert owner.keeps(name) and _same(t, ckpt.stock[name]), name
            seen.setdefault(name, []).append(rank)
        _assert_reads_within(rec.reads, spans)
        kept_bytes = sum(e - b for s in spans.values() for b, e, _ in s)
        assert loader.stats.bytes_read == kept_bytes == sum(n for _, _, n in rec.reads)
        # the mtp shard holds nothing this rank keeps: the index spares opening it
        assert os.path.realpath(ckpt.files[-1]) not in rec.opened
    experts = {
        n for n in ckpt.stock if _expert(n) is not None and not n.startswith("mtp.")
    }
    assert all(len(seen[n]) == 1 for n in experts)  # each expert on exactly one rank
    assert all(
        len(seen[n]) == EP
        for n in ckpt.stock
        if _expert(n) is None and not n.startswith("mtp.")
    )


def test_tp_rank_reads_only_its_rows_behind_a_stand_in(ckpt, monkeypatch):
    for rank in range(4):
        owner = TPOwner(rank)
        rec = _Reads(monkeypatch)
        loader, got = _load(ckpt.files, owner, num_threads=2, slab_bytes=4096)
        for name, t in got.items():
            s = owner.rank_slice(name, ckpt.stock[name].shape, None)
            if s is not None and s.dim == 0:
                assert isinstance(t, RankSliceTensor)
                assert (
                    t.shape == ckpt.stock[name].shape
                    and t.dtype == ckpt.stock[name].dtype
                )
                assert _same(
                    t.narrow(s.dim, s.start, s.length),
                    ckpt.stock[name].narrow(s.dim, s.start, s.length),
                )
            else:  # w2's columns are strided: read whole, the model narrows the real tensor
                assert not isinstance(t, RankSliceTensor) and _same(
                    t, ckpt.stock[name]
                ), name
        expected = 0
        for f in ckpt.files:
            for e in fl.read_header(f)[0]:
                if not owner.keeps(e.name):
                    continue
                s = owner.rank_slice(e.name, e.shape, e.dtype)
                expected += e.nbytes // 4 if s is not None and s.dim == 0 else e.nbytes
        assert loader.stats.bytes_read == expected == sum(n for _, _, n in rec.reads)
        assert loader.stats.tensors_sliced == N_LAYERS * N_EXPERTS * 4


def test_draft_reads_only_mtp_and_opens_only_its_shard(ckpt, monkeypatch):
    spans = _spans(ckpt.files, DraftOwner().keeps)
    rec = _Reads(monkeypatch)
    loader, got = _load(ckpt.files, DraftOwner(), index_path=ckpt.index)
    assert set(got) == {n for n in ckpt.stock if n.startswith("mtp.")}
    assert all(_same(t, ckpt.stock[n]) for n, t in got.items())
    _assert_reads_within(rec.reads, spans)
    assert rec.opened == [os.path.realpath(ckpt.files[-1])]
    assert loader.stats.files_opened == 1


def test_without_an_index_every_header_is_read_but_no_other_data(ckpt, monkeypatch):
    spans = _spans(ckpt.files, DraftOwner().keeps)
    rec = _Reads(monkeypatch)
    loader, got = _load(ckpt.files, DraftOwner())
    assert set(got) == {n for n in ckpt.stock if n.startswith("mtp.")}
    assert loader.stats.files_opened == len(ckpt.files)
    _assert_reads_within(rec.reads, spans)


# --------------------------------------------------------------------------- stand-in


def _standin():
    kept = torch.arange(12, dtype=torch.bfloat16).view(3, 4)
    return (
        RankSliceTensor(
            "layers.0.ffn.experts.3.w1.weight", (12, 4), kept, RankSlice(0, 3, 3)
        ),
        kept,
    )


def test_stand_in_allows_metadata_and_its_narrow_only():
    t, kept = _standin()
    assert t.shape == (12, 4) and t.dtype == torch.bfloat16 and t.device.type == "cpu"
    assert (
        t.dim() == 2 and t.size(0) == 12 and t.numel() == 48 and t.element_size() == 2
    )
    assert t.narrow(0, 3, 3) is kept and torch.narrow(t, 0, 3, 3) is kept
    assert t.narrow(-2, 3, 3) is kept and t.narrow(dim=0, start=3, length=3) is kept
    assert t[3:6] is kept
    assert "experts.3.w1" in repr(t)


@pytest.mark.parametrize(
    "access",
    [
        lambda t: t.narrow(0, 0, 3),
        lambda t: t.narrow(1, 0, 2),
        lambda t: t[0:3],
        lambda t: t[3],
        lambda t: t.t(),
        lambda t: t.transpose(0, 1),
        lambda t: t.contiguous(),
        lambda t: t.clone(),
        lambda t: t.view(-1),
        lambda t: t.to(torch.float32),
        lambda t: t.float(),
        lambda t: t.sum(),
        lambda t: t + 1,
        lambda t: torch.empty(12, 4, dtype=torch.bfloat16).copy_(t),
        lambda t: t.data_ptr(),
        lambda t: t.numpy(),
        lambda t: t.tolist(),
        lambda t: t.untyped_storage(),
        lambda t: torch.cat([t, t]),
        lambda t: t.eq(t),
        lambda t: f"{t:}",
    ],
)
def test_stand_in_refuses_every_other_access(access):
    t, _ = _standin()
    with pytest.raises((RankSliceAccessError, RuntimeError, TypeError)) as e:
        access(t)
    if isinstance(e.value, RankSliceAccessError):
        assert "experts.3.w1" in str(e.value) and "narrow(0, 3, 3)" in str(e.value)


# --------------------------------------------------------------------------- memory


@pytest.mark.parametrize("queue", [0, 3])
def test_slab_memory_is_bounded_and_released_after_load(ckpt, queue):
    """The model copies as it goes (queue 0) or keeps a queue of copies (queue 3): the
    slabs alive stay within the budget plus the slab it waits for plus the ones it holds.
    """
    slab = 8192  # >= the largest tensor: every slab is at most this (+ alignment)
    loader = FastLoader(ckpt.files, num_threads=2, slab_bytes=slab)
    held = []
    for name, t in loader:
        held.append(t)
        if len(held) > queue:
            held.pop(0)
    bound = loader.budget + (1 + queue) * (slab + 64)
    assert loader.stats.peak_live_bytes <= bound < loader.stats.checkpoint_bytes
    del held, t
    gc.collect()
    assert loader.wait_released(10)
    assert loader.stats.live_bytes == 0


def test_a_model_holding_every_tensor_is_never_starved(ckpt, caplog):
    """Over budget the slab the model waits for is read once nothing is held, or once no
    slab was released for head_wait_s: a model that keeps every tensor still gets them all,
    and the pacing turns off (logged) rather than stalling every slab."""
    loader = FastLoader(ckpt.files, num_threads=2, slab_bytes=1024, head_wait_s=0.05)
    t0 = time.monotonic()
    with caplog.at_level("WARNING"):
        got = dict(loader)
    assert time.monotonic() - t0 < 5
    assert set(got) == set(ckpt.stock)
    assert loader.stats.peak_live_bytes > loader.budget
    assert "without pacing" in caplog.text
    # the stall is accounted to the pacing (it waited for slabs the model never released)
    s = loader.stats
    assert (
        s.wait_budget_s >= 0.05
        and s.wait_budget_s + s.wait_read_s + s.alloc_s <= s.seconds
    )
    del got
    gc.collect()
    assert loader.wait_released(10)


# --------------------------------------------------------------------------- bad checkpoints


def _copy_ckpt(ckpt, dst: Path) -> list[str]:
    out = []
    for f in ckpt.files:
        p = dst / os.path.basename(f)
        p.write_bytes(Path(f).read_bytes())
        out.append(str(p))
    (dst / "model.safetensors.index.json").write_bytes(Path(ckpt.index).read_bytes())
    return out


def _rewrite_header(path: str, edit):
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    Path(path).write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])


def _last_tensor(path):
    return fl.read_header(path)[0][-1]


def _open_fds():
    return len(os.listdir("/proc/self/fd"))


def test_truncated_shard_names_file_and_tensor(ckpt, tmp_path):
    files = _copy_ckpt(ckpt, tmp_path)
    last = _last_tensor(files[1])
    os.truncate(files[1], last.end - 3)
    before = _open_fds()
    with pytest.raises(CheckpointError, match="truncated") as e:
        _load(files)
    assert e.value.path == files[1] and e.value.tensor == last.name
    assert _open_fds() == before  # the shards opened before the bad one are closed


def test_header_lying_about_sizes_names_the_tensor(ckpt, tmp_path):
    files = _copy_ckpt(ckpt, tmp_path)
    victim = "layers.0.attn.wq_a.weight"
    path = next(f for f in files if victim in {e.name for e in fl.read_header(f)[0]})
    _rewrite_header(path, lambda h: h[victim].update(shape=[24, 41]))
    with pytest.raises(CheckpointError, match="lies about its size") as e:
        _load(files)
    assert e.value.path == path and e.value.tensor == victim


def test_header_lying_about_offsets_names_the_tensor(ckpt, tmp_path):
    files = _copy_ckpt(ckpt, tmp_path)
    entries = fl.read_header(files[0])[0]
    a, b = entries[1], entries[2]

    def swap_into_overlap(h):
        begin = h[a.name]["data_offsets"][0]
        size = b.nbytes
        h[b.name]["data_offsets"] = [begin, begin + size]

    _rewrite_header(files[0], swap_into_overlap)
    with pytest.raises(CheckpointError, match="lies about offsets") as e:
        _load(files)
    assert e.value.path == files[0] and e.value.tensor in (a.name, b.name)


def test_header_past_end_of_file_and_bad_json(ckpt, tmp_path):
    files = _copy_ckpt(ckpt, tmp_path)
    raw = Path(files[0]).read_bytes()
    Path(files[0]).write_bytes(struct.pack("<Q", len(raw) * 2) + raw[8:])
    with pytest.raises(CheckpointError, match="runs past the end") as e:
        _load(files)
    assert e.value.path == files[0]
    (n,) = struct.unpack("<Q", raw[:8])
    Path(files[0]).write_bytes(raw[:8] + b"{" * n + raw[8 + n :])
    with pytest.raises(CheckpointError, match="not valid JSON"):
        _load(files)


def test_missing_shard_names_the_file(ckpt, tmp_path):
    files = _copy_ckpt(ckpt, tmp_path)
    os.remove(files[2])
    with pytest.raises(CheckpointError, match="missing shard") as e:
        _load(files)
    assert e.value.path == files[2]
    with pytest.raises(
        CheckpointError, match="missing shard"
    ) as e:  # named by the index
        _load(
            files[:2] + files[3:],
            DraftOwner(),
            index_path=str(tmp_path / "model.safetensors.index.json"),
        )
    assert e.value.path == files[2]


def test_shard_shrinking_during_the_load_names_file_and_tensor(ckpt, tmp_path):
    files = _copy_ckpt(ckpt, tmp_path)
    last = _last_tensor(files[2])
    loader = FastLoader(files, num_threads=1, slab_bytes=1024)
    it = iter(loader)
    first = next(
        it
    )  # planned (headers checked); reads issued only up to the 2 KiB budget
    assert first[0] in ckpt.stock
    os.truncate(files[2], last.begin + 1)
    with pytest.raises(CheckpointError, match="truncated while reading") as e:
        list(it)
    assert e.value.path == files[2] and e.value.tensor is not None


def test_index_that_misplaces_a_tensor_is_refused_when_it_skips_files(ckpt, tmp_path):
    files = _copy_ckpt(ckpt, tmp_path)
    index = tmp_path / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"]["mtp.0.enorm.weight"] = os.path.basename(files[0])
    index.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="index places"):
        _load(files, DraftOwner(), index_path=str(index))


# --------------------------------------------------------------------------- flags


def _cfg(**kw):
    base = dict(
        weight_loader_fast_load=False,
        weight_loader_fast_load_num_threads=None,
        weight_loader_fast_load_slab_mb=None,
        load_format="auto",
        weight_loader_prefetch_checkpoints=False,
        weight_loader_disable_mmap=False,
        startup_weight_load_mode="serial",
        model_loader_extra_config="{}",
        model_path="org/remote-repo",
    )
    base.update(kw)
    return types.SimpleNamespace(**base)


def test_flag_parsers_list_the_accepted_forms():
    from sglang.srt.arg_groups import fast_load_args as fl

    assert (
        fl.parse_fast_load_num_threads("8") == 8
        and fl.parse_fast_load_slab_mb(64) == 64
    )
    for bad in ("0", "-1", "257", "x", "1.5", None):
        with pytest.raises(argparse.ArgumentTypeError, match=r"integer in 1\.\.256"):
            fl.parse_fast_load_num_threads(bad)
    with pytest.raises(argparse.ArgumentTypeError, match=r"integer in 1\.\.4096"):
        fl.parse_fast_load_slab_mb("4097")


def test_validation_refuses_what_would_do_nothing(ckpt, tmp_path):
    from sglang.srt.arg_groups import fast_load_args as fl

    torch.save({"w": torch.zeros(2)}, tmp_path / "pytorch_model.bin")
    fl.validate_fast_load(
        _cfg(weight_loader_fast_load=True, model_path=str(ckpt.folder))
    )
    fl.validate_fast_load(_cfg())
    fl.validate_fast_load(
        _cfg(
            weight_loader_fast_load=True,
            weight_loader_fast_load_num_threads=4,
            weight_loader_fast_load_slab_mb=32,
            load_format="safetensors",
        )
    )
    refusals = {
        "does nothing without": _cfg(weight_loader_fast_load_num_threads=4),
        "slab-mb 8 does nothing": _cfg(weight_loader_fast_load_slab_mb=8),
        "--load-format gguf": _cfg(weight_loader_fast_load=True, load_format="gguf"),
        "prefetch-checkpoints": _cfg(
            weight_loader_fast_load=True, weight_loader_prefetch_checkpoints=True
        ),
        "disable-mmap": _cfg(
            weight_loader_fast_load=True, weight_loader_disable_mmap=True
        ),
        "overlap": _cfg(
            weight_loader_fast_load=True, startup_weight_load_mode="overlap"
        ),
        "enable_multithread_load": _cfg(
            weight_loader_fast_load=True,
            model_loader_extra_config='{"enable_multithread_load": true}',
        ),
        "pytorch_model.bin and no .safetensors": _cfg(
            weight_loader_fast_load=True, model_path=str(tmp_path)
        ),
    }
    for msg, cfg in refusals.items():
        with pytest.raises(ValueError, match=msg.replace(".", r"\.")):
            fl.validate_fast_load(cfg)
    with pytest.raises(
        argparse.ArgumentTypeError,  # Engine(...) skips argparse: parsed by the hook
        match=r"--weight-loader-fast-load-num-threads: .*integer in 1\.\.256",
    ):
        fl.validate_fast_load(
            _cfg(weight_loader_fast_load=True, weight_loader_fast_load_num_threads=0)
        )


# --------------------------------------------------------------------------- DeepSeek-V4's owner


H, I, N_V4, V = (
    64,
    256,
    8,
    100,
)  # hidden, expert intermediate, routed experts (MXFP4), vocabulary


def _v4_expert_tensors(g):
    t = {}
    for layer in range(2):
        for e in range(N_V4):
            q = f"layers.{layer}.ffn.experts.{e}"
            t[f"{q}.w1.weight"] = _rand((I, H // 2), torch.uint8, g)
            t[f"{q}.w3.weight"] = _rand((I, H // 2), torch.uint8, g)
            t[f"{q}.w2.weight"] = _rand((H, I // 2), torch.uint8, g)
            t[f"{q}.w1.scale"] = _rand((I, H // 32), torch.float8_e8m0fnu, g)
            t[f"{q}.w3.scale"] = _rand((I, H // 32), torch.float8_e8m0fnu, g)
            t[f"{q}.w2.scale"] = _rand((H, I // 32), torch.float8_e8m0fnu, g)
        t[f"layers.{layer}.attn_norm.weight"] = _rand((H,), torch.float32, g)
    t["mtp.0.ffn.experts.0.w1.weight"] = _rand((I, H // 2), torch.uint8, g)
    t["mtp.0.enorm.weight"] = _rand((H,), torch.float32, g)
    t["embed.weight"] = _rand((V, H), torch.bfloat16, g)
    t["head.weight"] = _rand((V, H), torch.bfloat16, g)
    t["layers.1.engram.embed.weight"] = _rand((V, H), torch.float8_e4m3fn, g)
    t["layers.1.engram.embed.scale"] = _rand((V, H // 32), torch.float8_e8m0fnu, g)
    return t


def _engram_table(n, rank):
    """An EngramEmbedding as its __init__ lays it out in device memory: the rank's rows."""
    from sglang.srt.layers.engram import EngramEmbedding

    emb = EngramEmbedding.__new__(EngramEmbedding)
    torch.nn.Module.__init__(emb)
    per = -(-V // n)
    emb.row_start, emb.host_table, emb.peer = per * rank, None, None
    emb.row_store = (
        None  # the Engram row store's attribute (--engram-row-store-dir off)
    )
    emb.rows = min(per, V - emb.row_start)
    for name, cols, dtype in (
        ("weight", H, torch.float8_e4m3fn),
        ("scale", H // 32, torch.float8_e8m0fnu),
    ):
        p = torch.nn.Parameter(
            torch.zeros(emb.rows, cols, dtype=torch.uint8).view(dtype),
            requires_grad=False,
        )
        p.weight_loader = emb._load_rows
        emb.register_parameter(name, p)
    return emb


def _vocab_parallel(tp, rank):
    """A VocabParallelEmbedding as its __init__ lays it out at attention TP ``tp``: the
    rank's 25 rows of 100, in a buffer padded to 32."""
    from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding

    emb = VocabParallelEmbedding.__new__(VocabParallelEmbedding)
    torch.nn.Module.__init__(emb)
    per = V // tp
    emb.tp_size, emb.org_vocab_size, emb.use_presharded_weights = tp, V, False
    emb.shard_indices = types.SimpleNamespace(
        org_vocab_start_index=per * rank, org_vocab_end_index=per * (rank + 1)
    )
    w = torch.nn.Parameter(
        torch.zeros(-(-V // tp // 8) * 8 if tp > 1 else V, H, dtype=torch.bfloat16),
        requires_grad=False,
    )
    w.output_dim, w.weight_loader = 0, emb.weight_loader
    emb.register_parameter("weight", w)
    return emb


class _MXFP4LikeMethod:  # FusedMoE only reads the method's class name and a few attributes
    pass


class _FakeMeta:
    """EPLB's logical -> physical map: expert e lives at physical slot perm[e] (and, for
    expert 0, a redundant copy in the last slot)."""

    def __init__(self, n):
        self.num_logical_experts = n
        self.perm = [(3 * e + 1) % n for e in range(n)]

    def logical_to_all_physical(self, layer_id, e, require_global=False):
        return [self.perm[e]] + ([self.perm[-1]] if e == 0 else [])


def _fused_moe(layer, tp, tp_rank, ep, ep_rank, padded=False, rows_pad=0, eplb=False):
    """A FusedMoE as FusedMoE.__init__ lays it out, without the parallel state it needs."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    moe = FusedMoE.__new__(FusedMoE)
    torch.nn.Module.__init__(moe)
    n_local = N_V4 // ep
    ip = (
        I // tp + rows_pad
    )  # padded per-rank intermediate (the buffer, not the checkpoint)
    attrs = dict(
        layer_id=layer,
        quant_config=None,
        uses_expert_location=eplb,
        scheme=None,
        quant_method=_MXFP4LikeMethod(),
        use_flashinfer_trtllm_moe=False,
        use_triton_kernels=False,
        use_presharded_weights=False,
        moe_tp_size=tp,
        moe_tp_rank=tp_rank,
        moe_ep_size=ep,
        moe_ep_rank=ep_rank,
        _expert_storage_rank=ep_rank,
        _num_global_routed=N_V4,
        _num_local_routed=n_local,
        num_local_experts=n_local,
        num_fused_shared_experts=0,
        _has_fused_shared=False,
        moe_runner_config=types.SimpleNamespace(is_gated=True),
    )
    for k, v in attrs.items():
        setattr(moe, k, v)
    moe.__dict__["use_padded_loading"] = padded
    shapes = {
        "w13_weight": (n_local, 2 * ip, H // 2),
        "w2_weight": (n_local, H, ip // 2),
        "w13_weight_scale_inv": (n_local, 2 * ip, H // 32),
        "w2_weight_scale_inv": (n_local, H, ip // 32),
    }
    for name, shape in shapes.items():
        dtype = torch.float8_e8m0fnu if "scale" in name else torch.uint8
        p = torch.nn.Parameter(
            torch.zeros(shape, dtype=torch.uint8).view(dtype), requires_grad=False
        )
        p.weight_loader = moe.weight_loader
        if "scale" in name:
            p.quant_method = "block"
        moe.register_parameter(name, p)
    return moe


def _v4_model(tp, tp_rank, ep, ep_rank, **kw):
    from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM

    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList()
    for layer in range(2):
        block = torch.nn.Module()
        block.mlp = torch.nn.Module()
        block.mlp.experts = _fused_moe(layer, tp, tp_rank, ep, ep_rank, **kw)
        block.input_layernorm = torch.nn.Module()
        block.input_layernorm.weight = torch.nn.Parameter(
            torch.zeros(H), requires_grad=False
        )
        model.model.layers.append(block)
    model.model.start_layer, model.model.end_layer = 0, 2
    attn_tp, attn_rank = (
        tp * ep,
        tp_rank * ep + ep_rank,
    )  # attention is TP over every rank
    model.model.layers[1].engram = torch.nn.Module()
    model.model.layers[1].engram.embed = _engram_table(attn_tp, attn_rank)
    model.model.embed_tokens = _vocab_parallel(attn_tp, attn_rank)
    model.lm_head = _vocab_parallel(attn_tp, attn_rank)
    model.config = types.SimpleNamespace(
        num_hidden_layers=2,
        n_routed_experts=N_V4,
        num_nextn_predict_layers=1,
        model_type="deepseek_v4",
    )
    model.num_fused_shared_experts = 0
    model.vision = None
    model.remap_weight_name_to_dpsk_hf_format = (
        DeepseekV4ForCausalLM.remap_weight_name_to_dpsk_hf_format
    )
    return model


def _load_like_v4(model, weights):
    """DeepseekV4ForCausalLM.load_weights' path for these tensors: remap, skip mtp, expert
    mapping into FusedMoE.weight_loader, plain copy for the rest."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    params = dict(model.named_parameters())
    mapping = FusedMoE.make_expert_params_mapping(
        "gate_proj", "down_proj", "up_proj", N_V4
    )
    for name, w in weights:
        name = model.remap_weight_name_to_dpsk_hf_format(
            name, is_nextn=False, num_hidden_layers=2
        )
        if name.startswith("mtp"):
            continue
        for param_name, weight_name, expert_id, shard_id in mapping:
            if weight_name in name:
                resolved = name.replace(weight_name, param_name)
                params[resolved].weight_loader(
                    params[resolved],
                    w,
                    resolved,
                    shard_id=shard_id,
                    expert_id=expert_id,
                )
                break
        else:
            loader = getattr(params[name], "weight_loader", None)
            loader(params[name], w) if loader else params[name].data.copy_(w)
    return {k: v.detach().clone() for k, v in params.items()}


@pytest.fixture(scope="module")
def v4ckpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fast_load_v4")
    return _write_checkpoint(
        folder, _v4_expert_tensors(torch.Generator().manual_seed(1))
    )


V4_LAYOUTS = {
    "tp4": dict(tp=4, ep=1),
    "tp4-padded-loading": dict(tp=4, ep=1, padded=True),
    "tp4-padded-buffer": dict(tp=4, ep=1, padded=True, rows_pad=32),
    "ep4": dict(tp=1, ep=4),
    "ep4-eplb": dict(tp=1, ep=4, eplb=True),
    "tp2-ep2": dict(tp=2, ep=2),
}


@pytest.mark.parametrize("layout", list(V4_LAYOUTS))
def test_deepseek_v4_owner_loads_the_same_parameters_as_stock(
    v4ckpt, monkeypatch, layout
):
    """FusedMoE's, VocabParallelEmbedding's and EngramEmbedding's real loaders, fed fast
    load's tensors (stand-ins included) under the V4 owner, leave every parameter bitwise
    as they do fed safe_open's; a rank reads only its experts, at TP its rows of w1/w3, and
    its rows of the embedding, the LM head and the Engram table."""
    from sglang.srt.layers.moe.fused_moe_triton import layer as moe_layer
    from sglang.srt.models import deepseek_v4_fast_load as v4fl

    cfg = dict(V4_LAYOUTS[layout])
    tp, ep = cfg.pop("tp"), cfg.pop("ep")
    meta = _FakeMeta(N_V4) if cfg.get("eplb") else None
    monkeypatch.setattr(moe_layer, "get_global_expert_location_metadata", lambda: meta)
    monkeypatch.setattr(v4fl, "get_global_expert_location_metadata", lambda: meta)
    total = sum(e.nbytes for f in v4ckpt for e in fl.read_header(f)[0])
    read_by_ranks = 0
    for tp_rank in range(tp):
        for ep_rank in range(ep):
            stock_model = _v4_model(tp, tp_rank, ep, ep_rank, **cfg)
            fast_model = _v4_model(tp, tp_rank, ep, ep_rank, **cfg)

            def stock_weights():
                for f in v4ckpt:
                    with safe_open(f, framework="pt", device="cpu") as h:
                        for k in h.keys():
                            yield k, h.get_tensor(k)

            expected = _load_like_v4(stock_model, stock_weights())
            owner = v4fl.DeepseekV4Owner(fast_model, is_nextn=False)
            loader = FastLoader(
                v4ckpt,
                owner,
                num_threads=3,
                slab_bytes=4096,
                index_path=os.path.join(
                    os.path.dirname(v4ckpt[0]), "model.safetensors.index.json"
                ),
            )
            got = _load_like_v4(fast_model, iter(loader))
            for k in expected:
                assert _same(got[k], expected[k]), (layout, tp_rank, ep_rank, k)
            read_by_ranks += loader.stats.bytes_read
            assert loader.stats.files_opened < len(
                v4ckpt
            )  # the mtp shard is never opened
            if not cfg.get(
                "rows_pad"
            ):  # w1, w3 and their scales at TP; embed, head, Engram table
                assert loader.stats.tensors_sliced == 2 * (N_V4 // ep) * 4 * (
                    tp > 1
                ) + 4 * (tp * ep > 1)
    # every rank reads the norms; together they read each expert byte once, w2 once per TP rank
    expert = lambda n: ".experts." in n and not n.startswith("mtp.")
    sizes = {e.name: e.nbytes for f in v4ckpt for e in fl.read_header(f)[0]}
    w13 = sum(n for k, n in sizes.items() if expert(k) and ".w2." not in k)
    w2 = sum(n for k, n in sizes.items() if expert(k) and ".w2." in k)
    vocab = sum(
        n
        for k, n in sizes.items()
        if k in ("embed.weight", "head.weight") or ".engram." in k
    )
    norms = (
        sum(n for k, n in sizes.items() if not expert(k) and not k.startswith("mtp."))
        - vocab
    )
    norms_and_vocab = (
        tp * ep * norms + vocab
    )  # every rank its norms, the ranks together one vocabulary
    if cfg.get("rows_pad"):
        assert read_by_ranks < norms_and_vocab + w13 + tp * w2
    elif cfg.get("eplb"):  # expert 0 has a redundant copy on a second rank
        dup = sum(
            n
            for k, n in sizes.items()
            if ".experts.0." in k and not k.startswith("mtp.")
        )
        assert read_by_ranks == norms_and_vocab + w13 + tp * w2 + dup
    else:
        assert read_by_ranks == norms_and_vocab + w13 + tp * w2
    assert read_by_ranks < tp * ep * total


def test_deepseek_v4_owner_keeps_whole_what_it_cannot_prove(v4ckpt):
    """triton_kernels' transpose, pre-sharded weights, a FusedMoE subclass overriding its
    loader: the owner reads those tensors whole (the model narrows them itself)."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.models import deepseek_v4_fast_load as v4fl

    name, shape = "layers.0.ffn.experts.1.w1.weight", (I, H // 2)
    model = _v4_model(4, 1, 1, 0)
    assert v4fl.DeepseekV4Owner(model, is_nextn=False).rank_slice(
        name, shape, torch.uint8
    ) == RankSlice(0, 64, 64)
    for attr in ("use_triton_kernels", "use_presharded_weights"):
        model = _v4_model(4, 1, 1, 0)
        setattr(model.model.layers[0].mlp.experts, attr, True)
        assert (
            v4fl.DeepseekV4Owner(model, is_nextn=False).rank_slice(
                name, shape, torch.uint8
            )
            is None
        )

    class Overriding(FusedMoE):
        def weight_loader(self, *a, **k):
            return super().weight_loader(*a, **k)

    model = _v4_model(1, 0, 4, 1)
    moe = model.model.layers[0].mlp.experts
    moe.__class__ = Overriding
    for p in moe.parameters():
        p.weight_loader = moe.weight_loader
    owner = v4fl.DeepseekV4Owner(model, is_nextn=False)
    assert owner.keeps(
        "layers.0.ffn.experts.0.w1.weight"
    )  # rank 1's loader is not FusedMoE's: kept
    assert not owner.keeps(
        "layers.1.ffn.experts.0.w1.weight"
    )  # layer 1 is plain FusedMoE: expert 0 is rank 0's
    assert not owner.keeps("mtp.0.ffn.experts.0.w1.weight")


def test_deepseek_v4_owner_refuses_a_slice_the_loader_does_not_take(v4ckpt):
    """A loader that narrows differently than declared meets the stand-in's refusal."""
    from sglang.srt.models import deepseek_v4_fast_load as v4fl

    model = _v4_model(4, 2, 1, 0)
    owner = v4fl.DeepseekV4Owner(model, is_nextn=False)
    loader = FastLoader(v4ckpt, owner)
    name, t = next((n, t) for n, t in loader if isinstance(t, RankSliceTensor))
    with pytest.raises(RankSliceAccessError, match=name.replace(".", r"\.")):
        t.narrow(0, 0, t.shape[0] // 4)  # rank 0's rows, not rank 2's


def _draft_tensors(g):
    t = {
        "embed.weight": _rand((96, H), torch.bfloat16, g),
        "layers.0.attn_norm.weight": _rand((H,), torch.float32, g),
    }
    for e in range(N_V4):
        for p in (f"layers.0.ffn.experts.{e}", f"mtp.0.ffn.experts.{e}"):
            t[f"{p}.w1.weight"] = _rand((I, H // 2), torch.uint8, g)
            t[f"{p}.w2.weight"] = _rand((H, I // 2), torch.uint8, g)
            t[f"{p}.w3.weight"] = _rand((I, H // 2), torch.uint8, g)
    t["mtp.0.attn_norm.weight"] = _rand((H,), torch.float32, g)
    t["mtp.0.embed.weight"] = _rand(
        (96, H), torch.bfloat16, g
    )  # the DSpark draft shares the target's
    return t


@pytest.mark.parametrize("draft", ["dspark", "nextn"])
def test_deepseek_v4_drafts_read_only_their_layer(tmp_path, draft):
    """The DSpark draft maps only mtp.*, the NextN draft only its layer; both then keep only
    their EP rank's experts, and read only their shard."""
    from sglang.srt.models import deepseek_v4_dspark as dspark
    from sglang.srt.models import deepseek_v4_fast_load as v4fl
    from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM

    files = _write_checkpoint(
        tmp_path, _draft_tensors(torch.Generator().manual_seed(2)), n_shards=3
    )
    index = str(tmp_path / "model.safetensors.index.json")
    cfg = types.SimpleNamespace(
        num_hidden_layers=2,
        n_routed_experts=N_V4,
        num_nextn_predict_layers=1,
        model_type="deepseek_v4",
    )
    for rank in range(4):
        model = torch.nn.Module()
        model.config, model.num_fused_shared_experts = cfg, 0
        block = torch.nn.Module()
        block.mlp = torch.nn.Module()
        block.mlp.experts = _fused_moe(0, 1, 0, 4, rank)
        if draft == "dspark":
            model.stages = torch.nn.ModuleList([block])
            model.confidence_head = None
            model._remap_dspark_weight_name = types.MethodType(
                dspark.DeepseekV4ForCausalLMDSpark._remap_dspark_weight_name, model
            )
            owner = v4fl.DeepseekV4DSparkOwner(model)
        else:
            model.model = torch.nn.Module()
            model.model.decoder = block
            model.remap_weight_name_to_dpsk_hf_format = (
                DeepseekV4ForCausalLM.remap_weight_name_to_dpsk_hf_format
            )
            owner = v4fl.DeepseekV4Owner(model, is_nextn=True)
        loader, got = _load(files, owner, index_path=index)
        mine = {
            f"mtp.0.ffn.experts.{e}.w{k}.weight"
            for e in range(2 * rank, 2 * rank + 2)
            for k in (1, 2, 3)
        }
        # both loaders map mtp.0.embed and drop it themselves (it is no draft parameter)
        assert set(got) == mine | {"mtp.0.attn_norm.weight", "mtp.0.embed.weight"}
        assert loader.stats.files_opened == 1


# --------------------------------------------------------------------------- the engine's call site


def test_default_loader_reads_through_fast_load_only_behind_the_flag(
    ckpt, monkeypatch, tmp_path
):
    """DefaultModelLoader._get_weights_iterator: flag off, upstream's iterator (every tensor,
    as mmap views); flag on, FastLoader with the thread / slab flags and the model's
    checkpoint_owner()."""
    from sglang.srt.configs.load_config import LoadConfig, LoadFormat
    from sglang.srt.model_loader import loader as L

    flags = types.SimpleNamespace(
        weight_loader_fast_load=False,
        weight_loader_fast_load_num_threads=3,
        weight_loader_fast_load_slab_mb=1,
        weight_loader_drop_cache_after_load=False,
        weight_loader_disable_mmap=False,
        weight_loader_prefetch_checkpoints=False,
        weight_loader_prefetch_num_threads=4,
        model_checksum=None,
    )
    monkeypatch.setattr(L, "get_model", lambda: flags)
    monkeypatch.setattr(L, "get_server_args", lambda: None)
    built = []
    real = fl.FastLoader.__init__

    def spy(self, *a, **k):
        real(self, *a, **k)
        built.append(self)

    monkeypatch.setattr(fl.FastLoader, "__init__", spy)
    loader = L.DefaultModelLoader(LoadConfig(load_format=LoadFormat.AUTO))
    model = types.SimpleNamespace(checkpoint_owner=lambda: EPOwner(2))
    config = types.SimpleNamespace(
        model_path=str(ckpt.folder), revision=None, hf_config=None
    )
    source = L.DefaultModelLoader.Source.init_new(config, model)
    assert source.checkpoint_owner is model.checkpoint_owner

    stock = dict(loader._get_weights_iterator(source))
    assert not built and set(stock) == set(ckpt.stock)

    flags.weight_loader_fast_load = True
    got = dict(loader._get_weights_iterator(source))
    assert len(built) == 1 and isinstance(built[0].owner, EPOwner)
    assert (built[0].num_threads, built[0].slab_bytes) == (3, 1 << 20)
    assert built[0].index_path == os.path.join(
        str(ckpt.folder), "model.safetensors.index.json"
    )
    assert set(got) == {n for n in ckpt.stock if EPOwner(2).keeps(n)}
    assert all(_same(t, stock[n]) for n, t in got.items())

    # a .bin checkpoint keeps upstream's pt iterator (refused at startup where the path is local)
    torch.save({"w": torch.zeros(2)}, tmp_path / "pytorch_model.bin")
    built.clear()
    assert (
        set(
            loader._get_weights_iterator(
                L.DefaultModelLoader.Source(str(tmp_path), None)
            )
        )
        and not built
    )


@pytest.mark.e2e
def test_launch_server_refuses_fast_load_where_it_would_do_nothing(tmp_path):
    """A real launch_server start: the model namespace's check runs before any model work."""
    from e2e.checkpoints import write_tiny_llama
    from e2e.server import refusal
    from test_e2e_cpu import CPU_ARGS, CPU_ENV

    r = refusal(
        write_tiny_llama(tmp_path / "tiny"),
        CPU_ARGS + ["--load-format", "dummy", "--weight-loader-fast-load"],
        env=CPU_ENV,
        timeout=240,
    )
    assert r.returncode != 0
    assert (
        "--weight-loader-fast-load reads safetensors checkpoints" in r.stdout
        and "dummy" in r.stdout
    )


@pytest.mark.gpu
@pytest.mark.parametrize("pin", [False, True], ids=["pageable-default", "pinned"])
def test_slabs_feed_async_copies_to_the_gpu_and_are_released(ckpt, pin):
    """The engine's pageable slabs (the default even where CUDA exists: pinned ones measured
    slower on the GPU host, docs/fast-load.md) and pinned ones (pin_memory=True, the benchmark's
    fast-pinned row): non-blocking copies to the GPU from them land bitwise (a slab is released
    only once no view is left; a pinned one through torch's host allocator, which waits for the
    copies), and the slab memory is released after the load."""
    loader = FastLoader(
        ckpt.files,
        num_threads=4,
        slab_bytes=4096,
        **({"pin_memory": True} if pin else {}),
    )
    on_gpu = {}
    for name, t in loader:
        assert t.is_pinned() == pin, name
        on_gpu[name] = t.to("cuda", non_blocking=True)
    del t
    torch.cuda.synchronize()
    for name, g in on_gpu.items():
        assert _same(g.cpu(), ckpt.stock[name]), name
    gc.collect()
    assert loader.wait_released(10) and loader.stats.live_bytes == 0


# --------------------------------------------------------------------------- the benchmark


def test_the_benchmark_runs_end_to_end_at_tiny_size(tmp_path):
    """bench_fast_load.py --tiny at 1 rank, stock and fast: the rows, the storage ceilings in
    both read patterns and where the fast load's time went (a GPU-host run is too dear to find
    a broken benchmark)."""
    import subprocess
    import sys

    from conftest import REPO

    run = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmark" / "loading" / "bench_fast_load.py"),
            "--tiny",
            "--dir",
            str(tmp_path / "ckpt"),
            "--gb",
            "0.05",
            "--ranks",
            "1",
            "--iterators",
            "stock-default,fast",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    payload = json.loads(run.stdout[run.stdout.index("\n{") + 1 :])
    assert payload["complete"] and [r["iterator"] for r in payload["rows"]] == [
        "stock-default",
        "fast",
    ]
    assert {c["pattern"] for c in payload["storage_ceiling"]} == {
        "shared chunks",
        "one stream per shard",
    }
    fast = payload["rows"][1]
    assert set(fast["seconds_per_rank"]) == {
        "loader_s",
        "wait_read_s",
        "wait_budget_s",
        "alloc_s",
    }
    assert fast["read_gb_per_rank"][0] > 0 and fast["slabs_released_after_load"]
    assert "terminate called" not in run.stderr
    assert not (tmp_path / "ckpt").exists()  # the checkpoint it wrote is deleted


def _help_problems(help_text: str, pinned: bool) -> list[str]:
    """What the flag's help says about the slabs against what the engine allocates."""
    wrong = "pageable" if pinned else "pinned"
    right = "pinned" if pinned else "pageable"
    return [f"help says {wrong}"] * (wrong in help_text) + [
        f"help does not say {right}"
    ] * (right not in help_text)


def test_help_says_the_slabs_the_engine_allocates():
    """--weight-loader-fast-load's help names the slabs the served loader uses: the engine's
    iterator passes no pin_memory, so FastLoader's default decides (pageable)."""
    import ast
    import inspect
    import textwrap

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    (action,) = [a for a in parser._actions if a.dest == "weight_loader_fast_load"]
    tree = ast.parse(textwrap.dedent(inspect.getsource(fl.fast_load_weights_iterator)))
    (call,) = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "FastLoader"
    ]
    assert "pin_memory" not in {k.arg for k in call.keywords}
    pinned = inspect.signature(FastLoader).parameters["pin_memory"].default
    assert _help_problems(action.help, pinned) == []
    # The help as it was (pinned on CUDA) is refused.
    assert _help_problems("into large (pinned on CUDA) buffers", pinned) == [
        "help says pinned",
        "help does not say pageable",
    ]
