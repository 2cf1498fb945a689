"""Side-by-side decode timing at full depth: unpatched upstream and the fork, served at once.

    python -m e2e.matrix --side-by-side all_on[,wo_a_mid,...] --out DIR [--standins]
        --upstream PATH [--sbs-batches 1,4,8,16,32] [--sbs-repeats 10] [--sbs-profile 1,32]

Two real ``launch_server`` processes share the GPU for the whole measurement: upstream's release
(``--upstream PATH``, the tree the matrix's ``up_*`` rows serve) with DSpark, and the fork with one
flag set (``FLAG_SETS``). Upstream stays up; the flag sets run one after another against it, one
fork server at a time, so never more than two servers hold the GPU. Both serve the full-depth
checkpoint (``checkpoints.FULL_DEPTH_DSV4``: DeepSeek-V4.1-Flash widths at TP1, 43 layers, 3
draft stages, block-fp8 dense linears, a draft that agrees in runs of 2 and 3 tokens), written
from a seed on the GPU machine.

Per batch size (``bs`` concurrent requests, one ``/generate`` of ``bs`` prompts as token ids,
greedy, ``--sbs-tokens`` output tokens with ``ignore_eos``): one warm-up request on each server (it
compiles the batch's kernels), then ``--sbs-repeats`` interleaved pairs, the first of each pair
alternating (upstream, fork | fork, upstream | ...: ``interleave_order``), so a slow drift of the
machine falls on both sides alike; ``step_ratio_by_order`` shows whether the order mattered.
A request is timed from its POST to its answer; its **decode step time** is that wall time over
the verify steps a request took (``spec_verify_ct`` of the server's answer, summed over the
batch, over ``bs``), so it includes the prefill of the batch and the HTTP round trip, once per
request, on both sides alike; output tokens/s is ``bs x tokens`` over the wall time. Per
repeat, the ratio fork / upstream of each (step time: below 1 is faster; tokens/s: above 1 is
faster), with a 95 % t-interval and a bootstrap percentile interval of the mean ratio
(``ratio_summary``). Greedy tokens are held to the matrix's rule for the agree
checkpoints: identical to upstream's (``tokens_identical``), every repeat.

``--sbs-profile 1,32`` also records, at those batch sizes, both servers' GPU kernels of one
request (upstream's ``/start_profile``, ``matrix.profile``), one server after the other, and
attributes the change: kernel names grouped (``KERNEL_GROUPS``), time per decode step of each
group on each side, and the sum of the groups' savings beside the measured step change
(``attribute``). The JSON, ``DIR/e2e-full-depth-<device>.json``, carries the provenance block
(build, device, torch, triton, harness commit), per batch the cost model's command for that measurement, and
the judging rule's verdict per flag set x batch (``noninferiority``): the fork's time per output
token over upstream's, its one-sided 95 % upper bound below 1 + ``DELTA``, no upward drift, and
exactly the pairs its plan fixed before the run (``--sbs-plan``). A cell that has not passed is
in the report's ``not_noninferior``, and the fork must not serve that flag set at that batch.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import random
import re
import signal
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .checkpoints import (
    FULL_DEPTH_DRAFT_RUNS,
    FULL_DEPTH_DSV4,
    checkpoint_written,
    write_dsv4,
)
from .provenance import write_result
from .server import Server, ServerDied

TWIN_MID = ["--dsv4-wo-a-fp8-twin", "mid"]
HEAD_FP8 = ["--speculative-dspark-draft-head-fp8"]
CAP_3 = ["--speculative-dspark-verify-cap", "3"]
# wo_a_head: the two kernel flags, every site of which the cost model has a measured saving for
# (the cap's is measured at DeepSeek-V4's expert shape only), so its prediction can be checked.
FLAG_SETS = {
    "wo_a_mid": TWIN_MID,
    "head_fp8": HEAD_FP8,
    "cap_3": CAP_3,
    "wo_a_head": TWIN_MID + HEAD_FP8,
    "all_on": TWIN_MID + HEAD_FP8 + CAP_3,
}
BATCHES = (1, 4, 8, 16, 32)
REPEATS = 10
OUTPUT_TOKENS = 64
CHECKPOINT_SEED = 5
# Two servers of ~37 GB of weights each (fp8 experts; ~50 GB with bf16 experts; the Hopper bf16
# copies upstream keeps of its block-fp8 dense weights included) start together: each sizes its KV
# pool as the memory free after its load minus 15 % of the memory free before it (both loaded, fp8:
# ~67 GB free, ~46 GB left; bf16: ~41 GB free, ~20 GB left), and the token cap keeps the pool
# itself small (32 requests x ~100 tokens need ~3,200), so the fraction reserves nothing.
MEM_ARGS = ["--mem-fraction-static", "0.85", "--max-total-tokens", "65536"]
GRAPH_ARGS = ["--cuda-graph-bs-decode", *map(str, BATCHES)] + [
    "--max-running-requests",
    str(max(BATCHES)),
]
# Upstream reads DeepSeek-V4 routed experts as MXFP4 unless told or unless it recognizes e4m3 in the
# checkpoint; the full-depth checkpoint's experts are e4m3 or bf16, never MXFP4 (both servers).
SERVE_ENV = {"SGLANG_DSV4_FP4_EXPERTS": "0"}
# Kernel names -> groups, first match wins (case-insensitive). The stock wo_a on Hopper is a
# torch einsum: its cuBLAS kernel lands in "gemm" with the LM heads' and other bf16 GEMMs.
KERNEL_GROUPS = (
    ("wo_a", r"wo_a"),
    ("draft_head_fp8", r"draft_head"),
    ("moe", r"fused_moe|moe|expert"),
    ("fp8_gemm", r"w8a8|block_fp8"),
    ("act_quant", r"quant"),
    ("attention", r"flash_?mla|mla|attn|attention|sparse|splitkv|combine"),
    ("gemm", r"gemm|gemv|cutlass|cublas|xmma|nvjet|matmul|sm90_"),
    ("norm", r"norm"),
    ("hc", r"hc_|mhc|sinkhorn"),
    ("sampling", r"sampl|argmax|softmax|verify|accept|top_?k|multinomial"),
    ("rope", r"rope|rotary"),
)
OTHER = "other"
# The groups each flag changes: the twin and the fp8 head replace cuBLAS calls (the einsum, the bf16
# head: "gemm") with their own kernels; the cap cuts rows out of the routed experts. Every other
# group runs the same kernels on both sides, so its change is the profiles' own noise.
FLAG_GROUPS = {
    TWIN_MID[0]: ("wo_a", "gemm"),
    HEAD_FP8[0]: ("draft_head_fp8", "gemm"),
    CAP_3[0]: ("moe",),
}
# two-sided 95 % Student t quantiles, df 1..30; beyond, z + (z^3 + z) / (4 df)
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)
_T975 += (2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086)
_T975 += (2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


# ---------------------------------------------------------------------------- statistics


def t975(df: int) -> float:
    if df < 1:
        raise ValueError("a t-interval needs at least two values")
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * df)


def t_interval(values: list[float]) -> tuple[float, float]:
    """The 95 % t-interval of the mean of ``values``."""
    n = len(values)
    mean = statistics.fmean(values)
    half = t975(n - 1) * statistics.stdev(values) / math.sqrt(n)
    return mean - half, mean + half


def bootstrap_interval(
    values: list[float], draws: int = 4000, seed: int = 0
) -> tuple[float, float]:
    """The 95 % bootstrap percentile interval of the mean of ``values`` (fixed seed)."""
    rng = random.Random(seed)
    n = len(values)
    means = sorted(statistics.fmean(rng.choices(values, k=n)) for _ in range(draws))
    return means[int(0.025 * draws)], means[min(draws - 1, int(0.975 * draws))]


def ratio_summary(fork: list[float], upstream: list[float]) -> dict:
    """Per-repeat ratios fork / upstream (paired by repeat) and their mean's 95 % intervals."""
    if len(fork) != len(upstream) or len(fork) < 2:
        raise ValueError(
            f"paired repeats needed: {len(fork)} fork, {len(upstream)} upstream"
        )
    ratios = [f / u for f, u in zip(fork, upstream)]
    lo, hi = t_interval(ratios)
    blo, bhi = bootstrap_interval(ratios)
    return {
        "mean": round(statistics.fmean(ratios), 4),
        "median": round(statistics.median(ratios), 4),
        "t95": [round(lo, 4), round(hi, 4)],
        "bootstrap95": [round(blo, 4), round(bhi, 4)],
        "n": len(ratios),
        "per_repeat": [round(r, 4) for r in ratios],
    }


