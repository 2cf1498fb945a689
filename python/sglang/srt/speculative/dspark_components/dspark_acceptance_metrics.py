"""DSpark acceptance by draft position, in upstream's metrics framework (--enable-metrics).

Series (upstream's scheduler labels plus one of ours; what they mean and how to read them:
docs/dspark-tuning.md): ``sglang:dspark_drafts_proposed_total`` and ``..._accepted_total``
per ``position``, ``sglang:dspark_verify_steps_total`` per ``accepted_drafts`` (a histogram in
counter form), ``sglang:dspark_verify_rows_total`` per ``rows`` (``live``,
``kept_out_of_moe``) and the gauge ``sglang:dspark_draft_temperature_scale``.

Invariants: the scheduler counts from the accept and cap lengths upstream already copied to the
host (no device sync), the requests upstream's per-request statistics count (neither retracted
nor finished); the counters are written at the decode-log interval and when the scheduler goes
idle, so an idle server's counters equal the sum of its responses' ``meta_info`` counts, which
the tokenizer derives from upstream's per-request histograms. Without --enable-metrics or DSpark
nothing is built, registered or counted.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch

DSPARK = "DSPARK"
POSITION_LABEL = "position"
ACCEPTED_LABEL = "accepted_drafts"
ROWS_LABEL = "rows"
ROWS_LIVE = "live"
ROWS_KEPT_OUT = "kept_out_of_moe"
META_PROPOSED = "dspark_drafts_proposed_by_position"
META_ACCEPTED = "dspark_drafts_accepted_by_position"


def _is_dspark(spec) -> bool:
    algorithm = spec.speculative_algorithm
    return algorithm is not None and str(algorithm).upper() == DSPARK


def position_counts(
    accepted_hist: Sequence[int], verified_hist: Sequence[int], gamma: int
) -> tuple[List[int], List[int]]:
    """(proposed, accepted) per draft position 1..gamma from two histograms over request
    verify steps: ``accepted_hist[c]`` steps accepted c drafts, ``verified_hist[k]`` steps
    verified k drafts. Acceptance is a prefix, so position p is accepted in the steps with
    c >= p and proposed in those with k >= p."""
    proposed, accepted = [0] * gamma, [0] * gamma
    run_a = run_v = 0
    for p in range(gamma, 0, -1):
        run_a += accepted_hist[p] if p < len(accepted_hist) else 0
        run_v += verified_hist[p] if p < len(verified_hist) else 0
        accepted[p - 1], proposed[p - 1] = run_a, run_v
    return proposed, accepted


class DsparkAcceptanceCounts:
    """Request verify steps by accepted drafts and by verified drafts (host ints)."""

    def __init__(self, gamma: int) -> None:
        if gamma < 1:
            raise ValueError(
                f"DSpark acceptance metrics: gamma must be >= 1, got {gamma}"
            )
        self.gamma = int(gamma)
        self.accepted_hist = [0] * (self.gamma + 1)
        self.verified_hist = [0] * (self.gamma + 1)

    def observe(
        self,
        reqs,
        correct_drafts: Sequence[int],
        cap_lens: Optional[Sequence[int]] = None,
    ) -> None:
        """One verify step: ``correct_drafts[i]`` accepted drafts of ``reqs[i]``, ``cap_lens[i]``
        its verified length with the bonus slot (None: every draft verified). Skips the
        requests upstream's per-request statistics skip (retracted or already finished).
        """
        acc, ver, gamma = self.accepted_hist, self.verified_hist, self.gamma
        for i, req in enumerate(reqs):
            if req.is_retracted or req.finished():
                continue
            c = correct_drafts[i]
            k = gamma if cap_lens is None else cap_lens[i] - 1
            if not 0 <= c <= k <= gamma:
                raise ValueError(
                    f"DSpark acceptance metrics: request {req.rid} accepted {c} drafts of "
                    f"{k} verified (gamma {gamma}); expected 0 <= accepted <= verified <= gamma"
                )
            acc[c] += 1
            ver[k] += 1

    def totals(self) -> Dict[str, List[int]]:
        """Cumulative counts: per position (index p - 1), per accepted count, and rows."""
        proposed, accepted = position_counts(
            self.accepted_hist, self.verified_hist, self.gamma
        )
        steps = sum(self.accepted_hist)
        live = sum((k + 1) * n for k, n in enumerate(self.verified_hist))
        return {
            "proposed": proposed,
            "accepted": accepted,
            "steps_by_accepted": list(self.accepted_hist),
            "rows": [live, steps * (self.gamma + 1) - live],
        }


def _delta(now: Dict[str, List[int]], then: Dict[str, List[int]]):
    return {k: [a - b for a, b in zip(now[k], then[k])] for k in now}


class DsparkAcceptanceMetrics:
    """The scheduler's counts, their Prometheus series and the decode-log suffix
    (``registry``: prometheus' default, as upstream's collectors use, or a test's)."""

    def __init__(
        self,
        *,
        labels: Dict[str, str],
        gamma: int,
        draft_temperature_scale: float,
        registry=None,
    ) -> None:
        # Imported here, as upstream's collectors do: after PROMETHEUS_MULTIPROC_DIR is set.
        from prometheus_client import REGISTRY, Counter, Gauge

        registry = REGISTRY if registry is None else registry
        self.labels = dict(labels)
        self.counts = DsparkAcceptanceCounts(gamma)
        self.gamma = self.counts.gamma
        names = list(self.labels.keys())
        proposed = Counter(
            name="sglang:dspark_drafts_proposed_total",
            documentation="DSpark drafts put to the target's verification, per draft position "
            "(1 = first draft); a draft past a verify cap is not proposed.",
            labelnames=[*names, POSITION_LABEL],
            registry=registry,
        )
        accepted = Counter(
            name="sglang:dspark_drafts_accepted_total",
            documentation="DSpark drafts the target accepted, per draft position (1 = first draft).",
            labelnames=[*names, POSITION_LABEL],
            registry=registry,
        )
        steps = Counter(
            name="sglang:dspark_verify_steps_total",
            documentation="DSpark request verify steps by their number of accepted drafts "
            "(a histogram in counter form).",
            labelnames=[*names, ACCEPTED_LABEL],
            registry=registry,
        )
        rows = Counter(
            name="sglang:dspark_verify_rows_total",
            documentation="DSpark static verify rows: live (the anchor and the verified "
            "drafts) or kept_out_of_moe (past the verify cap, routed as the anchor).",
            labelnames=[*names, ROWS_LABEL],
            registry=registry,
        )
        self._tau = Gauge(
            name="sglang:dspark_draft_temperature_scale",
            documentation="DSpark draft temperature scale (tau) in effect.",
            labelnames=names,
            multiprocess_mode="mostrecent",
            registry=registry,
        ).labels(**self.labels)
        positions = [str(p) for p in range(1, self.gamma + 1)]
        self._series = {
            "proposed": [proposed.labels(**self.labels, position=p) for p in positions],
            "accepted": [accepted.labels(**self.labels, position=p) for p in positions],
            "steps_by_accepted": [
                steps.labels(**self.labels, accepted_drafts=str(c))
                for c in range(self.gamma + 1)
            ],
            "rows": [
                rows.labels(**self.labels, rows=r) for r in (ROWS_LIVE, ROWS_KEPT_OUT)
            ],
        }
        self._flushed = self.counts.totals()
        self._logged = self.counts.totals()
        self.set_draft_temperature_scale(draft_temperature_scale)

    def set_draft_temperature_scale(self, tau: float) -> None:
        self.draft_temperature_scale = float(tau)
        self._tau.set(self.draft_temperature_scale)

    def observe_verify(self, reqs, correct_drafts, cap_lens=None) -> None:
        self.counts.observe(reqs, correct_drafts, cap_lens)

    def flush(self) -> None:
        """Add the counts since the last flush to the Prometheus counters."""
        now = self.counts.totals()
        for key, deltas in _delta(now, self._flushed).items():
            for series, d in zip(self._series[key], deltas):
                if d:
                    series.inc(d)
        self._flushed = now

    def interval_log_suffix(self) -> str:
        """Flush; the decode-log text of the interval: accepted / proposed per position."""
        self.flush()
        now = self.counts.totals()
        d = _delta(now, self._logged)
        self._logged = now
        rates = " ".join(
            f"{a / p:.2f}" if p else "-" for p, a in zip(d["proposed"], d["accepted"])
        )
        msg = f"dspark accept by position: {rates}, "
        live, kept_out = d["rows"]
        if kept_out:
            msg += f"verify rows kept out of MoE: {kept_out / (live + kept_out):.2f}, "
        if self.draft_temperature_scale != 1.0:
            msg += f"draft tau: {self.draft_temperature_scale:g}, "
        return msg


def build_dspark_acceptance_metrics(
    spec, collector, registry=None
) -> Optional[DsparkAcceptanceMetrics]:
    """The metrics for this scheduler when it exports metrics (``collector``: upstream's
    scheduler collector, whose labels they share, or None) and serves DSpark; else None.
    """
    if collector is None or not _is_dspark(spec):
        return None
    return DsparkAcceptanceMetrics(
        labels=collector.labels,
        gamma=int(spec.speculative_num_draft_tokens) - 1,
        draft_temperature_scale=spec.speculative_dspark_draft_temperature_scale,
        registry=registry,
    )


def observe_dspark_verify(
    metrics: Optional[DsparkAcceptanceMetrics], reqs, correct_drafts, cap_lens
) -> None:
    """Upstream's spec-v2 result hook: count one verify step (no-op when metrics are off)."""
    if metrics is not None:
        metrics.observe_verify(reqs, correct_drafts, cap_lens)


def flush_dspark_acceptance(metrics: Optional[DsparkAcceptanceMetrics]) -> None:
    """Upstream's idle hook: write pending counts, so a scrape of an idle server is exact."""
    if metrics is not None:
        metrics.flush()


def add_dspark_position_counts(meta_info: dict, spec, enabled: bool) -> None:
    """Per-request proposed and accepted drafts per position into ``meta_info``, from the
    histograms upstream put there (``spec_correct_drafts_histogram``; with a cap,
    ``spec_cap_lens_histogram``). Only with metrics on and DSpark."""
    verify_ct = meta_info.get("spec_verify_ct")
    if not enabled or not verify_ct or not _is_dspark(spec):
        return
    gamma = int(spec.speculative_num_draft_tokens) - 1
    cap_hist = meta_info.get("spec_cap_lens_histogram")
    if cap_hist:
        verified_hist = [0] * (gamma + 1)
        for length, n in enumerate(cap_hist[1:], start=1):
            verified_hist[length - 1] += n
    else:
        verified_hist = [0] * gamma + [verify_ct]
    proposed, accepted = position_counts(
        meta_info.get("spec_correct_drafts_histogram") or [], verified_hist, gamma
    )
    meta_info[META_PROPOSED] = proposed
    meta_info[META_ACCEPTED] = accepted


class VerifyCapLens:
    """A step's verify-cap live lengths as upstream's ``cap_lens`` result field (a copy: the
    next step rewrites the cap's buffer); upstream's asynchronous result copy carries it.
    """

    def __init__(self, verify_cap) -> None:
        self.verify_cap = verify_cap

    def __call__(self, bs: int) -> torch.Tensor:
        return self.verify_cap.live[:bs].to(torch.int32)


def build_verify_cap_lens(verify_cap, observability) -> Optional[VerifyCapLens]:
    """``VerifyCapLens`` when a verify cap is on and --enable-metrics is set, else None."""
    if verify_cap is None or not observability.enable_metrics:
        return None
    return VerifyCapLens(verify_cap)
