"""--speculative-dspark-draft-temperature-scale: per-step cost and alpha(tau).

Cost: the draft's params are staged on the host before the draft graph replay, only when
the batch's sampling tensors change; tau != 1 adds one multiply into the draft's buffer
and one in-place multiply of the step temperatures there (nothing inside any graph).
Measured: host and GPU microseconds of stage_sampling_params, stock vs tau = 0.8, bs 1/4/64.
alpha(tau) = E sum_v min(p_T(v), q_{tau T}(v)) on synthetic logits (target ~ N(0, 2^2) over
a 129280 vocab, draft = target + N(0, 1) noise): a shape, not a forecast; real gains need
the real draft and target logits.
"""

from __future__ import annotations

import statistics
import sys
import time
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools" / "standins"))
sys.path.insert(0, str(REPO / "benchmark"))

import harness  # noqa: E402
import torch  # noqa: E402

from sglang.srt.speculative.dspark_components import dspark_draft_tau  # noqa: E402
from sglang.srt.speculative.dspark_components.dspark_draft_sampler import (  # noqa: E402
    DsparkDraftSampler,
)


def _sampler(tau: float):
    dspark_draft_tau.draft_temperature_scale = lambda: tau
    model = types.SimpleNamespace(
        markov_head=None, sample_from_anchor=False, confidence_head=None
    )
    return DsparkDraftSampler(
        model=model,
        gamma=5,
        max_bs=64,
        device="cuda",
        noise=None,
        tp_sync=None,
        greedy_draft=False,
    )


def _time(fn, n=200, reps=15):
    host, gpu = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
            enable_timing=True
        )
        s.record()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        host.append((time.perf_counter() - t0) / n * 1e6)
        e.record()
        e.synchronize()
        gpu.append(s.elapsed_time(e) * 1e3 / n)
    return statistics.median(host), statistics.median(gpu)


def main() -> None:
    args = harness.parse_args(__doc__)
    rows = []
    for bs in (1, 4, 64):
        info = types.SimpleNamespace(
            temperatures=torch.rand(bs, device="cuda") + 0.3,
            top_ks=torch.full((bs,), 1 << 30, device="cuda"),
        )
        base = None
        for tau in (1.0, 0.8):
            s = _sampler(tau)
            f = lambda: s.stage_sampling_params(bs=bs, sampling_info=info)  # noqa: E731
            for _ in range(20):
                f()
            host, gpu = _time(f)
            base = base or (host, gpu)
            rows.append(
                {
                    "what": "stage params",
                    "bs": bs,
                    "tau": tau,
                    "host_us": host,
                    "gpu_us": gpu,
                    "extra_host_us": host - base[0],
                    "extra_gpu_us": gpu - base[1],
                    "alpha": 0.0,
                }
            )
    gen = torch.Generator(device="cuda").manual_seed(7)
    zp = torch.randn(64, 129280, device="cuda", generator=gen) * 2.0
    zq = zp + torch.randn(64, 129280, device="cuda", generator=gen)
    for T in (0.6, 1.0):
        p = torch.softmax(zp / T, -1)
        for tau in (0.5, 0.8, 1.0, 1.25):
            q = torch.softmax(zq / (tau * T), -1)
            alpha = float(torch.minimum(p, q).sum(-1).mean())
            rows.append(
                {
                    "what": f"alpha synthetic T={T}",
                    "bs": 64,
                    "tau": tau,
                    "host_us": 0.0,
                    "gpu_us": 0.0,
                    "extra_host_us": 0.0,
                    "extra_gpu_us": 0.0,
                    "alpha": alpha,
                }
            )
    harness.report(
        "draft_tau",
        [
            "what",
            "bs",
            "tau",
            "host_us",
            "gpu_us",
            "extra_host_us",
            "extra_gpu_us",
            "alpha",
        ],
        rows,
        args.out,
        {
            "note": "staging runs only when the batch's sampling tensors change; "
            "alpha on synthetic logits, real gains need real logits"
        },
        overwrite=args.overwrite,
    )


if __name__ == "__main__":
    main()