def t_sf(t: float, df: int) -> float:
    """P(T > t) for Student's t with ``df`` degrees of freedom (scipy, as the matrix's
    chi-square tests)."""
    from scipy.stats import t as student_t

    return float(student_t.sf(t, df))


def one_sided_p(ratios: list[float]) -> tuple[float, float]:
    """Paired t-test of the mean ratio against 1: (p that it is above, p that it is below)."""
    n = len(ratios)
    se = statistics.stdev(ratios) / math.sqrt(n)
    diff = statistics.fmean(ratios) - 1.0
    if se == 0.0:
        return (0.0, 1.0) if diff > 0 else (1.0, 0.0) if diff < 0 else (1.0, 1.0)
    t = diff / se
    return t_sf(t, n - 1), t_sf(-t, n - 1)


def holm(pvalues: dict[str, float], alpha: float = 0.05) -> list[str]:
    """The hypotheses Holm's step-down rejects with a family-wise error of at most ``alpha``."""
    rejected = []
    for i, (key, p) in enumerate(
        sorted(pvalues.items(), key=lambda kv: (kv[1], kv[0]))
    ):
        if p > alpha / (len(pvalues) - i):
            break
        rejected.append(key)
    return sorted(rejected)


def step_verdicts(report: dict, alpha: float = 0.05) -> None:
    """Which flag set makes the verify step slower, or faster, at which batch, over all the
    file's cells: secondary information beside the judging rule (``noninferiority``), which
    judges time per output token (a step may shorten while its accepted tokens fall) against a
    margin (a test against 1 lets any slowdown its pairs cannot resolve through).

    Per cell, a paired one-sided t-test of the step ratios against 1 (``p_slower``,
    ``p_faster`` in ``step_ratio``); over the cells, Holm's step-down at ``alpha`` for each
    direction. Each batch gets its ``step_verdict`` (slower, faster, or not shown), the report
    the lists (``step_verdicts``) and the cells whose own 95 % t-interval lies above 1
    (``slower_per_cell``)."""
    cells: dict[str, dict] = {}
    for name, rec in report.get("flag_sets", {}).items():
        for key, b in rec.get("batches", {}).items():
            if "skipped" not in b:
                cells[f"{name} {key}"] = b
    p = {k: one_sided_p(b["step_ratio"]["per_repeat"]) for k, b in cells.items()}
    slower = holm({k: v[0] for k, v in p.items()}, alpha)
    faster = holm({k: v[1] for k, v in p.items()}, alpha)
    for k, b in cells.items():
        b["step_ratio"]["p_slower"] = round(p[k][0], 4)
        b["step_ratio"]["p_faster"] = round(p[k][1], 4)
        b["step_verdict"] = (
            "slower" if k in slower else "faster" if k in faster else "not shown"
        )
    report["step_verdicts"] = {
        "test": "one-sided paired t-test of the step ratios against 1 per cell; Holm's "
        f"step-down over the {len(cells)} flag set x batch cells, each direction",
        "family_wise_alpha": alpha,
        "slower": slower,
        "faster": faster,
        "slower_per_cell": sorted(
            k for k, b in cells.items() if b["step_ratio"]["t95"][0] > 1
        ),
    }


# ---------------------------------------------------------------------------- the judging rule

# Non-inferiority on time per output token, per flag set x batch cell (``noninferiority``): the
# fork serves a flag set at a batch only once that cell passes. Every constant is fixed in advance.
DELTA = 0.02  # the margin: a cell's TPOT ratio's upper bound must lie below 1 + DELTA
NI_ALPHA = 0.05  # the upper bound is one-sided 95 %
DRIFT_ALPHA = 0.05  # one-sided level of the test for an upward trend over the pairs
POWER = 0.90  # pairs_needed: the chance that a cell of equal speed passes the bound
MIN_PAIRS = 4  # the trend's fit (mu, order, slope) needs one degree of freedom left
CONTROL_SLOWDOWN = 1.05  # the positive control's injected slowdown (positive_control)


def t_ppf(q: float, df: int) -> float:
    """The ``q`` quantile of Student's t with ``df`` degrees of freedom (scipy)."""
    from scipy.stats import t as student_t

    return float(student_t.ppf(q, df))


def pair_orders(n: int, sittings: list[int] | None = None) -> list[float]:
    """Each pair's order as the model's centred covariate: +1/2 where upstream went first, -1/2
    where the fork did. Every run begins upstream first and alternates (``interleave_order``);
    ``sittings``: the pairs of each run pooled in one record, in order."""
    out: list[float] = []
    for m in sittings or [n]:
        out += [0.5 if j % 2 == 0 else -0.5 for j in range(m)]
    if len(out) != n:
        raise ValueError(f"{n} pairs, but the record's runs hold {len(out)}")
    return out


def tpot_ratios(b: dict) -> list[float]:
    """Per pair, the fork's time per output token over upstream's, from a batch record.

    Each side's request of ``bs`` prompts yields ``tokens`` output tokens per prompt in its wall
    time, and its recorded tokens/s is ``bs x tokens`` over that time: upstream's tokens/s over
    the fork's is the ratio of the two wall times per output token (prefill and HTTP included,
    once per request, on both sides alike). Exact up to the 0.1 tokens/s the record keeps
    (under 0.07 % of a value from 75 tokens/s up)."""
    up, fork = b["upstream"]["tokens_per_s_runs"], b["fork"]["tokens_per_s_runs"]
    if len(up) != len(fork):
        raise ValueError(f"paired runs needed: {len(fork)} fork, {len(up)} upstream")
    return [u / f for u, f in zip(up, fork)]


