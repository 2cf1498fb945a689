#!/usr/bin/env python3
"""The measured tables of docs/, generated from the result files in benchmark/results/.

A figure lives once, in its result file: a page carries it only inside a generated block,

    <!-- docs_tables: NAME -->
    ... what TABLES[NAME] renders from its result file ...
    <!-- /docs_tables -->

which this script rewrites (``python3 tools/docs_tables.py``) or checks (``--check``: exit 1
naming each page whose block differs from its file, a block with no table of that name, or a
table whose block is missing from its page). test/test_docs_tables.py runs the check in CI.

A new table is a render function of the result file's parsed content (JSON, or the text of a
``.txt`` file) returning markdown, added to TABLES with its page and file; then run the script
once and commit the page. Standard library only.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
RESULTS = "benchmark/results"
# Older files without complete provenance (benchmark/results/archive/README.md): a table still
# read from one says so under it, and no page links into the archive.
ARCHIVE = f"{RESULTS}/archive"
ARCHIVED = (
    "an older build's file, archived without complete provenance: awaits a re-run"
)
BLOCK_RE = re.compile(
    r"(<!-- docs_tables: (?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- /docs_tables -->)",
    re.S,
)


@dataclass(frozen=True)
class Table:
    page: str  # relative to the repository
    result: str  # file name in benchmark/results/
    render: Callable[..., str]
    # Further result files the renderer reads, passed after the first one's data.
    also: tuple[str, ...] = ()


def _g(x: float) -> str:
    """Microseconds as a table shows them: 3 significant figures, whole numbers from 100 up."""
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"


def _source(page: str, result: str, data: Any, archived: bool = False) -> str:
    """The line under a table: its result file, linked from the page, and the build that wrote it.
    A file in the archive (an older build's, without complete provenance) is named, not linked,
    and the line says the table awaits a re-run."""
    rel = Path("../" * (page.count("/"))) / RESULTS / result
    build = data.get("fork_version") if isinstance(data, dict) else None
    device = data.get("device") if isinstance(data, dict) else None
    device = device.replace("_", " ") if device else None
    extra = ", ".join(x for x in (device, f"build {build}" if build else None) if x)
    if archived:
        return f"From `{result}` ({extra + '; ' if extra else ''}{ARCHIVED})."
    return f"From [`{result}`]({rel.as_posix()})" + (f" ({extra})." if extra else ".")


# --- draft temperature scale -------------------------------------------------------------


def draft_tau_staging(d: dict) -> str:
    rows = {(r["bs"], r["tau"]): r for r in d["rows"] if r["what"] == "stage params"}
    out = [
        "| bs | tau = 1, host | tau = 0.8, host | added |",
        "| --- | --- | --- | --- |",
    ]
    for bs in sorted({bs for bs, _ in rows}):
        one, scaled = rows[bs, 1.0], rows[bs, 0.8]
        out.append(
            f"| {bs} | {one['host_us']:.1f} us | {scaled['host_us']:.1f} us "
            f"| {scaled['extra_host_us']:.1f} us |"
        )
    return "\n".join(out)


def draft_tau_alpha(d: dict) -> str:
    alpha: dict[str, dict[float, float]] = {}
    for r in d["rows"]:
        if m := re.fullmatch(r"alpha synthetic T=(\S+)", r["what"]):
            alpha.setdefault(m.group(1), {})[r["tau"]] = r["alpha"]
    taus = sorted({t for row in alpha.values() for t in row})
    out = [
        "| T | " + " | ".join(f"tau = {t:g}" for t in taus) + " |",
        "| --- |" + " --- |" * len(taus),
    ]
    for temp in sorted(alpha, key=float, reverse=True):
        out.append(
            f"| {temp} | " + " | ".join(f"{alpha[temp][t]:.2f}" for t in taus) + " |"
        )
    return "\n".join(out)


def e2e_tau_control(d: dict) -> str:
    row = d["rows"]["s_tau_0.7"]
    control = d["rows"]["s_tau_wrong_q"]["sampled_vs_upstream_nospec"]["min_p"]
    ok = "passed" if row["ok"] else "FAILED"
    return (
        f"On the {d['device'].replace('_', ' ')}, row `s_tau_0.7` {ok} (smallest p against "
        f"upstream without speculation {row['sampled_vs_upstream_nospec']['min_p']:.2g}, "
        f"{d['sampled_requests']:,} requests); the negative control `s_tau_wrong_q` (the accept "
        f"rule reads q at T while the draft samples at 0.7 T) was refused at p = {control:.1e}."
    )


def e2e_last_run(d: dict) -> str:
    """The matrix's rows by kind: how many served, passed, and the figures each kind is judged by."""
    rows = d["rows"]

    def identical(names: list[str], versus: str) -> list[str]:
        """The fork rows equal to an upstream row (key ``versus...``) in tokens and logprobs."""
        return [
            n
            for n in names
            if rows[n].get("tree") == "fork"
            and any(
                v.get("logprobs_identical") and v.get("tokens_identical")
                for key, v in rows[n].items()
                if key.startswith(versus)
            )
        ]

    def kind(name: str) -> str:
        if name.startswith("refuse_"):
            return "startup refusals"
        if name.startswith("s_"):
            return "sampled (sample checkpoint)"
        if name.startswith("random_"):
            return "greedy, random weights"
        if name.startswith("v41_"):
            return "greedy, DeepSeek-V4.1 (random weights)"
        return "greedy, agree checkpoint"

    out = [
        "| rows | served | passed | judged by |",
        "| --- | ---: | ---: | --- |",
    ]
    for k in (
        "greedy, agree checkpoint",
        "greedy, random weights",
        "greedy, DeepSeek-V4.1 (random weights)",
        "sampled (sample checkpoint)",
        "startup refusals",
    ):
        names = [n for n in rows if kind(n) == k]
        if not names:  # a matrix served before the V4.1 rows existed
            continue
        done = [n for n in names if rows[n].get("ok") is not None]
        passed = sum(bool(rows[n]["ok"]) for n in done)
        if k == "greedy, random weights":
            same = identical(names, "vs_random_up_")
            bound = [
                rows[n]["vs_random_up_off"]["first_decode_max_abs"]
                for n in names
                if rows[n]["checks"].get("within_bound_of_random_up_off")
            ]
            wrong = rows["random_wo_a_wrong"]["vs_random_up_off"][
                "first_decode_max_abs"
            ]
            how = (
                f"{len(same)} fork rows identical to upstream in tokens and logprobs; the wo_a "
                f"rows within the first-decode logprob bound (largest {max(bound):.3g}), the "
                f"wrong twin outside it ({wrong:.3g})"
            )
        elif k == "greedy, DeepSeek-V4.1 (random weights)":
            same = identical(names, "vs_v41_up_")
            how = (
                f"{len(same)} of {sum(rows[n].get('tree') == 'fork' for n in names)} fork rows "
                "identical to upstream's V4.1 rows in tokens and logprobs"
            )
        elif k == "sampled (sample checkpoint)":
            ps = {
                n: rows[n]["sampled_vs_upstream_nospec"]["min_p"]
                for n in names
                if "sampled_vs_upstream_nospec" in rows[n] and n != "s_tau_wrong_q"
            }
            how = (
                f"smallest p against upstream without speculation {min(ps.values()):.2g} "
                f"({min(ps, key=ps.get)}); controls refused: 0.97 T at p = "
                f"{rows['s_up_nospec']['negative_control_0.97T']['min_p']:.1e}, q at T at p = "
                f"{rows['s_tau_wrong_q']['sampled_vs_upstream_nospec']['min_p']:.1e}"
            )
        elif k == "greedy, agree checkpoint":
            diffs = [
                v["max_abs"]
                for n in names
                for key, v in rows[n].items()
                if key.startswith("vs_up_")
            ]
            how = f"tokens identical to upstream; largest logprob difference {max(diffs):.2g}"
        else:
            how = "the server exits with the flag's message"
        out.append(f"| {k} | {len(done)} | {passed} | {how} |")
    return "\n".join(out)


# --- hyper-connection mix statistics -------------------------------------------------------


def hc_fused(d: dict) -> str:
    by = {(r["route"], r["rows"]): r for r in d["rows"]}
    routes = sorted({r for r, _ in by})
    out = [
        "| rows | "
        + " | ".join(f"{r}: stock / ours us | ratio" for r in routes)
        + " |",
        "| ---: |" + " ---: | ---: |" * len(routes),
    ]

    def cell(r: dict | None) -> str:
        if r is None:
            return "- | -"
        if r["ours_us"] is None:
            return f"{_g(r['stock_us'])} / stock | -"
        return f"{_g(r['stock_us'])} / {_g(r['ours_us'])} | {r['ratio']:.2f}"

    for rows in sorted({n for _, n in by}):
        out.append(
            f"| {rows} | " + " | ".join(cell(by.get((r, rows))) for r in routes) + " |"
        )
    mins = ", ".join(
        f"`{r}` {'from ' + str(m) + ' rows' if m else 'never'}"
        for r, m in sorted(d["min_rows"].items())
    )
    return (
        "\n".join(out)
        + f"\n\nMeasured threshold (ours >= {d['margin']}x stock): {mins}."
    )


def hc_upstream_repeat(text: str) -> str:
    """Per input (rows, seed): of 7 repeated calls, how many gave other bits than the first,
    and the most rows one call changed (of pre, post and comb)."""
    out = [
        "| rows | input | calls differing from the first (of 7) | most rows differing in one call |",
        "| ---: | ---: | ---: | ---: |",
    ]
    for m in re.finditer(r"^m=(\d+) seed=(\d+) stock repeat: \[(.*)\]$", text, re.M):
        calls = re.findall(r"'([^']*)'", m.group(3))
        counts = [
            max(int(n) for n in re.findall(r":(\d+) rows", call)) for call in calls
        ]
        out.append(
            f"| {m.group(1)} | {m.group(2)} | {sum(c > 0 for c in counts)} | {max(counts)} |"
        )
    return "\n".join(out)


# --- fast load -------------------------------------------------------------------------------


def fast_load(d: dict) -> str:
    out = [
        "| iterator | ranks | split | wall s | GB/s | peak RSS GB (max rank) | of it private / file-backed |",
        "| --- | ---: | --- | ---: | ---: | ---: | --- |",
    ]
    for r in d["rows"]:
        out.append(
            f"| {r['iterator']} | {r['ranks']} | {r['split']} | {r['wall_s']:.1f} "
            f"| {r['checkpoint_gbps']:.2f} | {r['peak_rss_gb_max_rank']:.2f} "
            f"| {r['peak_rss_anon_gb_max_rank']:.2f} / {r['peak_rss_file_gb_max_rank']:.2f} |"
        )
    return "\n".join(out)


# --- fp8 draft head ----------------------------------------------------------------------------


def draft_head_fp8(d: dict) -> str:
    """Stock (cuBLAS bf16) -> the served kernel per row count and shard; rows it does not serve
    say so (the bf16 head runs there)."""
    shards = sorted({r["N"] for r in d["rows"]})
    cells = {(r["N"], r["rows"]): r for r in d["rows"]}
    names = {32320: "TP4 shard 32320 x 5120", 129280: "TP1 129280 x 5120"}
    out = [
        "| rows | "
        + " | ".join(names.get(n, f"{n} x {d['K']}") for n in shards)
        + " |",
        "| --- |" + " --- |" * len(shards),
    ]
    for m in sorted({r["rows"] for r in d["rows"]}):
        row = [cells.get((n, m)) for n in shards]
        served = all(r and r["served"] for r in row)
        cols = []
        for r in row:
            if r is None:
                cols.append("")
            elif r["served"]:
                cols.append(
                    f"{_g(r['stock_us'])} -> {_g(r['fp8_us'])} us, {r['ratio']:.2f}x ({r['kernel']})"
                )
            else:
                cols.append(f"{_g(r['stock_us'])} us (bf16 head)")
        out.append(
            f"| {m}{'' if served else ' (not served)'} | " + " | ".join(cols) + " |"
        )
    return "\n".join(out)


# --- the per-step cost model (benchmark/e2e/cost_model.py) -----------------------------------


def cost_model_table(d: dict, line: str) -> str:
    """One line's predictions (flags x batch sizes); the cost model prints the same table."""
    rows = [r for r in d["rows"] if r["line"] == line]
    labels = list(dict.fromkeys(r["label"] for r in rows))
    batches = sorted({r["bs"] for r in rows})
    cells = {(r["label"], r["bs"]): r["cell"] for r in rows}
    out = [
        "| flags | " + " | ".join(f"bs {b}" for b in batches) + " |",
        "| --- |" + " ---: |" * len(batches),
    ]
    for label in labels:
        out.append(
            f"| {label} | " + " | ".join(cells[label, b] for b in batches) + " |"
        )
    return "\n".join(out)


def _cost_model_line(d: dict, line: str) -> str:
    build = d.get("provenance", {}).get("fork_version")
    table = cost_model_table(d, line)
    return table + (f"\n\nPredicted by build {build}." if build else "")


def cost_model_h200_tp4(d: dict) -> str:
    return _cost_model_line(d, "H200, TP4")


def cost_model_h200_tp1(d: dict) -> str:
    return _cost_model_line(d, "H200, TP1")


def cost_model_gb10(d: dict) -> str:
    return "\n\n".join(
        f"{line}:\n\n{d['served'][line]}" for line in d["served"] if "GB10" in line
    )


STEP_MARKS = {
    "measured": "m",
    "interpolated": "i",
    "assumed": "a",
    "measured + assumed": "m+a",
}


def step_share_table(s: dict) -> str:
    """The cost model's step by kernel group (``step_share``): us per step on one rank with
    each figure's status, the flag sets' savings as a percent of it, and how each group is
    timed; the cost model's ``--step-share`` prints the same."""
    batches = s["batches"]
    head = "| {} | " + " | ".join(f"bs {b['bs']}" for b in batches) + " |"
    rule = "| --- |" + " ---: |" * len(batches)
    out = [head.format("kernel group"), rule]
    for group in s["how"]:
        cells = []
        for b in batches:
            x = b["groups"][group]
            if x["status"] == "none":
                cells.append("-")
                continue
            where = "".join(f", {d.removeprefix('NVIDIA ')}" for d in x["devices"])
            cells.append(f"{x['us']:,.0f} ({STEP_MARKS[x['status']]}{where})")
        out.append(f"| {group} | " + " | ".join(cells) + " |")
    out.append(
        "| **step** | " + " | ".join(f"**{b['step_us']:,.0f}**" for b in batches) + " |"
    )
    out.append(
        "| of it measured (m, i) | "
        + " | ".join(
            f"{b['measured_us'] / b['step_us']:.0%}".replace("%", " %") for b in batches
        )
        + " |"
    )
    out += ["", head.format("saving, % of the step (us)"), rule]
    for label in batches[0]["flags"]:
        out.append(
            f"| {label} | "
            + " | ".join(b["flags"][label]["cell"] for b in batches)
            + " |"
        )
    out += [
        "",
        "m: measured; i: interpolated between two measured row counts; a: assumed; m+a: parts "
        "of both. `*`: a saving read at an interpolated row count.",
        "",
        "How each group is timed:",
        "",
    ]
    out += [f"- {group}: {how}." for group, how in s["how"].items()]
    check = s.get("kernel_us_check", {})
    if check:
        spans = "; ".join(
            f"{name} {c['min_us']:g}-{c['max_us']:g} us (`{c['source']}`)"
            for name, c in check.items()
        )
        out += [
            "",
            f"The fixed cost per kernel ({s['assumptions']['kernel_us']['value']:g} us) against "
            f"what the measured stock GEMMs of this rank take over their bytes' time at up to 8 "
            f"rows: {spans}.",
        ]
    out += ["", "Not modelled:", ""] + [f"- {x}." for x in s["not_modelled"]]
    return "\n".join(out)


def cost_model_step_share(d: dict) -> str:
    build = d.get("provenance", {}).get("fork_version")
    table = step_share_table(d["step_share"])
    return table + (f"\n\nPredicted by build {build}." if build else "")


# --- full-depth side by side (tools/e2e/side_by_side.py) --------------------------------------

FULL_DEPTH_SETS = (
    ("wo_a_mid", "wo_a mid"),
    ("head_fp8", "head fp8"),
    ("cap_3", "cap 3"),
    ("wo_a_head", "wo_a mid + head fp8"),
    ("all_on", "all three"),
)


def _cost_model_flags(args: list[str]) -> dict:
    """A flag set's server arguments as the cost model's ``Flags`` fields (its rows' inputs)."""
    from e2e.side_by_side import CAP_3, HEAD_FP8, TWIN_MID

    def value(flag: str) -> str | None:
        return args[args.index(flag) + 1] if flag in args else None

    return {
        "wo_a_twin": value(TWIN_MID[0]) or "off",
        "draft_head_fp8": HEAD_FP8[0] in args,
        "verify_cap": value(CAP_3[0]),
    }


def e2e_attribution(d: dict, model: dict) -> str:
    """Per flag set and profiled batch: the kernel time per verify step of the groups the flags
    change (``side_by_side.split_by_flags``) on both servers and its fall, beside the cost model's
    prediction at TP1 on the H200 (``cost_model-cpu.json``, the same build's report) and whether
    it is within a third of the fall; then the change of every other group (kernels both sides
    run alike: the profile's noise) and the GPU's busy share of the request."""
    from e2e.side_by_side import split_by_flags

    tp1 = [r for r in model["rows"] if r["line"] == "H200, TP1"]
    out = [
        "| flags | bs | groups the flags change | upstream us/step | fork us/step | fall "
        "| cost model | within a third | other groups, fork - upstream | GPU busy, upstream / fork |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | --- | ---: | --- |",
    ]
    for key, label in FULL_DEPTH_SETS:
        rec = d.get("flag_sets", {}).get(key, {})
        for b, m in rec.get("batches", {}).items():
            prof = m.get("profile")
            if not prof:
                continue
            bs = int(b[2:])
            split = split_by_flags(prof["groups"], rec["args"])
            up, fork = split["flag_groups_upstream_us"], split["flag_groups_fork_us"]
            fall = up - fork
            wanted = _cost_model_flags(rec["args"])
            p = next(
                (
                    r
                    for r in tp1
                    if r["bs"] == bs
                    and all(r["inputs"]["flags"][k] == v for k, v in wanted.items())
                ),
                None,
            )
            if p is None:
                model_cell, verdict = "-", "no prediction"
            else:
                model_cell = p["cell"]
                if not p["complete"]:
                    verdict = "part not measured"
                else:
                    ok = abs(p["saved_us_per_step"] - fall) <= abs(fall) / 3
                    verdict = "yes" if ok else "no"
            out.append(
                f"| {label} | {bs} | {', '.join(split['flag_groups'])} | {up:,.0f} "
                f"| {fork:,.0f} | {fall:,.0f} | {model_cell} | {verdict} "
                f"| {-split['other_groups_change_us']:+,.0f} "
                f"| {prof['upstream']['gpu_busy']:.2f} / {prof['fork']['gpu_busy']:.2f} |"
            )
    return "\n".join(out)


def e2e_full_depth(d: dict) -> str:
    """Per flag set and batch: the judging rule's row first (``side_by_side.noninferiority``:
    the time per output token fork / upstream, order-balanced, with its one-sided 95 % upper
    bound; a cell that has not passed says "not served" and, past the bound, why), the pairs a
    fresh run's plan needs for the 2 % and the 1 % margin, then the step time and the output
    tokens/s (mean of the paired repeats, 95 % t-interval; their number where it is not most
    cells') and the accepted drafts per step on both sides; the upstream step time last. Every
    flag set and batch of the method appears: one the run did not measure says so (not run,
    skipped and why, or its error).
    """
    sets = d.get("flag_sets", {})
    measured = {b for rec in sets.values() for b in rec.get("batches", {})}
    batches = sorted(  # a run may list its batches in any order
        measured | {f"bs{b}" for b in d.get("method", {}).get("batches", [])},
        key=lambda b: int(b[2:]),
    )
    lines = [
        "| flags | " + " | ".join(f"bs {b[2:]}" for b in batches) + " |",
        "| --- |" + " ---: |" * len(batches),
    ]

    ns = [  # the pairs behind most cells; a cell with another number says it
        m["step_ratio"].get("n")
        for rec in sets.values()
        for m in rec.get("batches", {}).values()
        if "step_ratio" in m
    ]
    repeats = max(set(ns), key=ns.count) if ns else None

    def pairs(r: dict) -> str:
        return f" (n = {r['n']})" if r.get("n", repeats) != repeats else ""

    def ratio(b: dict, key: str) -> str:
        r = b[key]
        return f"{r['mean']:.3f} [{r['t95'][0]:.3f}, {r['t95'][1]:.3f}]{pairs(r)}"

    def tpot(b: dict) -> str:
        t = b.get("tpot_ratio")
        if t is None:
            return "not judged"
        if t.get("ni_upper95") is None:
            return f"not served: {'; '.join(t['reasons'])}"
        cell = f"{t['order_balanced']:.3f} (upper {t['ni_upper95']:.3f}){pairs(t)}"
        if t["ni_pass"]:
            return cell
        why = [
            "drifting" if t["drifting"] else "",
            f"plan of {t['planned_pairs']}" if t["n"] != t["planned_pairs"] else "",
        ]
        why = ", ".join(w for w in why if w)
        return f"{cell} **not served{': ' + why if why else ''}**"

    def needed(b: dict) -> str:
        t = b.get("tpot_ratio") or {}
        if t.get("pairs_needed_2pct") is None:
            return "-"
        return f"{t['pairs_needed_2pct']} / {t['pairs_needed_1pct']}"

    def drafts(b: dict) -> str:
        return (
            f"{b['fork']['accepted_drafts_per_step']:.2f} / "
            f"{b['upstream']['accepted_drafts_per_step']:.2f}"
        )

    def row(what: str, cells: list[str]) -> None:
        lines.append(f"| {what} | " + " | ".join(cells) + " |")

    first = "time per output token"
    reference = None
    for key, label in FULL_DEPTH_SETS:
        rec = sets.get(key)
        if rec is None or "batches" not in rec:
            why = "not run" if rec is None else rec.get("skipped") or rec["error"]
            row(label, [why[:60]] * len(batches))
            continue
        got = {b: m for b, m in rec["batches"].items() if "skipped" not in m}
        reference = reference or rec
        for what, cell in (
            (first, tpot),
            ("pairs for 2 % / 1 %", needed),
            ("step time", lambda b: ratio(b, "step_ratio")),
            ("output tokens/s", lambda b: ratio(b, "throughput_ratio")),
            ("accepted drafts per step, fork / upstream", drafts),
        ):
            cells = []
            for b in batches:
                m = rec["batches"].get(b, {"skipped": "not run"})
                if b not in got:  # why, once: in the first row
                    cells.append(m["skipped"] if what == first else "-")
                elif what == first and not m["tokens_identical"]:
                    cells.append(cell(m) + " (tokens differ)")
                else:
                    cells.append(cell(m))
            row(f"{label}: {what}", cells)
    if reference is not None:
        row(
            "upstream step (ms)",
            [
                f"{m['upstream']['step_ms']:.1f}" if "upstream" in m else "-"
                for m in (reference["batches"].get(b, {}) for b in batches)
            ],
        )
    return "\n".join(lines)


def e2e_not_served(d: dict) -> str:
    """The cells the dispatch must not serve (``side_by_side.noninferiority``'s
    ``not_noninferior``), in the file's order: flag set, batch, the time per output token fork /
    upstream and its upper bound where the cell was measured, why, and the pairs a fresh run
    needs for the 2 % and the 1 % margin."""
    out = [
        "| flag set | bs | time per output token | upper bound | why | pairs for 2 % / 1 % |",
        "| --- | ---: | ---: | ---: | --- | ---: |",
    ]
    for c in d.get("not_noninferior", []):
        rec = d["flag_sets"].get(c["flag_set"], {})
        t = rec.get("batches", {}).get(f"bs{c['bs']}", {}).get("tpot_ratio") or {}
        ratio = f"{t['order_balanced']:.3f}" if "order_balanced" in t else "-"
        upper = f"{c['ni_upper95']:.3f}" if c["ni_upper95"] is not None else "-"
        pairs = (
            f"{t['pairs_needed_2pct']} / {t['pairs_needed_1pct']}"
            if "pairs_needed_2pct" in t
            else "-"
        )
        out.append(
            f"| `{c['flag_set']}` | {c['bs']} | {ratio} | {upper} | {c['reason']} | {pairs} |"
        )
    return "\n".join(out)


# --- measured tables of the feature pages --------------------------------------------------


def _span(values: list[float], unit: str = "x") -> str:
    """A cell's rows as min-max (one figure where they agree at 2 decimals)."""
    lo, hi = f"{min(values):.2f}", f"{max(values):.2f}"
    return f"{lo}{unit}" if lo == hi else f"{lo}-{hi}{unit}"


# (first row, last row, the level serving them): the twin's levels by row count
WO_A_BINS = ((2, 8, "small"), (9, 16, "mid"), (17, 32, "mid"), (33, 192, "drop"))


def wo_a_fp8(d: dict) -> str:
    """The twin against the einsum per G and level; at G = 2 and 2..8 rows also its time, the
    small-batch kernel (stock there) and the MXFP8-epilogue calls. Ranges over the rows measured.
    """
    out = [
        "| G | "
        + " | ".join(f"{lo}..{hi} rows (`{lvl}`)" for lo, hi, lvl in WO_A_BINS)
        + " |",
        "| --- |" + " --- |" * len(WO_A_BINS),
    ]
    for g in sorted({r["G"] for r in d["rows"]}):
        cells = []
        for lo, hi, level in WO_A_BINS:
            rows = [r for r in d["rows"] if r["G"] == g and lo <= r["M"] <= hi]
            assert rows and {r["served_by"] for r in rows} == {level}, (g, lo, hi)
            cell = _span([r["over_einsum"] for r in rows])
            small = [r for r in rows if r["stock"] == "wo_a_bf16_small_batch"]
            if small:
                cell = (
                    f"{_span([r['twin_us'] for r in small], ' us')}: {cell} the einsum, "
                    f"{_span([r['speedup'] for r in small])} the small-batch kernel "
                    f"({_span([r['stock_us'] for r in small], ' us')}); MXFP8 calls "
                    f"{_span([r['stock_mx_us'] / r['twin_mx_us'] for r in small])}"
                )
            cells.append(cell)
        out.append(f"| {g} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def wo_a_bound(d: dict) -> str:
    """Past 32 rows: the einsum against the lower bound of any kernel without thread-block
    clusters (``l2_model_us``) and the twin's pure read, so the most such a kernel could gain.
    """
    out = [
        "| G | rows | einsum (stock) | bound without clusters | pure read of the twin "
        "| at most, without clusters |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in sorted(d["rows"], key=lambda r: (r["G"], r["M"])):
        if r["M"] < 33:
            continue
        floor = max(r["l2_model_us"], r["read_us"])
        out.append(
            f"| {r['G']} | {r['M']} | {_g(r['einsum_us'])} us | {_g(r['l2_model_us'])} us "
            f"| {_g(r['read_us'])} us | {r['einsum_us'] / floor:.2f}x |"
        )
    return "\n".join(out)


def verify_cap_moe(d: dict) -> str:
    """MoE time per layer and distinct experts, no cap and cap k (k below gamma)."""
    by = {(r["bs"], r["k"]): r for r in d["rows"]}
    gamma = max(k for _, k in by)
    caps = sorted({k for _, k in by if k < gamma})
    out = [
        "| bs | no cap | " + " | ".join(f"k = {k}" for k in caps) + " |",
        "| --- | --- |" + " --- |" * len(caps),
    ]
    for bs in sorted({bs for bs, _ in by}):
        first = by[bs, caps[0]]
        cols = [
            f"{first['moe_us_no_cap']:.0f} us, {first['experts_no_cap']:.1f} experts"
        ] + [
            f"{by[bs, k]['moe_us_cap']:.0f} us ({by[bs, k]['speedup']:.2f}x), "
            f"{by[bs, k]['experts_cap']:.1f}"
            for k in caps
        ]
        out.append(f"| {bs} | " + " | ".join(cols) + " |")
    return "\n".join(out)


def router_live(d: dict) -> str:
    """Stock moe_fused_gate per call and the live-aware router's time over it."""
    rows = sorted(d["rows"], key=lambda r: r["bs"])
    return "\n".join(
        [
            "| bs (rows) | " + " | ".join(f"{r['bs']} ({r['M']})" for r in rows) + " |",
            "| --- |" + " --- |" * len(rows),
            "| stock, us | " + " | ".join(f"{r['stock_us']:.2f}" for r in rows) + " |",
            "| with live lengths | "
            + " | ".join(f"{r['ratio']:.2f}x" for r in rows)
            + " |",
        ]
    )


def folded_result_fence(d: dict) -> str:
    """Host time per step of stock's views and the ring, and the ring's copy on the GPU."""
    by = {(r["bs"], r["variant"]): r for r in d["rows"]}
    out = [
        "| bs | stock views, host | ring, host | ring, GPU (in the graph) |",
        "| --- | --- | --- | --- |",
    ]
    for bs in sorted({bs for bs, _ in by}):
        stock, ring = by[bs, "stock views"], by[bs, "ring (in-graph copy)"]
        out.append(
            f"| {bs} | {stock['host_us']:.1f} us | {ring['host_us']:.1f} us "
            f"| {ring['gpu_us']:.2f} us |"
        )
    return "\n".join(out)


def engram_row_store(d: dict) -> str:
    out = [
        "| ids | cache | step | rows | stock us | store us | store host us "
        "| hit rate (unique rows) | KiB read / step |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in d["rows"]:
        out.append(
            f"| {r['dist']} | {r['cache_frac'] * 100:.0f} % ({r['cache_mib']:.0f} MiB) "
            f"| {r['shape']} | {r['rows_per_step']} | {r['stock_us']:.0f} | {r['store_us']:.0f} "
            f"| {r['store_host_us']:.0f} | {r['hit_rate']:.2f} | {r['read_kib_per_step']:.0f} |"
        )
    return "\n".join(out)


def loop_abort(d: dict) -> str:
    """Medians over the repeats, ns per generated token."""
    out = [
        "| max period P, min tokens N | output tokens | stock ns/token | on ns/token | added "
        "| every-period rescan (reference) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in d["rows"]:
        out.append(
            f"| {r['max_period']}, {r['min_tokens']} | {r['output_tokens']} "
            f"| {r['stock_ns_per_token']} | {r['on_ns_per_token']} | {r['added_ns_per_token']} "
            f"| {r['rescan_ns_per_token']} |"
        )
    return "\n".join(out)


def serial_weight_load(d: dict) -> str:
    runs = len(d["rows"][0]["load_seconds"])
    out = [
        f"| load | peak RSS above baseline, MiB ({runs} fresh processes) | median "
        "| load time, s | median |",
        "| --- | --- | ---: | --- | ---: |",
    ]
    for r in d["rows"]:
        out.append(
            f"| {r['mode']} | {', '.join(f'{x:.1f}' for x in r['peak_rss_above_baseline_mib'])} "
            f"| {r['median_peak_rss_mib']:.1f} | {', '.join(f'{x:g}' for x in r['load_seconds'])} "
            f"| {r['median_load_seconds']:g} |"
        )
    return "\n".join(out)


TABLES: dict[str, Table] = {
    "cost_model_h200_tp4": Table(
        "docs/performance.md", "cost_model-cpu.json", cost_model_h200_tp4
    ),
    "cost_model_h200_tp1": Table(
        "docs/performance.md", "cost_model-cpu.json", cost_model_h200_tp1
    ),
    "cost_model_gb10": Table(
        "docs/performance.md", "cost_model-cpu.json", cost_model_gb10
    ),
    "cost_model_step_share": Table(
        "docs/performance.md", "cost_model-cpu.json", cost_model_step_share
    ),
    "draft_head_fp8": Table(
        "docs/draft-head-fp8.md", "draft_head_fp8-NVIDIA_H200.json", draft_head_fp8
    ),
    "draft_tau_staging": Table(
        "docs/draft-temperature-scale.md",
        "draft_tau-NVIDIA_H200.json",
        draft_tau_staging,
    ),
    "draft_tau_alpha": Table(
        "docs/draft-temperature-scale.md", "draft_tau-NVIDIA_H200.json", draft_tau_alpha
    ),
    "e2e_tau_control": Table(
        "docs/draft-temperature-scale.md", "e2e-NVIDIA_H200.json", e2e_tau_control
    ),
    "e2e_last_run": Table("docs/gpu-testing.md", "e2e-NVIDIA_H200.json", e2e_last_run),
    "e2e_full_depth": Table(
        "docs/performance.md", "e2e-full-depth-NVIDIA_H200.json", e2e_full_depth
    ),
    "e2e_not_served": Table(
        "docs/performance.md", "e2e-full-depth-NVIDIA_H200.json", e2e_not_served
    ),
    "e2e_attribution": Table(
        "docs/performance.md",
        "e2e-full-depth-NVIDIA_H200.json",
        e2e_attribution,
        also=("cost_model-cpu.json",),
    ),
    "hc_fused": Table("docs/hc_fused.md", "hc_fused-NVIDIA_H200.json", hc_fused),
    "hc_upstream_repeat": Table(
        "docs/hc_fused.md", "hc-upstream-repeat-NVIDIA_H200.txt", hc_upstream_repeat
    ),
    "fast_load_h200": Table(
        "docs/fast-load.md", "fast_load-NVIDIA_H200.json", fast_load
    ),
    "fast_load_h200_repeat": Table(
        "docs/fast-load.md", "fast_load_ep4_repeat-NVIDIA_H200.json", fast_load
    ),
    "wo_a_fp8": Table("docs/wo-a-fp8-twin.md", "wo_a_fp8-NVIDIA_H200.json", wo_a_fp8),
    "wo_a_bound": Table(
        "docs/wo-a-fp8-twin.md", "wo_a_fp8_goals-NVIDIA_H200.json", wo_a_bound
    ),
    "verify_cap_moe": Table(
        "docs/verify-cap.md", "verify_cap_moe-NVIDIA_H200.json", verify_cap_moe
    ),
    "router_live": Table(
        "docs/verify-cap.md", "router_live-NVIDIA_H200.json", router_live
    ),
    "folded_result_fence": Table(
        "docs/result-fence.md",
        "folded_result_fence-NVIDIA_H200.json",
        folded_result_fence,
    ),
    "engram_row_store": Table(
        "docs/engram-row-store.md", "engram_row_store-cpu-2core.json", engram_row_store
    ),
    "loop_abort": Table("docs/loop-abort.md", "loop_abort-cpu.json", loop_abort),
    "serial_weight_load": Table(
        "docs/serial-weight-load.md", "serial_weight_load-cpu.json", serial_weight_load
    ),
}


def render(name: str, root: Path = REPO, tables: dict[str, Table] = TABLES) -> str:
    """The block's body: the table from its result file, then the line linking that file."""
    t = tables[name]
    data, *also = (_load(result_path(f, root)) for f in (t.result, *t.also))
    archived = result_path(t.result, root).parent == root / ARCHIVE
    return f"{t.render(data, *also)}\n\n{_source(t.page, t.result, data, archived)}\n"


def result_path(name: str, root: Path = REPO) -> Path:
    """``benchmark/results/<name>``, or the archived file of that name until a re-run lands."""
    current = root / RESULTS / name
    return (
        current
        if current.exists() or not (root / ARCHIVE / name).exists()
        else root / ARCHIVE / name
    )


def _load(path: Path) -> Any:
    return json.loads(path.read_text()) if path.suffix == ".json" else path.read_text()


def _pages(root: Path, tables: dict[str, Table]) -> list[Path]:
    return sorted(
        {*(root / "docs").glob("*.md"), *(root / t.page for t in tables.values())}
    )


def update(
    root: Path = REPO, tables: dict[str, Table] = TABLES, write: bool = True
) -> list[str]:
    """Regenerate every block (``write``) or only compare; returns the problems found."""
    problems, seen = [], set()
    for page in _pages(root, tables):
        if not page.exists():
            continue
        rel = page.relative_to(root).as_posix()
        text = page.read_text()

        def sub(m: re.Match) -> str:
            name = m.group("name")
            seen.add((rel, name))
            if name not in tables or tables[name].page != rel:
                problems.append(
                    f"{rel}: block {name!r} has no table for this page in TABLES"
                )
                return m.group(0)
            body = render(name, root, tables)
            if body != m.group("body"):
                problems.append(
                    f"{rel}: block {name!r} differs from {RESULTS}/{tables[name].result}"
                    " (python3 tools/docs_tables.py rewrites it)"
                )
            return m.group(1) + body + m.group(4)

        new = BLOCK_RE.sub(sub, text)
        if write and new != text:
            page.write_text(new)
    for name, t in tables.items():
        if (t.page, name) not in seen:
            problems.append(
                f"{t.page}: no block '<!-- docs_tables: {name} -->' for {RESULTS}/{t.result}"
            )
    return problems


def main(argv: list[str]) -> int:
    check = "--check" in argv
    problems = update(write=not check)
    stale = [p for p in problems if not check and "differs from" in p]
    for p in problems:
        if p not in stale:
            print(p, file=sys.stderr)
    if check:
        return 1 if problems else 0
    for p in stale:
        print("rewrote " + p.split(" (")[0])
    return 1 if len(problems) > len(stale) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
