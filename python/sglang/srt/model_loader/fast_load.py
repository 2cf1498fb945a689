"""Read a safetensors checkpoint at disk speed, and only the bytes this rank keeps.

``--weight-loader-fast-load``: ``pread`` threads read the tensors this rank copies
(``checkpoint_owner()``) into slabs the model gets views of. How and why: docs/fast-load.md.

INVARIANTS (argued in docs/fast-load.md): a yielded tensor holds exactly the bytes
``safetensors.safe_open`` returns (else :class:`CheckpointError`); no byte outside a kept range
is read but the headers; held slabs stay within ``2 x threads x slab`` but for the one the model
waits for (``_head_may_go``: no deadlock); a slab is released only once no tensor views it.

THE TRAP: skipping a tensor is safe only when the model would never copy it. A
wrong ``keeps()`` leaves a parameter at its initial values and upstream's loaders
only warn about that, so an owner must mirror the model's own loader exactly
(DeepSeek-V4's is tested against FusedMoE's loader, test/test_fast_load.py).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import math
import mmap
import os
import struct
import threading
import time
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from sglang.srt.arg_groups.fast_load_args import DEFAULT_NUM_THREADS, DEFAULT_SLAB_MB

logger = logging.getLogger(__name__)

_MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit
_HEAD_WAIT_S = (
    0.5  # with no slab released for this long, the slab the model needs is read anyway
)
_HEAD_WAIT_MAX_S = 5.0  # ... stretched by 1 s per GB the model holds, up to this
_INDEX_NAME = "model.safetensors.index.json"

# safetensors dtype -> (torch dtype, bits per header element). F4 packs two
# elements per byte; torch's float4_e2m1fn_x2 counts bytes, so its last dim halves.
_DTYPES: Dict[str, Tuple[Optional[torch.dtype], int]] = {
    "F64": (torch.float64, 64),
    "F32": (torch.float32, 32),
    "F16": (torch.float16, 16),
    "BF16": (torch.bfloat16, 16),
    "I64": (torch.int64, 64),
    "I32": (torch.int32, 32),
    "I16": (torch.int16, 16),
    "I8": (torch.int8, 8),
    "U64": (getattr(torch, "uint64", None), 64),
    "U32": (getattr(torch, "uint32", None), 32),
    "U16": (getattr(torch, "uint16", None), 16),
    "U8": (torch.uint8, 8),
    "BOOL": (torch.bool, 8),
    "C64": (torch.complex64, 64),
    "F8_E4M3": (getattr(torch, "float8_e4m3fn", None), 8),
    "F8_E4M3FNUZ": (getattr(torch, "float8_e4m3fnuz", None), 8),
    "F8_E5M2": (getattr(torch, "float8_e5m2", None), 8),
    "F8_E5M2FNUZ": (getattr(torch, "float8_e5m2fnuz", None), 8),
    "F8_E8M0": (getattr(torch, "float8_e8m0fnu", None), 8),
    "F4": (getattr(torch, "float4_e2m1fn_x2", None), 4),
}


class CheckpointError(ValueError):
    """A checkpoint file that cannot be read as safetensors says: names the file and tensor."""

    def __init__(self, path: str, tensor: Optional[str], what: str):
        where = f"{path}" + (f", tensor {tensor!r}" if tensor else "")
        super().__init__(f"fast_load: {where}: {what}")
        self.path = path
        self.tensor = tensor


# --------------------------------------------------------------------------- header


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """One tensor of a shard: its torch dtype and shape, and its bytes [begin, end) in the file."""

    name: str
    dtype: torch.dtype
    shape: Tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def _pread_exact(
    fd: int, n: int, offset: int, path: str, tensor: Optional[str]
) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = os.pread(fd, n - len(out), offset + len(out))
        if not chunk:
            raise CheckpointError(
                path,
                tensor,
                f"truncated: end of file at byte {offset + len(out)}, "
                f"expected {n} bytes from {offset}",
            )
        out += chunk
    return bytes(out)


def read_header(path: str, fd: Optional[int] = None) -> Tuple[List[TensorEntry], int]:
    """The tensors of one shard in file order, checked as safetensors checks them, and
    where their data starts; CheckpointError names the file and the first tensor found wrong.
    """
    own_fd = fd is None
    if own_fd:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise CheckpointError(path, None, "missing shard: no such file") from None
    try:
        size = os.fstat(fd).st_size
        if size < 8:
            raise CheckpointError(
                path, None, f"truncated: {size} bytes, no header length"
            )
        (n,) = struct.unpack("<Q", _pread_exact(fd, 8, 0, path, None))
        if n > _MAX_HEADER_BYTES or 8 + n > size:
            raise CheckpointError(
                path,
                None,
                f"header length {n} runs past the end of the file ({size} bytes): "
                "truncated, or not a safetensors file",
            )
        raw = _pread_exact(fd, n, 8, path, None)
    finally:
        if own_fd:
            os.close(fd)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(path, None, f"header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(path, None, "header is not a JSON object")

    data_start = 8 + n
    data_len = size - data_start
    entries: List[TensorEntry] = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict):
            raise CheckpointError(path, name, "header entry is not an object")
        dtype_str, shape, offsets = (
            info.get("dtype"),
            info.get("shape"),
            info.get("data_offsets"),
        )
        torch_dtype, bits = _DTYPES.get(dtype_str, (None, 0))
        if torch_dtype is None:
            raise CheckpointError(
                path, name, f"dtype {dtype_str!r} is not one torch can load"
            )
        if not (
            isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)
        ):
            raise CheckpointError(path, name, f"shape {shape!r} is not a list of sizes")
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1]
        ):
            raise CheckpointError(
                path, name, f"data_offsets {offsets!r} are not [begin, end]"
            )
        numel = math.prod(shape)
        if numel * bits % 8:
            raise CheckpointError(
                path, name, f"{dtype_str} shape {shape} is not a whole number of bytes"
            )
        nbytes = numel * bits // 8
        if offsets[1] - offsets[0] != nbytes:
            raise CheckpointError(
                path,
                name,
                f"header lies about its size: {dtype_str} {shape} is {nbytes} bytes, "
                f"data_offsets {offsets} span {offsets[1] - offsets[0]}",
            )
        if bits == 4:
            if not shape or shape[-1] % 2:
                raise CheckpointError(
                    path, name, f"F4 shape {shape} has an odd last dimension"
                )
            shape = shape[:-1] + [shape[-1] // 2]
        entries.append(
            TensorEntry(
                name,
                torch_dtype,
                tuple(shape),
                data_start + offsets[0],
                data_start + offsets[1],
            )
        )

    entries.sort(key=lambda e: (e.begin, e.end))
    pos = data_start
    for e in entries:
        if e.begin != pos:
            what = (
                "overlaps the tensor before it"
                if e.begin < pos
                else f"leaves a gap of {e.begin - pos} bytes before it"
            )
            raise CheckpointError(
                path, e.name, f"header lies about offsets: its data {what}"
            )
        if e.end > size:
            raise CheckpointError(
                path,
                e.name,
                f"truncated: its data ends at byte {e.end}, the file has {size} bytes",
            )
        pos = e.end
    if pos != size:
        raise CheckpointError(
            path,
            None,
            f"{size - pos} bytes after the last tensor's data: the header does not describe the file",
        )
    return entries, data_start


# --------------------------------------------------------------------------- owner


@dataclasses.dataclass(frozen=True)
class RankSlice:
    """``tensor.narrow(dim, start, length)``: the only part of a tensor the model copies."""

    dim: int
    start: int
    length: int


class CheckpointOwner:
    """What of a checkpoint this rank copies (names as in the checkpoint); this base keeps all."""

    def keeps(self, name: str) -> bool:
        """False only if the model never reads a byte of ``name`` on this rank."""
        return True

    def rank_slice(
        self, name: str, shape: Tuple[int, ...], dtype: torch.dtype
    ) -> Optional[RankSlice]:
        """The one narrow the model applies to ``name`` before copying it, or None (whole)."""
        return None


KEEP_ALL = CheckpointOwner()


def checkpoint_owner_of(model_or_hook) -> CheckpointOwner:
    """The owner a model supplies (``model.checkpoint_owner()``), else KEEP_ALL."""
    hook = getattr(model_or_hook, "checkpoint_owner", model_or_hook)
    owner = hook() if callable(hook) else None
    return owner if owner is not None else KEEP_ALL


# --------------------------------------------------------------------------- stand-in


class RankSliceAccessError(RuntimeError):
    pass


_METADATA = {
    torch.Tensor.shape.__get__,
    torch.Tensor.dtype.__get__,
    torch.Tensor.device.__get__,
    torch.Tensor.ndim.__get__,
    torch.Tensor.layout.__get__,
    torch.Tensor.is_cuda.__get__,
    torch.Tensor.is_cpu.__get__,
    torch.Tensor.requires_grad.__get__,
    torch.Tensor.size,
    torch.Tensor.dim,
    torch.Tensor.numel,
    torch.Tensor.nelement,
    torch.Tensor.element_size,
    torch.Tensor.is_floating_point,
    torch.Tensor.__len__,
}


class RankSliceTensor(torch.Tensor):
    """Full-shape stand-in for a checkpoint tensor of which this rank read one slice: ``narrow``
    (or ``[start:stop]`` on dim 0) with exactly that slice returns it, any other access raises
    naming the tensor (the owner did not declare what the model did)."""

    @staticmethod
    def __new__(
        cls,
        name: str,
        shape: Tuple[int, ...],
        kept: torch.Tensor,
        rank_slice: RankSlice,
    ):
        t = torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=kept.dtype, device=kept.device
        )
        t._fast_load = (name, kept, rank_slice)
        return t

    def __repr__(self):
        name, _, s = self._fast_load
        return f"RankSliceTensor({name!r}, shape={tuple(self.shape)}, keeps narrow({s.dim}, {s.start}, {s.length}))"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        self = args[0] if args and isinstance(args[0], RankSliceTensor) else None
        if self is not None:
            name, kept, s = self._fast_load
            if func in (torch.Tensor.narrow, torch.narrow):
                bound = _narrow_args(args[1:], kwargs)
                if bound is not None:
                    dim, start, length = bound
                    if dim < 0:
                        dim += self.dim()
                    if (dim, start, length) == (s.dim, s.start, s.length):
                        return kept
            elif func is torch.Tensor.__getitem__ and s.dim == 0 and len(args) == 2:
                idx = args[1]
                if isinstance(idx, slice) and idx.step in (None, 1):
                    start, stop, _ = idx.indices(self.shape[0])
                    if (start, stop - start) == (s.start, s.length):
                        return kept
        raise RankSliceAccessError(cls._refusal(args, func))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RankSliceAccessError(cls._refusal(args, func))

    @staticmethod
    def _refusal(args, func) -> str:
        flat, _ = torch.utils._pytree.tree_flatten(args)
        standin = next((a for a in flat if isinstance(a, RankSliceTensor)), None)
        fname = getattr(func, "__name__", str(func))
        if standin is None:
            return f"fast_load: a rank-slice stand-in was passed to {fname}"
        name, _, s = standin._fast_load
        return (
            f"fast_load read only narrow({s.dim}, {s.start}, {s.length}) of {name!r} "
            f"(shape {tuple(standin.shape)}) for this rank, but the model called {fname} on it: "
            "the model's checkpoint_owner() does not match its loader (run without "
            "--weight-loader-fast-load and report it)"
        )


def _narrow_args(args, kwargs) -> Optional[Tuple[int, int, int]]:
    names = ("dim", "start", "length")
    vals = list(args) + [kwargs[k] for k in names[len(args) :] if k in kwargs]
    if len(vals) != 3:
        return None
    try:
        return tuple(int(v) for v in vals)  # type: ignore[return-value]
    except (TypeError, ValueError):
        return None


# --------------------------------------------------------------------------- plan


@dataclasses.dataclass
class _Piece:
    """One yielded tensor: its bytes sit at ``slab_pos`` in its slab."""

    entry: TensorEntry
    slab_pos: int
    rank_slice: Optional[RankSlice]
    kept_shape: Tuple[int, ...]


@dataclasses.dataclass
class _Slab:
    file_idx: int
    nbytes: int
    reads: List[Tuple[int, int, int]]  # (file offset, length, slab position)
    pieces: List[_Piece]
    last_of_file: bool = False
    base: Optional[torch.Tensor] = None
    baseline_uses: int = 0
    futures: List[concurrent.futures.Future] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class FastLoadStats:
    """What a load read and where its ``seconds`` went (docs/fast-load.md reads them)."""

    files: int = 0
    files_opened: int = 0
    tensors: int = 0
    tensors_kept: int = 0
    tensors_sliced: int = 0
    checkpoint_bytes: int = 0
    bytes_read: int = 0
    header_bytes: int = 0
    preads: int = 0
    peak_live_bytes: int = 0
    live_bytes: int = 0
    seconds: float = 0.0
    wait_read_s: float = 0.0
    wait_budget_s: float = 0.0
    alloc_s: float = 0.0


def _kept_range(
    entry: TensorEntry, s: Optional[RankSlice]
) -> Tuple[int, int, Tuple[int, ...], Optional[RankSlice]]:
    """(file offset, nbytes, kept shape, slice) read for ``entry``; a strided slice is read whole."""
    shape = entry.shape
    if s is None or not shape:
        return entry.begin, entry.nbytes, shape, None
    dim = s.dim + len(shape) if s.dim < 0 else s.dim
    if not (
        0 <= dim < len(shape)
        and 0 <= s.start
        and 0 <= s.length
        and s.start + s.length <= shape[dim]
    ):
        raise ValueError(
            f"fast_load: {entry.name!r} {shape}: rank slice {s} is out of bounds"
        )
    if s.length == shape[dim] or (s.length and math.prod(shape[:dim]) != 1):
        return entry.begin, entry.nbytes, shape, None
    inner = math.prod(shape[dim + 1 :]) * entry.dtype.itemsize
    kept_shape = shape[:dim] + (s.length,) + shape[dim + 1 :]
    return (
        entry.begin + s.start * inner,
        s.length * inner,
        kept_shape,
        RankSlice(dim, s.start, s.length),
    )


def _align(pos: int, to: int = 64) -> int:
    return (pos + to - 1) // to * to


# --------------------------------------------------------------------------- loader


class FastLoader:
    """Iterate ``(name, tensor)`` over the kept tensors of ``files`` (``index_path``: skip others)."""

    def __init__(
        self,
        files: Sequence[str],
        owner: CheckpointOwner = KEEP_ALL,
        *,
        num_threads: int = DEFAULT_NUM_THREADS,
        slab_bytes: int = DEFAULT_SLAB_MB << 20,
        pin_memory: bool = False,
        index_path: Optional[str] = None,
        drop_cache_after_load: bool = False,
        log_progress: Optional[bool] = None,
        progress_interval_s: float = 10.0,
        head_wait_s: float = _HEAD_WAIT_S,
    ):
        if num_threads < 1 or slab_bytes < 1:
            raise ValueError("fast_load: num_threads and slab_bytes must be >= 1")
        self.files = list(files)
        self.owner = owner
        self.num_threads = num_threads
        self.slab_bytes = slab_bytes
        self.budget = 2 * num_threads * slab_bytes
        self.pin_memory = (
            pin_memory  # the benchmark's comparison row; the engine reads pageable
        )
        self.index_path = index_path
        self.drop_cache_after_load = drop_cache_after_load
        if log_progress is None:
            log_progress = (
                not torch.distributed.is_initialized()
                or torch.distributed.get_rank() == 0
            )
        self.log_progress = log_progress
        self.progress_interval_s = progress_interval_s
        self.head_wait_s = head_wait_s
        self.stats = FastLoadStats(files=len(self.files))
        self._lock = threading.Lock()
        self._held: List[_Slab] = (
            []
        )  # yielded slabs not yet released (polled by use count)
        self._pool: List[torch.Tensor] = (
            []
        )  # released pageable slabs, reused while reading
        self._reading = False
        self._ahead = 0  # slab bytes issued and not yet yielded (the read-ahead)
        self._paced = True  # whether held slabs count against the budget too
        self._last_release = time.monotonic()
        self._quiet_escapes = 0
        self._fds: List[Optional[int]] = [None] * len(
            self.files
        )  # closed by __iter__'s finally

    # ---- planning
    def _files_to_open(self) -> Tuple[List[bool], Dict[str, str]]:
        """Which files hold a kept tensor, by the index when it covers every file."""
        wanted = [True] * len(self.files)
        if not self.index_path or not os.path.isfile(self.index_path):
            return wanted, {}
        try:
            with open(self.index_path) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(
                self.index_path, None, f"unreadable index ({e})"
            ) from None
        folder = os.path.dirname(self.index_path)
        by_file: Dict[str, List[str]] = {}
        for name, fname in weight_map.items():
            by_file.setdefault(
                os.path.normpath(os.path.join(folder, fname)), []
            ).append(name)
        for fname in sorted(set(by_file)):
            if not os.path.exists(fname):
                raise CheckpointError(
                    fname,
                    by_file[fname][0],
                    f"missing shard: {os.path.basename(self.index_path)} places this tensor in it",
                )
        norm = [os.path.normpath(p) for p in self.files]
        if not all(p in by_file for p in norm):
            return (
                wanted,
                {},
            )  # the index does not describe these files: read every header
        wanted = [any(self.owner.keeps(n) for n in by_file[p]) for p in norm]
        if all(wanted):
            return wanted, {}
        # files are skipped on the index's word: hold the opened ones to it
        return wanted, {n: p for p, names in by_file.items() for n in names}

    def _plan(self) -> List[_Slab]:
        wanted, placed = self._files_to_open()
        slabs: List[_Slab] = []
        found = set()
        for i, path in enumerate(self.files):
            if not wanted[i]:
                self.stats.checkpoint_bytes += max(0, os.path.getsize(path))
                continue
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                raise CheckpointError(
                    path, None, "missing shard: no such file"
                ) from None
            self._fds[i] = fd
            self.stats.files_opened += 1
            entries, data_start = read_header(path, fd)
            self.stats.header_bytes += data_start
            self.stats.checkpoint_bytes += sum(e.nbytes for e in entries)
            self.stats.tensors += len(entries)
            norm = os.path.normpath(path)
            cur: Optional[_Slab] = None
            for e in entries:
                found.add(e.name)
                if placed and placed.get(e.name, norm) != norm:
                    raise CheckpointError(
                        path,
                        e.name,
                        f"the index places this tensor in {placed[e.name]}",
                    )
                if not self.owner.keeps(e.name):
                    continue
                off, nbytes, kept_shape, s = _kept_range(
                    e, self.owner.rank_slice(e.name, e.shape, e.dtype)
                )
                self.stats.tensors_kept += 1
                self.stats.tensors_sliced += s is not None
                # a slab never spans files, a tensor never spans slabs; a tensor keeps
                # its alignment in the file (mod 64) so that view(dtype) works
                pad = (off - data_start) % 64
                if cur is None or (
                    cur.nbytes and _align(cur.nbytes) + pad + nbytes > self.slab_bytes
                ):
                    cur = _Slab(i, 0, [], [])
                    slabs.append(cur)
                pos = _align(cur.nbytes) + pad
                cur.pieces.append(_Piece(e, pos, s, kept_shape))
                if (
                    cur.reads
                    and cur.reads[-1][0] + cur.reads[-1][1] == off
                    and cur.reads[-1][2] + cur.reads[-1][1] == pos
                ):
                    o, n, p = cur.reads[-1]
                    cur.reads[-1] = (o, n + nbytes, p)
                else:
                    cur.reads.append((off, nbytes, pos))
                cur.nbytes = pos + nbytes
            if slabs and slabs[-1].file_idx == i:
                slabs[-1].last_of_file = True
        if placed:
            opened = {os.path.normpath(f) for f, w in zip(self.files, wanted) if w}
            for name, p in placed.items():
                if name not in found and p in opened:
                    raise CheckpointError(
                        p,
                        name,
                        "the index places this tensor in the file, its header does not list it",
                    )
        return slabs

    # ---- reading
    def _alloc(self, nbytes: int) -> torch.Tensor:
        size = max(
            nbytes, self.slab_bytes
        )  # whole slabs, so that they are reused as they are
        if self.pin_memory:
            # torch's host allocator: async copies from it record events, so a block is
            # never handed out again while a copy may still read it; its cache reuses slabs
            return torch.empty(size, dtype=torch.uint8, pin_memory=True)
        if size == self.slab_bytes and self._pool:
            return self._pool.pop()
        # an anonymous mapping goes back to the OS when its last view dies
        mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            mm.madvise(mmap.MADV_HUGEPAGE)
        return torch.from_numpy(np.frombuffer(mm, dtype=np.uint8))

    def _read(
        self, slab: _Slab, base: torch.Tensor, reads: List[Tuple[int, int, int]]
    ) -> int:
        fd, path = self._fds[slab.file_idx], self.files[slab.file_idx]
        view = memoryview(base.numpy())
        n_preads = 0
        for off, n, pos in reads:
            done = 0
            while done < n:
                got = os.preadv(fd, [view[pos + done : pos + n]], off + done)
                n_preads += 1
                if got <= 0:
                    at = off + done
                    piece = next(
                        (
                            p
                            for p in slab.pieces
                            if p.entry.begin <= at < max(p.entry.end, p.entry.begin + 1)
                        ),
                        None,
                    )
                    raise CheckpointError(
                        path,
                        piece.entry.name if piece else None,
                        f"truncated while reading: end of file at byte {at} "
                        f"(the file has {os.fstat(fd).st_size} bytes now)",
                    )
                done += got
        return n_preads

    def _issue(self, slab: _Slab, pool: concurrent.futures.ThreadPoolExecutor) -> None:
        with self._lock:
            pooled = len(self._pool)
            t0 = time.perf_counter()
            slab.base = self._alloc(slab.nbytes)
            self.stats.alloc_s += time.perf_counter() - t0
            if (
                len(self._pool) == pooled
            ):  # newly allocated (a pooled one is counted already)
                self.stats.live_bytes += slab.base.numel()
            self.stats.peak_live_bytes = max(
                self.stats.peak_live_bytes, self.stats.live_bytes
            )
        slab.baseline_uses = _use_count(slab.base)
        # one task per slab; a slab bigger than slab_bytes (one large tensor) is split
        task: List[Tuple[int, int, int]] = []
        size = 0
        for off, n, pos in slab.reads:
            while n:
                take = min(n, self.slab_bytes - size)
                task.append((off, take, pos))
                off, n, pos, size = off + take, n - take, pos + take, size + take
                if size == self.slab_bytes:
                    slab.futures.append(pool.submit(self._read, slab, slab.base, task))
                    task, size = [], 0
        if task or not slab.futures:
            slab.futures.append(pool.submit(self._read, slab, slab.base, task))

    def _poll_released(self) -> None:
        """Release the yielded slabs no tensor views any more (pageable ones back to the pool)."""
        with self._lock:
            still = []
            for slab in self._held:
                if _use_count(slab.base) <= slab.baseline_uses:
                    self._last_release = time.monotonic()
                    self._quiet_escapes = 0
                    self.stats.live_bytes -= slab.base.numel()
                    if (
                        self._reading
                        and not self.pin_memory
                        and slab.base.numel() == self.slab_bytes
                    ):
                        self._pool.append(slab.base)
                        self.stats.live_bytes += slab.base.numel()
                    slab.base = None
                else:
                    still.append(slab)
            self._held = still

    def _head_may_go(self, blocked_since: float) -> bool:
        """Whether the slab the model waits for may be read over the budget (docs/fast-load.md)."""
        in_use = self._in_use()
        if not self._paced or in_use == 0:
            return True
        quiet = time.monotonic() - max(blocked_since, self._last_release)
        if quiet < min(self.head_wait_s + in_use / 1e9, _HEAD_WAIT_MAX_S):
            return False
        self._quiet_escapes += 1
        if self._quiet_escapes >= 2:
            self._paced = False
            logger.warning(
                "fast_load: the model keeps %.2f GiB of read tensors without releasing them; "
                "reading on without pacing its copies (memory now grows with what it keeps)",
                self._in_use() / 2**30,
            )
        return True

    def _in_use(self) -> int:
        """Slab bytes issued or held (the pool's idle slabs are memory, but reusable)."""
        return self.stats.live_bytes - len(self._pool) * self.slab_bytes

    def _views(self, slab: _Slab) -> Iterator[Tuple[str, torch.Tensor]]:
        base = slab.base
        for p in slab.pieces:
            e = p.entry
            n = math.prod(p.kept_shape) * e.dtype.itemsize
            raw = base[p.slab_pos : p.slab_pos + n]
            if p.slab_pos % max(e.dtype.itemsize, 1):
                raw = raw.clone()  # misaligned in the file: view(dtype) needs alignment
            t = raw.view(e.dtype).view(p.kept_shape)
            if p.rank_slice is not None:
                t = RankSliceTensor(e.name, e.shape, t, p.rank_slice)
            yield e.name, t

    def __iter__(self) -> Iterator[Tuple[str, torch.Tensor]]:
        t0 = time.perf_counter()
        pool = concurrent.futures.ThreadPoolExecutor(
            self.num_threads, thread_name_prefix="fast_load"
        )
        self._reading = True
        next_issue = 0
        last_log, last_bytes = t0, 0
        done_bytes = 0
        try:
            slabs = self._plan()
            total = sum(r[1] for s in slabs for r in s.reads)
            for head, slab in enumerate(slabs):
                blocked_since = None
                while True:
                    self._poll_released()
                    while next_issue < len(slabs):
                        size = max(slabs[next_issue].nbytes, self.slab_bytes)
                        fits = self._ahead + size <= self.budget and (
                            not self._paced or self._in_use() + size <= self.budget
                        )
                        if not fits:
                            if next_issue != head:
                                break
                            blocked_since = blocked_since or time.monotonic()
                            if not self._head_may_go(blocked_since):
                                break
                        self._issue(slabs[next_issue], pool)
                        self._ahead += slabs[next_issue].base.numel()
                        next_issue += 1
                    waited = time.perf_counter()
                    if (
                        not slab.futures
                    ):  # not issued: over the budget until the model releases slabs
                        time.sleep(0.005)
                        self.stats.wait_budget_s += time.perf_counter() - waited
                        continue
                    finished, _ = concurrent.futures.wait(slab.futures, timeout=0.02)
                    self.stats.wait_read_s += time.perf_counter() - waited
                    if len(finished) == len(slab.futures):
                        break
                for f in slab.futures:
                    self.stats.preads += (
                        f.result()
                    )  # re-raises a read's CheckpointError
                slab.futures = []
                done_bytes += sum(r[1] for r in slab.reads)
                self.stats.bytes_read = done_bytes
                if slab.last_of_file:
                    self._finish_file(slab.file_idx)
                self._ahead -= slab.base.numel()
                yield from self._views(slab)
                self._held.append(slab)
                now = time.perf_counter()
                if self.log_progress and now - last_log >= self.progress_interval_s:
                    logger.info(
                        "fast_load: %.1f / %.1f GiB read (%d%%), %.2f GB/s",
                        done_bytes / 2**30,
                        total / 2**30,
                        100 * done_bytes // max(total, 1),
                        (done_bytes - last_bytes) / (now - last_log) / 1e9,
                    )
                    last_log, last_bytes = now, done_bytes
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            with self._lock:
                self._reading = False
                self.stats.live_bytes -= sum(b.numel() for b in self._pool)
                self._pool.clear()
            for i in range(len(self.files)):
                self._finish_file(i, drop=False)
            self.stats.seconds = time.perf_counter() - t0
        self._log_summary()
        self._release_when_unused()

    def _finish_file(self, i: int, drop: bool = True) -> None:
        fd = self._fds[i]
        if fd is None:
            return
        if drop and self.drop_cache_after_load:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        self._fds[i] = None

    def _log_summary(self) -> None:
        s = self.stats
        logger.info(
            "fast_load: read %.2f GiB of a %.2f GiB checkpoint (%d of %d tensors kept, %d as a rank "
            "slice; %d of %d files opened) in %.1f s: %.2f GB/s, %d threads, %d MiB slabs%s, peak slab "
            "memory %.2f GiB; waited %.1f s for reads, %.1f s for the model to release slabs, %.1f s "
            "allocating",
            s.bytes_read / 2**30,
            s.checkpoint_bytes / 2**30,
            s.tensors_kept,
            s.tensors,
            s.tensors_sliced,
            s.files_opened,
            s.files,
            s.seconds,
            s.bytes_read / max(s.seconds, 1e-9) / 1e9,
            self.num_threads,
            self.slab_bytes >> 20,
            " pinned" if self.pin_memory else "",
            s.peak_live_bytes / 2**30,
            s.wait_read_s,
            s.wait_budget_s,
            s.alloc_s,
        )

    def _release_when_unused(self) -> None:
        """Release the slabs the model still holds after the last yield as their uses drop."""
        self._poll_released()
        if not self._held:
            self._empty_pinned_cache()
            return

        def watch():
            delay, deadline = 0.01, time.monotonic() + 600
            while self._held and time.monotonic() < deadline:
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
                self._poll_released()
            if self._held:
                logger.warning(
                    "fast_load: the model still holds %d slabs (%.2f GiB) 10 minutes after the load",
                    len(self._held),
                    self.stats.live_bytes / 2**30,
                )
            else:
                self._empty_pinned_cache()

        self._watcher = threading.Thread(
            target=watch, name="fast_load_release", daemon=True
        )
        self._watcher.start()

    def wait_released(self, timeout: float = 10.0) -> bool:
        """True once every slab is released (for tests and benchmarks)."""
        watcher = getattr(self, "_watcher", None)
        if watcher is not None:
            watcher.join(timeout)
        self._poll_released()
        return not self._held

    def _empty_pinned_cache(self) -> None:
        if self.pin_memory and hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()


def _use_count(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


# --------------------------------------------------------------------------- engine wiring


def fast_load_weights_iterator(
    hf_weights_files: Sequence[str],
    *,
    owner_hook: Optional[Callable[[], Optional[CheckpointOwner]]],
    hf_folder: str,
    num_threads: Optional[int],
    slab_mb: Optional[int],
    drop_cache_after_load: bool,
) -> Iterator[Tuple[str, torch.Tensor]]:
    """The DefaultModelLoader's iterator for a safetensors checkpoint under --weight-loader-fast-load."""
    owner = checkpoint_owner_of(owner_hook)
    loader = FastLoader(
        hf_weights_files,
        owner,
        num_threads=num_threads or DEFAULT_NUM_THREADS,
        slab_bytes=(slab_mb or DEFAULT_SLAB_MB) << 20,
        index_path=os.path.join(hf_folder, _INDEX_NAME),
        drop_cache_after_load=drop_cache_after_load,
    )
    if loader.log_progress:
        logger.info(
            "fast_load: reading %d checkpoint files with %d threads into %d MiB %s slabs "
            "(budget %d MiB); owner: %s",
            len(loader.files),
            loader.num_threads,
            loader.slab_bytes >> 20,
            "pinned" if loader.pin_memory else "pageable",
            loader.budget >> 20,
            (
                type(owner).__name__
                if owner is not KEEP_ALL
                else "every tensor (the model has no checkpoint_owner)"
            ),
        )
    return iter(loader)