def order_fit(y: list[float], order: list[float]) -> dict:
    """Least squares of y = mu + beta x order + noise, order +-1/2 (``pair_orders``): ``mu`` is
    the mean of the two orders' means (balanced whatever their counts), ``beta`` upstream-first
    minus fork-first, ``sd`` the residuals' spread and ``se`` mu's standard error, both on ``df``
    = n - 2 degrees of freedom."""
    groups = [[v for v, c in zip(y, order) if c == o] for o in (0.5, -0.5)]
    if len(y) < 3 or not all(groups):
        raise ValueError("the order model needs pairs of both orders and n >= 3")
    means = [statistics.fmean(g) for g in groups]
    ss = sum((v - m) ** 2 for g, m in zip(groups, means) for v in g)
    df = len(y) - 2
    sd = math.sqrt(ss / df)
    return {
        "mu": (means[0] + means[1]) / 2,
        "beta": means[0] - means[1],
        "sd": sd,
        "se": sd / 2 * math.sqrt(1 / len(groups[0]) + 1 / len(groups[1])),
        "df": df,
    }


def drift(y: list[float], order: list[float]) -> tuple[float, float]:
    """The trend of y over the pair index with order as a covariate (y = mu + beta x order +
    slope x index + noise, least squares: index and y centred on their order's means) and the
    one-sided p that the slope is above 0 (t on n - 3 degrees of freedom)."""
    n = len(y)
    if n < MIN_PAIRS:
        raise ValueError(f"a trend needs at least {MIN_PAIRS} pairs")
    ix: list[float] = []
    iy: list[float] = []
    for o in (0.5, -0.5):
        members = [i for i in range(n) if order[i] == o]
        mi = statistics.fmean(members)
        my = statistics.fmean(y[i] for i in members)
        ix += [i - mi for i in members]
        iy += [y[i] - my for i in members]
    sxx = sum(a * a for a in ix)
    sxy = sum(a * b for a, b in zip(ix, iy))
    slope = sxy / sxx
    rss = max(sum(b * b for b in iy) - slope * sxy, 0.0)
    se = math.sqrt(rss / (n - 3) / sxx)
    if se == 0.0:
        return slope, 0.0 if slope > 0 else 1.0
    return slope, t_sf(slope / se, n - 3)


def pairs_needed(
    sd_log: float, delta: float = DELTA, power: float = POWER, alpha: float = NI_ALPHA
) -> int:
    """The pairs a cell of equal speed needs for its upper bound to fall below 1 + ``delta`` with
    probability ``power``, ``sd_log`` the spread of its log ratios about the order model: the
    smallest even n (both orders alike, so mu's standard error is sd / sqrt(n)) with P(T' <
    -t(1 - alpha, n - 2)) >= power, T' noncentral t on n - 2 degrees of freedom with
    noncentrality -log(1 + delta) sqrt(n) / sd_log. The margin enters squared: half the
    margin takes about four times the pairs."""
    from scipy.stats import nct, norm

    if sd_log <= 0:
        return MIN_PAIRS
    margin = math.log1p(delta)

    def enough(n: int) -> bool:
        nc = -margin * math.sqrt(n) / sd_log
        return float(nct.cdf(-t_ppf(1 - alpha, n - 2), n - 2, nc)) >= power

    z = float(norm.ppf(1 - alpha) + norm.ppf(power))
    n = max(MIN_PAIRS, 2 * math.ceil((z * sd_log / margin) ** 2 / 2))
    while not enough(n):
        n += 2
    while n - 2 >= MIN_PAIRS and enough(n - 2):
        n -= 2
    return n


def planned_pairs(b: dict) -> int:
    """The pairs a cell's plan called for, fixed before its run (``--sbs-plan``, recorded per
    batch). A record from before plans were recorded planned its first run's pairs."""
    return (
        b.get("planned_pairs")
        or (b.get("sittings") or [len(b["fork"]["tokens_per_s_runs"])])[0]
    )


def tpot_noninferiority(b: dict) -> dict:
    """One cell's non-inferiority on time per output token (the judging rule, per cell).

    The log of each pair's TPOT ratio (``tpot_ratios``) = mu + beta x order + noise
    (``order_fit``): exp(mu) is the order-balanced ratio, its one-sided 95 % upper bound
    exp(mu + t(0.95, n - 2) se). The cell passes iff that bound lies below 1 + ``DELTA``, its
    log ratio does not trend upward over the pairs (``drift``, one-sided p >= ``DRIFT_ALPHA``;
    else it is drifting) and it holds exactly its plan's pairs (the fixed stopping rule: fewer
    is a plan not finished, more is pairs added after the plan ended). ``pairs_needed`` at 2 %
    and 1 % from the cell's own spread size a fresh run's plan."""
    ratios = tpot_ratios(b)
    n, plan = len(ratios), planned_pairs(b)
    out: dict = {
        "n": n,
        "planned_pairs": plan,
        "per_repeat": [round(r, 4) for r in ratios],
    }
    if n < MIN_PAIRS:
        return {
            **out,
            "ni_upper95": None,
            "ni_pass": False,
            "reasons": [f"fewer than {MIN_PAIRS} pairs"],
        }
    y = [math.log(r) for r in ratios]
    order = pair_orders(n, b.get("sittings"))
    fit = order_fit(y, order)
    upper = math.exp(fit["mu"] + t_ppf(1 - NI_ALPHA, fit["df"]) * fit["se"])
    slope, p = drift(y, order)
    reasons = []
    if not upper < 1 + DELTA:
        reasons.append(f"upper bound {upper:.4f} not below {1 + DELTA:g}")
    if p < DRIFT_ALPHA:
        reasons.append(f"drifting up {100 * slope:+.2f} % per pair (p {p:.4f})")
    if n < plan:
        reasons.append(f"{n} of {plan} planned pairs: the plan is not finished")
    elif n > plan:
        reasons.append(f"{n} pairs of a {plan}-pair plan: pairs added after it ended")
    return {
        **out,
        "order_balanced": round(math.exp(fit["mu"]), 4),
        "order_effect": round(math.exp(fit["beta"]), 4),
        "sd_log": round(fit["sd"], 4),
        "df": fit["df"],
        "ni_upper95": round(upper, 4),
        "drift_per_pair": round(slope, 5),
        "drift_p": round(p, 4),
        "drifting": p < DRIFT_ALPHA,
        "ni_pass": not reasons,
        "reasons": reasons,
        "pairs_needed_2pct": pairs_needed(fit["sd"], 0.02),
        "pairs_needed_1pct": pairs_needed(fit["sd"], 0.01),
    }


