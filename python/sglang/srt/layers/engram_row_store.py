"""Engram rows on local storage (NVMe) behind a bounded RAM cache (``--engram-row-store-dir``).

Each rank writes its shard of each Engram table to a file at load and serves lookups from a RAM
cache of rows, reading misses from the file (why, layout, cache policy: docs/engram-row-store.md).

INVARIANTS. A lookup returns the checkpoint's bytes, dequantized by the device table's own
arithmetic (on CUDA the same ``engram_gather`` kernel), so the output is bitwise the device
table's. The host work runs at a breakable-CUDA-graph break (``eager_on_graph``); a full CUDA
graph capture of the lookup refuses, naming the flag.
"""

from __future__ import annotations

import argparse
import logging
import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import numpy as np
import torch

logger = logging.getLogger(__name__)

SCALE_BLOCK = 32  # e8m0 scale per 32 fp8 values (FP8_BLOCK_SIZE of the engram table)
IO_BLOCK = 4096  # O_DIRECT alignment and the unit of a read
MAX_RUN_BLOCKS = 32  # contiguous blocks merged into one read (128 KiB)
_WRITE_CHUNK_ROWS = 1 << 18

FLAG = "--engram-row-store-dir"


def validate_engram_row_store(server_args) -> None:
    """Resolution-hook check; the model is read only when the flag is on."""
    from sglang.srt.arg_groups.model_override_base import (
        model_config_of,
        resolving_view,
    )

    cfg = resolving_view(server_args)
    directory, gib = cfg.engram_row_store_dir, cfg.engram_row_store_cache_gib
    if directory is None:
        if gib is not None:
            raise ValueError(
                f"--engram-row-store-cache-gib={gib} does nothing without {FLAG}; set both or neither"
            )
        return
    if gib is not None:  # Engine(...) bypasses argparse: the value is parsed here
        parse_engram_row_store_cache_gib(gib)
    if not os.path.isdir(directory) or not os.access(directory, os.W_OK | os.X_OK):
        raise ValueError(
            f"{FLAG}={directory!r}: not a writable directory (each rank writes its Engram shard there at load)"
        )
    from sglang.srt.environ import envs

    for env in (
        "SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE",
        "SGLANG_OPT_DSV41_ENGRAM_PEER_SHARDS",
    ):
        placement = getattr(envs, env, None)  # None: a release without that placement
        if placement is not None and placement.get():
            raise ValueError(
                f"{FLAG} cannot be used with {env}=1: that places the Engram tables elsewhere"
            )
    prefetch = cfg.engram_prefetch  # --engram-prefetch (patch 0015, in Depends:)
    if prefetch not in (None, "off"):
        raise ValueError(
            f"{FLAG} cannot be used with --engram-prefetch={prefetch}: the prefetch gathers from the "
            "device table, which the row store does not keep"
        )
    if cfg.enable_torch_compile:
        raise ValueError(
            f"{FLAG} cannot be used with --enable-torch-compile: the lookup reads storage on the host"
        )
    hf_config = model_config_of(server_args).hf_config
    if not getattr(hf_config, "engram_layer_ids", None):
        raise ValueError(f"{FLAG} does nothing here: the model has no Engram tables")


def parse_engram_row_store_cache_gib(value) -> float:
    """type_parser of --engram-row-store-cache-gib: a finite number of GiB >= 0."""
    try:
        gib = float(value)
    except (TypeError, ValueError):
        gib = float("nan")
    if not (gib >= 0 and gib != float("inf")):
        raise argparse.ArgumentTypeError(
            f"--engram-row-store-cache-gib {value!r}: accepted: a finite number of GiB >= 0 "
            "(0 reads every row from storage)"
        )
    return gib


DEFAULT_CACHE_GIB = 16.0

# Internal, not read by upstream code: every store of the process, to split the one cache budget.
_STORES: list["EngramRowStore"] = []


