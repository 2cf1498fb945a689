"""The end-to-end matrix: one real ``launch_server`` per row, DeepSeek-V4 + DSpark, every fork flag.

    python -m e2e.matrix --out DIR [--rows off,cap3,...] [--standins] [--budget SECONDS]

Each row starts the server on a tiny generated checkpoint (``e2e.checkpoints``), waits for it,
sends requests over HTTP, stops it and checks its log. Per row:

* the fork-flags startup line carries the values the row set; the log shows no error;
* greedy: 16 fixed prompts x 64 new tokens through ``/generate`` (and one through
  ``/v1/completions``): on the agree checkpoint the tokens must equal the flags-off row's and the
  row served without speculative decoding; on random weights only the rows that promise upstream's
  bits must (``Row.identical_to``), the others record their first differing token;
* sampled: 2000 requests at temperature 1 (fixed seeds), 4 new tokens: the distribution of the
  tokens at positions 2..4 (drafted and verified, not the prefill's) must agree with the
  flags-off row by a chi-square two-sample test; the same test is shown to reject a deliberately
  broken rule on the flags-off server (the target sampled at 0.7 T: what applying tau to the
  target's temperature would do);
* DSpark statistics (drafts accepted per verify step) and decode throughput.

Rows on the real-shape checkpoint time decode at batch 1, 4 and 16 instead (``timing`` rows).
Results: ``DIR/e2e-<device>.json`` and one log per row. ``--standins`` adds the H200 harness
(functional stand-ins for binary packages that do not load there, and the switches that keep the
model off them); without it the check runs on a GPU machine with upstream's real dependencies.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .checkpoints import REAL_SHAPE_DSV4, TINY_DSV4, write_dsv4
from .server import Server, ServerDied, refusal

HERE = Path(__file__).resolve().parent
STANDINS = [HERE / "standins", HERE.parent / "standins"]

# The switches that keep a tiny bf16 DeepSeek-V4 at TP1 off binary packages the H200 harness
# does not have (DeepGEMM, TileLang mHC, FlashInfer MoE, the Rust radix tree).
HARNESS_ENV = {
    "SGLANG_ENABLE_JIT_DEEPGEMM": "0",
    "SGLANG_FP8_PAGED_MQA_LOGITS_TORCH": "1",
    "SGLANG_OPT_DEEPGEMM_HC_PRENORM": "0",
    "SGLANG_OPT_USE_TILELANG_MHC_PRE": "0",
    "SGLANG_OPT_USE_TILELANG_MHC_POST": "0",
    "SGLANG_OPT_FUSE_MHC_POST_PRE": "0",
    "SGLANG_OPT_FLASHMLA_SPARSE_PREFILL": "0",
    "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python",
    "SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK": "1",  # the sgl_kernel stand-in has no package metadata
}
SERVE_ARGS = [
    "--moe-runner-backend",
    "triton",
    "--speculative-moe-runner-backend",
    "triton",
    "--sampling-backend",
    "pytorch",
    "--dsa-topk-backend",
    "torch",
    "--max-running-requests",
    "32",
    "--cuda-graph-backend-prefill",
    "disabled",
    "--cuda-graph-bs-decode",
    "1",
    "2",
    "4",
    "8",
    "16",
    "32",
]
DSPARK = ["--speculative-algorithm", "DSPARK"]
TIMING_ARGS = [
    "--cuda-graph-bs-decode",
    "1",
    "4",
    "16",
    "--max-running-requests",
    "16",
]  # the batches timed
PROGRESS_LOCK = threading.Lock()
# Startup lines in which a fork feature says what it built (kept in the report as evidence).
FEATURE_LINE = re.compile(
    r"--dsv4-wo-a-fp8-twin=|DSpark draft LM head in fp8|DSpark verify cap on|fence|"
    r"draft temperature|fast_load: read"
)
# Memory per server. Several tiny servers share the GPU: a server's KV budget is the memory free
# after its load minus (1 - fraction) of the memory free before it, so a neighbour loading in
# between shrinks it; a fraction of one half leaves room for that, and the token cap keeps the pool
# itself small. The real-shape rows run alone.
_TINY_MEM_ARGS = ["--mem-fraction-static", "0.5", "--max-total-tokens", "262144"]
MEM_ARGS = {
    "agree": _TINY_MEM_ARGS,
    "random": _TINY_MEM_ARGS,
    "real": ["--mem-fraction-static", "0.3"],
}
EAGER = ["--cuda-graph-backend-decode", "disabled"]

GREEDY_PROMPTS = [
    "The quick brown fox",
    "Hello, world",
    "0123456789",
    "def f(x):",
    "Once upon a time",
    "SGLang serves",
    "DeepSeek-V4 with DSpark",
    "abcdefghijklmnop",
    "To be or not to be",
    '{"key": [1, 2, 3]}',
    "GPU",
    "e",
    "Lorem ipsum dolor sit amet",
    "#include <stdio.h>",
    "  indented",
    "The end.",
]
GREEDY_TOKENS = 64
SAMPLED_PROMPT = "The quick brown fo"  # codespell:ignore
SAMPLED_REQUESTS = 2000
SAMPLED_TOKENS = 4
SAMPLED_POSITIONS = (
    1,
    2,
    3,
)  # 0-based positions of emitted tokens compared; 0 comes from prefill
P_MIN = (
    1e-4  # per-position chi-square p-value below which a row's distribution is refused
)


@dataclasses.dataclass
class Row:
    name: str
    args: list[str]
    model: str = "agree"  # agree | random | real
    sampled: bool = True
    timing: bool = False
    refused_with: str | None = (
        None  # a start that must be refused, with this text in its output
    )
    flags: dict[str, str] = dataclasses.field(
        default_factory=dict
    )  # fork flag -> value in the startup line
    # Rows whose greedy tokens this row's must equal. On the agree checkpoint: flags off and no
    # speculation. On random weights only rows that share the verify shapes and promise bit-exact
    # kernels compare: there upstream's DSpark with every fork flag off already leaves
    # non-speculative greedy after 17..56 tokens in 13 of 16 prompts (a verify forward of 6 rows is
    # not bit-identical to a decode forward of 1 on near-tied logits), the wo_a twin's levels give
    # rounding-level differences on Hopper (upstream runs those calls through cuBLAS there; the
    # twin's small kernel has the bits of upstream's Blackwell kernel), and a cap changes the
    # verify shape. Those rows record where they differ.
    identical_to: tuple[str, ...] = ("off", "nospec")


def _row(
    name, *flag_args, model="agree", extra=(), sampled=True, spec=True, **kw
) -> Row:
    flags = {}
    args = list(flag_args)
    i = 0
    while i < len(args):
        if i + 1 < len(args) and not args[i + 1].startswith("--"):
            flags[args[i]] = args[i + 1]
            i += 2
        else:
            flags[args[i]] = "True"
            i += 1
    return Row(
        name,
        (DSPARK if spec else []) + args + list(extra),
        model=model,
        sampled=sampled,
        flags=flags,
        **kw,
    )


ALL_ON = [
    "--dsv4-wo-a-fp8-twin",
    "drop",
    "--speculative-dspark-verify-cap",
    "conf:0.1",
    "--speculative-dspark-fence-accept-results",
    "--speculative-dspark-draft-temperature-scale",
    "0.7",
    "--speculative-dspark-draft-head-fp8",
    "--speculative-use-block-verification",
]


def rows() -> list[Row]:
    return [
        _row("off"),
        _row("nospec", spec=False, sampled=False),
        _row("wo_a_small", "--dsv4-wo-a-fp8-twin", "small"),
        _row("wo_a_mid", "--dsv4-wo-a-fp8-twin", "mid"),
        _row("wo_a_drop", "--dsv4-wo-a-fp8-twin", "drop"),
        _row("cap_3", "--speculative-dspark-verify-cap", "3"),
        _row("cap_conf", "--speculative-dspark-verify-cap", "conf:0.1"),
        _row("fence", "--speculative-dspark-fence-accept-results"),
        _row("tau_0.7", "--speculative-dspark-draft-temperature-scale", "0.7"),
        _row("head_fp8", "--speculative-dspark-draft-head-fp8"),
        # the target and the DSpark draft loaded through fast load (pinned slabs, their owners)
        _row(
            "fast_load",
            "--weight-loader-fast-load",
            "--weight-loader-fast-load-num-threads",
            "4",
            "--weight-loader-fast-load-slab-mb",
            "1",
        ),
        _row("block_verify", "--speculative-use-block-verification"),
        _row(
            "block_verify_cap",
            "--speculative-use-block-verification",
            "--speculative-dspark-verify-cap",
            "conf:0.1",
        ),
        # Serving control: the tiny model's greedy output cycles with a period far above 8, so
        # loop abort at P <= 8 must not fire (the same tokens with the flag on, no false positive).
        _row(
            "loop_abort",
            "--enable-loop-abort",
            "--loop-abort-max-period",
            "8",
            "--loop-abort-min-tokens",
            "24",
        ),
        _row(
            "thinking_aliases",
            "--enable-thinking-aliases",
            extra=["--reasoning-parser", "deepseek-v4"],
        ),
        _row("serial_load", "--weight-loader-disable-async-load"),
        _row("all_on", *ALL_ON),
        _row("off_eager", extra=EAGER),
        _row("all_on_eager", *ALL_ON, extra=EAGER),
        # Random weights: the draft rarely agrees, every output bit depends on every kernel.
        _row(
            "random_nospec", model="random", spec=False, sampled=False, identical_to=()
        ),
        _row("random_off", model="random", sampled=False, identical_to=()),
        _row(
            "random_wo_a_small",
            "--dsv4-wo-a-fp8-twin",
            "small",
            model="random",
            sampled=False,
            identical_to=(),
        ),
        _row(
            "random_fence",
            "--speculative-dspark-fence-accept-results",
            model="random",
            sampled=False,
            identical_to=("off",),
        ),
        _row("random_all_on", *ALL_ON, model="random", sampled=False, identical_to=()),
        Row(
            "refuse_wrong_build",
            DSPARK + ["--fork-expect-version", "0.5.23+fork.1.0000000"],
            refused_with="refusing to start another patch series",
        ),
        Row(
            "refuse_autotune_keep_tp1",
            DSPARK + ["--flashinfer-autotune-keep-cache"],
            refused_with="--tp-size 1 has no other rank to agree with",
        ),
        # The tiny checkpoints are DeepSeek-V4 (not V4.1) without Engram layers: both flags must
        # refuse them at startup (they serve V4.1 only; their GPU tests and benchmarks cover them).
        Row(
            "refuse_hc_fused_v4",
            DSPARK + ["--dsv4-hc-fused-stats", "auto"],
            refused_with="hc_pre_from_prev_sublayer is false",
        ),
        Row(
            "refuse_engram_prefetch",
            DSPARK + ["--engram-prefetch", "on"],
            refused_with="has no Engram layers",
        ),
        Row(
            "refuse_engram_fused_all_reduce",
            DSPARK + ["--engram-fused-all-reduce"],
            refused_with="--engram-fused-all-reduce does nothing at --tp-size 1",
        ),
        # The GB10 features refuse on this GPU and checkpoint, naming what they found.
        Row(
            "refuse_b12x_moe",
            DSPARK + ["--moe-runner-backend", "b12x"],
            refused_with="b12x kernels need SM120/SM121",
        ),
        Row(
            "refuse_b12x_mxfp8",
            DSPARK + ["--block-fp8-mxfp8-backend", "b12x"],
            refused_with="--block-fp8-mxfp8-backend b12x",
        ),
        Row(
            "refuse_b12x_roce",
            DSPARK + ["--enable-b12x-roce-all-gather"],
            refused_with="--enable-b12x-roce-all-gather does nothing with --tp 1",
        ),
        Row(
            "refuse_replicated_split_tp1",
            DSPARK + ["--replicated-linear-split", "wqkv_a,main_proj"],
            refused_with="--replicated-linear-split=wqkv_a,main_proj:96 does nothing with --tp 1",
        ),
        Row(
            "refuse_engram_store",
            DSPARK
            + ["--engram-row-store-dir", "/tmp", "--engram-row-store-cache-gib", "1"],
            refused_with="the model has no Engram tables",
        ),
        # DeepSeek-V4.1-Flash per-rank shapes at TP4: decode timing with the kernels on.
        _row("real_off", model="real", sampled=False, timing=True),
        _row(
            "real_wo_a_small",
            "--dsv4-wo-a-fp8-twin",
            "small",
            model="real",
            sampled=False,
            timing=True,
        ),
        _row(
            "real_head_fp8",
            "--speculative-dspark-draft-head-fp8",
            model="real",
            sampled=False,
            timing=True,
        ),
        _row(
            "real_cap_3",
            "--speculative-dspark-verify-cap",
            "3",
            model="real",
            sampled=False,
            timing=True,
        ),
        _row("real_all_on", *ALL_ON, model="real", sampled=False, timing=True),
    ]


# ---------------------------------------------------------------------------- requests


def greedy(server: Server, one_at_a_time: bool = False) -> dict:
    """The greedy prompts in one batch, or one request at a time.

    One at a time is for random weights: their logits have near ties, and upstream's kernels are not
    batch invariant (a prompt decoded beside fifteen others can take another token than alone, with
    every fork flag off), so only a fixed batch composition can be compared bit for bit.
    """
    params = {"temperature": 0, "max_new_tokens": GREEDY_TOKENS, "ignore_eos": True}
    t0 = time.perf_counter()
    if one_at_a_time:
        outs = [
            server.post("/generate", {"text": p, "sampling_params": params})
            for p in GREEDY_PROMPTS
        ]
    else:
        outs = server.post(
            "/generate", {"text": GREEDY_PROMPTS, "sampling_params": params}
        )
    seconds = time.perf_counter() - t0
    completion = server.post(
        "/v1/completions",
        {
            "model": "default",
            "prompt": GREEDY_PROMPTS[0],
            "temperature": 0,
            "max_tokens": GREEDY_TOKENS,
            "ignore_eos": True,
        },
    )
    return {
        "tokens": [o["output_ids"] for o in outs],
        "completion_matches_generate": completion["choices"][0]["text"]
        == outs[0]["text"],
        "batch_tokens_per_s": len(outs) * GREEDY_TOKENS / seconds,
        "spec": spec_stats(outs),
    }


def sampled(
    server: Server, temperature: float = 1.0, requests: int = SAMPLED_REQUESTS
) -> dict:
    tokens, metas = [], []
    for start in range(0, requests, 250):
        n = min(250, requests - start)
        outs = server.post(
            "/generate",
            {
                "text": [SAMPLED_PROMPT] * n,
                "sampling_params": [
                    {
                        "temperature": temperature,
                        "max_new_tokens": SAMPLED_TOKENS,
                        "ignore_eos": True,
                        "sampling_seed": start + i,
                    }
                    for i in range(n)
                ],
            },
        )
        tokens += [o["output_ids"] for o in outs]
        metas += outs
    return {"tokens": tokens, "spec": spec_stats(metas)}


def spec_stats(outs: list[dict]) -> dict | None:
    verify = sum(o["meta_info"].get("spec_verify_ct", 0) for o in outs)
    if not verify:
        return None
    correct = sum(o["meta_info"].get("spec_num_correct_drafts", 0) for o in outs)
    completion = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return {
        "verify_steps": verify,
        "accepted_drafts_per_step": correct / verify,
        "tokens_per_step": completion / verify,
    }


TIMING_REPEATS = 5


def timing(server: Server) -> dict:
    """Decode tokens/s and time per decode step at batch 1, 4 and 16 (128 greedy tokens each),
    the median of TIMING_REPEATS requests with every run's time kept (``ms_per_step_runs``): one
    request per batch size varied by up to 40 % between two runs of the same row on the H200.
    Each batch size is warmed up first with the same prompts: the first prefill and decode of a
    new batch shape compile kernels (Triton), which a timed request must not include."""
    out = {}
    for bs in (1, 4, 16):
        prompts = [f"{p} {bs}" for p in (GREEDY_PROMPTS * 2)[:bs]]
        server.post(
            "/generate",
            {
                "text": prompts,
                "sampling_params": {"temperature": 0, "max_new_tokens": 16},
            },
        )
        body = {
            "text": prompts,
            "sampling_params": {
                "temperature": 0,
                "max_new_tokens": 128,
                "ignore_eos": True,
            },
        }
        runs = []
        for _ in range(TIMING_REPEATS):
            t0 = time.perf_counter()
            outs = server.post("/generate", body)
            seconds = time.perf_counter() - t0
            stats = spec_stats(outs)
            steps = stats["verify_steps"] / bs if stats else 128
            runs.append((1e3 * seconds / steps, bs * 128 / seconds, stats))
        ms, tokens_per_s, stats = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
        out[f"bs{bs}"] = {
            "tokens_per_s": tokens_per_s,
            "ms_per_step": ms,
            "spec": stats,
            "ms_per_step_runs": [round(r[0], 3) for r in runs],
        }
    return out


PROFILE_TOKENS = 64
PROFILE_TOP = 25


def profile(server: Server, out_dir: Path) -> dict:
    """The GPU kernels of one batch-1 request of PROFILE_TOKENS greedy tokens, through upstream's
    ``/start_profile`` (torch profiler, GPU activity only; CUDA-graph replays included): time per
    kernel name summed, the top PROFILE_TOP kept. The trace itself is deleted (megabytes).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    server.post_text(
        "/start_profile",
        {
            "output_dir": str(out_dir),
            "activities": ["GPU"],
            "with_stack": False,
            "record_shapes": False,
            "profile_id": "row",
        },
    )
    outs = [
        server.post(
            "/generate",
            {
                "text": GREEDY_PROMPTS[0],
                "sampling_params": {
                    "temperature": 0,
                    "max_new_tokens": PROFILE_TOKENS,
                    "ignore_eos": True,
                },
            },
        )
    ]
    server.post_text("/stop_profile", {})
    traces = sorted(out_dir.glob("*.trace.json.gz"))
    if not traces:
        raise RuntimeError(f"/stop_profile wrote no trace under {out_dir}")
    summary = kernel_summary(traces[0])
    summary["spec"] = spec_stats(outs)
    for t in traces:
        t.unlink()
    return summary