def inject_slowdown(b: dict, factor: float) -> dict:
    """A copy of batch record ``b`` whose fork took ``factor`` times as long in every pair (its
    step times x ``factor``, its tokens/s / ``factor``), its ratios recomputed."""
    out = copy.deepcopy(b)
    up, fork = out["upstream"], out["fork"]
    fork["step_ms_runs"] = [m * factor for m in fork["step_ms_runs"]]
    fork["tokens_per_s_runs"] = [t / factor for t in fork["tokens_per_s_runs"]]
    out["step_ratio"] = ratio_summary(fork["step_ms_runs"], up["step_ms_runs"])
    out["throughput_ratio"] = ratio_summary(
        fork["tokens_per_s_runs"], up["tokens_per_s_runs"]
    )
    if "step_ratio_by_order" in out:
        out["step_ratio_by_order"] = order_means(
            out["step_ratio"]["per_repeat"], out.get("sittings")
        )
    out.pop("tpot_ratio", None)
    return out


def positive_control(b: dict, slowdown: float = CONTROL_SLOWDOWN) -> dict:
    """Batch record ``b`` made exactly ``slowdown`` times slower than upstream: the fork's times
    scaled so that the order-balanced TPOT ratio is ``slowdown``, each pair's own deviation
    (order, noise, trend) kept. From ``slowdown`` >= 1 + ``DELTA`` the rule must flag it in
    every cell whatever its spread (the upper bound is never below the ratio); a control that
    passes means the rule is broken."""
    ratios = tpot_ratios(b)
    fit = order_fit(
        [math.log(r) for r in ratios], pair_orders(len(ratios), b.get("sittings"))
    )
    return inject_slowdown(b, slowdown / math.exp(fit["mu"]))


def _not_served(name: str, bs: int, args: list[str], why: str, t: dict | None) -> dict:
    return {
        "flag_set": name,
        "bs": bs,
        "args": args,
        "reason": why,
        "ni_upper95": (t or {}).get("ni_upper95"),
        "pairs_needed_2pct": (t or {}).get("pairs_needed_2pct"),
    }


def noninferiority(report: dict) -> None:
    """The judging rule over a report: every measured cell's ``tpot_ratio``
    (``tpot_noninferiority``), the rule with its positive control (``noninferiority``: each
    measured cell made ``CONTROL_SLOWDOWN`` slower must fail), and the table the dispatch
    follows (``not_noninferior``: each flag set x batch that has not passed, with its
    arguments and why, a batch of the method that was not measured included). A cell absent
    from the file has not passed either."""
    failing = []
    controls = flagged = 0
    for name, rec in report.get("flag_sets", {}).items():
        args = rec.get("args", FLAG_SETS.get(name, []))
        method = rec.get("method") or report.get("method") or {}
        batches = rec.get("batches", {})
        why = None if "batches" in rec else (rec.get("skipped") or rec.get("error"))
        for bs in method.get("batches", []):
            if f"bs{bs}" not in batches:
                missing = "not measured" + (f": {why}" if why else "")
                failing.append(_not_served(name, bs, args, missing, None))
        for key, b in batches.items():
            if "skipped" in b:
                failing.append(
                    _not_served(
                        name, int(key[2:]), args, f"not measured: {b['skipped']}", None
                    )
                )
                continue
            b["tpot_ratio"] = t = tpot_noninferiority(b)
            if t["n"] >= MIN_PAIRS:
                controls += 1
                flagged += not tpot_noninferiority(positive_control(b))["ni_pass"]
            if not t["ni_pass"]:
                failing.append(
                    _not_served(name, b["bs"], args, "; ".join(t["reasons"]), t)
                )
    known = list(FLAG_SETS)
    failing.sort(
        key=lambda c: (
            known.index(c["flag_set"]) if c["flag_set"] in known else len(known),
            c["flag_set"],
            c["bs"],
        )
    )
    report["noninferiority"] = {
        "rule": "per flag set x batch, the fork's time per output token over upstream's per "
        "pair (upstream's tokens/s over the fork's); log ratio = mu + beta x order (+1/2 "
        "upstream first, -1/2 fork first) + noise; a cell passes iff exp(mu + t(0.95, n - 2) "
        "se) < 1 + margin, its log ratio has no upward trend over the pairs (one-sided t-test "
        "of the slope, order as a covariate, at drift_alpha) and it holds exactly its planned "
        "pairs",
        "margin": DELTA,
        "upper_bound": "one-sided 95 %",
        "drift_alpha": DRIFT_ALPHA,
        "pairs_needed_power": POWER,
        "positive_control": {
            "slowdown": CONTROL_SLOWDOWN,
            "cells": controls,
            "flagged": flagged,
        },
    }
    report["not_noninferior"] = failing


def judge_cells(report: dict) -> None:
    """Every verdict a report carries, from its pairs alone (a run's, a merge's, a re-judged
    file's): the step time's over all cells (secondary), then the judging rule's."""
    step_verdicts(report)
    noninferiority(report)


def order_means(per_repeat: list[float], sittings: list[int] | None = None) -> dict:
    """Mean ratio of the pairs upstream went first in and of those the fork went first in
    (``interleave_order``): equal up to noise when the measurement does not depend on the
    order; a gap is an effect the alternation cancels in the mean but not in its interval.
    ``sittings``: the pairs of each sitting pooled in ``per_repeat`` (each began upstream first).
    """
    first: dict[str, list[float]] = {"upstream_first": [], "fork_first": []}
    start = 0
    for n in sittings or [len(per_repeat)]:
        first["upstream_first"] += per_repeat[start : start + n : 2]
        first["fork_first"] += per_repeat[start + 1 : start + n : 2]
        start += n
    return {k: round(statistics.fmean(v), 4) for k, v in first.items()}


def interleave_order(repeats: int) -> list[tuple[int, str]]:
    """(repeat, side) in the order requests go: pairs whose first side alternates,
    upstream-fork, fork-upstream, ... (a drift over the run falls on both sides alike).
    """
    order = []
    for r in range(repeats):
        pair = ("upstream", "fork") if r % 2 == 0 else ("fork", "upstream")
        order += [(r, side) for side in pair]
    return order


# ---------------------------------------------------------------------------- attribution


def kernel_group(name: str) -> str:
    for group, pattern in KERNEL_GROUPS:
        if re.search(pattern, name, re.IGNORECASE):
            return group
    return OTHER


def group_kernels(by_name: dict[str, list[float]]) -> dict[str, dict]:
    """{kernel name: [us, calls]} -> {group: {"us", "calls", "kernels": distinct names}}."""
    groups: dict[str, dict] = {}
    for name, (us, calls) in by_name.items():
        g = groups.setdefault(kernel_group(name), {"us": 0.0, "calls": 0, "kernels": 0})
        g["us"] += us
        g["calls"] += calls
        g["kernels"] += 1
    return groups


def split_by_flags(groups: dict[str, dict], flags: list[str]) -> dict:
    """Per-step kernel groups (``attribute``'s ``groups``) split into those ``flags`` change
    (``FLAG_GROUPS``: both sides' time and its fall) and the change of the rest (noise).
    """
    touched = sorted({g for f in flags for g in FLAG_GROUPS.get(f, ())})
    mine = [groups[g] for g in touched if g in groups]
    return {
        "flag_groups": touched,
        "flag_groups_upstream_us": round(sum(r["upstream_us"] for r in mine), 2),
        "flag_groups_fork_us": round(sum(r["fork_us"] for r in mine), 2),
        "flag_groups_saving_us": round(sum(r["saving_us"] for r in mine), 2),
        "other_groups_change_us": round(
            sum(r["saving_us"] for g, r in groups.items() if g not in touched), 2
        ),
    }


