"""Cost per step of --speculative-dspark-fence-accept-results at bs 1, 4, 64.

The fence's work per folded step is host-issued: one arena clone (allocation + one copy
kernel) and the views. Measured in one process against stock (read_accept, views only)
and the naive fence (one clone per result tensor): host microseconds per step (median of
blocks of 200 calls, the GPU kept busy so the launch queue never stalls the host), and GPU
microseconds per step (CUDA events over 200 snapshots queued behind a sleep, so they run back to back). No weights stream,
so the 43-layer rotation of the harness does not apply; the floor is the arena's bytes
read + written at HBM bandwidth.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools" / "standins"))
sys.path.insert(0, str(REPO / "benchmark"))

import torch  # noqa: E402

import harness  # noqa: E402
from sglang.srt.speculative.dspark_components.dspark_verify import (  # noqa: E402
    AcceptOuts,
    DsparkVerifyEpilogue,
)

MAX_BS = 64
STRIDE = 6  # gamma 5 + anchor


class _NoTpSync:
    def enabled(self, site):
        return False

    def sync(self, site, tensor):
        return tensor


def _clone_each(epi, bs):
    a = epi.read_accept(bs)
    return AcceptOuts(**{f: getattr(a, f).clone() for f in AcceptOuts.__struct_fields__})


def _host_us(fn, n=200, blocks=15) -> float:
    times = []
    for _ in range(blocks):
        torch.cuda._sleep(50_000_000)  # keep the GPU busy: measure issue cost only
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def _gpu_us(fn, n=200, reps=15) -> float:
    """GPU time per call: the calls are queued behind a sleep, so they run back to back
    and the events time the device, not the host's issue rate."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(100_000_000)
        s.record()
        for _ in range(n):
            fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / n)
    return statistics.median(times)


def main() -> None:
    args = harness.parse_args(__doc__)
    dev = torch.device("cuda")
    stock = DsparkVerifyEpilogue(max_bs=MAX_BS, verify_num_draft_tokens=STRIDE, device=dev,
                                 tp_sync=_NoTpSync())
    fenced = DsparkVerifyEpilogue(max_bs=MAX_BS, verify_num_draft_tokens=STRIDE, device=dev,
                                  tp_sync=_NoTpSync(), result_fence=True)
    fence = fenced.result_fence
    rows = []
    for bs in (1, 4, 64):
        variants = {
            "stock views": lambda: stock.read_accept(bs),
            "clone each (6)": lambda: _clone_each(stock, bs),
            "arena snapshot": lambda: fence.snapshot(bs),
        }
        base_host = None
        for name, fn in variants.items():
            for _ in range(50):
                fn()
            host = _host_us(fn)
            gpu = _gpu_us(fn) if name != "stock views" else 0.0
            base_host = host if base_host is None else base_host
            rows.append({
                "bs": bs, "variant": name, "host_us": host, "extra_host_us": host - base_host,
                "gpu_us": gpu, "bytes": 0 if name == "stock views" else 2 * fence.nbytes,
                "floor_us": 0.0 if name == "stock views" else harness.floor_us(2 * fence.nbytes),
            })
    harness.report(
        "folded_result_fence",
        ["bs", "variant", "host_us", "extra_host_us", "gpu_us", "bytes", "floor_us"],
        rows, args.out,
        {"max_bs": MAX_BS, "stride": STRIDE, "arena_bytes": fence.nbytes,
         "note": "host_us: issue cost per step with the GPU busy; gpu_us: per step, 200 back to back"},
    )


if __name__ == "__main__":
    main()