def kernel_summary(trace: Path, top: int = PROFILE_TOP) -> dict:
    """Sum a chrome trace's GPU kernel events (``cat`` kernel) by name: total microseconds, the
    kernel count and the ``top`` names by time (share of the total). ``span_us`` runs from the
    first kernel's start to the last one's end; ``gpu_busy`` is the share of it covered by at
    least one kernel (overlapping streams counted once): a step that got slower while its
    kernels did not shows up as idle GPU time, i.e. time spent on the host."""
    import gzip

    with gzip.open(trace, "rt") as f:
        events = json.load(f).get("traceEvents", [])
    by_name: dict[str, list[float]] = {}
    spans = []
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "kernel":
            t = by_name.setdefault(e.get("name", "?"), [0.0, 0])
            t[0] += float(e.get("dur", 0.0))
            t[1] += 1
            if "ts" in e:
                spans.append(
                    (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))
                )
    total = sum(t[0] for t in by_name.values())
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    busy, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        busy += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    span = (max(e for _, e in spans) - min(s for s, _ in spans)) if spans else 0.0
    return {
        "kernel_us": round(total, 1),
        "kernels": sum(t[1] for t in by_name.values()),
        "span_us": round(span, 1),
        "gpu_busy": round(busy / span, 4) if span else 0.0,
        "top": [
            {
                "name": n[:160],
                "us": round(t[0], 1),
                "calls": t[1],
                "share": round(t[0] / total, 4) if total else 0.0,
            }
            for n, t in ranked
        ],
    }


