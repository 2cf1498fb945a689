#!/usr/bin/env python3
"""Per-step cost model of the fork's DSpark decode step: the calls each fork kernel replaces per
step, times the kernel benchmarks' measured saving at that shape.

One DSpark decode step on the target's TP rank (the engine code each count comes from):

- target verify: one ``wo_a`` call per layer with ``bs * (gamma + 1)`` rows
  (``dspark_config.resolve_runtime_config``: ``verify_num_draft_tokens = gamma + 1``; the attention
  layer of ``models/deepseek_v4.py`` calls ``_apply_wo_a_bf16_matmul(..., wo_a_twin=...)`` once);
  every layer is MoE (``moe_layer_freq = 1``), and the verify cap cuts each request's rows past
  its live length ``1 + k`` out of the experts those layers stream;
- draft forward: one ``wo_a`` call per draft stage with ``bs * query_token_num`` rows
  (``dspark_draft._run_forward`` builds a TARGET_VERIFY batch of ``bs * query_token_num`` rows,
  ``query_token_num = gamma`` when the draft samples from the anchor, else ``gamma + 1``; each stage's
  attention in ``models/deepseek_v4_dspark.py`` calls ``_apply_wo_a_bf16_matmul(..., wo_a_twin=...)``);
- draft logits: one LM-head call per step with ``bs * gamma`` rows (``compute_base_logits`` from
  ``DSparkDraftSampler._markov_block`` in the draft graph or ``DSparkDraft.propose`` eagerly; the
  gamma draft positions then read those logits, no further head call), on the rank's vocab shard
  (``layers/vocab_parallel_embedding.py``: padded to 64, to ``64 * tp`` where 64 does not split).

The row limits are read from the engine's own modules (``MID_FASTER_MAX``, ``MID_MAX_ROWS``,
``SMALL_KERNEL_MAX`` of ``deepseek_v4_wo_a_twin.py``, ``MAX_ROWS`` of ``dspark_draft_head_fp8.py``), so a
wider kernel moves the model with it. A call the fork does not serve runs stock: it saves nothing.
A served call's saving is stock minus ours from the committed result file of that device
(``benchmark/results/<name>-<device>.json``), at a measured shape or interpolated linearly between
two measured row counts served by the same kernel; any other shape is "not measured", never
extrapolated. Each input is marked measured, derived (from the engine code) or assumed.

``explains()`` / ``--measured-step-us STOCK FORK`` compare a prediction with a measured step-time
change: explained when they differ by at most a third of the measured change.

``step_share()`` / ``--step-share`` time the whole step on one H200 rank, every fork flag off, per
kernel group (routed experts, dense linears, ``wo_a``, LM heads, attention, all-reduce, other), so
each flag set's saving reads as a percent of it. A part is measured where a result file of the
step's device covers its rows (the MoE runner's ``moe_verify-<device>.json`` once it exists), else
assumed as a whole: bytes at the measured HBM bandwidth plus a fixed cost per kernel, or a stated
figure (``StepAssumptions``, each with its reason in the JSON).

Standard library only. Figures and assumptions: docs/performance.md.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmark" / "results"
sys.path.insert(0, str(REPO / "tools"))

TWIN_MODULE = REPO / "python/sglang/srt/models/deepseek_v4_wo_a_twin.py"
HEAD_MODULE = (
    REPO / "python/sglang/srt/speculative/dspark_components/dspark_draft_head_fp8.py"
)
WO_A_LEVELS = ("off", "small", "mid", "drop")
TOLERANCE = 1 / 3

# Hopper kernels where the device is SM90; elsewhere the portable kernels (the twin's Triton
# kernel, the head's mma.sync kernel) and upstream's MXFP8 wo_a stays stock.
HOPPER_DEVICES = ("NVIDIA_H200", "NVIDIA_H100")

# Result statuses of one call site.
MEASURED = "measured"
INTERPOLATED = "interpolated"
NOT_SERVED = "not served (stock)"
NOT_MEASURED = "not measured"
COUNTED = (MEASURED, INTERPOLATED, NOT_SERVED)


def engine_constant(path: Path, name: str):
    """A module-level literal of an engine module, read from its source (no torch import)."""
    for node in ast.parse(Path(path).read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            return ast.literal_eval(node.value)
    raise KeyError(f"{name} is not a module-level literal of {path}")


@dataclass(frozen=True)
class Model:
    """The widths the counted kernels read (HF ``config.json`` keys in ``from_config``)."""

    name: str
    hidden: int  # hidden_size: the draft head's K
    heads: int  # num_attention_heads
    head_dim: int  # wo_a's D = heads / o_groups * head_dim
    q_lora: int  # q_lora_rank (read by no counted kernel; kept for the record)
    o_groups: int  # wo_a's output groups G (all ranks)
    o_lora: int  # o_lora_rank: wo_a's R
    expert_width: int  # moe_intermediate_size (all ranks)
    experts: int  # n_routed_experts
    topk: int  # num_experts_per_tok
    vocab: int  # vocab_size: the draft head's N before the TP split
    layers: int  # num_hidden_layers, every one MoE
    draft_stages: int  # the DSpark draft's stages (its layers)
    source: str = "assumed"

    @classmethod
    def from_config(cls, cfg: dict, draft_stages: int, name: str = "config"):
        heads = int(cfg["num_attention_heads"])
        head_dim = int(
            cfg.get("head_dim")
            or int(cfg["qk_nope_head_dim"]) + int(cfg["qk_rope_head_dim"])
        )
        return cls(
            name=name,
            hidden=int(cfg["hidden_size"]),
            heads=heads,
            head_dim=head_dim,
            q_lora=int(cfg.get("q_lora_rank", 0)),
            o_groups=int(cfg["o_groups"]),
            o_lora=int(cfg["o_lora_rank"]),
            expert_width=int(cfg["moe_intermediate_size"]),
            experts=int(cfg["n_routed_experts"]),
            topk=int(cfg["num_experts_per_tok"]),
            vocab=int(cfg["vocab_size"]),
            layers=int(cfg["num_hidden_layers"]),
            draft_stages=int(draft_stages),
            source=f"read from {name}",
        )


# DeepSeek-V4.1-Flash's widths as the project states them (docs/b12x-moe.md: 384 experts,
# top 6, 2304 wide), with V4's head_dim 512 and o_lora_rank 1024 (configs/deepseek_v4.py). The
# kernel benchmarks ran at exactly these shapes (wo_a R = 1024, D = 4096; the draft head's K = 5120).
V41_FLASH = Model(
    name="DeepSeek-V4.1-Flash",
    hidden=5120,
    heads=64,
    head_dim=512,
    q_lora=1280,
    o_groups=8,
    o_lora=1024,
    expert_width=2304,
    experts=384,
    topk=6,
    vocab=129280,
    layers=43,
    draft_stages=3,
    source="assumed (the project's statement of V4.1-Flash's widths, not read from a checkpoint)",
)
MODELS = {"v4.1-flash": V41_FLASH}

# Output groups a rank holds where o_groups does not split evenly: docs/serving.md and
# docs/wo-a-fp8-twin.md state G = 4 at TP3 (padded); this tree's deepseek_v4.py computes
# n_local_groups = o_groups // attn_tp_size and pads nothing itself.
PADDED_GROUPS = {(8, 3): 4}


@dataclass(frozen=True)
class Flags:
    wo_a_twin: str = "off"  # --dsv4-wo-a-fp8-twin
    draft_head_fp8: bool = False  # --speculative-dspark-draft-head-fp8
    verify_cap: str | None = None  # --speculative-dspark-verify-cap: "K" or "conf:..."
    cap_mean_k: float | None = (
        None  # the drafts a conf: cap verifies per request, assumed
    )

    def label(self) -> str:
        parts = []
        if self.wo_a_twin != "off":
            parts.append(f"wo_a {self.wo_a_twin}")
        if self.draft_head_fp8:
            parts.append("head fp8")
        if self.verify_cap is not None:
            parts.append(f"cap {self.verify_cap}")
        return " + ".join(parts) or "flags off"


@dataclass(frozen=True)
class Setup:
    model: Model
    tp: int
    gamma: int
    bs: int
    flags: Flags
    device: str = "NVIDIA_H200"
    sample_from_anchor: bool = (
        True  # dspark_config.get_dspark_sample_from_anchor's default
    )
    mxfp8_wo_b: bool = False  # wo_b on FlashInfer's CuTe DSL MXFP8 backend (Blackwell)
    cuda_graph: bool = True  # the step replays a CUDA graph captured at graph_bs(bs)
    results: Path = RESULTS


@dataclass
class Site:
    """One call site of a fork kernel in one decode step."""

    feature: str
    site: str
    calls: int
    rows: int
    shape: dict
    code: str
    status: str = NOT_SERVED
    why: str = ""
    stock_us: float | None = None
    fork_us: float | None = None
    saved_us_per_call: float = 0.0
    source: str = ""

    @property
    def saved_us(self) -> float:
        return self.saved_us_per_call * self.calls if self.status in COUNTED else 0.0


# ------------------------------------------------------------------ shapes on one rank


def groups_per_rank(model: Model, tp: int) -> tuple[int, str]:
    if model.o_groups % tp == 0:
        return (
            model.o_groups // tp,
            "derived: o_groups // tp (deepseek_v4.py n_local_groups)",
        )
    if (model.o_groups, tp) in PADDED_GROUPS:
        return (
            PADDED_GROUPS[model.o_groups, tp],
            "assumed: padded, as docs/serving.md states (no padding in deepseek_v4.py)",
        )
    raise ValueError(
        f"{model.o_groups} output groups do not split over tp {tp}, and no padded group count "
        f"is known for it (known: {sorted(PADDED_GROUPS)})"
    )


def vocab_shard(vocab: int, tp: int) -> int:
    """``VocabParallelEmbedding``'s rows per rank: padded to 64, or to 64 * tp where 64 does not split."""

    def pad(v, to):
        return (v + to - 1) // to * to

    size = 64 if pad(vocab, 64) % tp == 0 else 64 * tp
    return pad(vocab, size) // tp