def attribute(
    upstream: dict,
    fork: dict,
    measured_step_us: tuple[float, float] | None = None,
    flags: list[str] | None = None,
) -> dict:
    """Fork vs upstream GPU time per decode step and kernel group, from two profiles
    (``matrix.profile(..., all_kernels=True)``: ``by_name`` and ``spec``). Each side's group time
    is divided by its verify steps per request; ``saving_us`` is upstream minus fork (positive:
    the fork spends less). ``measured_step_us`` (upstream, fork) adds the measured step change
    beside the sum of the groups' savings, and what the kernels leave unexplained (host time,
    idle GPU, the prefill both profiles include). ``flags`` splits the saving into the groups
    those flags change (``FLAG_GROUPS``: the fork's own share) and the change of the rest (noise).
    """

    def per_step(profile: dict) -> tuple[dict, float]:
        spec = profile.get("spec") or {}
        steps = spec.get("verify_steps", 0) / max(profile.get("requests", 1), 1)
        return group_kernels(profile["by_name"]), steps or 1.0

    up, up_steps = per_step(upstream)
    fk, fk_steps = per_step(fork)
    rows = {}
    for g in sorted(set(up) | set(fk)):
        u = up.get(g, {}).get("us", 0.0) / up_steps
        f = fk.get(g, {}).get("us", 0.0) / fk_steps
        rows[g] = {
            "upstream_us": round(u, 2),
            "fork_us": round(f, 2),
            "saving_us": round(u - f, 2),
            "upstream_calls": up.get(g, {}).get("calls", 0),
            "fork_calls": fk.get(g, {}).get("calls", 0),
        }
    ranked = dict(sorted(rows.items(), key=lambda kv: -abs(kv[1]["saving_us"])))
    out = {
        "groups": ranked,
        "kernel_saving_us": round(sum(r["saving_us"] for r in rows.values()), 2),
        "upstream_kernel_us_per_step": round(
            sum(r["upstream_us"] for r in rows.values()), 2
        ),
        "fork_kernel_us_per_step": round(sum(r["fork_us"] for r in rows.values()), 2),
    }
    if flags is not None:
        out.update(split_by_flags(rows, flags))
    if measured_step_us is not None:
        change = measured_step_us[0] - measured_step_us[1]
        out["measured_step_change_us"] = round(change, 2)
        out["unexplained_us"] = round(change - out["kernel_saving_us"], 2)
    return out


# ---------------------------------------------------------------------------- serving


def prompts_for(bs: int) -> list[str]:
    from .matrix import GREEDY_PROMPTS

    return [f"{GREEDY_PROMPTS[i % len(GREEDY_PROMPTS)]} {i}" for i in range(bs)]


def batch_ids(server: Server, bs: int) -> list[list[int]]:
    """``prompts_for(bs)`` as token ids, through the server's own ``/tokenize``.

    A batch is sent as ids because upstream's tokenizer manager then hands it to the scheduler
    as one message; a text batch goes prompt by prompt, and a scheduler that was idle starts
    its prefill on the first prompts alone, so the batch's step time would depend on what the
    other server did just before (the pair's order), not on the server.
    """
    ids = server.post("/tokenize", {"prompt": prompts_for(bs)})["tokens"]
    if len(ids) != bs or not all(ids):
        raise RuntimeError(f"/tokenize answered {len(ids)} prompts for {bs}")
    return ids


def timed_request(server: Server, ids: list[list[int]], tokens: int) -> dict:
    from .matrix import spec_stats

    body = {
        "input_ids": ids,
        "sampling_params": {
            "temperature": 0,
            "max_new_tokens": tokens,
            "ignore_eos": True,
        },
    }
    t0 = time.perf_counter()
    outs = server.post("/generate", body, timeout=600)
    seconds = time.perf_counter() - t0
    bs = len(ids)
    stats = spec_stats(outs) or {}
    steps = stats.get("verify_steps", 0) / bs or tokens
    return {
        "seconds": seconds,
        "step_ms": 1e3 * seconds / steps,
        "tokens_per_s": bs * tokens / seconds,
        "verify_steps_per_request": steps,
        "accepted_drafts_per_step": stats.get("accepted_drafts_per_step"),
        "tokens": [o["output_ids"] for o in outs],
    }


def _side(runs: list[dict]) -> dict:
    accepted = [r["accepted_drafts_per_step"] for r in runs]
    return {
        "step_ms": round(statistics.median(r["step_ms"] for r in runs), 3),
        "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in runs), 1),
        "accepted_drafts_per_step": (
            None if None in accepted else round(statistics.fmean(accepted), 3)
        ),
        "verify_steps_per_request": round(
            statistics.fmean(r["verify_steps_per_request"] for r in runs), 2
        ),
        "step_ms_runs": [round(r["step_ms"], 3) for r in runs],
        "tokens_per_s_runs": [round(r["tokens_per_s"], 1) for r in runs],
    }


def cost_model_command(flags: list[str], bs: int, up_ms: float, fork_ms: float) -> str:
    return (
        f"python3 benchmark/e2e/cost_model.py --tp 1 --bs {bs} {' '.join(flags)} "
        f"--measured-step-us {1e3 * up_ms:.0f} {1e3 * fork_ms:.0f}"
    )


def measure_batch(
    servers: dict[str, Server],
    bs: int,
    repeats: int,
    tokens: int,
    flags: list[str],
    planned: int | None = None,
) -> dict:
    """One batch size: warm-up on both, then ``repeats`` interleaved pairs (``interleave_order``)
    of the cell's plan of ``planned`` pairs (by default ``repeats``: the whole plan in one run).
    """
    ids = batch_ids(servers["upstream"], bs)
    for side in ("upstream", "fork"):
        timed_request(servers[side], ids, tokens)
    runs: dict[str, list[dict]] = {"upstream": [], "fork": []}
    for _, side in interleave_order(repeats):
        runs[side].append(timed_request(servers[side], ids, tokens))
    reference = runs["upstream"][0]["tokens"]
    return {
        **summarize_batch(bs, runs, flags, [repeats], planned or repeats),
        "tokens_identical": all(r["tokens"] == reference for r in runs["fork"]),
        "upstream_repeatable": all(r["tokens"] == reference for r in runs["upstream"]),
    }


