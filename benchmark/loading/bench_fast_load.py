"""--weight-loader-fast-load against upstream's safetensors iterators, cold page cache.

Writes a synthetic DeepSeek-V4-shaped checkpoint (MXFP4 experts as uint8 + e8m0 scales,
bf16 attention and embeddings, fp32 norms, e4m3 wo_a; ~4.3 GB shards with an index) of
``--gb`` GB under ``--dir``, then for 1 rank and for 4 simulated ranks (separate processes
started together: EP4, each rank copies its quarter of the experts, and TP4 at EP_SIZE=1,
each rank copies its rows of every w1/w3 and all of w2) loads it with each iterator:

  stock-default   buffered_multi_thread_safetensors_weights_iterator, 8 threads: what the
                  default loader runs (enable_multithread_load defaults to true)
  stock-single    safetensors_weights_iterator (enable_multithread_load=false)
  stock-prefetch  --weight-loader-prefetch-checkpoints: each rank pages in its 1/N of the
                  shards in the background while the single-threaded iterator runs
  stock-no-mmap   --weight-loader-disable-mmap (whole shards read into memory; only where
                  the RAM holds 2 shards per rank)
  fast            FastLoader (this patch): pageable slabs
  fast-pinned     FastLoader with pinned slabs (only where CUDA exists): what pinning costs
                  or buys (it lost on the GPU host, so the engine reads pageable)

Each rank consumes as DeepSeek-V4's load_weights does: a tensor it copies is submitted to a
ThreadPoolExecutor() (the model's async copies), narrowed to the rank's slice first, and
copied into a buffer on --dest (cuda where there is one). Before every run the page cache of
every shard is dropped with posix_fadvise(DONTNEED) and its residency checked with mincore.
Reported per run: wall time until the last rank's last copy, GB/s of the checkpoint, bytes
each rank copied, peak RSS per rank (ru_maxrss; anonymous and file-backed peaks sampled
from /proc), plus the storage's own ceiling (plain parallel preads of every shard, no
consumer) and a thread x slab sweep of the fast loader (--sweep).

fastsafetensors, instanttensor and the runai streamer are not run: their packages are not
installed here (and the first two need a CUDA device); the JSON says so.

Run (repository root, or the GPU bundle's root with its PYTHONPATH):
  python benchmark/loading/bench_fast_load.py --dir /tmp/fast_load_ckpt --gb 20 --out benchmark/results
The checkpoint is deleted afterwards unless --keep. In the GPU bundle (which passes only
--out), FAST_LOAD_BENCH_ARGS='--sweep 8,16,32x4,16,64 --iterators fast --ranks 1' adds arguments.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import json
import math
import mmap
import multiprocessing as mp
import os
import platform
import resource
import shlex
import shutil
import struct
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if (
    REPO / "tools" / "standins"
).is_dir():  # import-only stand-ins (sgl_kernel, torchvision, ...)
    sys.path.insert(0, str(REPO / "tools" / "standins"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(REPO / "tools"))
from e2e.provenance import add_overwrite_arg, write_result  # noqa: E402

# DeepSeek-V4-like dimensions: hidden, expert intermediate, routed experts, vocab
H, I, EXPERTS, VOCAB = 7168, 2048, 256, 129280
SHARD_BYTES = int(4.3e9)
FAST_KINDS = ("fast", "fast-pinned")
ITERATORS = [
    "stock-default",
    "stock-single",
    "stock-prefetch",
    "stock-no-mmap",
    *FAST_KINDS,
]
NOT_RUN = {
    "fastsafetensors": "package not installed (no network on the GPU host); its iterator "
    "also needs a CUDA device (it loads to cuda:<rank>)",
    "instanttensor": "package not installed; needs a CUDA device",
    "runai_streamer": "package not installed; object-storage streamer, not a local-disk path",
}


# --------------------------------------------------------------------------- checkpoint


def _layout(target_bytes: int):
    """[(name, safetensors dtype, shape)] of a V4-shaped checkpoint of about target_bytes."""
    t = [
        ("embed.weight", "BF16", (VOCAB, H)),
        ("head.weight", "BF16", (VOCAB, H)),
        ("norm.weight", "F32", (H,)),
    ]
    per_layer = EXPERTS * (2 * I * H // 2 + H * I // 2 + 2 * I * H // 32 + H * I // 32)
    layers = max(1, round((target_bytes - 2 * VOCAB * H * 2) / per_layer))
    for layer in range(layers):
        p = f"layers.{layer}"
        t += [
            (f"{p}.attn_norm.weight", "F32", (H,)),
            (f"{p}.ffn_norm.weight", "F32", (H,)),
            (f"{p}.attn.wq_a.weight", "BF16", (1536, H)),
            (f"{p}.attn.wkv.weight", "BF16", (576, H)),
            (f"{p}.attn.wo_a.weight", "F8_E4M3", (8192, 1024)),
            (f"{p}.attn.wo_a.scale", "F8_E8M0", (256, 32)),
            (f"{p}.ffn.gate.weight", "BF16", (EXPERTS, H)),
            (f"{p}.ffn.shared_experts.w1.weight", "U8", (I, H // 2)),
        ]
        for e in range(EXPERTS):
            q = f"{p}.ffn.experts.{e}"
            t += [
                (f"{q}.w1.weight", "U8", (I, H // 2)),
                (f"{q}.w3.weight", "U8", (I, H // 2)),
                (f"{q}.w2.weight", "U8", (H, I // 2)),
                (f"{q}.w1.scale", "F8_E8M0", (I, H // 32)),
                (f"{q}.w3.scale", "F8_E8M0", (I, H // 32)),
                (f"{q}.w2.scale", "F8_E8M0", (H, I // 32)),
            ]
    return t


_SIZE = {"F32": 4, "BF16": 2, "F8_E4M3": 1, "F8_E8M0": 1, "U8": 1}
_RANK = {
    "F32": 0,
    "BF16": 1,
    "F8_E8M0": 2,
    "F8_E4M3": 3,
    "U8": 4,
}  # safetensors writes wider dtypes first


def write_checkpoint(folder: Path, target_bytes: int) -> list[str]:
    """Shards of ~SHARD_BYTES in layer order, each laid out as safetensors' writer lays it out."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = _layout(target_bytes)
    shards, cur, size = [], [], 0
    for t in tensors:
        nbytes = math.prod(t[2]) * _SIZE[t[1]]
        if cur and size + nbytes > SHARD_BYTES:
            shards.append(cur)
            cur, size = [], 0
        cur.append(t)
        size += nbytes
    shards.append(cur)
    pool = np.random.default_rng(0).integers(
        0, 256, 1 << 28, dtype=np.uint8
    )  # 256 MiB of noise
    files, weight_map, cursor = [], {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        shard.sort(key=lambda t: (_RANK[t[1]], t[0]))
        header, off = {}, 0
        for name, dt, shape in shard:
            n = math.prod(shape) * _SIZE[dt]
            header[name] = {
                "dtype": dt,
                "shape": list(shape),
                "data_offsets": [off, off + n],
            }
            off += n
            weight_map[name] = fname
        raw = json.dumps(  # not a result: the safetensors header of a shard
            header, separators=(",", ":")
        ).encode()
        raw += b" " * (-len(raw) % 8)
        with open(folder / fname, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            left = off
            while left:
                start = cursor % (len(pool) - (64 << 20))
                n = min(left, 64 << 20)
                f.write(memoryview(pool)[start : start + n])
                cursor += 7919 * 4096 + n
                left -= n
            f.flush()
            os.fsync(f.fileno())  # written back, so that DONTNEED can drop the pages
        files.append(str(folder / fname))
        print(
            f"  wrote {fname}: {os.path.getsize(folder / fname) / 1e9:.2f} GB",
            flush=True,
        )
    (folder / "model.safetensors.index.json").write_text(  # not a result: the index
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    return files


# --------------------------------------------------------------------------- page cache


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def resident_fraction(path: str) -> float:
    """Fraction of the file's pages in the page cache (mincore)."""
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return float("nan")
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = (ctypes.c_ubyte * pages)()
        rc = _libc.mincore(addr, size, vec)
        _libc.munmap(addr, size)
        return float("nan") if rc else sum(v & 1 for v in vec) / pages
    finally:
        os.close(fd)


def drop_page_cache(files) -> float:
    """posix_fadvise(DONTNEED) on every shard; returns the largest residency left after it."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    return max(resident_fraction(f) for f in files)


# --------------------------------------------------------------------------- ranks


def _expert(name):
    parts = name.split(".")
    return int(parts[parts.index("experts") + 1]) if "experts" in parts else None


class RankOwner:
    """What simulated rank ``rank`` of ``n`` copies: split 'ep' (a quarter of the routed
    experts), 'tp' (EP_SIZE=1: rows of every w1/w3 and their scales; w2 whole, narrowed on
    its columns) or 'none' (one rank, everything). At n > 1 attention is TP over the ranks,
    so the embedding and LM head are narrowed to the rank's vocabulary rows."""

    def __init__(self, split: str, rank: int, n: int, experts: int):
        self.split, self.rank, self.n, self.experts = split, rank, n, experts

    def keeps(self, name):
        e = _expert(name)
        return (
            self.split != "ep" or e is None or e * self.n // self.experts == self.rank
        )

    def rank_slice(self, name, shape, dtype):
        from sglang.srt.model_loader.fast_load import RankSlice

        if self.n > 1 and name in (
            "embed.weight",
            "head.weight",
        ):  # vocab-parallel over attention TP
            k = shape[0] // self.n
            return RankSlice(0, k * self.rank, k)
        if self.split != "tp" or _expert(name) is None:
            return None
        dim = 1 if ".w2." in name else 0
        k = shape[dim] // self.n
        return RankSlice(dim, k * self.rank, k)


class _Sampler(threading.Thread):
    """Peak private (RssAnon + RssShmem) and file-backed (RssFile: shared page cache) RSS of
    this process, sampled every 20 ms."""

    def __init__(self):
        super().__init__(daemon=True)
        self.anon = self.file = 0
        self.stop = threading.Event()

    def run(self):
        while not self.stop.is_set():
            vals = {}
            for line in open("/proc/self/status"):
                if line.startswith(("RssAnon:", "RssFile:", "RssShmem:")):
                    vals[line.split(":")[0]] = int(line.split()[1]) * 1024
            self.anon = max(self.anon, vals.get("RssAnon", 0) + vals.get("RssShmem", 0))
            self.file = max(self.file, vals.get("RssFile", 0))
            self.stop.wait(0.02)


def _weights(kind, files, owner, rank, n, threads, slab_mb):
    from sglang.srt.model_loader import weight_utils as wu

    if kind in FAST_KINDS:
        from sglang.srt.model_loader.fast_load import FastLoader

        loader = FastLoader(
            files,
            owner,
            num_threads=threads,
            slab_bytes=slab_mb << 20,
            index_path=os.path.join(
                os.path.dirname(files[0]), "model.safetensors.index.json"
            ),
            log_progress=False,
            pin_memory=kind == "fast-pinned",
        )
        return iter(loader), loader
    if kind == "stock-default":
        return (
            wu.buffered_multi_thread_safetensors_weights_iterator(files, max_workers=8),
            None,
        )
    if kind == "stock-single":
        return wu.safetensors_weights_iterator(files), None
    if kind == "stock-no-mmap":
        return wu.safetensors_weights_iterator(files, disable_mmap=True), None
    if kind == "stock-prefetch":
        # what _prefetch_all_checkpoints does on local rank r of n: page in files[r::n]
        handle = wu._prefetch_all_checkpoints(sorted(files)[rank::n], num_threads=4)

        def gen():
            yield from wu.safetensors_weights_iterator(files)
            handle.stop()

        return gen(), None
    raise ValueError(kind)


def rank_main(
    kind, files, split, rank, n, threads, slab_mb, dest, experts, barrier, queue
):
    try:
        queue.put(
            _rank(kind, files, split, rank, n, threads, slab_mb, dest, experts, barrier)
        )
    except BaseException:
        import traceback

        barrier.abort()
        queue.put({"rank": rank, "error": traceback.format_exc()})


def _rank(kind, files, split, rank, n, threads, slab_mb, dest, experts, barrier):
    torch.set_num_threads(1)
    owner = RankOwner(split, rank, n, experts)
    device = torch.device(dest)
    workers = min(
        32, (os.cpu_count() or 1) + 4
    )  # ThreadPoolExecutor()'s default, as load_weights uses
    chunk = 64 << 20
    local = threading.local()
    # one 64 MiB buffer per copy thread, allocated up front (outside the measured RSS growth)
    buffers = [
        torch.empty(chunk, dtype=torch.uint8, device=device) for _ in range(workers)
    ]
    for b in buffers:
        b.fill_(0)
    claimed = iter(range(workers))
    claim_lock = threading.Lock()

    def copy(t):
        buf = getattr(local, "buf", None)
        if buf is None:
            with claim_lock:
                buf = local.buf = buffers[next(claimed)]
        flat = (
            (t if t.is_contiguous() else t.contiguous()).reshape(-1).view(torch.uint8)
        )
        for off in range(0, flat.numel(), chunk):
            piece = flat[off : off + chunk]
            buf[: piece.numel()].copy_(piece)
        return flat.numel()

    weights, loader = _weights(kind, files, owner, rank, n, threads, slab_mb)
    sampler = _Sampler()
    sampler.start()
    base_rss = int(open("/proc/self/statm").read().split()[1]) * mmap.PAGESIZE
    barrier.wait(timeout=900)
    t0 = time.time()
    copied = 0
    with concurrent.futures.ThreadPoolExecutor(workers) as ex:
        futures = []
        for name, t in weights:
            if not owner.keeps(name):
                continue
            s = owner.rank_slice(name, tuple(t.shape), t.dtype)
            if s is not None:
                t = t.narrow(s.dim, s.start, s.length)
            futures.append(ex.submit(copy, t))
        t = None
        copied = sum(f.result() for f in futures)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t1 = time.time()
    sampler.stop.set()
    sampler.join()
    out = {
        "rank": rank,
        "t0": t0,
        "t1": t1,
        "copied_bytes": copied,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "rss_before": base_rss,
        "peak_rss_anon": sampler.anon,
        "peak_rss_file": sampler.file,
    }
    if loader is not None:
        # let the release watcher (a daemon thread) finish before the process exits: the likely
        # source of the "terminate called ..." the fast rows printed at exit on the GPU host
        out["slabs_released"] = loader.wait_released(60)
        s = loader.stats
        out.update(
            bytes_read=s.bytes_read,
            peak_slab_bytes=s.peak_live_bytes,
            files_opened=s.files_opened,
            tensors_sliced=s.tensors_sliced,
            loader_s=s.seconds,
            wait_read_s=s.wait_read_s,
            wait_budget_s=s.wait_budget_s,
            alloc_s=s.alloc_s,
        )
    return out


def run(kind, files, split, n, threads, slab_mb, dest, total_bytes):
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(n), ctx.Queue()
    resident = drop_page_cache(files)
    procs = [
        ctx.Process(
            target=rank_main,
            args=(
                kind,
                files,
                split,
                r,
                n,
                threads,
                slab_mb,
                dest,
                EXPERTS,
                barrier,
                queue,
            ),
        )
        for r in range(n)
    ]
    for p in procs:
        p.start()
    results = []
    for _ in procs:
        results.append(queue.get(timeout=3600))
    for p in procs:
        p.join()
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise RuntimeError(f"{kind}: a rank failed:\n{errors[0]}")
    results.sort(key=lambda r: r["rank"])
    wall = max(r["t1"] for r in results) - min(r["t0"] for r in results)
    row = {
        "iterator": kind,
        "ranks": n,
        "split": split,
        "wall_s": round(wall, 2),
        "checkpoint_gbps": round(total_bytes / wall / 1e9, 3),
        "copied_gb_per_rank": [round(r["copied_bytes"] / 1e9, 3) for r in results],
        "peak_rss_gb_max_rank": round(max(r["peak_rss"] for r in results) / 1e9, 3),
        "peak_rss_over_start_gb_max_rank": round(
            max(r["peak_rss"] - r["rss_before"] for r in results) / 1e9, 3
        ),
        "peak_rss_anon_gb_max_rank": round(
            max(r["peak_rss_anon"] for r in results) / 1e9, 3
        ),
        "peak_rss_file_gb_max_rank": round(
            max(r["peak_rss_file"] for r in results) / 1e9, 3
        ),
        "page_cache_resident_after_drop": round(resident, 4),
    }
    if kind in FAST_KINDS:
        row.update(
            threads=threads,
            slab_mb=slab_mb,
            read_gb_per_rank=[round(r["bytes_read"] / 1e9, 3) for r in results],
            peak_slab_gb_max_rank=round(
                max(r["peak_slab_bytes"] for r in results) / 1e9, 3
            ),
            slabs_released_after_load=all(r["slabs_released"] for r in results),
            # where each rank's load went (FastLoadStats): storage, pacing, slab allocation
            seconds_per_rank={
                k: [round(r[k], 2) for r in results]
                for k in ("loader_s", "wait_read_s", "wait_budget_s", "alloc_s")
            },
        )
    print(
        f"  {kind:15s} ranks={n} split={split:4s} {row['wall_s']:7.1f} s  {row['checkpoint_gbps']:6.2f} GB/s  "
        f"peak RSS {row['peak_rss_gb_max_rank']:6.2f} GB (anon {row['peak_rss_anon_gb_max_rank']:.2f}, file "
        f"{row['peak_rss_file_gb_max_rank']:.2f})  resident after drop {resident:.1%}",
        flush=True,
    )
    if kind in FAST_KINDS:
        print(
            "    rank 0: "
            + ", ".join(f"{k} {v[0]:.1f}" for k, v in row["seconds_per_rank"].items()),
            flush=True,
        )
    return row


def storage_ceiling(files, threads, chunk_mb, streams=False):
    """Plain preads of every shard by a thread pool (no consumer, no allocation): the storage.
    Default pattern: the chunks of all shards in file order, shared by the threads (neighbouring
    offsets of one file at a time, as fast load reads). ``streams``: one thread per shard reading
    it front to back, every shard at once (upstream's prefetch pattern; ``threads`` must be the
    shard count); some storage serves
    several sequential streams better than one file read by many threads."""
    drop_page_cache(files)
    chunk = chunk_mb << 20
    fds = {f: os.open(f, os.O_RDONLY) for f in files}
    local = threading.local()

    def read(job):
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = bytearray(chunk)
        return os.preadv(fds[job[0]], [buf], job[1])

    def stream(f):
        return sum(read((f, off)) for off in range(0, os.path.getsize(f), chunk))

    t0 = time.time()
    if streams:
        assert threads == len(files), (threads, len(files))
        with concurrent.futures.ThreadPoolExecutor(threads) as ex:
            total = sum(ex.map(stream, files))
    else:
        jobs = [(f, off) for f in files for off in range(0, os.path.getsize(f), chunk)]
        with concurrent.futures.ThreadPoolExecutor(threads) as ex:
            total = sum(ex.map(read, jobs))
    wall = time.time() - t0
    for fd in fds.values():
        os.close(fd)
    pattern = "one stream per shard" if streams else "shared chunks"
    row = {
        "threads": threads,
        "chunk_mb": chunk_mb,
        "pattern": pattern,
        "gbps": round(total / wall / 1e9, 3),
    }
    print(
        f"  storage ceiling: {threads} threads x {chunk_mb} MiB preads ({pattern}): {row['gbps']:.2f} GB/s",
        flush=True,
    )
    return row


def device_label() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name().replace(" ", "_")
    return f"cpu-{os.cpu_count()}core"


def storage_info(folder: Path) -> dict:
    st = os.stat(folder)
    info = {
        "path": str(folder),
        "st_dev": f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}",
    }
    best = ""
    for line in open("/proc/mounts"):
        dev, mnt, fs = line.split()[:3]
        if str(folder).startswith(mnt) and len(mnt) > len(best):
            best, info["mount"], info["fs"], info["device"] = mnt, mnt, fs, dev
    blk = os.path.basename(info.get("device", ""))
    for attr in ("rotational", "read_ahead_kb", "max_sectors_kb", "nr_requests"):
        p = Path(f"/sys/block/{blk}/queue/{attr}")
        if p.exists():
            info[attr] = p.read_text().strip()
    return info


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", type=Path, default=Path("/tmp/fast_load_ckpt"))
    p.add_argument(
        "--gb", type=float, default=20.0, help="checkpoint size (default 20 GB)"
    )
    p.add_argument("--ranks", default="1,4")
    p.add_argument("--splits", default="ep,tp", help="4-rank splits to run")
    p.add_argument("--iterators", default=",".join(ITERATORS))
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="fast loader threads (default: the flag's)",
    )
    p.add_argument(
        "--slab-mb",
        type=int,
        default=None,
        help="fast loader slab MiB (default: the flag's)",
    )
    p.add_argument(
        "--sweep",
        default="",
        help="thread x slab sweep of the fast loader at 1 rank, e.g. '4,16,32x4,16,64'",
    )
    p.add_argument("--dest", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint")
    p.add_argument("--out", type=Path, default=REPO / "benchmark" / "results")
    p.add_argument("--name", default="fast_load")
    p.add_argument(
        "--tiny",
        action="store_true",
        help="smoke run: small dimensions, nothing written to --out",
    )
    add_overwrite_arg(p)
    # the GPU bundle's run.sh passes only --out: FAST_LOAD_BENCH_ARGS adds the rest
    a = p.parse_args(
        sys.argv[1:] + shlex.split(os.environ.get("FAST_LOAD_BENCH_ARGS", ""))
    )
    if a.tiny:
        global H, I, EXPERTS, VOCAB, SHARD_BYTES
        H, I, EXPERTS, VOCAB, SHARD_BYTES = 1024, 512, 32, 4096, 20_000_000

    from sglang.srt.arg_groups.fast_load_args import (
        DEFAULT_NUM_THREADS,
        DEFAULT_SLAB_MB,
    )

    threads = a.threads or DEFAULT_NUM_THREADS
    slab_mb = a.slab_mb or DEFAULT_SLAB_MB
    target = int(a.gb * 1e9)
    index = a.dir / "model.safetensors.index.json"
    created = False
    if index.exists():
        files = sorted(
            str(a.dir / f)
            for f in set(json.loads(index.read_text())["weight_map"].values())
        )
        print(f"==> reusing {len(files)} shards in {a.dir}")
    else:
        free = shutil.disk_usage(a.dir.parent if not a.dir.exists() else a.dir).free
        if free < target * 1.1:
            sys.exit(
                f"{a.dir}: {free / 1e9:.0f} GB free, need {target * 1.1 / 1e9:.0f}"
            )
        print(f"==> writing a {a.gb:g} GB checkpoint to {a.dir}", flush=True)
        t0 = time.time()
        files = write_checkpoint(a.dir, target)
        created = True
        print(f"    {time.time() - t0:.0f} s", flush=True)
    total = sum(os.path.getsize(f) for f in files)
    largest_shard = max(os.path.getsize(f) for f in files)
    mem_available = (
        int(
            next(
                l for l in open("/proc/meminfo") if l.startswith("MemAvailable")
            ).split()[1]
        )
        * 1024
    )
    residency_before = drop_page_cache(files)
    import safetensors
    import safetensors.torch

    no_mmap_unsupported = None
    try:
        safetensors.torch._getdtype("F8_E8M0")
    except KeyError:
        no_mmap_unsupported = (
            f"cannot run: safetensors.torch.load (the --weight-loader-disable-mmap path) of safetensors "
            f"{safetensors.__version__} has no F8_E8M0, so that upstream path cannot load a checkpoint with "
            "e8m0 scales (DeepSeek-V4's) at all"
        )
    rows, notes, sweep = [], dict(NOT_RUN), []
    ceiling = []
    load_start = os.getloadavg()[0]
    try:
        from sglang.fork import fork_version

        version = fork_version()
    except Exception:  # a tree without the fork's manifest
        version = "unknown"

    def report(complete: bool) -> None:
        """The JSON so far: written after every run, so a run cut short (a device call's time
        limit) keeps what it measured; ``complete`` says whether every row ran."""
        goal = {}
        for split in [s for s in a.splits.split(",") if s]:
            d = next(
                (
                    r
                    for r in rows
                    if r["iterator"] == "stock-default"
                    and r["ranks"] == 4
                    and r["split"] == split
                ),
                None,
            )
            f = next(
                (
                    r
                    for r in rows
                    if r["iterator"] == "fast"
                    and r["ranks"] == 4
                    and r["split"] == split
                ),
                None,
            )
            if d and f and ceiling:
                goal[split] = {
                    "speedup_vs_stock_default": round(
                        f["checkpoint_gbps"] / d["checkpoint_gbps"], 2
                    ),
                    "peak_rss_ratio_vs_stock_default": round(
                        f["peak_rss_gb_max_rank"] / d["peak_rss_gb_max_rank"], 2
                    ),
                    "fast_gbps_over_storage_ceiling": round(
                        f["checkpoint_gbps"] / max(c["gbps"] for c in ceiling), 2
                    ),
                    "stock_default_gbps_over_storage_ceiling": round(
                        d["checkpoint_gbps"] / max(c["gbps"] for c in ceiling), 2
                    ),
                }
        payload = {
            "benchmark": a.name,
            "fork_version": version,
            "device": device_label(),
            "cpus": os.cpu_count(),
            "complete": complete,
            "mem_total_gb": round(
                os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, 1
            ),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "dest": a.dest,
            "loadavg_1m_at_start_and_end": [
                round(load_start, 2),
                round(os.getloadavg()[0], 2),
            ],
            "checkpoint": {
                "gb": round(total / 1e9, 2),
                "shards": len(files),
                "largest_shard_gb": round(largest_shard / 1e9, 2),
                "dims": {
                    "hidden": H,
                    "expert_intermediate": I,
                    "experts": EXPERTS,
                    "vocab": VOCAB,
                },
            },
            "storage": storage_info(a.dir if a.dir.exists() else a.dir.parent),
            "fadvise_dontneed": {
                "works": residency_before < 0.01,
                "max_resident_fraction_after_drop": round(residency_before, 4),
            },
            "storage_ceiling": ceiling,
            "fast_defaults": {"threads": threads, "slab_mb": slab_mb},
            "goal_4_ranks": goal,
            "rows": rows,
            "sweep": sweep,
            "not_run": notes,
        }
        if a.tiny:
            if complete:
                print(json.dumps(payload, indent=1))
            return
        path = write_result(
            a.out / f"{a.name}-{device_label()}.json",
            payload,
            overwrite=a.overwrite,
            quiet=not complete,  # rewritten after every run: say where it went once
        )
        if complete:
            print(json.dumps(goal, indent=1))
            print(f"wrote {path}")

    try:
        ceiling += [
            storage_ceiling(files, 1, 16),
            storage_ceiling(files, threads, slab_mb),
            storage_ceiling(files, 32, 4),
            storage_ceiling(files, len(files), 16, streams=True),
        ]
        kinds = [k for k in a.iterators.split(",") if k]
        if "fast-pinned" in kinds and a.dest == "cpu":
            kinds.remove("fast-pinned")
            notes["fast-pinned"] = "not run: pinned memory needs CUDA"
        for n in [int(x) for x in a.ranks.split(",")]:
            for split in ["none"] if n == 1 else [s for s in a.splits.split(",") if s]:
                for kind in kinds:
                    if kind == "stock-no-mmap" and no_mmap_unsupported:
                        notes["stock-no-mmap"] = no_mmap_unsupported
                        continue
                    if (
                        kind == "stock-no-mmap"
                        and 2 * largest_shard * n > 0.8 * mem_available
                    ):
                        notes[f"stock-no-mmap ranks={n}"] = (
                            f"not run: {n} ranks x 2 x {largest_shard / 1e9:.1f} GB shards exceed the "
                            f"{mem_available / 1e9:.0f} GB of available memory"
                        )
                        continue
                    rows.append(
                        run(kind, files, split, n, threads, slab_mb, a.dest, total)
                    )
                    report(complete=False)
        if a.sweep:
            ts, ss = a.sweep.split("x")
            for t in [int(x) for x in ts.split(",")]:
                for s in [int(x) for x in ss.split(",")]:
                    r = run("fast", files, "none", 1, t, s, a.dest, total)
                    sweep.append(
                        {
                            k: r[k]
                            for k in (
                                "threads",
                                "slab_mb",
                                "wall_s",
                                "checkpoint_gbps",
                                "peak_rss_gb_max_rank",
                                "peak_slab_gb_max_rank",
                            )
                        }
                    )
                    report(complete=False)
    finally:
        if created and not a.keep:
            shutil.rmtree(a.dir)
            print(f"==> deleted {a.dir}")
    report(complete=True)


if __name__ == "__main__":
    main()