def graph_bs(bs: int) -> int:
    """The batch a speculative decode step's CUDA graph was captured at, so the rows its kernels
    see: the default capture sizes with a speculative algorithm
    (``arg_groups/cuda_graph_hook.generate_decode_cuda_graph_batch_sizes``: 1..8, then even to 32,
    every 4th to 64, every 8th to 256), padded up (``bisect_left`` over ``capture_bs``).
    """
    sizes = (
        list(range(1, 9))
        + list(range(10, 33, 2))
        + list(range(40, 65, 4))
        + list(range(72, 257, 8))
    )
    for size in sizes:
        if size >= bs:
            return size
    raise ValueError(f"bs {bs}: above the default capture sizes (256); run eager")


def count_sites(s: Setup) -> list[Site]:
    """The fork kernels' call sites in one decode step, with calls and rows (nothing timed)."""
    m, gamma = s.model, s.gamma
    bs = graph_bs(s.bs) if s.cuda_graph else s.bs
    g, _ = groups_per_rank(m, s.tp)
    wo_a_shape = {"G": g, "R": m.o_lora, "D": m.heads // m.o_groups * m.head_dim}
    draft_rows = bs * (gamma if s.sample_from_anchor else gamma + 1)
    sites = [
        Site(
            "--dsv4-wo-a-fp8-twin",
            "wo_a, target verify",
            m.layers,
            bs * (gamma + 1),
            {**wo_a_shape, "mxfp8": s.mxfp8_wo_b},
            "models/deepseek_v4.py: _apply_wo_a_bf16_matmul(wo_a_twin=...) per layer; "
            "dspark_config.py: verify_num_draft_tokens = gamma + 1",
        ),
        Site(
            "--dsv4-wo-a-fp8-twin",
            "wo_a, draft stages",
            m.draft_stages,
            draft_rows,
            {**wo_a_shape, "mxfp8": False},
            "models/deepseek_v4_dspark.py: each stage's _apply_wo_a_bf16_matmul(wo_a_twin=...); "
            "dspark_draft.py _run_forward: bs * query_token_num rows, TARGET_VERIFY",
        ),
        Site(
            "--speculative-dspark-draft-head-fp8",
            "draft LM head",
            1,
            bs * gamma,
            {"N": vocab_shard(m.vocab, s.tp), "K": m.hidden},
            "models/deepseek_v4_dspark.py _logits_from_x_post_hc: head_fp8.serves(rows); "
            "called once per step (dspark_draft_sampler.py _markov_block, dspark_draft.py propose)",
        ),
    ]
    if s.flags.verify_cap is not None:
        sites.append(
            Site(
                "--speculative-dspark-verify-cap",
                "routed experts, target verify",
                m.layers,
                bs * (gamma + 1),
                {
                    "hidden": m.hidden,
                    "experts": m.experts,
                    "topk": m.topk,
                    "inter_per_rank": m.expert_width // s.tp,
                    "gamma": gamma,
                },
                "dspark_verify_cap.py: rows past 1 + k take their anchor's experts in "
                "moe_fused_gate (router_live_rows.py), every MoE layer of the verify forward",
            )
        )
    return sites


# ------------------------------------------------------------------ which calls the fork serves


def wo_a_served(s: Setup, site: Site) -> tuple[bool, str]:
    """``apply_wo_a_fp8_twin``'s row gate (deepseek_v4_wo_a_twin.py), with its constants."""
    mode, rows, g = s.flags.wo_a_twin, site.rows, site.shape["G"]
    if mode == "off":
        return False, "flag off"
    hopper = s.device in HOPPER_DEVICES
    mxfp8 = site.shape["mxfp8"]
    mid_max = engine_constant(TWIN_MODULE, "MID_MAX_ROWS")
    if hopper:
        if 2 <= rows <= 8:
            if mxfp8 and (g, site.shape["R"]) != (2, 1024):
                return False, "MXFP8 epilogue exists for the TP4 shape only"
            return True, "small kernel, 2..8 rows"
        if rows == 1:
            return mode == "drop", "one row: served under drop only"
        top = (
            mid_max
            if mode == "drop"
            else (
                engine_constant(TWIN_MODULE, "MID_FASTER_MAX").get(g, 16)
                if mode == "mid"
                else 0
            )
        )
        if mxfp8:
            return False, "MXFP8 calls above 8 rows stay stock"
        if 9 <= rows <= top:
            return True, f"{mode}: 9..{top} rows"
        return False, f"{rows} rows: above what {mode} serves ({max(top, 8)})"
    if mxfp8:
        return False, "MXFP8 calls stay stock off Hopper"
    if 2 <= rows <= 8 or (mode in ("mid", "drop") and 9 <= rows <= mid_max):
        return True, "portable Triton kernel"
    return False, f"{rows} rows: not served by the portable kernel under {mode}"


def head_served(s: Setup, site: Site) -> tuple[bool, str]:
    if not s.flags.draft_head_fp8:
        return False, "flag off"
    kernel = "wgmma" if s.device in HOPPER_DEVICES else "mma.sync"
    top = engine_constant(HEAD_MODULE, "MAX_ROWS")[kernel]
    if 1 <= site.rows <= top:
        return True, f"1..{top} rows"
    return False, f"{site.rows} rows: above {top}, the bf16 head serves"


def cap_k(flags: Flags, gamma: int) -> tuple[float, str]:
    """The drafts a request verifies under the cap: K itself, or the assumed mean under conf:."""
    value = flags.verify_cap
    if value.startswith("conf:"):
        if flags.cap_mean_k is None:
            raise ValueError(
                f"--speculative-dspark-verify-cap {value}: the drafts it verifies depend on the "
                "confidence head; give the assumed mean with --cap-mean-k"
            )
        return float(flags.cap_mean_k), "assumed (mean of the conf: rule)"
    k = int(value)
    if not 1 <= k <= gamma:
        raise ValueError(
            f"--speculative-dspark-verify-cap {k}: outside 1..gamma ({gamma})"
        )
    return float(k), "derived: the fixed cap"


# ------------------------------------------------------------------ the measured savings


def result_file(results: Path, name: str) -> tuple[Path | None, str]:
    """``results/<name>``, else ``results/archive/<name>`` (an older build's file, kept until
    its re-run lands: named ``archive/<name>`` wherever the model cites it); (None, name)
    when neither exists."""
    for path, cited in (
        (results / name, name),
        (results / "archive" / name, f"archive/{name}"),
    ):
        if path.is_file():
            return path, cited
    return None, name


def _load(s: Setup, name: str) -> tuple[dict | None, str]:
    path, cited = result_file(s.results, f"{name}-{s.device}.json")
    if path is None:
        return None, f"no measurement on {s.device.replace('_', ' ')}"
    return json.loads(path.read_text()), cited


def interpolate(points: dict[float, tuple[float, str]], x: float):
    """``points``: {x: (value, kernel)}. (value, status, note) at ``x``: measured where x is a
    point, linear between the two neighbouring points when both ran the same kernel, else None.
    """
    if x in points:
        return points[x][0], MEASURED, f"at {x:g}"
    lower = [p for p in points if p < x]
    upper = [p for p in points if p > x]
    if not lower or not upper:
        return (
            None,
            NOT_MEASURED,
            f"{x:g} outside the measured {min(points):g}..{max(points):g}",
        )
    lo, hi = max(lower), min(upper)
    if points[lo][1] != points[hi][1]:
        return (
            None,
            NOT_MEASURED,
            f"{x:g} between {lo:g} ({points[lo][1]}) and {hi:g} ({points[hi][1]}): kernels differ",
        )
    t = (x - lo) / (hi - lo)
    value = points[lo][0] + t * (points[hi][0] - points[lo][0])
    return value, INTERPOLATED, f"between {lo:g} and {hi:g}"


def _fill(site: Site, status: str, note: str, stock=None, fork=None, source=""):
    site.status = status
    site.why = note if not site.why else f"{site.why}; {note}"
    site.source = source
    if stock is not None and fork is not None:
        site.stock_us, site.fork_us = stock, fork
        site.saved_us_per_call = stock - fork


def time_wo_a(s: Setup, site: Site) -> None:
    data, source = _load(s, "wo_a_fp8")
    if data is None:
        return _fill(site, NOT_MEASURED, source)
    shape = site.shape
    if (data["R"], data["D"]) != (shape["R"], shape["D"]):
        return _fill(
            site,
            NOT_MEASURED,
            f"measured at R={data['R']}, D={data['D']}, not {shape['R']}, {shape['D']}",
            source=source,
        )
    stock_key, fork_key = (
        ("stock_mx_us", "twin_mx_us") if shape["mxfp8"] else ("einsum_us", "twin_us")
    )
    points = {}
    for r in data["rows"]:
        if r["G"] != shape["G"]:
            continue
        stock, fork = r.get(stock_key), r.get(fork_key)
        if stock is None or fork is None or math.isnan(stock) or math.isnan(fork):
            continue
        points[float(r["M"])] = ((stock, fork), r["kernel"])
    if not points:
        return _fill(
            site,
            NOT_MEASURED,
            f"G={shape['G']}{' MXFP8' if shape['mxfp8'] else ''} not measured",
            source=source,
        )
    stock, _, _ = interpolate({x: (t[0], k) for x, (t, k) in points.items()}, site.rows)
    fork, status, note = interpolate(
        {x: (t[1], k) for x, (t, k) in points.items()}, site.rows
    )
    if fork is None:
        return _fill(site, status, f"G={shape['G']}: {note}", source=source)
    stock_what = "upstream's MXFP8 small-batch kernel" if shape["mxfp8"] else "einsum"
    _fill(
        site,
        status,
        f"G={shape['G']} rows {note}; stock on Hopper: {stock_what}",
        stock,
        fork,
        source,
    )


def time_head(s: Setup, site: Site) -> None:
    data, source = _load(s, "draft_head_fp8")
    if data is None:
        return _fill(site, NOT_MEASURED, source)
    if data["K"] != site.shape["K"]:
        return _fill(
            site,
            NOT_MEASURED,
            f"measured at K={data['K']}, not {site.shape['K']}",
            source=source,
        )
    rows = [r for r in data["rows"] if r["N"] == site.shape["N"] and r["served"]]
    if not rows:
        return _fill(
            site,
            NOT_MEASURED,
            f"vocab shard N={site.shape['N']} not measured "
            f"(measured: {sorted({r['N'] for r in data['rows']})})",
            source=source,
        )
    stock, _, _ = interpolate(
        {float(r["rows"]): (r["stock_us"], r["kernel"]) for r in rows}, site.rows
    )
    fork, status, note = interpolate(
        {float(r["rows"]): (r["fp8_us"], r["kernel"]) for r in rows}, site.rows
    )
    if fork is None:
        return _fill(site, status, f"N={site.shape['N']}: {note}", source=source)
    _fill(site, status, f"N={site.shape['N']} rows {note}", stock, fork, source)


def time_cap(s: Setup, site: Site, k: float) -> None:
    data, source = _load(s, "verify_cap_moe")
    if data is None:
        return _fill(site, NOT_MEASURED, source)
    want = {
        key: site.shape[key] for key in ("hidden", "experts", "topk", "inter_per_rank")
    }
    got = {key: data[key] for key in want}
    # the benchmark's gamma: its largest k verifies every draft (no cap)
    drafts = max(int(r["k"]) for r in data["rows"])
    if want != got or site.shape["gamma"] != drafts:
        return _fill(
            site,
            NOT_MEASURED,
            f"measured at {got}, gamma {drafts}; this model's experts are {want}, gamma "
            f"{site.shape['gamma']}",
            source=source,
        )
    by_bs: dict[float, dict[float, tuple[float, str]]] = {}
    for r in data["rows"]:
        saved = r["moe_us_no_cap"] - r["moe_us_cap"]
        by_bs.setdefault(float(r["bs"]), {})[float(r["k"])] = (saved, "fused_moe")
    at_bs = {}
    notes = []
    for bs, ks in by_bs.items():
        value, status, note = interpolate(ks, k)
        if value is not None:
            at_bs[bs] = (value, "fused_moe")
            notes.append(status)
    batch = site.rows // (site.shape["gamma"] + 1)  # the graph's batch, padded
    saved, status, note = (
        interpolate(at_bs, batch) if at_bs else (None, NOT_MEASURED, "k")
    )
    if saved is None:
        return _fill(site, status, f"bs {note}", source=source)
    if INTERPOLATED in notes:
        status = INTERPOLATED
    site.status = status
    site.why = f"k = {k:g}, bs {note}; per MoE layer, fp8 fused_moe_triton experts"
    site.source = source
    site.saved_us_per_call = saved


def predict(s: Setup) -> dict:
    """The predicted saving per decode step of one setup, every site with its status."""
    sites = count_sites(s)
    inputs = {
        "model": {**asdict(s.model), "mark": s.model.source},
        "tp": {"value": s.tp, "mark": "given"},
        "gamma": {"value": s.gamma, "mark": "assumed (V4.1-Flash's DSpark block: 5)"},
        "bs": {"value": s.bs, "mark": "given"},
        "graph_bs": {
            "value": graph_bs(s.bs) if s.cuda_graph else s.bs,
            "mark": (
                "derived: the default speculative CUDA-graph capture sizes (assumed "
                "--cuda-graph-bs unset)"
                if s.cuda_graph
                else "eager"
            ),
        },
        "device": {"value": s.device, "mark": "given"},
        "groups_per_rank": dict(zip(("value", "mark"), groups_per_rank(s.model, s.tp))),
        "sample_from_anchor": {
            "value": s.sample_from_anchor,
            "mark": "assumed: dspark_config.get_dspark_sample_from_anchor's default (True)",
        },
        "mxfp8_wo_b": {
            "value": s.mxfp8_wo_b,
            "mark": "assumed: off, FlashInfer's CuTe DSL MXFP8 wo_b is a Blackwell backend",
        },
        "flags": asdict(s.flags),
    }
    for site in sites:
        if site.feature == "--dsv4-wo-a-fp8-twin":
            served, why = wo_a_served(s, site)
            site.why = why
            if served:
                time_wo_a(s, site)
        elif site.feature == "--speculative-dspark-draft-head-fp8":
            served, why = head_served(s, site)
            site.why = why
            if served:
                time_head(s, site)
        else:
            k, mark = cap_k(s.flags, s.gamma)
            inputs["cap_k"] = {"value": k, "mark": mark}
            site.why = f"live rows {s.bs} x (1 + {k:g}) of {site.rows}"
            if k >= s.gamma:
                site.why += ": the cap cuts nothing"
            else:
                time_cap(s, site, k)
    missing = [f"{x.site}: {x.why}" for x in sites if x.status == NOT_MEASURED]
    return {
        "label": s.flags.label(),
        "inputs": inputs,
        "sites": [{**asdict(x), "saved_us": x.saved_us} for x in sites],
        "saved_us_per_step": sum(x.saved_us for x in sites),
        "complete": not missing,
        "not_measured": missing,
    }


# ------------------------------------------------------------------ against a measurement


def explains(
    prediction: dict,
    stock_step_us: float,
    fork_step_us: float,
    tol=TOLERANCE,
    ci_us: float | None = None,
) -> dict:
    """Whether ``prediction`` accounts for a measured step-time change (stock minus fork):
    within ``tol`` of the measured change, and only from a complete prediction. ``ci_us``, the
    half-width of the change's 95 % interval, widens the margin where the change itself is
    within noise (a prediction of zero against a change of zero +- ci)."""
    change = stock_step_us - fork_step_us
    predicted = prediction["saved_us_per_step"]
    out = {
        "stock_step_us": stock_step_us,
        "fork_step_us": fork_step_us,
        "measured_change_us": change,
        "predicted_us": predicted,
        "tolerance": tol,
        "ratio": predicted / change if change else None,
    }
    if not prediction["complete"]:
        return {
            **out,
            "explained": False,
            "why": "the prediction is incomplete: "
            + "; ".join(prediction["not_measured"]),
        }
    margin = max(tol * abs(change), ci_us or 0.0)
    ok = abs(predicted - change) <= margin
    why = (
        f"predicted {predicted:.1f} us against a measured {change:.1f} us"
        + (f" +- {ci_us:.1f}" if ci_us else "")
        + f": {'within' if ok else 'outside'} {margin:.1f} us "
        f"(a third of the measured change{', or its interval' if ci_us else ''})"
    )
    return {**out, "explained": ok, "why": why}


# ------------------------------------------------------------------ the report


BATCHES = (1, 2, 4, 8, 16, 32)
FLAG_SETS = (
    Flags(wo_a_twin="small"),
    Flags(wo_a_twin="mid"),
    Flags(draft_head_fp8=True),
    Flags(wo_a_twin="mid", draft_head_fp8=True),
    Flags(verify_cap="3"),
    Flags(wo_a_twin="mid", draft_head_fp8=True, verify_cap="3"),
)
# (title, tp, device): the H200 lines the project measures on; the GB10 line (one GPU per node,
# three or four nodes, docs/b12x-roce-all-gather.md).
LINES = (
    ("H200, TP4", 4, "NVIDIA_H200"),
    ("H200, TP1", 1, "NVIDIA_H200"),
    ("GB10 line, TP3 (per rank)", 3, "NVIDIA_GB10"),
    ("GB10 line, TP4 (per rank)", 4, "NVIDIA_GB10"),
)


def report(
    model: Model = V41_FLASH,
    gamma: int = 5,
    batches=BATCHES,
    flag_sets=FLAG_SETS,
    lines=LINES,
    results: Path = RESULTS,
) -> dict:
    out, code, marks = [], {}, {}
    for title, tp, device in lines:
        for flags in flag_sets:
            for bs in batches:
                p = predict(
                    Setup(model, tp, gamma, bs, flags, device=device, results=results)
                )
                p["inputs"].pop("model")  # once, at the top
                for name, value in p["inputs"].items():  # marks once, values per row
                    if isinstance(value, dict) and "mark" in value:
                        marks.setdefault(name, set()).add(value["mark"])
                        p["inputs"][name] = value["value"]
                for site in p["sites"]:
                    code[site["site"]] = site.pop("code")
                    for key in ("stock_us", "fork_us", "saved_us_per_call", "saved_us"):
                        if isinstance(site[key], float):
                            site[key] = round(site[key], 3)
                p["saved_us_per_step"] = round(p["saved_us_per_step"], 3)
                out.append({"line": title, "tp": tp, "bs": bs, **p, "cell": _cell(p)})
    return {
        "benchmark": "cost_model",
        "what": "predicted time saved per DSpark decode step (us, one rank) by the fork's "
        "speed flags: calls counted from the engine code, times the per-call saving measured "
        "by the kernel benchmarks; no end-to-end measurement behind it",
        "model": {**asdict(model), "mark": model.source},
        "gamma": gamma,
        "marks": {name: sorted(m) for name, m in marks.items()},
        "code": code,
        "lines": [{"line": t, "tp": tp, "device": d} for t, tp, d in lines],
        "served": {t: served_table(model, gamma, tp, d, batches) for t, tp, d in lines},
        "rows": out,
        "step_share": step_share(model, gamma, batches=batches, results=results),
    }


def _cell(p: dict) -> str:
    done = sum(1 for x in p["sites"] if x["status"] in (MEASURED, INTERPOLATED))
    saved = p["saved_us_per_step"]
    if not p["complete"]:
        no_device = [w for w in p["not_measured"] if "no measurement on" in w]
        if done == 0 and no_device:
            return "no measurement on " + no_device[0].split("no measurement on ")[1]
        if done == 0:
            return "not measured"
        return f">= {saved:.0f} (part not measured)"
    if done == 0:
        return "0 (stock)"
    mark = (
        "*"
        if any(x["status"] == INTERPOLATED for x in p["sites"] if x["saved_us"])
        else ""
    )
    return f"{saved:.0f}{mark}"


def served_table(
    model: Model, gamma: int, tp: int, device: str, batches=BATCHES
) -> str:
    """Rows per call of every site, all flags on (wo_a mid, head fp8, cap 3), and whether the
    fork serves it there: the part of the model that needs no timing."""
    flags = Flags("mid", True, "3")
    out = [
        "| site | calls/step | " + " | ".join(f"bs {b}" for b in batches) + " |",
        "| --- | --- |" + " --- |" * len(batches),
    ]
    per: dict = {}
    for bs in batches:
        s = Setup(model, tp, gamma, bs, flags, device=device)
        for site in count_sites(s):
            if site.feature == "--dsv4-wo-a-fp8-twin":
                served = wo_a_served(s, site)[0]
            elif site.feature == "--speculative-dspark-draft-head-fp8":
                served = head_served(s, site)[0]
            else:
                served = True
            cell = f"{site.rows} {'served' if served else 'stock'}"
            if site.feature == "--speculative-dspark-verify-cap":
                cell = f"{site.rows} capped"
            per.setdefault((site.site, site.calls), []).append(cell)
    for (name, calls), cells in per.items():
        out.append(f"| {name} | {calls} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def render(rep: dict) -> str:
    from docs_tables import cost_model_table  # the docs render the same table

    parts = [
        f"{rep['model']['name']}, gamma {rep['gamma']}: predicted us saved per decode step and rank "
        "(* = an interpolated shape; '0 (stock)' = no call is served at this batch)."
    ]
    for line in rep["lines"]:
        title = line["line"]
        rows = [r for r in rep["rows"] if r["line"] == title]
        parts += ["", f"## {title}", ""]
        unmeasured = any(r["cell"].startswith("no measurement on") for r in rows)
        if unmeasured and not any(r["saved_us_per_step"] for r in rows):
            device = line["device"].replace("_", " ")
            parts += [
                f"No measurement on {device}: no saving is predicted. Rows per call on one "
                "rank, all flags on (wo_a mid, head fp8, cap 3), served by the fork or stock:",
                "",
                rep["served"][title],
            ]
        else:
            parts.append(cost_model_table(rep, title))
    parts += ["", render_step_share(rep["step_share"])]
    return "\n".join(parts)


def render_step_share(s: dict) -> str:
    from docs_tables import step_share_table  # the docs render the same table

    return (
        f"## {s['device'].replace('_', ' ')}, TP{s['tp']}: the step by kernel group\n\n"
        f"{s['model']}, gamma {s['gamma']}, {s['routing']} routing: us per decode step on one "
        "rank, every fork flag off, and what each flag set saves of it.\n\n"
        + step_share_table(s)
    )


# ------------------------------------------------------------------ the step, kernel group by kernel group

HARNESS = REPO / "benchmark" / "harness.py"
ASSUMED = "assumed"
NONE = "none"
GROUPS = (
    "routed experts",
    "dense linears",
    "wo_a",
    "LM heads",
    "attention",
    "all-reduce",
    "other",
)
# The step table models one device: its assumed figures divide by that device's HBM bandwidth.
STEP_DEVICE = "NVIDIA_H200"
# The MoE runner benchmark's result files (benchmark/moe_verify/), read in this order: the step's
# own device first; another device's figures carry that device's name.
MOE_DEVICES = ("NVIDIA_H200", "NVIDIA_H100_80GB_HBM3")
# The benchmark's shape names, for a row that carries its name but not its widths.
MOE_SHAPES = {
    "v41_flash_tp4": (5120, 576),
    "v41_flash_tp1": (5120, 2304),
    "v4_tp4": (7168, 768),
}
MOE_FLAG = "moe triton_mxfp4"  # --moe-runner-backend triton_mxfp4
NO_UPSTREAM = "upstream has no default path: not a saving"
UPSTREAM_KEY = re.compile(r"upstream_(?P<route>.+)_us")
ROUTINGS = ("random", "shared")


@dataclass(frozen=True)
class StepAssumptions:
    """The figures the step table assumes where no result file times a kernel group. Each goes
    into the JSON with its reason (``ASSUMPTION_WHY``); none is read from a checkpoint or a GPU.
    """

    kernel_us: float = 3.0
    expert_bytes_per_weight: float = 0.53125
    dense_bytes_per_weight: float = 1 + 4 / 1024
    router_bytes_per_weight: float = 2.0
    shared_experts: int = 1
    index_topk: int = 512
    window: int = 128
    kv_entry_bytes: int = 656
    attention_kernels: int = 4
    collective_us: float = 10.0
    nvlink_gbps: float = 450.0
    logits_bytes_per_value: int = 2
    other_kernels_per_layer: int = 17
    other_kernels_per_step: int = 20

    def marked(self) -> dict:
        return {
            name: {"value": value, "why": ASSUMPTION_WHY[name]}
            for name, value in asdict(self).items()
        }


ASSUMPTION_WHY = {
    "kernel_us": "the fixed cost of one kernel in the CUDA graph (launch, ramp, tail), added to "
    "every assumed call; kernel_us_check holds what the measured stock GEMMs take over the time "
    "of their bytes",
    "expert_bytes_per_weight": "MXFP4 routed experts: an e2m1 nibble per weight and a ue8m0 "
    "scale per 32 weights",
    "dense_bytes_per_weight": "dense linears in e4m3 with one fp32 scale per 32 x 32 block, as "
    "DeepSeek-V4.1 ships them",
    "router_bytes_per_weight": "the router's gate in bf16",
    "shared_experts": "shared experts per layer, each as wide as a routed one and split over "
    "the TP ranks like a dense MLP (not fused into the routed experts' call)",
    "index_topk": "cache entries the sparse attention selects per query: DeepSeekV4Config's "
    "default (configs/deepseek_v4.py), not read from a V4.1-Flash checkpoint",
    "window": "the sliding window's entries per query: DeepSeekV4Config's default",
    "kv_entry_bytes": "one cache entry in FlashMLA's fp8 sparse layout (512 e4m3, 4 fp32 "
    "scales, 64 bf16 rope values), read once per query row (rows of one request are not "
    "assumed to share reads)",
    "attention_kernels": "kernels per attention layer: the indexer's logits, its top-k, the "
    "sparse decode and its metadata",
    "collective_us": "one TP collective's fixed latency at TP4 on NVLink (the stand-in "
    "collective of benchmark/l2_prefetch)",
    "nvlink_gbps": "NVLink bandwidth per direction (the H200's specification), for the bytes "
    "a ring moves: 2 (tp - 1) / tp of an all-reduce's message, (tp - 1) / tp of a gather",
    "logits_bytes_per_value": "the target's logits gathered over the TP ranks in bf16",
    "other_kernels_per_layer": "small kernels per layer outside the other groups: "
    "hyper-connection mixing before and after both sublayers (4), q and kv norms (2), rope "
    "and the cache store (2), fp8 activation quantisation before the dense linears (5), the "
    "router's top-k (1), the experts' alignment (1), the shared expert's activation (1), the "
    "expert sum (1)",
    "other_kernels_per_step": "small kernels once per step: embedding, the final norm and "
    "hyper-connection head, the verify's accept and sampling, the draft's Markov block over "
    "its positions, input preparation",
}

NOT_MODELLED = (
    "compute: an assumed time is bytes over bandwidth plus a fixed cost, a lower bound where "
    "a call is compute-bound (attention and the dense linears at the larger batches)",
    "the indexer's and the compressor's own linears and their read of the compressed keys "
    "(it grows with the context)",
    "the draft's main_proj (its width depends on the checkpoint's dspark_target_layer_ids) "
    "and its Markov head's weights",
    "V4.1's Engram layers (their lookups and all-reduces)",
    "host time and overlap: the kernels are added as if the step were GPU-bound",
)


@dataclass
class Part:
    """One part of a kernel group's time in one step: ``calls`` calls of ``us_per_call`` each,
    with its status (measured, interpolated between two measured row counts, or assumed) and
    where the figure comes from. A part is never a mix: a call whose rows lie outside what its
    result file measured is assumed as a whole."""

    group: str
    part: str
    calls: int
    rows: int
    us_per_call: float
    status: str
    source: str
    device: str | None = None  # the device that measured it, where not the step's

    @property
    def us(self) -> float:
        return self.calls * self.us_per_call


def hbm_tbps() -> float:
    """The H200's measured HBM read bandwidth, as the kernel benchmarks' floor divides by it."""
    return float(engine_constant(HARNESS, "HBM_TBPS"))


def bytes_us(nbytes: float, tbps: float) -> float:
    return nbytes / (tbps * 1e6)


def distinct_experts(model: Model, rows: int) -> float:
    """The expected distinct experts a call of ``rows`` rows reads when every row draws its
    top-k uniformly: more than a trained router's, whose rows of one request share experts.
    """
    return model.experts * (1 - (1 - model.topk / model.experts) ** rows)


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _result(results: Path, name: str, device: str) -> tuple[dict | None, str]:
    path, cited = result_file(results, f"{name}-{device}.json")
    if path is None:
        return None, f"no {cited}"
    return json.loads(path.read_text()), cited


Points = dict[float, tuple[float, str]]


def _read(points: Points, rows: int) -> tuple[float | None, str, str]:
    """(value, status, note) at ``rows``: measured, interpolated, or None outside the points."""
    if not points:
        return None, NOT_MEASURED, "no measured rows"
    return interpolate(points, rows)


def _span(points: Points) -> str:
    return f"{min(points):g}..{max(points):g} rows" if points else "no rows"


def _timed(
    group: str,
    part: str,
    calls: int,
    rows: int,
    points: Points,
    source: str,
    assumed_us: float,
    assumed_source: str,
) -> Part:
    """The part from its measured points where they cover ``rows``, else assumed as a whole."""
    value, status, note = _read(points, rows)
    if value is not None:
        return Part(group, part, calls, rows, value, status, f"{source}, rows {note}")
    return Part(
        group,
        part,
        calls,
        rows,
        assumed_us,
        ASSUMED,
        f"{assumed_source} ({source}: {note}, not extrapolated)",
    )


def _gemm_us(
    k: int,
    n: int,
    rows: int,
    weight_bytes: float,
    a: StepAssumptions,
    tbps: float,
    act_in: float = 1.0,
) -> float:
    """An assumed linear: its weights, its input and bf16 output at the floor, plus one kernel."""
    nbytes = k * n * weight_bytes + rows * (k * act_in + n * 2)
    return bytes_us(nbytes, tbps) + a.kernel_us


@dataclass(frozen=True)
class StockFiles:
    """The measured stock times the step reads besides the experts: Hopper's ``wo_a`` einsum
    per row count at this rank's G, and cuBLAS's bf16 LM head per row count at this rank's
    vocab shard (the fp8 draft head benchmark's baseline)."""

    wo_a: Points
    wo_a_file: str
    head: Points
    head_file: str

    @classmethod
    def read(cls, results: Path, model: Model, tp: int) -> StockFiles:
        g, _ = groups_per_rank(model, tp)
        wo_a, wo_a_file = _result(results, "wo_a_fp8", STEP_DEVICE)
        head, head_file = _result(results, "draft_head_fp8", STEP_DEVICE)
        d = model.heads // model.o_groups * model.head_dim
        wo_a_points: Points = {}
        if wo_a is not None and (wo_a["R"], wo_a["D"]) == (model.o_lora, d):
            wo_a_points = {
                float(r["M"]): (r["einsum_us"], "einsum")
                for r in wo_a["rows"]
                if r["G"] == g and _finite(r.get("einsum_us"))
            }
        head_points: Points = {}
        if head is not None and head["K"] == model.hidden:
            head_points = {
                float(r["rows"]): (r["stock_us"], "cuBLAS bf16")
                for r in head["rows"]
                if r["N"] == vocab_shard(model.vocab, tp) and _finite(r.get("stock_us"))
            }
        return cls(wo_a_points, wo_a_file, head_points, head_file)


def load_moe(results: Path) -> tuple[dict | None, str, str | None]:
    """The MoE runner benchmark's result: the step's device's file, else another Hopper's."""
    for device in MOE_DEVICES:
        data, name = _result(results, "moe_verify", device)
        if data is not None:
            return data, name, device
    return None, "no moe_verify result file", None


def moe_rows(data: dict, model: Model, tp: int, routing: str) -> list[dict]:
    """The benchmark's rows at this rank's expert shape and this routing."""
    if (data.get("experts", model.experts), data.get("topk", model.topk)) != (
        model.experts,
        model.topk,
    ):
        return []
    want = (model.hidden, model.expert_width // tp)

    def shape(r: dict) -> tuple | None:
        if "hidden" in r and "inter" in r:
            return (r["hidden"], r["inter"])
        return MOE_SHAPES.get(r.get("shape"))

    return [
        r
        for r in data.get("rows", [])
        if r.get("routing") == routing and shape(r) == want
    ]


def _moe_points(rows_of: list[dict], key: str) -> Points:
    return {float(r["rows"]): (r[key], "moe") for r in rows_of if _finite(r.get(key))}


def moe_site(
    model: Model,
    tp: int,
    routing: str,
    site: str,
    calls: int,
    rows: int,
    moe: tuple[dict | None, str, str | None],
    a: StepAssumptions,
    tbps: float,
) -> tuple[Part, dict]:
    """The routed experts of one call site: the step's time, and the MoE runner's saving.

    The step takes upstream's time where the MoE benchmark measured an upstream route at these
    rows (the fastest one, so the saving is the smallest measured), else the fork's runner
    (``fork_us``: upstream has no path there, and the step cannot run without one), else the
    floor: the expected distinct experts' bytes at the HBM bandwidth, assumed. The saving is
    upstream's time minus the fork's where both are measured at these rows."""
    data, source, device = moe
    per_expert_bytes = (
        3 * model.hidden * (model.expert_width // tp) * a.expert_bytes_per_weight
    )
    experts = distinct_experts(model, rows)
    floor = bytes_us(experts * per_expert_bytes, tbps)
    floor_source = (
        f"assumed: the floor, {experts:.1f} distinct experts x "
        f"{per_expert_bytes / 1e6:.2f} MB at {tbps:g} TB/s"
    )
    name = f"{site}: one MoE call per layer"
    if data is None:
        part = Part(
            "routed experts",
            name,
            calls,
            rows,
            floor,
            ASSUMED,
            f"{floor_source} ({source})",
        )
        return part, {"status": "no upstream", "why": source}
    rows_of = moe_rows(data, model, tp, routing)
    shape = f"hidden {model.hidden}, {model.expert_width // tp} wide, {routing} routing"
    mark = None if device == STEP_DEVICE else str(device).replace("_", " ")
    fork, fork_status, fork_note = _read(_moe_points(rows_of, "fork_us"), rows)
    routes = sorted(
        {
            m.group("route")
            for r in rows_of
            for k in r
            if (m := UPSTREAM_KEY.fullmatch(k))
        }
    )
    best = None
    for route in routes:
        value, status, note = _read(_moe_points(rows_of, f"upstream_{route}_us"), rows)
        if value is not None and (best is None or value < best[0]):
            best = (value, status, note, route)
    if best is not None:
        part = Part(
            "routed experts",
            name,
            calls,
            rows,
            best[0],
            best[1],
            f"{source} upstream_{best[3]}_us ({shape}), rows {best[2]}: upstream's "
            f"{best[3]} route",
            mark,
        )
    elif fork is not None:
        part = Part(
            "routed experts",
            name,
            calls,
            rows,
            fork,
            fork_status,
            f"{source} fork_us ({shape}), rows {fork_note}: the fork's triton_mxfp4 runner, "
            "upstream having no measured path here",
            mark,
        )
    else:
        part = Part(
            "routed experts",
            name,
            calls,
            rows,
            floor,
            ASSUMED,
            f"{floor_source} ({source}, {shape}: {fork_note}, not extrapolated)",
        )
    if best is not None and fork is not None:
        status = INTERPOLATED if INTERPOLATED in (best[1], fork_status) else MEASURED
        saving = {
            "status": status,
            "saved_us": calls * (best[0] - fork),
            "why": f"upstream's {best[3]} route minus the fork's runner",
        }
    elif any(_moe_points(rows_of, f"upstream_{r}_us") for r in routes):
        saving = {
            "status": NOT_MEASURED,
            "why": f"{rows} rows: upstream and the fork not both measured",
        }
    else:
        saving = {
            "status": "no upstream",
            "why": f"{source}: no upstream route measured",
        }
    return part, saving


def step_parts(
    model: Model,
    gamma: int,
    tp: int,
    bs: int,
    results: Path = RESULTS,
    routing: str = "random",
    a: StepAssumptions = StepAssumptions(),
) -> tuple[list[Part], list[dict]]:
    """Every kernel group's parts in one DSpark decode step on one rank, every fork flag off,
    and the MoE runner's saving per call site. The target verifies ``bs * (gamma + 1)`` rows
    over every layer, the draft runs ``bs * gamma`` rows (it samples from its anchor) over its
    stages, batches padded to their CUDA graph's size."""
    tbps = hbm_tbps()
    b = graph_bs(bs)
    g, _ = groups_per_rank(model, tp)
    vocab = vocab_shard(model.vocab, tp)
    moe = load_moe(results)
    stock = StockFiles.read(results, model, tp)
    d_wo_a = model.heads // model.o_groups * model.head_dim
    shared = model.expert_width // tp * a.shared_experts
    fp8 = a.dense_bytes_per_weight
    dense = (  # (name, K, N, bytes per weight, bytes per input value)
        ("wq_a + wkv (fused)", model.hidden, model.q_lora + model.head_dim, fp8, 1.0),
        ("wq_b", model.q_lora, model.heads * model.head_dim // tp, fp8, 1.0),
        ("wo_b", g * model.o_lora, model.hidden, fp8, 1.0),
        ("shared expert w13", model.hidden, 2 * shared, fp8, 1.0),
        ("shared expert w2", shared, model.hidden, fp8, 1.0),
        ("router gate", model.hidden, model.experts, a.router_bytes_per_weight, 2.0),
    )
    at = f"at {tbps:g} TB/s + {a.kernel_us:g} us"
    parts: list[Part] = []
    savings: list[dict] = []
    sites = (
        ("target verify", model.layers, b * (gamma + 1)),
        ("draft stages", model.draft_stages, b * gamma),
    )
    for site, calls, rows in sites:
        part, saving = moe_site(model, tp, routing, site, calls, rows, moe, a, tbps)
        parts.append(part)
        savings.append({"site": site, "calls": calls, "rows": rows, **saving})
        for name, k, n, wb, act in dense:
            parts.append(
                Part(
                    "dense linears",
                    f"{site}: {name} ({k} x {n})",
                    calls,
                    rows,
                    _gemm_us(k, n, rows, wb, a, tbps, act),
                    ASSUMED,
                    f"assumed: weights, input and bf16 output {at}",
                )
            )
        wo_a_bytes = (
            g * model.o_lora * d_wo_a * 2 + rows * g * (d_wo_a + model.o_lora) * 2
        )
        parts.append(
            _timed(
                "wo_a",
                f"{site}: wo_a (G = {g})",
                calls,
                rows,
                stock.wo_a,
                f"{stock.wo_a_file} einsum_us (Hopper's stock)",
                bytes_us(wo_a_bytes, tbps) + a.kernel_us,
                f"assumed: the bf16 weight, input and output {at}",
            )
        )
        kv = rows * (a.index_topk + a.window) * a.kv_entry_bytes
        parts.append(
            Part(
                "attention",
                f"{site}: sparse attention",
                calls,
                rows,
                bytes_us(kv, tbps) + a.attention_kernels * a.kernel_us,
                ASSUMED,
                f"assumed: {a.index_topk + a.window} cache entries of {a.kv_entry_bytes} "
                f"bytes per row at {tbps:g} TB/s + {a.attention_kernels} kernels of "
                f"{a.kernel_us:g} us",
            )
        )
        if tp > 1:
            msg = rows * model.hidden * 2
            parts.append(
                Part(
                    "all-reduce",
                    f"{site}: after attention and after the MoE",
                    2 * calls,
                    rows,
                    a.collective_us + 2 * (tp - 1) / tp * msg / (a.nvlink_gbps * 1e3),
                    ASSUMED,
                    f"assumed: {a.collective_us:g} us + a ring's bytes of a "
                    f"{msg / 1e3:.0f} kB bf16 message at {a.nvlink_gbps:g} GB/s",
                )
            )
        parts.append(
            Part(
                "other",
                f"{site}: small kernels of a layer",
                calls * a.other_kernels_per_layer,
                rows,
                a.kernel_us,
                ASSUMED,
                f"assumed: {a.other_kernels_per_layer} kernels a layer of {a.kernel_us:g} us",
            )
        )
    for name, rows in (("target verify", b * (gamma + 1)), ("draft", b * gamma)):
        parts.append(
            _timed(
                "LM heads",
                f"{name}: LM head (N = {vocab}, K = {model.hidden})",
                1,
                rows,
                stock.head,
                f"{stock.head_file} stock_us (cuBLAS bf16)",
                _gemm_us(model.hidden, vocab, rows, 2.0, a, tbps, act_in=2.0),
                f"assumed: the bf16 shard, input and output {at}",
            )
        )
    if tp > 1:
        gathered = b * (gamma + 1) * vocab * tp * a.logits_bytes_per_value
        parts.append(
            Part(
                "all-reduce",
                "target verify: the logits' all-gather",
                1,
                b * (gamma + 1),
                a.collective_us + (tp - 1) / tp * gathered / (a.nvlink_gbps * 1e3),
                ASSUMED,
                f"assumed: {a.collective_us:g} us + a ring's bytes of {gathered / 1e6:.1f} "
                f"MB gathered at {a.nvlink_gbps:g} GB/s",
            )
        )
        parts.append(
            Part(
                "all-reduce",
                "draft: a candidate gather per draft position",
                gamma,
                b,
                a.collective_us,
                ASSUMED,
                f"assumed: {a.collective_us:g} us each (a few kB)",
            )
        )
    parts.append(
        Part(
            "other",
            "once per step",
            a.other_kernels_per_step,
            b,
            a.kernel_us,
            ASSUMED,
            f"assumed: {a.other_kernels_per_step} kernels of {a.kernel_us:g} us",
        )
    )
    return parts, savings


def group_status(parts: list[Part]) -> str:
    """measured, interpolated, assumed, 'measured + assumed' where a group has parts of both
    (the JSON keeps each side's microseconds), or none where the step has no such kernel.
    """
    statuses = {p.status for p in parts}
    if not statuses:
        return NONE
    if statuses == {ASSUMED}:
        return ASSUMED
    if ASSUMED in statuses:
        return "measured + assumed"
    return INTERPOLATED if INTERPOLATED in statuses else MEASURED


def moe_saving(sites: list[dict]) -> dict:
    """The MoE runner's saving over a step's call sites: a number where every site has
    upstream and the fork measured, at least the counted sites where some have, and not a
    saving where no site has an upstream route measured."""
    counted = [s for s in sites if "saved_us" in s]
    out = {
        "saved_us": sum(s["saved_us"] for s in counted),
        "complete": len(counted) == len(sites),
        "counted": len(counted),
        "interpolated": any(s["status"] == INTERPOLATED for s in counted),
    }
    if not counted and all(s["status"] == "no upstream" for s in sites):
        out.update(complete=True, text=NO_UPSTREAM)
    return out


def _pct(x: float) -> str:
    return f"{x:.1f} %" if abs(x) >= 1 or x == 0 else f"{x:.2f} %"


def share_cell(
    saved: float, step: float, complete: bool, counted: int, interpolated: bool
) -> str:
    """A saving as a percent of the step and in us ('*': at an interpolated row count)."""
    if counted == 0:
        return "0 (stock)" if complete else "not measured"
    text = f"{_pct(100 * saved / step)} ({saved:.0f} us){'*' if interpolated else ''}"
    return text if complete else f">= {text} (part not measured)"


# (the cost model's flags or None, with the MoE runner): each flag alone, then all together
STEP_FLAG_SETS = (
    (Flags(wo_a_twin="small"), False),
    (Flags(wo_a_twin="mid"), False),
    (Flags(wo_a_twin="drop"), False),
    (Flags(draft_head_fp8=True), False),
    (Flags(verify_cap="3"), False),
    (None, True),
    (Flags(wo_a_twin="mid", draft_head_fp8=True, verify_cap="3"), True),
)


def flag_label(flags: Flags | None, moe: bool) -> str:
    parts = [flags.label()] if flags is not None else []
    return " + ".join(parts + ([MOE_FLAG] if moe else []))


def flag_saving(
    model: Model,
    gamma: int,
    tp: int,
    bs: int,
    results: Path,
    flags: Flags | None,
    with_moe: bool,
    moe_cut: dict,
    step_us: float,
) -> dict:
    """One flag set's predicted saving at one batch: the cost model's sites (``predict``) plus
    the MoE runner's, in us and as a percent of the step."""
    saved, complete, counted, interpolated = 0.0, True, 0, False
    if flags is not None:
        p = predict(
            Setup(model, tp, gamma, bs, flags, device=STEP_DEVICE, results=results)
        )
        saved = p["saved_us_per_step"]
        complete = p["complete"]
        done = [x for x in p["sites"] if x["status"] in (MEASURED, INTERPOLATED)]
        counted = len(done)
        interpolated = any(x["status"] == INTERPOLATED for x in done if x["saved_us"])
    note = ""
    if with_moe:
        saved += moe_cut["saved_us"]
        complete = complete and moe_cut["complete"]
        counted += moe_cut["counted"]
        interpolated = interpolated or moe_cut["interpolated"]
        note = moe_cut.get("text", "")
    if note and flags is None:
        cell = note
    else:
        cell = share_cell(saved, step_us, complete, counted, interpolated)
        if note:
            cell += "; moe: not a saving"
    return {
        "saved_us": round(saved, 3),
        "percent": round(100 * saved / step_us, 4),
        "complete": complete,
        "cell": cell,
    }


def kernel_us_check(results: Path, model: Model, tp: int) -> dict:
    """What the measured stock GEMMs of this rank take over the time of their bytes at the HBM
    bandwidth, at decode sizes (up to 8 rows): the range the assumed fixed cost per kernel is
    held against. A check beside the table, not an input to it."""
    out = {}

    def span(source: str, over: list[float]) -> dict:
        return {
            "source": source,
            "min_us": round(min(over), 2),
            "max_us": round(max(over), 2),
        }

    stock, name = _result(results, "wo_a_stock", STEP_DEVICE)
    if stock is not None:
        g, _ = groups_per_rank(model, tp)
        over = [r["einsum_us"] - r["floor_us"] for r in stock["rows"] if r["G"] == g]
        if over:
            out["wo_a einsum"] = span(name, over)
    head, name = _result(results, "draft_head_fp8", STEP_DEVICE)
    if head is not None:
        n = vocab_shard(model.vocab, tp)
        over = [
            r["stock_us"] - r["floor_bf16_us"]
            for r in head["rows"]
            if r["rows"] <= 8 and r["N"] == n
        ]
        if over:
            out["LM head, cuBLAS bf16"] = span(name, over)
    return out


def group_how(
    model: Model, tp: int, routing: str, results: Path, a: StepAssumptions
) -> dict[str, str]:
    """How each group is timed, in words, with the files and figures it reads."""
    tbps = hbm_tbps()
    g, _ = groups_per_rank(model, tp)
    stock = StockFiles.read(results, model, tp)
    data, moe_file, device = load_moe(results)
    per_expert = (
        3 * model.hidden * (model.expert_width // tp) * a.expert_bytes_per_weight
    )
    floor = (
        f"the floor: the expected distinct experts of uniform routing, {model.experts} (1 - "
        f"(1 - {model.topk}/{model.experts})^rows), x {per_expert / 1e6:.2f} MB each at "
        f"{tbps:g} TB/s (assumed: a trained router's rows of one request share experts, so "
        "fewer)"
    )
    if data is None:
        experts = f"assumed, {floor}; no moe_verify result file yet"
    else:
        where = (
            ""
            if device == STEP_DEVICE
            else f" (measured on {device.replace('_', ' ')})"
        )
        experts = (
            f"measured: {moe_file}{where}, {routing} routing, one call per layer; upstream's "
            "fastest measured route where it has one, else the fork's runner; rows it did not "
            f"measure: assumed, {floor}"
        )
    collectives = (
        f"assumed: two all-reduces per layer, {a.collective_us:g} us each plus a ring's "
        f"bytes at {a.nvlink_gbps:g} GB/s; the target's logits all-gather; a gather per "
        "draft position"
        if tp > 1
        else "none at TP1"
    )
    return {
        "routed experts": experts,
        "dense linears": f"assumed: per layer wq_a + wkv, wq_b, wo_b and the shared expert's "
        f"w13 and w2 (e4m3, {a.dense_bytes_per_weight:.4g} bytes a weight) and the router's "
        f"gate (bf16): weights, input and bf16 output at {tbps:g} TB/s + {a.kernel_us:g} us "
        "a call",
        "wo_a": f"measured: {stock.wo_a_file} einsum_us at G = {g} (Hopper's stock), "
        f"{_span(stock.wo_a)}, interpolated between measured row counts",
        "LM heads": f"measured: {stock.head_file} stock_us (cuBLAS bf16, the fp8 head's "
        f"baseline) for the target's and the draft's head, {_span(stock.head)}; more rows: "
        f"assumed, the bf16 shard at {tbps:g} TB/s + {a.kernel_us:g} us",
        "attention": f"assumed: {a.index_topk + a.window} cache entries of "
        f"{a.kv_entry_bytes} bytes per query row at {tbps:g} TB/s, plus "
        f"{a.attention_kernels} kernels of {a.kernel_us:g} us a layer",
        "all-reduce": collectives,
        "other": f"assumed: {a.other_kernels_per_layer} kernels a layer and "
        f"{a.other_kernels_per_step} a step, {a.kernel_us:g} us each",
    }


def step_share(
    model: Model = V41_FLASH,
    gamma: int = 5,
    tp: int = 4,
    batches=BATCHES,
    results: Path = RESULTS,
    routing: str = "random",
    a: StepAssumptions = StepAssumptions(),
    flag_sets=STEP_FLAG_SETS,
) -> dict:
    """Per batch: one DSpark decode step's time per kernel group on one rank of the H200 (every
    fork flag off), each part measured, interpolated or assumed with its source, and each flag
    set's predicted saving as a percent of that step.

    Invariants: the groups' times add up to the step; a set's saving is the sum of its flags'
    savings; a figure counts as measured only at row counts its result file measured or lies
    between; the MoE runner saves only where upstream and the fork are both measured."""
    if routing not in ROUTINGS:
        raise ValueError(f"routing {routing!r}: one of {', '.join(ROUTINGS)}")
    moe = load_moe(results)
    out = []
    for bs in batches:
        parts, moe_sites = step_parts(model, gamma, tp, bs, results, routing, a)
        step = sum(p.us for p in parts)
        groups = {}
        for group in GROUPS:
            mine = [p for p in parts if p.group == group]
            total = sum(p.us for p in mine)
            measured = sum(p.us for p in mine if p.status != ASSUMED)
            groups[group] = {
                "us": round(total, 3),
                "status": group_status(mine),
                "measured_us": round(measured, 3),
                "assumed_us": round(total - measured, 3),
                "share": round(total / step, 5),
                "devices": sorted({p.device for p in mine if p.device}),
            }
        moe_cut = moe_saving(moe_sites)
        flags = {
            flag_label(f, m): flag_saving(
                model, gamma, tp, bs, results, f, m, moe_cut, step
            )
            for f, m in flag_sets
        }
        out.append(
            {
                "bs": bs,
                "graph_bs": graph_bs(bs),
                "verify_rows": graph_bs(bs) * (gamma + 1),
                "draft_rows": graph_bs(bs) * gamma,
                "step_us": round(step, 3),
                "measured_us": round(
                    sum(p.us for p in parts if p.status != ASSUMED), 3
                ),
                "groups": groups,
                "flags": flags,
                "moe_sites": moe_sites,
                "parts": [
                    {
                        **asdict(p),
                        "us_per_call": round(p.us_per_call, 3),
                        "us": round(p.us, 3),
                    }
                    for p in parts
                ],
            }
        )
    return {
        "what": "one DSpark decode step's time per kernel group (us, one rank, every fork flag "
        "off) and each flag set's predicted saving as a percent of it; each figure measured (a "
        "result file), interpolated between two measured row counts, or assumed (bytes at the "
        "HBM bandwidth plus a fixed cost per kernel, or a stated figure)",
        "model": model.name,
        "tp": tp,
        "gamma": gamma,
        "device": STEP_DEVICE,
        "routing": routing,
        "hbm_tbps": {
            "value": hbm_tbps(),
            "mark": "measured: benchmark/harness.py HBM_TBPS",
        },
        "moe_file": moe[1] if moe[0] is not None else None,
        "how": group_how(model, tp, routing, results, a),
        "assumptions": a.marked(),
        "kernel_us_check": kernel_us_check(results, model, tp),
        "not_modelled": list(NOT_MODELLED),
        "batches": out,
    }


# ------------------------------------------------------------------ command line


def _parser() -> argparse.ArgumentParser:
    from e2e.provenance import add_overwrite_arg

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--report",
        action="store_true",
        help="the standard predictions: V4.1-Flash on H200 at TP4 and TP1, the GB10 line "
        "at TP3 and TP4, bs 1..32, each flag set",
    )
    p.add_argument(
        "--step-share",
        action="store_true",
        help="the step's time per kernel group on the H200 (--tp, --gamma, --bs; every figure "
        "measured or assumed) and each flag set's predicted saving as a percent of it",
    )
    p.add_argument(
        "--routing",
        default="random",
        choices=ROUTINGS,
        help="with --step-share: the MoE benchmark's routing to read (default: random)",
    )
    p.add_argument("--model", default="v4.1-flash", choices=sorted(MODELS))
    p.add_argument(
        "--config", type=Path, help="a model's HF config.json instead of --model"
    )
    p.add_argument(
        "--draft-stages", type=int, default=3, help="with --config (default: 3)"
    )
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--gamma", type=int, default=5)
    p.add_argument("--bs", type=int, nargs="+", default=list(BATCHES))
    p.add_argument(
        "--device", default="NVIDIA_H200", help="result files' device suffix"
    )
    p.add_argument("--dsv4-wo-a-fp8-twin", default="off", choices=WO_A_LEVELS)
    p.add_argument("--speculative-dspark-draft-head-fp8", action="store_true")
    p.add_argument("--speculative-dspark-verify-cap", default=None)
    p.add_argument("--cap-mean-k", type=float, default=None, help="assumed, for conf:")
    p.add_argument("--no-sample-from-anchor", action="store_true")
    p.add_argument("--mxfp8-wo-b", action="store_true")
    p.add_argument(
        "--measured-step-us",
        nargs=2,
        type=float,
        metavar=("STOCK", "FORK"),
        help="a measured decode step time, flags off and on (one --bs): does the prediction "
        "explain the change within a third?",
    )
    p.add_argument(
        "--measured-ci-us",
        type=float,
        default=None,
        help="with --measured-step-us: the half-width of the change's 95 %% interval",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument(
        "--out", type=Path, help="with --report: write cost_model-cpu.json here"
    )
    add_overwrite_arg(p)
    return p


def main(argv=None) -> int:
    a = _parser().parse_args(argv)
    if a.config is not None:
        model = Model.from_config(
            json.loads(a.config.read_text()), a.draft_stages, a.config.name
        )
    else:
        model = MODELS[a.model]
    if a.step_share:
        s = step_share(model, a.gamma, a.tp, tuple(a.bs), routing=a.routing)
        print(json.dumps(s, indent=1) if a.json else render_step_share(s))
        return 0
    if a.report:
        rep = report(model, a.gamma)
        print(render(rep))
        if a.out is not None:
            from e2e.provenance import write_result

            path = write_result(
                a.out / "cost_model-cpu.json", rep, overwrite=a.overwrite
            )
            print(f"wrote {path}")
        return 0
    flags = Flags(
        a.dsv4_wo_a_fp8_twin,
        a.speculative_dspark_draft_head_fp8,
        a.speculative_dspark_verify_cap,
        a.cap_mean_k,
    )
    if a.measured_step_us is not None and len(a.bs) != 1:
        raise SystemExit("--measured-step-us compares one batch size: give one --bs")
    for bs in a.bs:
        s = Setup(
            model,
            a.tp,
            a.gamma,
            bs,
            flags,
            device=a.device,
            sample_from_anchor=not a.no_sample_from_anchor,
            mxfp8_wo_b=a.mxfp8_wo_b,
        )
        p = predict(s)
        if a.measured_step_us is not None:
            p["check"] = explains(p, *a.measured_step_us, ci_us=a.measured_ci_us)
        if a.json:
            print(json.dumps(p, indent=1))
            continue
        print(
            f"bs {bs}, tp {a.tp}, gamma {a.gamma}, {flags.label()}, {a.device}: "
            f"{p['saved_us_per_step']:.1f} us saved per step"
            + ("" if p["complete"] else " (incomplete)")
        )
        for x in p["sites"]:
            print(
                f"  {x['site']}: {x['calls']} x {x['rows']} rows, {x['status']}, "
                f"{x['saved_us']:.1f} us ({x['why']}{'; ' + x['source'] if x['source'] else ''})"
            )
        if "check" in p:
            print(
                f"  {'EXPLAINED' if p['check']['explained'] else 'NOT EXPLAINED'}: {p['check']['why']}"
            )
    if a.measured_step_us is not None and not p["check"]["explained"]:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