def summarize_batch(
    bs: int,
    runs: dict[str, list[dict]],
    flags: list[str],
    sittings: list[int],
    planned: int | None = None,
) -> dict:
    """The timing part of a batch's record from its paired runs (``sittings``: the pairs of
    each run they come from, in order; ``planned``: the pairs the cell's plan called for, by
    default those it holds)."""
    up, fork = _side(runs["upstream"]), _side(runs["fork"])
    step = ratio_summary(
        [r["step_ms"] for r in runs["fork"]],
        [r["step_ms"] for r in runs["upstream"]],
    )
    return {
        "bs": bs,
        "upstream": up,
        "fork": fork,
        "step_ratio": step,
        "step_ratio_by_order": order_means(step["per_repeat"], sittings),
        "throughput_ratio": ratio_summary(
            [r["tokens_per_s"] for r in runs["fork"]],
            [r["tokens_per_s"] for r in runs["upstream"]],
        ),
        "cost_model": cost_model_command(flags, bs, up["step_ms"], fork["step_ms"]),
        **({"sittings": sittings} if len(sittings) > 1 else {}),
        "planned_pairs": planned or sum(sittings),
    }


def _runs(rec: dict, side: str) -> list[dict]:
    """One side's runs as ``summarize_batch`` takes them, from a batch record."""
    s = rec[side]
    return [
        {
            "step_ms": ms,
            "tokens_per_s": tps,
            "accepted_drafts_per_step": s["accepted_drafts_per_step"],
            "verify_steps_per_request": s["verify_steps_per_request"],
        }
        for ms, tps in zip(s["step_ms_runs"], s["tokens_per_s_runs"])
    ]


def pool_batch(earlier: dict, later: dict, flags: list[str]) -> dict:
    """One batch measured in two runs of one cell's plan, as one measurement of all their pairs
    (a plan of more pairs than one device call holds): ratios, intervals and medians over the
    pooled pairs, the token checks of both, the later run's profile if it took one. Refuses two
    records that share their pairs (a run merged twice would count its pairs twice), two plans,
    and more pairs than the plan (adding pairs until a cell passes is no fixed stopping rule).
    """
    a, b = earlier["step_ratio"]["per_repeat"], later["step_ratio"]["per_repeat"]
    if any(a[i : i + len(b)] == b for i in range(len(a) - len(b) + 1)) or any(
        b[i : i + len(a)] == a for i in range(len(b) - len(a) + 1)
    ):
        raise SystemExit(
            f"merge: bs{later['bs']} holds the same pairs twice (a run merged twice?)"
        )
    plan = planned_pairs(later)
    if planned_pairs(earlier) != plan or len(a) + len(b) > plan:
        raise SystemExit(
            f"merge: bs{later['bs']}: {len(a)} + {len(b)} pairs of plans of "
            f"{planned_pairs(earlier)} and {plan}: runs pool only within one plan, up to its "
            "pairs (a cell is re-measured in a fresh run with a new plan)"
        )
    pooled = summarize_batch(
        later["bs"],
        {
            side: _runs(earlier, side) + _runs(later, side)
            for side in ("upstream", "fork")
        },
        flags,
        earlier.get("sittings", [len(a)]) + later.get("sittings", [len(b)]),
        plan,
    )
    profile = later.get("profile", earlier.get("profile"))
    return {
        **pooled,
        "tokens_identical": earlier["tokens_identical"] and later["tokens_identical"],
        "upstream_repeatable": earlier["upstream_repeatable"]
        and later["upstream_repeatable"],
        **({"profile": profile} if profile else {}),
    }


def profile_pair(
    servers: dict[str, Server],
    bs: int,
    tokens: int,
    out_dir: Path,
    measured,
    flags: list[str],
) -> dict:
    """Both servers' kernels of one request of ``bs`` prompts, one server after the other, and
    the cost model's command that holds the kernel time per step of the groups the flags change
    (no host time, no HTTP, not the other groups' noise) against its prediction."""
    from .matrix import profile

    ids = batch_ids(servers["upstream"], bs)
    profiles = {
        side: profile(
            servers[side],
            out_dir / f"{side}-bs{bs}",
            input_ids=ids,
            tokens=tokens,
            all_kernels=True,
        )
        for side in ("upstream", "fork")
    }
    result = attribute(profiles["upstream"], profiles["fork"], measured, flags)
    result["cost_model"] = cost_model_command(
        flags,
        bs,
        result["flag_groups_upstream_us"] / 1e3,
        result["flag_groups_fork_us"] / 1e3,
    )
    for side, p in profiles.items():
        result[side] = {k: v for k, v in p.items() if k != "by_name"}
    return result


def ensure_checkpoint(models: Path, experts: str, device: str) -> Path:
    path = models / ("full" if experts == "fp8" else f"full-{experts}")
    if not checkpoint_written(path):
        t0 = time.monotonic()
        write_dsv4(
            path,
            agree=True,
            shape=dict(FULL_DEPTH_DSV4, experts=experts),
            seed=CHECKPOINT_SEED,
            device=device,
            draft_runs=FULL_DEPTH_DRAFT_RUNS,
        )
        gc.collect()
        try:
            import torch

            torch.cuda.empty_cache()  # the servers size their pools from free memory
        except (ImportError, RuntimeError):
            pass
        print(
            f"==> wrote the full-depth checkpoint ({experts} experts) in "
            f"{time.monotonic() - t0:.0f} s",
            flush=True,
        )
    return path


def checkpoint_size_gb(path: Path) -> float:
    return round(sum(f.stat().st_size for f in path.glob("*.safetensors")) / 1e9, 2)


def fork_row(name: str):
    from .matrix import DSPARK, L_CAP, L_HEAD, L_TWIN, Row, _flags

    flags = FLAG_SETS[name]
    engaged = tuple(
        line
        for line, flag in ((L_TWIN, TWIN_MID), (L_HEAD, HEAD_FP8), (L_CAP, CAP_3))
        if flag[0] in flags
    )
    # No probes: a probe wraps the feature's function in Python, which a timing must not pay.
    return Row(
        f"full_{name}",
        DSPARK + flags,
        model="full",
        greedy=False,
        timing=True,
        flags=_flags(flags),
        engaged=engaged,
    )


def upstream_row():
    from .matrix import DSPARK, Row

    return Row(
        "full_up",
        list(DSPARK),
        model="full",
        tree="upstream",
        greedy=False,
        timing=True,
    )


def startup_checks(row, server: Server) -> dict:
    """The matrix's startup checks of a row (fork flags line or none, no log errors, engaged)."""
    from .matrix import evaluate, evidence, feature_lines, fork_flags_line

    log = server.log()
    line = fork_flags_line(log)
    rec = {
        "startup_s": round(server.startup_seconds or 0.0, 1),
        "fork_flags_line": None if line is None else line.split("fork flags: ", 1)[-1],
        "log_errors": server.errors()[:20],
        "feature_lines": feature_lines(log),
        "_evidence": {e: bool(re.search(e, log)) for e in evidence(row)},
    }
    evaluate(row, rec, {})
    rec.pop("_evidence", None)
    return rec


def server_args(row) -> list[str]:
    from .matrix import SERVE_ARGS

    return SERVE_ARGS + MEM_ARGS + GRAPH_ARGS + row.args


