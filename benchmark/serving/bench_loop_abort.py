"""--enable-loop-abort: host cost per generated token of ``Req.update_finish_state``, stock and on.

One process, the same token stream for both: real ``Req`` objects (the engine's own
``update_finish_state``) fed one token per call, as a decode step does. The stream is English
text (Python's ``pydoc_data`` topics, word-level ids), so nothing loops and the guard pays its
full tracking cost to the end. Rows: output length 1k..32k tokens x (max period, min tokens):
the cost per token stays flat in the length (amortized O(1), no rescan), and a rescan of every
period per token is timed beside it for scale. CPU only (no GPU work is involved); the JSON is
named after the device the host sits beside: ``loop_abort-cpu.json`` on a CPU machine.
"""

from __future__ import annotations

import argparse
import platform
import re
import statistics
import sys
import time
from array import array
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from e2e.provenance import add_overwrite_arg, write_result  # noqa: E402


def corpus_ids(n: int) -> list[int]:
    from pydoc_data import topics

    words = re.findall(r"\w+|[^\w\s]|\s+", "\n\n".join(topics.topics.values()))
    vocab: dict[str, int] = {}
    ids = [vocab.setdefault(w, len(vocab)) + 10 for w in words]
    return (ids * (n // len(ids) + 1))[:n]


def make_req(tokens: int, limits):
    from sglang.srt.managers.loop_abort import LoopAbort
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    sp = SamplingParams(max_new_tokens=tokens + 1, temperature=0)
    sp.normalize(None)
    req = Req(
        "bench", "", array("q", [1, 2, 3]), sp, vocab_size=1 << 20, eos_token_ids={2}
    )
    if limits is not None:
        LoopAbort(*limits).attach(req)
    return req


def ns_per_token(stream: list[int], limits) -> float:
    req = make_req(len(stream), limits)
    out, update = req.output_ids, req.update_finish_state
    t0 = time.perf_counter_ns()
    for tok in stream:
        out.append(tok)
        update(1)
    dt = time.perf_counter_ns() - t0
    assert not req.finished(), req.finished_reason
    return dt / len(stream)


def rescan_ns_per_token(stream: list[int], p_max: int, n_min: int) -> float:
    """For scale: per token, the periodic tail of every period 1..P (what the guard avoids)."""
    out = array("q")
    t0 = time.perf_counter_ns()
    for tok in stream:
        out.append(tok)
        i = len(out) - 1
        for p in range(1, p_max + 1):
            k = i
            while k - p >= 0 and out[k] == out[k - p] and i - k + p < n_min:
                k -= 1
    return (time.perf_counter_ns() - t0) / len(stream)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmark/results"))
    ap.add_argument("--repeats", type=int, default=5)
    args = add_overwrite_arg(ap).parse_args()
    rows = []
    for limits in ((128, 512), (32, 128)):
        for length in (1024, 8192, 32768):
            stream = corpus_ids(length)
            stock, on = [], []
            for _ in range(args.repeats):  # interleaved, so drift hits both alike
                stock.append(ns_per_token(stream, None))
                on.append(ns_per_token(stream, limits))
            s, o = statistics.median(stock), statistics.median(on)
            rows.append(
                {
                    "max_period": limits[0],
                    "min_tokens": limits[1],
                    "output_tokens": length,
                    "stock_ns_per_token": round(s),
                    "on_ns_per_token": round(o),
                    "added_ns_per_token": round(o - s),
                    "stock_min_ns_per_token": round(min(stock)),
                    "on_min_ns_per_token": round(min(on)),
                    "added_min_ns_per_token": round(min(on) - min(stock)),
                    "rescan_ns_per_token": round(
                        rescan_ns_per_token(stream[:4096], *limits)
                    ),
                }
            )
            print(rows[-1], flush=True)
    device = (
        torch.cuda.get_device_name().replace(" ", "_")
        if torch.cuda.is_available()
        else "cpu"
    )
    path = write_result(
        args.out / f"loop_abort-{device}.json",
        {
            "benchmark": "loop_abort",
            "device": device,
            "cpu": platform.processor() or platform.machine(),
            "python": sys.version.split()[0],
            "repeats": args.repeats,
            "what": "host ns per generated token of Req.update_finish_state (one token per call; medians and "
            "minimums over the repeats, stock and on interleaved), "
            "non-looping English word stream; stock = no guard, on = --enable-loop-abort; "
            "rescan = every period 1..P checked per token (reference, not served)",
            "rows": rows,
        },
        overwrite=args.overwrite,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
