#!/usr/bin/env python3
"""Cap advisor: which ``--speculative-dspark-verify-cap`` gives the lowest time per output token.

It replays a recorded acceptance under candidate caps and prices each with a step time:

- acceptance: the ``conf:`` cap log (``--speculative-dspark-verify-cap-log``) or the per-request
  acceptance histograms the server returns (``meta_info.spec_correct_drafts_histogram``);
- step time per verified rows of a request: a JSON table (rows -> step ms), or the uncapped step
  time minus the saving the per-step cost model (``benchmark/e2e/cost_model.py``) predicts;
- per candidate: accepted drafts per step, step time, time per output token (TPOT), sorted by
  TPOT, the best and the log's own setting marked.

The log (``VerifyCap.log_step`` in ``dspark_verify_cap.py``): rank 0 appends, per step and
request, gamma + 2 little-endian float32: the confidences of drafts 1..gamma, the live length
L = 1 + k (anchor plus verified drafts) and the accepted drafts (``correct_len`` after the cap:
at most L - 1). gamma is not in the file: ``--gamma`` gives it.

Invariants and assumptions (docs/verify-cap.md, "Pick a cap from a log"):

- A step commits accepted + 1 tokens (``finalize_accept_lens``: commit = correct_len + 1, the
  bonus or correction token), so TPOT = step time / (accepted + 1).
- A record verified L - 1 drafts. Accepting fewer tells the uncapped acceptance exactly;
  accepting all of them tells only a lower bound (censored). A candidate that would verify more
  drafts than a censored record did cannot be priced from it: it gets an accepted range and is
  flagged, never picked as best. Record under ``conf:0`` (every draft verified) to avoid this.
- The ``conf:`` rule is the engine's (``drafts_from_confidence``): k = the leading drafts whose
  float32 running product of clamp(confidence, 0, 1) stays >= the threshold, clamped to
  [cap-min, gamma]; one threshold applies to every draft, a list of gamma - 1 to drafts 2..gamma.
- Each record is replayed on its own: a cap moves where the next step starts, which the replay
  does not see; the step time is taken at the mean verified rows per request.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

REPO = Path(__file__).resolve().parents[1]
COST_MODEL_DIR = REPO / "benchmark" / "e2e"
FLOAT = np.dtype("<f4")
# Default threshold grid: conf:0.05 .. conf:0.95.
DEFAULT_THRESHOLDS = tuple(round(0.05 * i, 2) for i in range(1, 20))
# Relative slack on a threshold when checking that the recorded rule gives the logged live
# lengths: the GPU's cumprod may round a product one way where numpy rounds it the other.
TIE_SLACK = 1e-6


class AdvisorError(ValueError):
    """A refused input: the message says what and where."""


# ------------------------------------------------------------------ recorded acceptance


@dataclass(frozen=True)
class Records:
    """Recorded acceptance, one row per request step (``weight`` steps alike for a histogram).

    ``live`` is L = 1 + verified drafts; ``accepted`` <= L - 1; ``confidence`` is None for a
    histogram (no confidences recorded).
    """

    gamma: int
    live: np.ndarray  # int64 [n]
    accepted: np.ndarray  # int64 [n]
    weight: np.ndarray  # float64 [n]
    confidence: Optional[np.ndarray] = None  # float32 [n, gamma]
    source: str = ""

    @property
    def steps(self) -> float:
        return float(self.weight.sum())


def read_cap_log(path: Path, gamma: int) -> Records:
    """The ``conf:`` cap log as the engine writes it; AdvisorError naming the byte offset of the
    first record that is truncated or cannot come from the writer."""
    if gamma < 1:
        raise AdvisorError(f"--gamma must be >= 1, got {gamma}")
    data = Path(path).read_bytes()
    width = gamma + 2
    rec_bytes = width * FLOAT.itemsize
    whole, rest = divmod(len(data), rec_bytes)
    if whole == 0 and rest == 0:
        raise AdvisorError(f"{path}: empty, no records")
    if rest:
        raise AdvisorError(
            f"{path}: truncated at offset {whole * rec_bytes}: expected a record of "
            f"{rec_bytes} bytes (gamma + 2 = {width} float32 for gamma {gamma}), found {rest} "
            f"bytes; {whole} whole records before it (is --gamma right?)"
        )
    rows = np.frombuffer(data, dtype=FLOAT).reshape(whole, width)
    conf, live_f, acc_f = rows[:, :gamma], rows[:, gamma], rows[:, gamma + 1]

    def refuse(i: int, column: int, what: str) -> AdvisorError:
        offset = i * rec_bytes + column * FLOAT.itemsize
        return AdvisorError(
            f"{path}: record {i} (offset {offset}): {what} (is --gamma {gamma} right?)"
        )

    bad = np.flatnonzero(~np.isfinite(conf).all(axis=1))
    if bad.size:
        i = int(bad[0])
        j = int(np.flatnonzero(~np.isfinite(conf[i]))[0])
        raise refuse(
            i, j, f"confidence of draft {j + 1} is {conf[i, j]}, expected finite"
        )
    ok_live = np.isfinite(live_f) & (live_f == np.round(live_f))
    ok_live &= (live_f >= 2) & (live_f <= gamma + 1)
    bad = np.flatnonzero(~ok_live)
    if bad.size:
        i = int(bad[0])
        raise refuse(
            i,
            gamma,
            f"live length {live_f[i]}, expected an integer 2..{gamma + 1} (1 + the verified "
            "drafts)",
        )
    ok_acc = np.isfinite(acc_f) & (acc_f == np.round(acc_f)) & (acc_f >= 0)
    ok_acc &= acc_f <= live_f - 1
    bad = np.flatnonzero(~ok_acc)
    if bad.size:
        i = int(bad[0])
        raise refuse(
            i,
            gamma + 1,
            f"accepted drafts {acc_f[i]}, expected an integer 0..{int(live_f[i]) - 1} (at most "
            "the verified drafts; a simulated acceptance, SGLANG_SIMULATE_ACC_LEN, is not a "
            "measurement)",
        )
    return Records(
        gamma=gamma,
        live=live_f.astype(np.int64),
        accepted=acc_f.astype(np.int64),
        weight=np.ones(whole),
        confidence=np.ascontiguousarray(conf),
        source=f"{path}: {whole} records",
    )


def _histograms(obj, where: str) -> list[list]:
    """Every ``spec_correct_drafts_histogram`` in a JSON value (a bare list of counts, a
    response, its ``meta_info``, or a list of those)."""
    if isinstance(obj, list) and all(isinstance(x, (int, float)) for x in obj):
        return [obj]
    if isinstance(obj, list):
        return [h for i, x in enumerate(obj) for h in _histograms(x, f"{where}[{i}]")]
    if isinstance(obj, dict):
        if "spec_correct_drafts_histogram" in obj:
            return [obj["spec_correct_drafts_histogram"]]
        if "meta_info" in obj:
            return _histograms(obj["meta_info"], f"{where}.meta_info")
    raise AdvisorError(
        f"{where}: expected a list of step counts per accepted drafts, or responses whose "
        "meta_info carries spec_correct_drafts_histogram"
    )


def read_histogram(path: Path, gamma: int, recorded_k: int) -> Records:
    """Summed acceptance histograms (index = accepted drafts, value = steps) recorded with a
    fixed cap of ``recorded_k`` drafts (gamma when uncapped)."""
    try:
        obj = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise AdvisorError(f"{path}: not JSON ({e})") from None
    total = np.zeros(gamma + 1)
    for h in _histograms(obj, str(path)):
        counts = np.asarray(h, dtype=float)
        if counts.size > recorded_k + 1 and counts[recorded_k + 1 :].any():
            raise AdvisorError(
                f"{path}: a histogram has steps with more than {recorded_k} accepted drafts, "
                f"more than the recorded setting verifies ({recorded_k})"
            )
        if (counts < 0).any() or not np.isfinite(counts).all():
            raise AdvisorError(f"{path}: step counts must be finite and >= 0")
        total[: min(counts.size, gamma + 1)] += counts[: gamma + 1]
    if total.sum() <= 0:
        raise AdvisorError(f"{path}: no steps in its histograms")
    acc = np.flatnonzero(total)
    return Records(
        gamma=gamma,
        live=np.full(acc.size, recorded_k + 1, dtype=np.int64),
        accepted=acc.astype(np.int64),
        weight=total[acc],
        source=f"{path}: {int(total.sum())} steps",
    )


# ------------------------------------------------------------------ candidates


@dataclass(frozen=True)
class Candidate:
    """One value of ``--speculative-dspark-verify-cap``: a fixed K or conf: thresholds."""

    text: str
    fixed: Optional[int] = None
    thresholds: Optional[tuple[float, ...]] = None

    @property
    def key(self) -> tuple:
        """The setting itself (``conf:0.10`` and ``conf:0.1`` are one)."""
        return (self.fixed, self.thresholds)


def parse_candidate(text: str, gamma: int) -> Candidate:
    """The flag's forms, with the engine's range checks (``verify_cap_spec`` and the gamma
    checks of ``validate_verify_cap``)."""
    t = str(text).strip()
    try:
        if t.startswith("conf:"):
            vals = tuple(float(v) for v in t[len("conf:") :].split(","))
            if any(not (0.0 <= v <= 1.0) for v in vals):
                raise ValueError("thresholds must lie in [0, 1]")
            if len(vals) not in (1, gamma - 1):
                raise ValueError(f"give one threshold or gamma - 1 = {gamma - 1}")
            return Candidate(t, thresholds=vals)
        k = int(t)
        if not 1 <= k <= gamma:
            raise ValueError(f"K must be in 1..gamma ({gamma})")
        return Candidate(t, fixed=k)
    except ValueError as e:
        raise AdvisorError(
            f"candidate {text!r}: {e}; forms: K, conf:T, conf:t2,...,tgamma"
        ) from None


def threshold_vector(thresholds: Sequence[float], gamma: int) -> np.ndarray:
    """float32 [gamma]: one value for every draft, or 0 (always verified) then t2..tgamma."""
    vals = [thresholds[0]] * gamma if len(thresholds) == 1 else [0.0, *thresholds]
    return np.asarray(vals[:gamma], dtype=np.float32)


def drafts_from_confidence(
    confidence: np.ndarray, thresholds: np.ndarray, k_min: int
) -> np.ndarray:
    """k per record: the engine's rule (float32 running product, >= threshold, leading run,
    clamped to [k_min, gamma])."""
    gamma = confidence.shape[1]
    survive = np.cumprod(
        np.clip(confidence.astype(np.float32), np.float32(0), np.float32(1)),
        axis=1,
        dtype=np.float32,
    )
    keep = (survive >= thresholds.astype(np.float32)).astype(np.int64)
    k = np.cumprod(keep, axis=1).sum(axis=1)
    return np.clip(k, k_min, gamma)


def candidate_drafts(c: Candidate, rec: Records, k_min: int) -> np.ndarray:
    """Verified drafts per record under ``c``."""
    if c.fixed is not None:
        return np.full(rec.live.shape, c.fixed, dtype=np.int64)
    if rec.confidence is None:
        raise AdvisorError(
            f"candidate {c.text}: a conf: cap needs the confidences of the cap log; the "
            "histogram has none"
        )
    return drafts_from_confidence(
        rec.confidence, threshold_vector(c.thresholds, rec.gamma), k_min
    )


def check_recorded(c: Candidate, rec: Records, k_min: int) -> None:
    """AdvisorError unless ``c`` gives every record its logged live length (a threshold within
    TIE_SLACK of a product may round either way)."""
    got = rec.live - 1
    if c.fixed is not None:
        lo = hi = np.full(got.shape, c.fixed)
    else:
        if rec.confidence is None:
            raise AdvisorError(
                f"--recorded {c.text}: a histogram cannot tell a conf: cap's cut steps; use "
                "the cap log"
            )
        thr = threshold_vector(c.thresholds, rec.gamma)
        hi = drafts_from_confidence(rec.confidence, thr * (1 - TIE_SLACK), k_min)
        lo = drafts_from_confidence(rec.confidence, thr * (1 + TIE_SLACK), k_min)
    bad = np.flatnonzero((got < lo) | (got > hi))
    if bad.size:
        i = int(bad[0])
        raise AdvisorError(
            f"--recorded {c.text} (cap-min {k_min}) does not give the logged live lengths: "
            f"record {i} (offset {i * (rec.gamma + 2) * FLOAT.itemsize}) verified {got[i]} "
            f"drafts, the rule gives {lo[i]}; {bad.size} of {got.size} records differ"
        )


# ------------------------------------------------------------------ step time

# rows per request (1 + verified drafts, may be fractional) -> (step ms or None, note)
StepTime = Callable[[float], tuple[Optional[float], str]]


def step_table(path: Path, gamma: int) -> StepTime:
    """A JSON table {rows: step ms} (or {"rows": {...}}): rows = 1 + verified drafts per
    request. Linear between two listed rows, nothing outside them."""
    try:
        obj = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise AdvisorError(f"{path}: not JSON ({e})") from None
    if isinstance(obj, dict) and isinstance(obj.get("rows"), dict):
        obj = obj["rows"]
    if not isinstance(obj, dict) or not obj:
        raise AdvisorError(f"{path}: expected an object of rows -> step ms")
    table: dict[int, float] = {}
    for key, value in obj.items():
        try:
            rows, ms = int(key), float(value)
        except (TypeError, ValueError):
            raise AdvisorError(
                f"{path}: entry {key!r}: {value!r} is not rows -> ms"
            ) from None
        if not 1 <= rows <= gamma + 1 or not (math.isfinite(ms) and ms > 0):
            raise AdvisorError(
                f"{path}: entry {key!r}: {value!r}: rows must be 1..{gamma + 1}, ms > 0"
            )
        table[rows] = ms
    xs = sorted(table)

    def at(rows: float) -> tuple[Optional[float], str]:
        if rows in table:
            return table[int(rows)], f"table at {rows:g} rows"
        lo = [x for x in xs if x < rows]
        hi = [x for x in xs if x > rows]
        if not lo or not hi:
            return None, f"{rows:g} rows outside the table's {xs[0]}..{xs[-1]}"
        a, b = lo[-1], hi[0]
        t = (rows - a) / (b - a)
        return table[a] + t * (table[b] - table[a]), f"table between {a} and {b} rows"

    return at


def cost_model_steps(
    *,
    base_step_ms: float,
    bs: int,
    tp: int,
    gamma: int,
    device: str,
    model: str = "v4.1-flash",
    config: Optional[Path] = None,
    draft_stages: int = 3,
) -> StepTime:
    """The uncapped step time (measured) minus the cost model's predicted saving of a cap that
    verifies ``rows - 1`` drafts per request (its routed-experts site; the cap changes no other
    site's rows)."""
    if str(COST_MODEL_DIR) not in sys.path:
        sys.path.insert(0, str(COST_MODEL_DIR))
    import cost_model as cm

    if config is not None:
        m = cm.Model.from_config(
            json.loads(Path(config).read_text()), draft_stages, Path(config).name
        )
    else:
        m = cm.MODELS[model]

    def at(rows: float) -> tuple[Optional[float], str]:
        k = rows - 1
        cap = str(int(k)) if float(k).is_integer() else "conf:"
        flags = cm.Flags(verify_cap=cap, cap_mean_k=k)
        p = cm.predict(cm.Setup(m, tp, gamma, bs, flags, device=device))
        site = next(
            s for s in p["sites"] if s["feature"] == "--speculative-dspark-verify-cap"
        )
        if site["status"] == cm.NOT_MEASURED:
            return None, f"cost model: {site['why']}"
        saved = site["saved_us"]
        return base_step_ms - saved / 1e3, f"cost model: {saved:.0f} us saved"

    return at


# ------------------------------------------------------------------ the advice


@dataclass
class Row:
    """One candidate's prediction; ``accepted_low``..``accepted_high`` is the range where some
    record would need drafts past those it verified (``beyond_log`` records)."""

    candidate: str
    drafts: float  # mean verified drafts per request
    rows: float  # 1 + drafts
    accepted: Optional[float]
    accepted_low: float
    accepted_high: float
    beyond_log: float  # steps (records) that cannot price this candidate exactly
    step_ms: Optional[float]
    tpot_ms: Optional[float]
    tpot_ms_range: Optional[tuple[float, float]]
    note: str
    best: bool = False
    current: bool = False

    @property
    def ranked(self) -> bool:
        return self.tpot_ms is not None


def _mean(x: np.ndarray, weight: np.ndarray) -> float:
    """Weighted mean, a whole number kept whole (a table row is looked up, not interpolated)."""
    m = float(weight @ x / weight.sum())
    return float(round(m)) if abs(m - round(m)) < 1e-9 else m


def evaluate(
    name: str, k: np.ndarray, rec: Records, step: StepTime, current: bool = False
) -> Row:
    """Accepted drafts per step = mean over records of min(accepted, k), exact where the record
    verified at least k drafts or rejected one; bounds elsewhere."""
    verified = rec.live - 1
    censored = rec.accepted == verified
    exact = ~censored | (k <= verified)
    low = np.where(exact, np.minimum(rec.accepted, k), verified)
    high = np.where(exact, np.minimum(rec.accepted, k), k)
    acc_low, acc_high = _mean(low, rec.weight), _mean(high, rec.weight)
    beyond = float(rec.weight[~exact].sum())
    drafts = _mean(k, rec.weight)
    step_ms, note = step(1.0 + drafts)
    accepted = acc_low if beyond == 0 else None
    tpot = tpot_range = None
    if step_ms is not None:
        if accepted is not None:
            tpot = step_ms / (accepted + 1.0)
        else:
            tpot_range = (step_ms / (acc_high + 1.0), step_ms / (acc_low + 1.0))
            note = (
                f"{note}; {beyond:g} of {rec.steps:g} steps would need drafts past those "
                "they verified"
            )
    return Row(
        name,
        drafts,
        1.0 + drafts,
        accepted,
        acc_low,
        acc_high,
        beyond,
        step_ms,
        tpot,
        tpot_range,
        note,
        current=current,
    )


@dataclass
class Advice:
    gamma: int
    cap_min: int
    source: str
    steps: float
    censored_steps: float
    rows: list[Row] = field(default_factory=list)
    assumptions: tuple[str, ...] = ()

    @property
    def best(self) -> Optional[Row]:
        return next((r for r in self.rows if r.best), None)

    @property
    def current(self) -> Optional[Row]:
        return next((r for r in self.rows if r.current), None)


ASSUMPTIONS = (
    "tokens per step = accepted drafts + 1 (the bonus or correction token)",
    "TPOT = step time / (accepted drafts + 1), per request",
    "step time at the mean verified rows per request (1 + drafts)",
    "each logged step replayed alone: a cap does not move later steps' drafts",
    "a step that accepted every draft it verified bounds acceptance past them from below only",
)


def advise(
    rec: Records,
    candidates: Sequence[Candidate],
    step: StepTime,
    *,
    cap_min: int = 1,
    recorded: Optional[Candidate] = None,
) -> Advice:
    """Every candidate's row, sorted: priced exactly by TPOT, then flagged (by their best
    TPOT), then unpriced; the first exact one is the best. The current row is ``recorded``
    (checked against the log) or, without it, the log as recorded."""
    if not 1 <= cap_min <= rec.gamma:
        raise AdvisorError(
            f"--cap-min must be in 1..gamma ({rec.gamma}), got {cap_min}"
        )
    cands = list(candidates)
    if recorded is not None:
        check_recorded(recorded, rec, cap_min)
        if all(c.key != recorded.key for c in cands):
            cands.append(recorded)
    rows = [
        evaluate(
            c.text,
            candidate_drafts(c, rec, cap_min),
            rec,
            step,
            current=recorded is not None and c.key == recorded.key,
        )
        for c in cands
    ]
    if recorded is None:
        rows.append(evaluate("as logged", rec.live - 1, rec, step, current=True))

    def order(r: Row):
        if r.tpot_ms is not None:
            return (0, r.tpot_ms)
        if r.tpot_ms_range is not None:
            return (1, r.tpot_ms_range[0])
        return (2, 0.0)

    rows.sort(key=order)
    if rows and rows[0].ranked:
        rows[0].best = True
    verified = rec.live - 1
    return Advice(
        gamma=rec.gamma,
        cap_min=cap_min,
        source=rec.source,
        steps=rec.steps,
        censored_steps=float(rec.weight[rec.accepted == verified].sum()),
        rows=rows,
        assumptions=ASSUMPTIONS,
    )


# ------------------------------------------------------------------ output


def _f(x: Optional[float], digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def render(a: Advice) -> str:
    """The text table, best first."""
    out = [
        f"{a.source}; gamma {a.gamma}, cap-min {a.cap_min}; {a.censored_steps:g} of "
        f"{a.steps:g} steps accepted every draft they verified; "
        f"{sum(r.step_ms is None for r in a.rows)} candidate(s) without a step time",
        "",
        "| cap | verified drafts | accepted drafts/step | step ms | TPOT ms | note |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in a.rows:
        marks = [m for m, on in (("BEST", r.best), ("current", r.current)) if on]
        acc = (
            _f(r.accepted, 3)
            if r.accepted is not None
            else f"{r.accepted_low:.3f}..{r.accepted_high:.3f}"
        )
        tpot = (
            _f(r.tpot_ms, 3)
            if r.tpot_ms is not None
            else (
                f"{r.tpot_ms_range[0]:.3f}..{r.tpot_ms_range[1]:.3f}"
                if r.tpot_ms_range
                else "-"
            )
        )
        note = "; ".join([*marks, r.note])
        out.append(
            f"| {r.candidate} | {r.drafts:.2f} | {acc} | {_f(r.step_ms, 3)} | {tpot} | "
            f"{note} |"
        )
    out += ["", "Assumes: " + "; ".join(a.assumptions) + "."]
    return "\n".join(out)


def to_json(a: Advice) -> dict:
    return {
        "source": a.source,
        "gamma": a.gamma,
        "cap_min": a.cap_min,
        "steps": a.steps,
        "censored_steps": a.censored_steps,
        "best": a.best.candidate if a.best else None,
        "current": a.current.candidate if a.current else None,
        "assumptions": list(a.assumptions),
        "candidates": [asdict(r) for r in a.rows],
    }


# ------------------------------------------------------------------ command line


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Step time: --step-table, or --base-step-ms with the cost model's options.",
    )
    p.add_argument(
        "log", nargs="?", type=Path, help="--speculative-dspark-verify-cap-log"
    )
    p.add_argument(
        "--histogram",
        type=Path,
        help="instead of a log: JSON responses (or their meta_info, or lists of counts) with "
        "spec_correct_drafts_histogram; fixed caps only",
    )
    p.add_argument(
        "--gamma", type=int, required=True, help="drafts per step (block size)"
    )
    p.add_argument(
        "--cap-min",
        type=int,
        default=1,
        help="--speculative-dspark-verify-cap-min for conf: candidates and --recorded",
    )
    p.add_argument(
        "--recorded",
        help="the cap the log was recorded with (checked against it); a histogram without it "
        "is taken as uncapped",
    )
    p.add_argument(
        "--candidate",
        action="append",
        default=None,
        help="a cap value (K, conf:T, conf:t2,...); repeat. Default: K 1..gamma and "
        "conf:0.05..0.95 in steps of 0.05 (fixed K only for a histogram)",
    )
    p.add_argument("--step-table", type=Path, help="JSON {rows: step ms}, rows = 1 + k")
    p.add_argument(
        "--base-step-ms",
        type=float,
        help="measured uncapped step time (ms) at --bs: the cost model subtracts the cap's "
        "predicted saving",
    )
    p.add_argument("--bs", type=int, default=1)
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--device", default="NVIDIA_H200")
    p.add_argument("--model", default="v4.1-flash")
    p.add_argument("--config", type=Path, help="an HF config.json for the cost model")
    p.add_argument("--draft-stages", type=int, default=3)
    p.add_argument("--json", action="store_true", help="print JSON")
    return p


def run(argv: Optional[Sequence[str]] = None) -> Advice:
    """Parse, read, advise (AdvisorError on a refused input)."""
    a = _parser().parse_args(argv)
    gamma = a.gamma
    recorded = None if a.recorded is None else parse_candidate(a.recorded, gamma)
    if (a.log is None) == (a.histogram is None):
        raise AdvisorError("give a cap log or --histogram, not both or neither")
    if a.log is not None:
        if recorded is not None and recorded.thresholds is None:
            raise AdvisorError(
                "--recorded: the engine writes the log under a conf: cap only"
            )
        rec = read_cap_log(a.log, gamma)
    else:
        if recorded is not None and recorded.fixed is None:
            raise AdvisorError(
                f"--recorded {recorded.text}: a histogram cannot tell a conf: cap's cut "
                "steps; use the cap log"
            )
        rec = read_histogram(a.histogram, gamma, recorded.fixed if recorded else gamma)
    if a.candidate:
        cands = [parse_candidate(t, gamma) for t in a.candidate]
    else:
        cands = [Candidate(str(k), fixed=k) for k in range(1, gamma + 1)]
        if rec.confidence is not None:
            cands += [
                Candidate(f"conf:{t:g}", thresholds=(t,)) for t in DEFAULT_THRESHOLDS
            ]
    if (a.step_table is None) == (a.base_step_ms is None):
        raise AdvisorError(
            "give --step-table or --base-step-ms (cost model), one of them"
        )
    if a.step_table is not None:
        step = step_table(a.step_table, gamma)
    else:
        step = cost_model_steps(
            base_step_ms=a.base_step_ms,
            bs=a.bs,
            tp=a.tp,
            gamma=gamma,
            device=a.device,
            model=a.model,
            config=a.config,
            draft_stages=a.draft_stages,
        )
    advice = advise(rec, cands, step, cap_min=a.cap_min, recorded=recorded)
    priced = {r.drafts for r in advice.rows if r.ranked}
    if len(priced) < 2:
        why = "; ".join(f"{r.candidate}: {r.note}" for r in advice.rows if not r.ranked)
        raise AdvisorError(
            f"nothing to compare: {len(priced)} setting(s) priced exactly ({why[:600]})"
        )
    if a.json:
        print(json.dumps(to_json(advice), indent=1))
    else:
        print(render(advice))
    return advice


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        run(argv)
    except AdvisorError as e:
        print(f"cap_advisor: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
