"""Cost per step of --speculative-dspark-fence-accept-results at bs 1, 4, 64.

The fence is an in-graph copy of the accept-result arena into a two-slot ring: its GPU
cost is one single-program kernel inside the verify graph, its host cost building the
``[:bs]`` views of the slot (cached per slot and bs). Measured in one process beside
stock (read_accept, views only) and the two snapshot forms it replaces (one clone per
result tensor; one clone of the arena, the flag's first version): host microseconds per
step (median of blocks of 200 calls, the GPU kept busy so the launch queue never stalls
the host) and GPU microseconds per step (the snapshots: CUDA events over 200 calls queued
behind a sleep, so they run back to back; the ring: 200 copies captured in one CUDA graph,
per replay / 200). The ring's host figure includes its drift check (a device-counter
read-back at the first step and every 64th, an event query while one is pending). No weights
stream, so the 43-layer rotation of the harness does not apply; the floor is the arena's
bytes read + written at HBM bandwidth.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools" / "standins"))
sys.path.insert(0, str(REPO / "benchmark"))

import harness  # noqa: E402
import torch  # noqa: E402

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
    return AcceptOuts(
        **{f: getattr(a, f).clone() for f in AcceptOuts.__struct_fields__}
    )


def _arena_snapshot(fence, bs):
    """The flag's first version (patch 0005 before the ring): clone the arena once,
    one typed view per dtype, one slice per field."""
    snap = fence.arena.clone()
    typed = {
        dtype: snap.view(dtype) for dtype in {d for _, _, _, d, _ in fence._layout}
    }
    views = {}
    for name, _, offset, dtype, shape in fence._layout:
        start = offset // typed[dtype].element_size()
        if len(shape) == 1:
            views[name] = typed[dtype][start : start + bs]
        else:
            views[name] = typed[dtype][start : start + bs * shape[1]].view(bs, shape[1])
    return AcceptOuts(**{f: views[n] for n, f, *_ in fence._layout if f is not None})


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
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
            enable_timing=True
        )
        torch.cuda._sleep(100_000_000)
        s.record()
        for _ in range(n):
            fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / n)
    return statistics.median(times)


def _ring_gpu_us(fence, n=200, reps=15) -> float:
    """The ring copy as the verify graph runs it: n copies in one captured graph."""
    gate = torch.ones((1,), dtype=torch.int32, device=fence.arena.device)
    return harness.graph_us_per_call([lambda: fence.copy_in(gate)] * n, reps)


def main() -> None:
    args = harness.parse_args(__doc__)
    dev = torch.device("cuda")
    stock = DsparkVerifyEpilogue(
        max_bs=MAX_BS, verify_num_draft_tokens=STRIDE, device=dev, tp_sync=_NoTpSync()
    )
    fenced = DsparkVerifyEpilogue(
        max_bs=MAX_BS,
        verify_num_draft_tokens=STRIDE,
        device=dev,
        tp_sync=_NoTpSync(),
        result_fence=True,
    )
    fence = fenced.result_fence
    ring_gpu = _ring_gpu_us(fence)
    # Host-only timing consumes slots no copy wrote: the drift check runs (its cost is in
    # the figure) but its verdict is ignored.
    fence._verify = lambda device_count, host_count: None
    rows = []
    for bs in (1, 4, 64):
        variants = {
            "stock views": (lambda: stock.read_accept(bs), None),
            "clone each (6)": (lambda: _clone_each(stock, bs), "eager"),
            "arena snapshot": (lambda: _arena_snapshot(fence, bs), "eager"),
            "ring (in-graph copy)": (lambda: fence.snapshot(bs), "graph"),
        }
        base_host = None
        for name, (fn, gpu_kind) in variants.items():
            for _ in range(50):
                fn()
            host = _host_us(fn)
            gpu = {None: 0.0, "eager": None, "graph": ring_gpu}[gpu_kind]
            if gpu is None:
                gpu = _gpu_us(fn)
            base_host = host if base_host is None else base_host
            nbytes = 0 if gpu_kind is None else 2 * fence.nbytes
            rows.append(
                {
                    "bs": bs,
                    "variant": name,
                    "host_us": host,
                    "extra_host_us": host - base_host,
                    "gpu_us": gpu,
                    "bytes": nbytes,
                    "floor_us": harness.floor_us(nbytes),
                }
            )
    harness.report(
        "folded_result_fence",
        ["bs", "variant", "host_us", "extra_host_us", "gpu_us", "bytes", "floor_us"],
        rows,
        args.out,
        {
            "max_bs": MAX_BS,
            "stride": STRIDE,
            "arena_bytes": fence.nbytes,
            "note": "host_us: issue cost per step with the GPU busy; gpu_us: per step, 200 "
            "back to back (ring: 200 in-graph copies per replay); the ring's host "
            "figure includes its drift check (read-back every 64 steps)",
        },
        overwrite=args.overwrite,
    )


if __name__ == "__main__":
    main()