def chi2_same(a: list[list[int]], b: list[list[int]]) -> dict:
    """Chi-square two-sample test per compared position; categories with < 5 expected merged."""
    from collections import Counter

    from scipy.stats import chi2_contingency

    result = {}
    for pos in SAMPLED_POSITIONS:
        ca, cb = Counter(t[pos] for t in a), Counter(t[pos] for t in b)
        total = len(a) + len(b)
        big = [
            k
            for k in set(ca) | set(cb)
            if (ca[k] + cb[k]) * min(len(a), len(b)) / total >= 5
        ]
        table = [
            [ca[k] for k in big] + [len(a) - sum(ca[k] for k in big)],
            [cb[k] for k in big] + [len(b) - sum(cb[k] for k in big)],
        ]
        if table[0][-1] + table[1][-1] == 0:
            table = [r[:-1] for r in table]
        p = 1.0 if len(table[0]) < 2 else float(chi2_contingency(table)[1])
        result[f"p_pos{pos}"] = p
    result["min_p"] = min(result.values())
    return result


# ---------------------------------------------------------------------------- driver


def fork_flags_line(log: str) -> str | None:
    return next((line for line in log.splitlines() if "fork flags:" in line), None)


def feature_lines(log: str, limit: int = 12) -> list[str]:
    """The startup lines in which a fork feature reports itself; not the command or the argument dump."""
    lines = [
        line.split("] ", 1)[-1]
        for line in log.splitlines()
        if FEATURE_LINE.search(line)
    ]
    return [
        line[:400] for line in lines if not line.startswith(("$ ", "server_args="))
    ][:limit]