def maybe_engram_row_store(
    offload_cfg, label: str, row_start: int, rows: int, dim: int
):
    """The store for one Engram table shard when ``--engram-row-store-dir`` is set, else None."""
    directory = offload_cfg.engram_row_store_dir
    if directory is None:
        return None
    gib = offload_cfg.engram_row_store_cache_gib
    store = EngramRowStore(
        directory,
        label,
        row_start,
        rows,
        dim,
        cache_bytes=int((DEFAULT_CACHE_GIB if gib is None else gib) * 2**30),
    )
    _STORES.append(store)
    return store


class EngramRowStore:
    """One Engram table shard in a record file, with a RAM cache; ``cache_bytes`` is the process's
    budget, shared by the stores by their rows (``share=False``: this store alone)."""

    def __init__(
        self,
        directory: str,
        label: str,
        row_start: int,
        rows: int,
        dim: int,
        *,
        cache_bytes: int,
        threads: Optional[int] = None,
        direct_io: Optional[bool] = None,
    ):
        if dim % SCALE_BLOCK:
            raise ValueError(
                f"engram row store {label}: dim {dim} is not a multiple of {SCALE_BLOCK}"
            )
        self.label, self.row_start, self.rows, self.dim = label, row_start, rows, dim
        self.rec = dim + dim // SCALE_BLOCK
        rank = _rank_tag()
        self.path = os.path.join(
            directory,
            f"engram-{label}-rows{row_start}-{row_start + rows}-dim{dim}{rank}.rows",
        )
        self.cache_bytes = cache_bytes
        # Reads overlap on a thread pool where there are cores for it; on 2 cores the pool's
        # hand-offs cost more than they overlap (benchmark/results/archive/engram_row_store-cpu-2core.json).
        self.threads = (
            min(16, len(os.sched_getaffinity(0))) if threads is None else threads
        )
        self.want_direct = direct_io
        self._pending: dict[str, torch.Tensor] = {}
        self._written_s: Optional[float] = None
        self.fd: Optional[int] = None
        self.direct = False
        self.capacity = 0
        self.pool: Optional[ThreadPoolExecutor] = None
        self.lock = threading.Lock()
        self.stats = {
            "lookups": 0,
            "rows": 0,
            "unique": 0,
            "hits": 0,
            "misses": 0,
            "uncached": 0,
            "reads": 0,
            "read_bytes": 0,
            "read_s": 0.0,
            "lookup_s": 0.0,
        }

    # ---------------------------------------------------------------- load
    def load_rows(self, loaded: torch.Tensor, *, scale: bool) -> None:
        """The checkpoint's full table (or with ``scale`` its e8m0 scales); once both arrived, this
        shard's rows are written. The loader may call it from several threads."""
        kind = "scale" if scale else "weight"
        width = self.dim // SCALE_BLOCK if scale else self.dim
        if (
            loaded.dim() != 2
            or loaded.element_size() != 1
            or loaded.shape[1] != width
            or loaded.shape[0] < self.row_start + self.rows
        ):
            raise ValueError(
                f"engram row store {self.label}: checkpoint {kind} {tuple(loaded.shape)} "
                f"{loaded.dtype}, expected at least {(self.row_start + self.rows, width)} of 1-byte values"
            )
        with self.lock:
            self._pending[kind] = loaded
            if len(self._pending) == 2:
                self._write_file()

    def _write_file(self) -> None:
        w, s = self._pending.pop("weight"), self._pending.pop("scale")
        t0 = time.perf_counter()
        tmp = self.path + ".partial"
        with open(tmp, "wb") as f:
            for lo in range(0, self.rows, _WRITE_CHUNK_ROWS):
                hi = min(self.rows, lo + _WRITE_CHUNK_ROWS)
                g = slice(self.row_start + lo, self.row_start + hi)
                recs = np.empty((hi - lo, self.rec), np.uint8)
                recs[:, : self.dim] = _bytes(w[g])
                recs[:, self.dim :] = _bytes(s[g])
                f.write(recs.tobytes())
            size = self.rows * self.rec
            f.truncate(max(IO_BLOCK, -(-size // IO_BLOCK) * IO_BLOCK))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        self._written_s = time.perf_counter() - t0

    def finish_load(self, share: bool = True) -> None:
        """Open the written file for reads and allocate this store's share of the cache."""
        if self._written_s is None:
            missing = sorted({"weight", "scale"} - set(self._pending))
            raise RuntimeError(
                f"engram row store {self.label}: the checkpoint did not load the table's "
                f"{' and '.join(missing) or 'rows'}; nothing to serve from {self.path}"
            )
        if self.fd is not None:
            return
        stores = [s for s in _STORES] if share and self in _STORES else [self]
        total_rows = sum(s.rows for s in stores) or 1
        budget = int(self.cache_bytes * self.rows / total_rows)
        self.capacity = min(self.rows, budget // self.rec)
        self.fd, self.direct = _open_for_reads(self.path, self.want_direct)
        # The written pages are not needed again: reads go through this cache.
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        self.slot_of = np.full(self.rows, -1, np.int32)
        self.row_of = np.full(self.capacity, -1, np.int64)
        self.ref = np.zeros(self.capacity, np.uint8)
        self.stamp = np.zeros(self.capacity, np.int64)
        self.cache = np.empty((self.capacity, self.rec), np.uint8)
        self.used, self.hand, self.epoch = 0, 0, 0
        self.pool = (
            ThreadPoolExecutor(self.threads, thread_name_prefix=f"engram-{self.label}")
            if self.threads > 2
            else None
        )
        self._bounce = _AlignedBuffer()
        logger.info(
            "engram row store %s: %d rows x %d B in %s (%s reads), cache %d rows = %.2f GiB, written in %.1f s",
            self.label,
            self.rows,
            self.rec,
            self.path,
            "O_DIRECT" if self.direct else "buffered",
            self.capacity,
            self.capacity * self.rec / 2**30,
            self._written_s,
        )

    # ---------------------------------------------------------------- lookup
    def read_records(self, local: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(unique records [u, rec] uint8, inverse) with ``records[inverse]`` the rows of ``local``."""
        t0 = time.perf_counter()
        with self.lock:
            out = self._read_records(local)
            self.stats["lookup_s"] += time.perf_counter() - t0
        return out

    def _read_records(self, local: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        st = self.stats
        st["lookups"] += 1
        st["rows"] += local.size
        uniq, inv = np.unique(local, return_inverse=True)
        out = np.empty((uniq.size, self.rec), np.uint8)
        if uniq.size == 0:
            return out, inv
        st["unique"] += uniq.size
        self.epoch += 1
        slots = self.slot_of[uniq]
        hit = slots >= 0
        hs = slots[hit]
        self.ref[hs] = 1
        self.stamp[hs] = self.epoch
        out[hit] = self.cache[hs]
        miss_pos = np.flatnonzero(~hit)
        st["hits"] += hs.size
        st["misses"] += miss_pos.size
        if miss_pos.size:
            rows = uniq[miss_pos]
            new = self._victims(rows.size)
            n_c = new.size
            if n_c:
                old = self.row_of[new]
                self.slot_of[old[old >= 0]] = -1
                self.row_of[new] = rows[:n_c]
                self.slot_of[rows[:n_c]] = new
                self.ref[new] = 0
                self.stamp[new] = self.epoch
            recs = self._read_rows(rows)
            if n_c:
                self.cache[new] = recs[:n_c]
            st["uncached"] += rows.size - n_c
            out[miss_pos] = recs
        return out, inv

    def _victims(self, k: int) -> np.ndarray:
        """Up to ``k`` slots for new rows: free slots first, then CLOCK."""
        free = min(k, self.capacity - self.used)
        got = [np.arange(self.used, self.used + free, dtype=np.int64)]
        self.stamp[got[0]] = self.epoch  # taken: not a victim again in this lookup
        self.used += free
        need = k - free
        swept = 0
        while need > 0 and self.capacity and swept < 2 * self.capacity:
            lo = self.hand
            hi = min(self.capacity, lo + max(4 * need, 4096))
            cand = lo + np.flatnonzero(
                (self.ref[lo:hi] == 0) & (self.stamp[lo:hi] != self.epoch)
            )
            take = cand[:need]
            end = int(take[-1]) + 1 if take.size == need else hi
            self.ref[lo:end] = 0
            self.stamp[take] = self.epoch
            got.append(take)
            need -= take.size
            swept += end - lo
            self.hand = end % self.capacity
        return np.concatenate(got)

    def _read_rows(self, rows: np.ndarray) -> np.ndarray:
        """Records of sorted unique shard-local ``rows`` read from the file, in aligned runs."""
        t0 = time.perf_counter()
        off = rows * self.rec
        b0 = off // IO_BLOCK
        b1 = (off + self.rec - 1) // IO_BLOCK
        blocks = np.unique(np.concatenate([b0, b1]))
        brk = np.flatnonzero(np.diff(blocks) != 1) + 1
        runs = []
        for seg in np.split(np.arange(blocks.size), brk):
            for i in range(0, seg.size, MAX_RUN_BLOCKS):
                part = seg[i : i + MAX_RUN_BLOCKS]
                runs.append((int(part[0]), int(blocks[part[0]]), part.size))
        buf = self._bounce.get(blocks.size * IO_BLOCK)
        mv = memoryview(buf)

        def read(run):
            pos, block, n = run
            want = n * IO_BLOCK
            got = os.preadv(
                self.fd, [mv[pos * IO_BLOCK : pos * IO_BLOCK + want]], block * IO_BLOCK
            )
            if got != want:
                raise OSError(
                    f"engram row store {self.label}: short read {got} of {want} B at block {block}"
                )

        if len(runs) <= 8 or self.pool is None:
            for r in runs:
                read(r)
        else:
            list(self.pool.map(read, runs))
        src = np.searchsorted(blocks, b0) * IO_BLOCK + off % IO_BLOCK
        data = np.frombuffer(buf, np.uint8, count=blocks.size * IO_BLOCK)
        recs = np.lib.stride_tricks.sliding_window_view(data, self.rec)[src]
        st = self.stats
        st["reads"] += len(runs)
        st["read_bytes"] += blocks.size * IO_BLOCK
        st["read_s"] += time.perf_counter() - t0
        return recs

    def owned_rows(self, indices: torch.Tensor) -> torch.Tensor:
        """bf16 rows of global ids ``indices``; zero for ids this shard does not own."""
        out = torch.empty(
            *indices.shape, self.dim, dtype=torch.bfloat16, device=indices.device
        )
        if indices.is_cuda and torch.cuda.is_current_stream_capturing():
            from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph.context import (
                is_in_breakable_cuda_graph,
            )

            if not is_in_breakable_cuda_graph():
                raise RuntimeError(
                    f"{FLAG}: an Engram lookup is being captured into a full CUDA graph, but it "
                    "reads storage on the host; use --cuda-graph-backend-decode breakable (and "
                    "--cuda-graph-backend-prefill breakable or disabled)"
                )
        _lookup_at_graph_break(self, indices, out)
        return out

    def lookup_into(self, indices: torch.Tensor, out: torch.Tensor) -> None:
        flat = indices.reshape(-1)
        local = flat.to("cpu", torch.int64).numpy() - self.row_start
        owned = (local >= 0) & (local < self.rows)
        recs, inv = self.read_records(local[owned])
        pos = np.full(flat.numel(), -1, np.int64)
        pos[owned] = inv
        w = torch.from_numpy(np.ascontiguousarray(recs[:, : self.dim]))
        s = torch.from_numpy(np.ascontiguousarray(recs[:, self.dim :]))
        pos_t = torch.from_numpy(pos)
        dst = out.view(-1, self.dim)
        if out.is_cuda:
            from sglang.kernels.ops.embeddings.engram_gather import engram_gather

            dev = out.device
            w = w.pin_memory().to(dev, non_blocking=True)
            s = s.pin_memory().to(dev, non_blocking=True)
            pos_t = pos_t.pin_memory().to(dev, non_blocking=True)
            # Positions the shard does not own are -1, outside [0, u): the kernel writes zeros.
            engram_gather(
                w.data_ptr(),
                s.data_ptr(),
                pos_t,
                dst,
                self.dim,
                SCALE_BLOCK,
                row_lo=0,
                row_hi=recs.shape[0],
            )
            # The caching host allocator keeps the pinned sources until their copies complete.
            return
        dst.copy_(dequant_rows_cpu(w, s, pos_t))

    def hit_rate(self) -> float:
        u = self.stats["unique"]
        return self.stats["hits"] / u if u else 0.0


def dequant_rows_cpu(
    w: torch.Tensor, s: torch.Tensor, pos: torch.Tensor
) -> torch.Tensor:
    """Upstream's CPU expression (EngramEmbedding._owned_rows) over compact rows."""
    owned = pos >= 0
    local = pos.masked_fill(~owned, 0)
    if w.shape[0] == 0:
        return torch.zeros(pos.shape[0], w.shape[1], dtype=torch.bfloat16)
    weight = w.view(torch.float8_e4m3fn)
    scale = s.view(torch.float8_e8m0fnu)
    rows = weight[local].float().unflatten(-1, (-1, SCALE_BLOCK))
    values = (rows * scale[local].float().unsqueeze(-1)).flatten(-2)
    return values.to(torch.bfloat16).masked_fill(~owned.unsqueeze(-1), 0)


def _lookup_eager(
    store: EngramRowStore, indices: torch.Tensor, out: torch.Tensor
) -> None:
    store.lookup_into(indices, out)


def _make_graph_break():
    from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph.breakable_cuda_graph import (
        eager_on_graph,
    )

    return eager_on_graph(_lookup_eager)


_graph_break = None
"""The eager host lookup wrapped for breakable CUDA graphs, built at the first use (its
import is heavy); stateless, read only by ``_lookup_at_graph_break``."""


def _lookup_at_graph_break(store, indices, out) -> None:
    """The host part runs eagerly between breakable-CUDA-graph segments (replays included)."""
    global _graph_break
    if _graph_break is None:
        _graph_break = _make_graph_break()
    _graph_break(store, indices, out)


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu").contiguous().view(torch.uint8).numpy()


def _rank_tag() -> str:
    try:
        from sglang.srt.runtime_context import get_parallel

        p = get_parallel()
        return f"-tp{p.tp_rank}" if p.tp_size > 1 else ""
    except Exception:  # no published runtime context (tools, unit tests)
        return ""


class _AlignedBuffer:
    """A page-aligned read buffer (O_DIRECT needs aligned memory), grown on demand."""

    def __init__(self):
        self.mm: Optional[mmap.mmap] = None

    def get(self, nbytes: int) -> mmap.mmap:
        if self.mm is None or len(self.mm) < nbytes:
            size = max(1 << 20, 1 << (max(nbytes, 1) - 1).bit_length())
            self.mm = mmap.mmap(-1, size)
        return self.mm


def _open_for_reads(path: str, want_direct: Optional[bool]) -> tuple[int, bool]:
    """(fd, O_DIRECT?) ``want_direct`` None: O_DIRECT where the filesystem takes it."""
    if want_direct is not False and hasattr(os, "O_DIRECT"):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            probe = mmap.mmap(-1, IO_BLOCK)
            os.preadv(fd, [memoryview(probe)], 0)
            return fd, True
        except OSError:
            if want_direct:
                raise
            try:
                os.close(fd)
            except (OSError, UnboundLocalError):
                pass
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    return fd, False
