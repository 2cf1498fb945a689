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

Standard library only. Figures and assumptions: docs/performance.md.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
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


# DeepSeek-V4.1-Flash's widths as the project states them (issue 33; docs/b12x-moe.md: 384 experts,
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


def _load(s: Setup, name: str) -> tuple[dict | None, str]:
    path = s.results / f"{name}-{s.device}.json"
    if not path.is_file():
        return None, f"no measurement on {s.device.replace('_', ' ')}"
    return json.loads(path.read_text()), path.name


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
    return "\n".join(parts)


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