def serve_row(
    row: Row, model: Path, env: dict, logs: Path, profiled: bool = False
) -> dict:
    """Start the row's server, send its requests, stop it: the raw record (tokens included).
    ``profiled``: a timing row also records its GPU kernels (``profile``) after timing.
    """
    rec: dict = {"args": row.args, "model": row.model}
    if row.refused_with:
        r = refusal(model, SERVE_ARGS + row.args, env=env)
        (logs / f"{row.name}.log").write_text(r.stdout)
        rec["refused"] = r.returncode != 0 and row.refused_with in r.stdout
        rec["exit_code"] = r.returncode
        return rec
    args = (
        SERVE_ARGS
        + MEM_ARGS[row.model]
        + (TIMING_ARGS if row.timing else [])
        + row.args
    )
    with Server(model, args, env=env, log_path=logs / f"{row.name}.log") as server:
        rec["startup_s"] = round(server.startup_seconds, 1)
        line = fork_flags_line(server.log()) or ""
        from sglang.fork import (
            fork_flags,  # upstream flags in a row (block verification) are not in the line
        )

        rec["fork_flags_line_ok"] = all(
            f"{flag}={value}" in line
            for flag, value in row.flags.items()
            if flag in fork_flags()
        )
        rec["fork_flags_line"] = line.split("fork flags: ", 1)[-1]
        if row.timing:
            rec["timing"] = timing(server)
            if profiled:
                rec["profile"] = profile(server, logs / f"{row.name}-profile")
        else:
            rec["greedy"] = greedy(server, one_at_a_time=row.model == "random")
        if row.sampled:
            rec["sampled"] = sampled(server)
            if (
                row.name == "off"
            ):  # the negative control: the target sampled at 0.7 T must be refused
                rec["sampled_target_at_0.7T"] = sampled(server, temperature=0.7)
    rec["log_errors"] = server.errors()[:20]
    rec["upstream_fallbacks"] = server.fallbacks()[:5]
    rec["feature_lines"] = feature_lines(server.log())
    rec["exit_code"] = server.proc.returncode
    return rec


