"""Engram NVMe row store (--engram-row-store-dir) against the in-memory table, in one process.

A synthetic V4.1-shaped table (dim 256: 264-byte records) is written to a directory on local
storage; each row of the output times one Engram layer's lookup per step, stock (the table in
memory: on CUDA upstream's engram_gather over a device table, on CPU upstream's torch lookup)
and the store (its RAM cache, misses read with O_DIRECT), for decode / verify / prefill steps,
Zipf-distributed n-grams and uniform rows, and cache sizes from none to a quarter of the table.
Every step's rows are checked bitwise against stock before timing. Writes
benchmark/results/engram_row_store-<device>.json (device: the GPU's name, or cpu-<N>core).

  python benchmark/engram/bench_engram_row_store.py [--dir /nvme/scratch] [--rows 2000000]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from e2e.provenance import add_overwrite_arg, write_result  # noqa: E402

from sglang.srt.layers import engram_row_store as rs

DIM = 256
REC = DIM + DIM // 32


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("benchmark/results"))
    p.add_argument(
        "--dir",
        default=os.environ.get("ENGRAM_STORE_DIR", "."),
        help="where the table file goes (local NVMe; a temporary folder inside it is removed after)",
    )
    p.add_argument(
        "--rows", type=int, default=2_000_000, help="table rows (2M = 528 MB on disk)"
    )
    p.add_argument(
        "--cols",
        type=int,
        default=16,
        help="hash columns per token ((max n-gram - 1) x heads)",
    )
    p.add_argument(
        "--steps", type=int, default=60, help="timed decode/verify steps per row"
    )
    p.add_argument(
        "--caches", default="0,0.05,0.25", help="cache sizes as fractions of the table"
    )
    return add_overwrite_arg(p).parse_args()


def device_tag(dev: torch.device) -> tuple[str, str]:
    if dev.type == "cuda":
        name = torch.cuda.get_device_name()
        return name, name.replace(" ", "_")
    n = len(os.sched_getaffinity(0))
    return f"cpu ({n} cores)", f"cpu-{n}core"


class Workload:
    """Row ids per step: Zipf over n-grams (s = 1.1, each n-gram hashed to a random row) or
    uniform over the table."""

    def __init__(self, dist: str, rows: int, seed: int):
        self.dist, self.rows, self.g = dist, rows, np.random.default_rng(seed)

    def ids(self, tokens: int, cols: int) -> np.ndarray:
        n = tokens * cols
        if self.dist == "uniform":
            return self.g.integers(0, self.rows, n)
        z = self.g.zipf(1.1, n).astype(np.uint64)
        col = np.tile(np.arange(cols, dtype=np.uint64), tokens)
        h = (
            z * np.uint64(0x9E3779B97F4A7C15) + col * np.uint64(0xBF58476D1CE4E5B9)
        ) >> np.uint64(17)
        return (h % np.uint64(self.rows)).astype(np.int64)


def main():
    args = parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device, tag = device_tag(dev)
    g = np.random.default_rng(0)
    w = g.integers(0, 256, (args.rows, DIM), dtype=np.uint8)
    w[(w & 0x7F) == 0x7F] = 0
    s = g.integers(110, 140, (args.rows, DIM // 32), dtype=np.uint8)
    weight = torch.from_numpy(w).view(torch.float8_e4m3fn)
    scale = torch.from_numpy(s).view(torch.float8_e8m0fnu)
    if dev.type == "cuda":
        from sglang.kernels.ops.embeddings.engram_gather import engram_gather

        wd, sd = weight.to(dev), scale.to(dev)

        def stock(idx):
            out = torch.empty(idx.numel(), DIM, dtype=torch.bfloat16, device=dev)
            return engram_gather(wd.data_ptr(), sd.data_ptr(), idx, out, DIM, 32)

    else:

        def stock(idx):
            return rs.dequant_rows_cpu(w_u8, s_u8, idx)

        w_u8, s_u8 = weight.view(torch.uint8), scale.view(torch.uint8)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    workdir = tempfile.mkdtemp(prefix="engram-store-", dir=args.dir)
    rows_out = []
    try:
        t0 = time.perf_counter()
        probe = rs.EngramRowStore(workdir, "bench", 0, args.rows, DIM, cache_bytes=0)
        probe.load_rows(weight, scale=False)
        probe.load_rows(scale, scale=True)
        write_s = time.perf_counter() - t0
        probe.finish_load(share=False)
        print(
            f"wrote {args.rows} rows ({args.rows * REC / 2**20:.0f} MiB) in {write_s:.1f} s; "
            f"reads: {'O_DIRECT' if probe.direct else 'buffered (no O_DIRECT here)'}"
        )
        shapes = [
            ("decode bs4", 4, args.steps),
            ("verify bs4 x4", 16, args.steps),
            ("prefill 2048", 2048, max(3, args.steps // 20)),
        ]
        for dist in ("zipf", "uniform"):
            for frac in (float(x) for x in args.caches.split(",")):
                for name, tokens, steps in shapes:
                    st = rs.EngramRowStore(
                        workdir,
                        "bench",
                        0,
                        args.rows,
                        DIM,
                        cache_bytes=int(frac * args.rows * REC),
                    )
                    st._written_s = 0.0  # the file above
                    st.finish_load(share=False)
                    wl = Workload(dist, args.rows, seed=1)
                    # warm the cache with as many rows as it holds (a served model's steady state)
                    warm = 0
                    while frac and warm < 2 * st.capacity:
                        ids = wl.ids(2048, args.cols)
                        st.read_records(ids)
                        warm += ids.size
                    base = dict(st.stats)
                    t_store, t_stock, t_host = [], [], []
                    for i in range(steps):
                        idx = torch.from_numpy(wl.ids(tokens, args.cols)).to(dev)
                        sync()
                        h0 = st.stats["lookup_s"]
                        a = time.perf_counter()
                        got = st.owned_rows(idx)
                        sync()
                        b = time.perf_counter()
                        ref = stock(idx)
                        sync()
                        c = time.perf_counter()
                        if i < 3 and not torch.equal(
                            got.view(torch.int16), ref.view(torch.int16)
                        ):
                            raise SystemExit(
                                f"{name} {dist} cache {frac}: rows differ from the in-memory table"
                            )
                        t_store.append(b - a)
                        t_host.append(st.stats["lookup_s"] - h0)
                        t_stock.append(c - b)
                    d = {k: st.stats[k] - base[k] for k in st.stats}
                    us_store, us_stock = (
                        statistics.median(t_store) * 1e6,
                        statistics.median(t_stock) * 1e6,
                    )
                    pos = tokens * args.cols
                    rows_out.append(
                        {
                            "shape": name,
                            "dist": dist,
                            "cache_frac": frac,
                            "cache_mib": round(st.capacity * REC / 2**20, 1),
                            "rows_per_step": pos,
                            "steps": steps,
                            "stock_us": round(us_stock, 1),
                            "store_us": round(us_store, 1),
                            "store_over_stock": round(us_store / us_stock, 2),
                            "store_rows_per_s": round(pos / (us_store * 1e-6)),
                            "store_host_us": round(statistics.median(t_host) * 1e6, 1),
                            "hit_rate": (
                                round(d["hits"] / d["unique"], 4)
                                if d["unique"]
                                else 0.0
                            ),
                            "read_kib_per_step": round(
                                d["read_bytes"] / steps / 1024, 1
                            ),
                            "reads_per_step": round(d["reads"] / steps, 1),
                            "uncached_per_step": round(d["uncached"] / steps, 1),
                        }
                    )
                    r = rows_out[-1]
                    print(
                        f"{dist:8s} cache {frac:5.2f} {name:14s} stock {r['stock_us']:9.1f} us  store "
                        f"{r['store_us']:9.1f} us ({r['store_over_stock']:6.2f}x, host {r['store_host_us']:8.1f})  hit {r['hit_rate']:.3f}  "
                        f"{r['store_rows_per_s']:>9d} rows/s  {r['read_kib_per_step']:8.1f} KiB read/step"
                    )
                    os.close(st.fd)
                    if st.pool is not None:
                        st.pool.shutdown()
        meta = {
            "table_rows": args.rows,
            "record_bytes": REC,
            "hash_cols": args.cols,
            "o_direct": probe.direct,
            "write_s": round(write_s, 2),
            "write_mib_per_s": round(args.rows * REC / 2**20 / write_s, 1),
            "note": "one Engram layer's lookup per step; stock = the table in memory "
            "(CUDA: engram_gather over a device table; CPU: upstream's torch lookup); "
            "rows checked bitwise against stock",
        }
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    path = write_result(
        args.out / f"engram_row_store-{tag}.json",
        {
            "benchmark": "engram_row_store",
            "device": device,
            "torch": torch.__version__,
            **meta,
            "rows": rows_out,
        },
        overwrite=args.overwrite,
        device=device,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