def start_servers(pairs: list[tuple[object, Server]]) -> dict[str, str]:
    """Start the servers together; {row name: error} for those that did not come up."""
    errors = {}

    def one(pair):
        row, server = pair
        try:
            server.start()
        except (ServerDied, OSError) as e:
            errors[row.name] = f"{type(e).__name__}: {str(e).splitlines()[0]}"

    pool = ThreadPoolExecutor(len(pairs))
    try:
        list(pool.map(one, pairs))
    finally:  # interrupted: the caller's finally stops the servers; do not wait for their start
        pool.shutdown(wait=False)
    return errors


def run(args, env: dict, trees: dict, device_label: str, meta: dict) -> int:
    """The side-by-side measurement (``--side-by-side``); returns the exit status."""
    from .matrix import _gen_device, row_env

    sets = [s for s in args.side_by_side.split(",") if s]
    unknown = [s for s in sets if s not in FLAG_SETS]
    if unknown or not sets:
        raise SystemExit(
            f"--side-by-side: {', '.join(unknown) or '(none)'}: expected a comma-separated "
            f"list of {', '.join(FLAG_SETS)}"
        )
    batches = [int(b) for b in args.sbs_batches.split(",")]
    profiled = {int(b) for b in args.sbs_profile.split(",") if b}
    if not profiled <= set(batches):
        raise SystemExit(
            f"--sbs-profile: {sorted(profiled)} not all in --sbs-batches {batches}"
        )
    if args.sbs_repeats < 2:
        raise SystemExit(
            "--sbs-repeats: at least 2 (a confidence interval needs two pairs)"
        )
    plan = args.sbs_plan or args.sbs_repeats
    if plan < args.sbs_repeats:
        raise SystemExit(
            f"--sbs-plan: {plan} pairs, fewer than --sbs-repeats {args.sbs_repeats} (a run "
            "takes no more pairs than its cell's plan)"
        )
    t_start = time.monotonic()
    env = {**env, **SERVE_ENV}
    model = ensure_checkpoint(args.models, args.sbs_experts, _gen_device())
    draft = json.loads((model / "draft.json").read_text())
    logs = args.out / "e2e-logs"
    logs.mkdir(parents=True, exist_ok=True)
    report = {
        **meta,
        "checkpoint": {
            "shape": {**FULL_DEPTH_DSV4, "experts": args.sbs_experts},
            "seed": CHECKPOINT_SEED,
            "architecture": "DeepseekV4ForCausalLM (model_type deepseek_v4, no Engram)",
            "quantization_config": json.loads((model / "config.json").read_text()).get(
                "quantization_config"
            ),
            "draft_runs": draft["draft_runs"],
            "intended_accepted_drafts_per_step": draft[
                "intended_accepted_drafts_per_step"
            ],
            "size_gb": checkpoint_size_gb(model),
        },
        "method": {
            "batches": batches,
            "repeats": args.sbs_repeats,
            "planned_pairs": plan,
            "output_tokens": args.sbs_tokens,
            "order": "pairs, first side alternating (upstream-fork, fork-upstream, ...)",
            "step_time": "wall time of one /generate of bs prompts over the verify steps per "
            "request (spec_verify_ct summed / bs): prefill and HTTP included",
            "batch": "bs prompts as token ids (one message to the scheduler, one prefill)",
            "ratios": "fork / upstream per repeat; mean with 95 % t and bootstrap intervals",
            "tokens": "greedy tokens identical to upstream's (the agree checkpoints' rule)",
            "server_args": server_args(upstream_row()),
            "server_env": SERVE_ENV,
        },
        "flag_sets": {},
    }
    up_row = upstream_row()
    upstream = Server(
        model,
        server_args(up_row),
        env=row_env(up_row, env, trees),
        log_path=logs / "full_up.log",
    )
    dest = args.out / f"e2e-full-depth-{device_label}.json"

    def save() -> Path:
        """The report so far (rewritten after every batch: a run cut short keeps its numbers)."""
        done = json.loads(json.dumps(report))  # not a result: a deep copy
        if args.sbs_merge:
            merge_flag_sets(done, json.loads(Path(args.sbs_merge).read_text()))
        judge_cells(done)
        return write_result(dest, done, overwrite=args.overwrite, quiet=True)

    def late() -> bool:
        return (
            args.sbs_deadline is not None
            and time.monotonic() - t_start > args.sbs_deadline
        )

    previous = signal.signal(signal.SIGTERM, _terminate)
    live = [
        upstream
    ]  # every server started, stopped in the end whatever happens (idempotent)
    status = 0
    try:
        for i, name in enumerate(sets):
            elapsed = time.monotonic() - t_start
            if (i and elapsed > args.budget) or late():
                report["flag_sets"][name] = {
                    "skipped": f"over the time budget ({elapsed:.0f} s)"
                }
                continue
            row = fork_row(name)
            fork = Server(
                model,
                server_args(row),
                env=row_env(row, env, trees),
                log_path=logs / f"{row.name}.log",
            )
            live.append(fork)
            print(f"==> {name}: {' '.join(FLAG_SETS[name])}", flush=True)
            errors = start_servers(
                [(up_row, upstream), (row, fork)] if i == 0 else [(row, fork)]
            )
            if up_row.name in errors:
                report["upstream"] = {"error": errors[up_row.name]}
                fork.stop()
                status = 1
                break
            if i == 0:
                report["upstream"] = startup_checks(up_row, upstream)
            rec: dict = {"args": FLAG_SETS[name]}
            report["flag_sets"][name] = rec
            if row.name in errors:
                fork.stop()
                rec.update(error=errors[row.name], ok=False)
                status = 1
                continue
            try:
                servers = {"upstream": upstream, "fork": fork}
                rec["batches"] = {}
                for bs in batches:
                    if late():
                        rec["batches"][f"bs{bs}"] = {"skipped": "past --sbs-deadline"}
                        continue
                    rec["batches"][f"bs{bs}"] = b = measure_batch(
                        servers,
                        bs,
                        args.sbs_repeats,
                        args.sbs_tokens,
                        FLAG_SETS[name],
                        plan,
                    )
                    print(
                        f"    bs {bs:>2}: step {b['upstream']['step_ms']:.2f} -> "
                        f"{b['fork']['step_ms']:.2f} ms (x{b['step_ratio']['mean']:.3f} "
                        f"{b['step_ratio']['t95']}), accepted "
                        f"{b['upstream']['accepted_drafts_per_step']} / "
                        f"{b['fork']['accepted_drafts_per_step']}, tokens identical "
                        f"{b['tokens_identical']}; by order (upstream / fork first) "
                        f"{b['step_ratio_by_order']['upstream_first']:.3f} / "
                        f"{b['step_ratio_by_order']['fork_first']:.3f}, tokens/s "
                        f"x{b['throughput_ratio']['mean']:.3f}",
                        flush=True,
                    )
                    if bs in profiled and not late():
                        b["profile"] = profile_pair(
                            servers,
                            bs,
                            args.sbs_tokens,
                            logs / f"{row.name}-profile",
                            (
                                1e3 * b["upstream"]["step_ms"],
                                1e3 * b["fork"]["step_ms"],
                            ),
                            FLAG_SETS[name],
                        )
                        a = b["profile"]
                        print(
                            f"    bs {bs:>2} kernels per step: "
                            f"{a['upstream_kernel_us_per_step']:.0f} -> "
                            f"{a['fork_kernel_us_per_step']:.0f} us; the flags' groups "
                            f"save {a['flag_groups_saving_us']:.0f}, the rest change "
                            f"{a['other_groups_change_us']:.0f}; GPU busy "
                            f"{a['upstream']['gpu_busy']:.2f} / {a['fork']['gpu_busy']:.2f}",
                            flush=True,
                        )
                    save()
            except (RuntimeError, OSError, ValueError) as e:
                rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
            finally:
                fork.stop()
            rec.update(startup_checks(row, fork))
            judge(rec)
            status |= 0 if rec["ok"] else 1
            save()
    finally:
        for server in live:
            server.stop()
        signal.signal(signal.SIGTERM, previous)
    if "upstream" in report and "error" not in report["upstream"]:
        report["upstream"]["log_errors"] = upstream.errors()[:20]
    out = save()
    print(f"wrote {out}")
    return status


