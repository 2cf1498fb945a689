"""How the fork measures on a GPU: stock and ours in one process, CUDA-graph replay over enough
distinct weights that they stream from HBM (43 layers as in DeepSeek-V4.1; the H200's L2 is
60 MB), median of many replays, achieved bandwidth and the floor from bytes beside each time.
Every benchmark prints a table and writes JSON named after itself and the device, through
``write_result`` (tools/e2e/provenance.py): each result carries its ``provenance`` block (fork
build, device, torch, triton, python, harness commit), and a rerun by another build never silently replaces a
result that docs cite (``--overwrite``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Callable, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from e2e.provenance import add_overwrite_arg  # noqa: E402
from e2e.provenance import write_result  # noqa: E402
from e2e.provenance import device_name as detected_device  # noqa: E402

LAYERS = 43
HBM_TBPS = 4.09  # measured read bandwidth of the H200 (shared/notes/gpu-h200.md); the floor's divisor


def arg_parser(description: str, replays: int = 30) -> argparse.ArgumentParser:
    """Every benchmark's command line: ``--out`` (the JSON's folder), ``--replays`` and
    ``--overwrite`` (``write_result``)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument(
        "--out",
        type=Path,
        default=Path("benchmark/results"),
        help="folder for the JSON",
    )
    p.add_argument("--replays", type=int, default=replays)
    return add_overwrite_arg(p)


def parse_args(description: str) -> argparse.Namespace:
    return arg_parser(description).parse_args()


def graph_us_per_call(
    calls: Sequence[Callable[[], object]], replays: int = 30
) -> float:
    """Median time of one call when ``calls`` (one per layer) run back to back in a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:  # warm up: compile and autotune outside the graph
            call()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
            enable_timing=True
        )
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return statistics.median(times)


def floor_us(nbytes: int) -> float:
    return nbytes / (HBM_TBPS * 1e12) * 1e6


def tbps(nbytes: int, us: float) -> float:
    return nbytes / (us * 1e-6) / 1e12


def device_name() -> str:
    """The device as a file-name part: ``NVIDIA_H200``, or ``cpu-<N>core`` without CUDA."""
    return detected_device().replace(" ", "_")


def report(
    name: str,
    columns: Sequence[str],
    rows: list[dict],
    out: Path,
    meta: dict,
    overwrite: bool = False,
) -> Path:
    """Print ``rows`` as a table and write ``<name>-<device>.json`` in ``out`` through
    ``write_result``; returns the path written (beside the usual name when another build's
    cited result is there and ``overwrite`` is false)."""
    widths = [max(len(c), *(len(_fmt(r[c])) for r in rows)) for c in columns]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(_fmt(r[c]).rjust(w) for c, w in zip(columns, widths)))
    payload = {
        "benchmark": name,
        "device": detected_device(),
        "torch": torch.__version__,
        **meta,
        "rows": rows,
    }
    path = write_result(
        out / f"{name}-{device_name()}.json", payload, overwrite=overwrite
    )
    print(f"wrote {path}")
    return path


def _fmt(v) -> str:
    return f"{v:.2f}" if isinstance(v, float) else str(v)