def evaluate(name: str, rec: dict, recs: dict, identical_to: tuple[str, ...]) -> None:
    """Compare a served row with the rows of its checkpoint it must equal (``identical_to``: ``off``,
    ``nospec``); differences from the others are recorded, not failed. Sets ``ok``."""
    if "error" in rec:
        rec["ok"] = False
        return
    if "refused" in rec:
        rec["ok"] = rec["refused"]
        return
    prefix = "random_" if rec["model"] == "random" else ""
    checks = [rec["fork_flags_line_ok"], not rec["log_errors"]]
    if "greedy" in rec:
        tokens = rec["greedy"].pop("tokens")
        rec.setdefault("_tokens", tokens)
        for ref in ("off", "nospec"):
            other = recs.get(prefix + ref, {})
            other_tokens = other.get("_tokens") or other.get("greedy", {}).get("tokens")
            rec[f"greedy_identical_to_{ref}"] = (
                None if other_tokens is None else tokens == other_tokens
            )
            if (
                other_tokens is not None and tokens != other_tokens
            ):  # where: prompt -> first differing token
                rec[f"greedy_first_difference_from_{ref}"] = {
                    i: next(
                        (j for j, (x, y) in enumerate(zip(a, b)) if x != y),
                        min(len(a), len(b)),
                    )
                    for i, (a, b) in enumerate(zip(tokens, other_tokens))
                    if a != b
                }
            if ref in identical_to:
                checks.append(rec[f"greedy_identical_to_{ref}"] is not False)
        checks.append(rec["greedy"]["completion_matches_generate"])
    off_sampled = recs.get("off", {}).get("sampled", {}).get("tokens")
    if "sampled" in rec:
        rec["sampled_spec"] = rec["sampled"]["spec"]
        if off_sampled is not None and name != "off":
            rec["sampled_vs_off"] = chi2_same(rec["sampled"]["tokens"], off_sampled)
            checks.append(rec["sampled_vs_off"]["min_p"] >= P_MIN)
    if "sampled_target_at_0.7T" in rec and off_sampled is not None:
        rec["negative_control_target_at_0.7T"] = chi2_same(
            rec.pop("sampled_target_at_0.7T")["tokens"], off_sampled
        )
        checks.append(rec["negative_control_target_at_0.7T"]["min_p"] < P_MIN)
    rec["ok"] = all(checks)