def _terminate(signum, frame):
    """SIGTERM (a ``timeout``) ends the run through its ``finally``: both servers stopped."""
    raise KeyboardInterrupt(f"signal {signum}")


def judge(rec: dict) -> None:
    """A flag set's checks over the batches it measured (any, without an error; greedy tokens
    identical to upstream's in each) beside its startup checks, and its verdict."""
    measured = [b for b in rec["batches"].values() if "skipped" not in b]
    rec["checks"]["measured"] = "error" not in rec and bool(measured)
    rec["checks"]["tokens_identical_to_upstream"] = bool(measured) and all(
        b["tokens_identical"] for b in measured
    )
    rec["ok"] = all(rec["checks"].values())


def merge_flag_sets(report: dict, earlier: dict) -> None:
    """Keep what ``earlier`` measured (same build, device and harness commit: the file records
    one): a flag set this run did not
    measure, whole; of a flag set both measured with the same method, the batches this run
    skipped or did not list (each batch is its own interleaved pairs, so a set may gather its
    batches from several sittings; a kept batch says ``earlier_sitting``), and a batch both
    measured pooled (``pool_batch``). A set measured with another method is replaced whole.
    """
    for key in ("fork_version", "device", "standins", "commit"):
        if earlier.get(key) != report.get(key):
            raise SystemExit(
                f"--sbs-merge: the earlier run's {key} is {earlier.get(key)!r}, this run's "
                f"{report.get(key)!r}"
            )
    for name, rec in earlier.get("flag_sets", {}).items():
        # the upstream server and the method that flag set was measured with (another
        # sitting's)
        kept = {
            "upstream": earlier.get("upstream"),
            "method": earlier.get("method"),
            **rec,
        }
        now = report["flag_sets"].get(name)
        if now is None or "skipped" in now:
            report["flag_sets"][name] = kept
        elif kept.get("ok") and "batches" in kept and "batches" in now:
            _keep_batches(now, kept, now.get("method", report.get("method")))


def _keep_batches(now: dict, kept: dict, method: dict | None) -> None:
    """``kept``'s measured batches that ``now`` lacks, and those both measured pooled if both
    runs are of one plan (``planned_pairs``; else ``now``'s fresh run replaces the earlier), if
    both used one method (the batch list and the pairs aside: each batch records its own ``n``
    and plan); ``now``'s token check and verdict then cover them too."""

    def same(m: dict | None) -> dict:
        skip = ("batches", "repeats", "planned_pairs")
        return {k: v for k, v in (m or {}).items() if k not in skip}

    if same(kept["method"]) != same(method):
        return
    batches = now["batches"]
    for key, b in kept["batches"].items():
        if "skipped" in b:
            continue
        if "skipped" in batches.get(key, {"skipped": ""}):
            batches[key] = {**b, "earlier_sitting": True}
        elif planned_pairs(b) == planned_pairs(batches[key]):
            batches[key] = pool_batch(b, batches[key], now.get("args", []))
    now["batches"] = dict(sorted(batches.items(), key=lambda kv: int(kv[0][2:])))
    if "checks" in now:
        judge(now)


def merge_files(paths: list[Path]) -> dict:
    """Several sittings' ``e2e-full-depth-<device>.json`` as one (``python -m
    e2e.side_by_side A.json B.json --out C.json``): flag set by flag set and batch by batch, a
    later file's measurement is added to an earlier one's of the same method and replaces one of
    another (``merge_flag_sets``); every file must be of one build and device (their provenance
    is kept, not restamped by the machine that merges)."""
    merged = json.loads(Path(paths[-1]).read_text())
    for path in reversed(paths[:-1]):
        merge_flag_sets(merged, json.loads(Path(path).read_text()))
    judge_cells(merged)
    return merged


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description="merge side-by-side result files, or re-judge one (CPU)"
    )
    p.add_argument("files", type=Path, nargs="+")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    merged = merge_files(args.files)
    args.out.write_text(  # not a result: GPU sittings merged, their provenance kept
        json.dumps(merged, indent=1) + "\n"
    )
    print(f"wrote {args.out}")
    return 0


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--side-by-side",
        default="",
        metavar="SETS",
        help="instead of the matrix: time upstream and the fork side by side on the full-depth "
        f"checkpoint, one fork server per flag set ({', '.join(FLAG_SETS)}), against one "
        "upstream server (e2e.side_by_side); --budget stops starting flag sets",
    )
    p.add_argument(
        "--sbs-batches",
        default=",".join(map(str, BATCHES)),
        help="side by side: batch sizes (concurrent requests)",
    )
    p.add_argument(
        "--sbs-repeats",
        type=int,
        default=REPEATS,
        help="side by side: interleaved pairs per batch",
    )
    p.add_argument(
        "--sbs-plan",
        type=int,
        help="side by side: the pairs each batch's plan calls for, fixed before the run "
        "(default --sbs-repeats); a plan of more pairs than one call holds is taken in runs of "
        "--sbs-repeats pairs, pooled by the merge up to the plan",
    )
    p.add_argument(
        "--sbs-tokens",
        type=int,
        default=OUTPUT_TOKENS,
        help="side by side: output tokens per request",
    )
    p.add_argument(
        "--sbs-profile",
        default="",
        help="side by side: batch sizes whose kernels are profiled on both servers and attributed",
    )
    p.add_argument(
        "--sbs-experts",
        choices=("fp8", "bf16"),
        default="fp8",
        help="side by side: the routed experts' format in the checkpoint",
    )
    p.add_argument(
        "--sbs-deadline",
        type=float,
        help="side by side: after this many seconds no batch or flag set starts; the servers "
        "stop and the JSON is written (keep it below the machine's time limit)",
    )
    p.add_argument(
        "--sbs-merge",
        type=Path,
        help="side by side: an earlier e2e-full-depth JSON (same build and device) whose flag "
        "sets and batches this run does not measure are kept",
    )


if __name__ == "__main__":
    raise SystemExit(main())