def device_name() -> str:
    try:
        import torch

        return torch.cuda.get_device_name().replace(" ", "_")
    except Exception:
        return "cpu"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--rows", help="comma-separated row names (default: all)")
    p.add_argument(
        "--models", type=Path, default=Path("/tmp/e2e-models"), help="checkpoint cache"
    )
    p.add_argument(
        "--standins",
        action="store_true",
        help="the H200 harness: functional stand-ins + switches",
    )
    p.add_argument(
        "--budget", type=float, default=1e9, help="start no row after this many seconds"
    )
    p.add_argument("--parallel", type=int, default=4, help="servers at a time")
    p.add_argument(
        "--profile",
        default="",
        help="comma-separated timing rows that also record their GPU "
        "kernels for one batch-1 request (torch profiler through /start_profile)",
    )
    p.add_argument(
        "--merge",
        type=Path,
        help="an earlier run's JSON (same build and device): its rows that "
        "this run does not serve are kept, so a matrix can be served in several sittings",
    )
    args = p.parse_args(argv)

    t_start = time.monotonic()
    selected = [r for r in rows() if not args.rows or r.name in args.rows.split(",")]
    profiled = {name for name in args.profile.split(",") if name}
    unknown = sorted(profiled - {r.name for r in selected if r.timing})
    if unknown:
        p.error(
            f"--profile: {', '.join(unknown)} is not a timing row of this run "
            f"(timing rows: {', '.join(r.name for r in rows() if r.timing)})"
        )
    logs = args.out / "e2e-logs"
    logs.mkdir(parents=True, exist_ok=True)
    env = {"PYTHONUNBUFFERED": "1"}
    if args.standins:
        env.update(HARNESS_ENV)
        env["PYTHONPATH"] = os.pathsep.join(
            [*map(str, STANDINS), os.environ.get("PYTHONPATH", "")]
        )
    models = {}
    for name, agree, shape, seed in (
        ("agree", True, TINY_DSV4, 0),
        ("random", False, TINY_DSV4, 1),
        ("real", False, REAL_SHAPE_DSV4, 2),
    ):
        if any(r.model == name for r in selected):
            path = args.models / name
            if not (path / "model.safetensors").exists():
                t0 = time.monotonic()
                write_dsv4(
                    path, agree=agree, shape=shape, seed=seed, device=_gen_device()
                )
                print(
                    f"==> wrote the {name} checkpoint in {time.monotonic() - t0:.0f} s",
                    flush=True,
                )
            models[name] = path

    from sglang.fork import fork_version

    report = {
        "fork_version": fork_version(),
        "device": device_name(),
        "standins": args.standins,
        "rows": {},
    }
    out_json = args.out / f"e2e-{report['device']}.json"
    recs: dict = {}

    def one(row: Row) -> None:
        if time.monotonic() - t_start > args.budget:
            recs[row.name] = {"skipped": "over the time budget"}
            return
        print(f"==> {row.name}: {' '.join(row.args)}", flush=True)
        t0 = time.monotonic()
        try:
            rec = serve_row(
                row, models[row.model], env, logs, profiled=row.name in profiled
            )
        except (ServerDied, RuntimeError, OSError, KeyError, ValueError) as e:
            rec = {
                "model": row.model,
                "error": f"{type(e).__name__}: {str(e).splitlines()[0]}",
            }
        rec["seconds"] = round(time.monotonic() - t0, 1)
        recs[row.name] = rec
        with (
            PROGRESS_LOCK
        ):  # a progress file, so a run cut short still says what served
            (args.out / "e2e-progress.json").write_text(
                json.dumps(
                    {
                        k: {
                            "seconds": v.get("seconds"),
                            "error": v.get("error"),
                            "startup_s": v.get("startup_s"),
                            "log_errors": v.get("log_errors"),
                            "spec": (v.get("greedy") or {}).get("spec"),
                            "sampled_spec": (v.get("sampled") or {}).get("spec"),
                        }
                        for k, v in list(recs.items())
                    },
                    indent=1,
                )
            )
        print(
            f"<== {row.name} served in {rec['seconds']} s"
            + (f": {rec['error']}" if "error" in rec else ""),
            flush=True,
        )

    # Correctness rows share the GPU a few servers at a time, after the first one has run alone (it
    # fills the JIT and Triton caches the others read). Timing rows run alone, one after another: a
    # server sizes its KV pool from the memory it sees, which a neighbour's loading would skew.
    shared = [r for r in selected if not r.timing]
    if shared:
        one(shared[0])
    with ThreadPoolExecutor(max(1, args.parallel)) as pool:
        list(pool.map(one, shared[1:]))
    for row in selected:
        if row.timing:
            one(row)

    for row in selected:  # references first, so every row compares against them
        rec = recs[row.name]
        if "skipped" in rec:
            report["rows"][row.name] = {"ok": None, **rec}
            continue
        evaluate(row.name, rec, recs, row.identical_to)
    for row in selected:
        rec = recs[row.name]
        rec.pop("_tokens", None)
        rec.get("sampled", {}).pop("tokens", None)
        report["rows"][row.name] = rec
        if rec.get("ok") is False:
            print(
                f"FAILED {row.name}: "
                + _failure_excerpt(rec, logs / f"{row.name}.log"),
                flush=True,
            )
    if args.merge:
        merge_rows(report, json.loads(args.merge.read_text()))
    done = [r for r in report["rows"].values() if r.get("ok") is not None]
    report["passed"] = sum(bool(r["ok"]) for r in done)
    report["failed"] = len(done) - report["passed"]
    out_json.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{report['passed']} passed, {report['failed']} failed")
    return 0 if report["failed"] == 0 else 1


def merge_rows(report: dict, earlier: dict) -> None:
    """Keep ``earlier``'s rows that ``report`` did not serve; refuses another build or device (a
    row's comparisons are only meaningful within one build on one device)."""
    for key in ("fork_version", "device", "standins"):
        if earlier.get(key) != report[key]:
            raise SystemExit(
                f"--merge: the earlier run's {key} is {earlier.get(key)!r}, this run's {report[key]!r}"
            )
    for name, rec in earlier["rows"].items():
        if name not in report["rows"] or report["rows"][name].get("ok") is None:
            report["rows"][name] = rec


def _failure_excerpt(rec: dict, log: Path, lines: int = 45) -> str:
    """What a failed row shows on the console: its checks and the end of its log, warnings left out."""
    summary = {k: v for k, v in rec.items() if k not in ("args", "fork_flags_line")}
    text = log.read_text(errors="replace").splitlines() if log.exists() else []
    text = [
        t for t in text if "warn" not in t.lower() and not t.lstrip().startswith("^")
    ]
    return json.dumps(summary)[:2000] + "\n" + "\n".join(t[:300] for t in text[-lines:])


def _gen_device() -> str:
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


if __name__ == "__main__":
    sys.exit(main())
