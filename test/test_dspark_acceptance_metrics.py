"""DSpark acceptance by draft position through upstream's metrics (--enable-metrics).

* The counting: position counts from the two histograms equal a brute-force count over
  random steps; retracted and finished requests are skipped as upstream's per-request
  statistics skip them; an accept count past the verified drafts raises.
* The series: upstream's scheduler labels plus ``position`` / ``accepted_drafts`` /
  ``rows``, ``sglang:`` names, counters written only at a flush, the tau gauge.
* meta_info: the per-request counts derived from upstream's per-request histograms.
* A synthetic run through upstream's own result hook (``_resolve_spec_v2_tokens``) and
  tokenizer meta_info (``_calculate_spec_decoding_metrics``): the per-position counts summed
  over the responses equal the registry's counters; counting finished requests too (a fault)
  breaks the equality.
* Off: no metrics object, nothing registered, results and meta_info unchanged.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from prometheus_client import REGISTRY, CollectorRegistry

from sglang.srt.managers import tokenizer_manager
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.scheduler_components.batch_result_processor import (
    SchedulerBatchResultProcessor,
)
from sglang.srt.managers.scheduler_components.metrics_reporter import (
    SchedulerMetricsReporter,
)
from sglang.srt.managers.tokenizer_manager import TokenizerManager
from sglang.srt.speculative.dspark_components import dspark_acceptance_metrics as dam
from sglang.srt.speculative.dspark_components.dspark_verify_cap import (
    VerifyCap,
    verify_cap_spec,
)

# The labels upstream's SchedulerMetricsCollector.init_new gives a scheduler.
LABELS = {
    "model_name": "m",
    "engine_type": "unified",
    "tp_rank": "0",
    "pp_rank": "0",
    "moe_ep_rank": "0",
}
NAMES = (
    "sglang:dspark_drafts_proposed",
    "sglang:dspark_drafts_accepted",
    "sglang:dspark_verify_steps",
    "sglang:dspark_verify_rows",
    "sglang:dspark_draft_temperature_scale",
)


def _spec(gamma=4, algorithm="DSPARK", tau=1.0):
    return SimpleNamespace(
        speculative_algorithm=algorithm,
        speculative_num_draft_tokens=gamma + 1,
        speculative_dspark_draft_temperature_scale=tau,
    )


def _metrics(gamma=4, tau=1.0):
    registry = CollectorRegistry()
    collector = SimpleNamespace(labels=dict(LABELS))
    m = dam.build_dspark_acceptance_metrics(_spec(gamma, tau=tau), collector, registry)
    return m, registry


def _value(registry, name, **extra):
    return registry.get_sample_value(name, {**LABELS, **extra})


def _registry_counts(registry, gamma):
    return [
        [
            _value(registry, f"sglang:dspark_drafts_{kind}_total", position=str(p))
            for p in range(1, gamma + 1)
        ]
        for kind in ("proposed", "accepted")
    ]


class _Req:
    """The fields of upstream's Req that the spec-v2 result hook reads and writes."""

    update_spec_correct_drafts_histogram = Req.update_spec_correct_drafts_histogram
    update_spec_cap_lens_histogram = Req.update_spec_cap_lens_histogram

    def __init__(self, rid):
        self.rid = rid
        self.is_retracted = False
        self.done = False
        self.grammar = None
        self.kv = SimpleNamespace(kv_committed_len=0)
        self.spec_verify_ct = 0
        self.spec_num_correct_drafts = 0
        self.spec_num_block_accept_tokens = 0
        self.spec_num_cap_tokens = 0
        self.spec_correct_drafts_histogram = []
        self.spec_cap_lens_histogram = []
        self.output_len = 0

    def finished(self):
        return self.done


# --- counting -----------------------------------------------------------------


def test_position_counts_equal_a_brute_force_count():
    rng = random.Random(0)
    gamma = 5
    counts = dam.DsparkAcceptanceCounts(gamma)
    proposed, accepted = [0] * gamma, [0] * gamma
    for _ in range(50):
        bs = rng.randint(1, 8)
        ks = [rng.randint(1, gamma) for _ in range(bs)]
        cs = [rng.randint(0, k) for k in ks]
        counts.observe([_Req(i) for i in range(bs)], cs, [k + 1 for k in ks])
        for c, k in zip(cs, ks):
            for p in range(1, gamma + 1):
                proposed[p - 1] += p <= k
                accepted[p - 1] += p <= c
    totals = counts.totals()
    assert totals["proposed"] == proposed and totals["accepted"] == accepted
    steps = sum(totals["steps_by_accepted"])
    live, kept_out = totals["rows"]
    assert live == steps + sum(proposed)
    assert live + kept_out == steps * (gamma + 1)


def test_no_cap_proposes_every_draft():
    counts = dam.DsparkAcceptanceCounts(3)
    counts.observe([_Req(0), _Req(1)], [0, 3], None)
    t = counts.totals()
    assert t["proposed"] == [2, 2, 2] and t["accepted"] == [1, 1, 1]
    assert t["steps_by_accepted"] == [1, 0, 0, 1] and t["rows"] == [8, 0]


def test_retracted_and_finished_requests_are_not_counted():
    reqs = [_Req(i) for i in range(3)]
    reqs[0].is_retracted = True
    reqs[1].done = True
    counts = dam.DsparkAcceptanceCounts(2)
    counts.observe(reqs, [2, 2, 1], None)
    assert counts.totals()["steps_by_accepted"] == [0, 1, 0]


@pytest.mark.parametrize("correct, cap_lens", [([3], [3]), ([5], None), ([-1], None)])
def test_an_impossible_accept_count_raises(correct, cap_lens):
    with pytest.raises(ValueError, match="expected 0 <= accepted <= verified"):
        dam.DsparkAcceptanceCounts(4).observe([_Req("r")], correct, cap_lens)


# --- series -------------------------------------------------------------------


def test_series_carry_upstreams_labels_and_are_written_at_a_flush():
    m, registry = _metrics(gamma=3, tau=1.25)
    assert _value(registry, "sglang:dspark_draft_temperature_scale") == 1.25
    m.observe_verify([_Req(0), _Req(1)], [1, 2], [3, 4])
    # Counted, not yet written.
    assert _registry_counts(registry, 3) == [[0.0] * 3, [0.0] * 3]
    m.flush()
    assert _registry_counts(registry, 3) == [[2.0, 2.0, 1.0], [2.0, 1.0, 0.0]]
    steps = [
        _value(registry, "sglang:dspark_verify_steps_total", accepted_drafts=str(c))
        for c in range(4)
    ]
    assert steps == [0.0, 1.0, 1.0, 0.0]
    assert _value(registry, "sglang:dspark_verify_rows_total", rows="live") == 7.0
    assert (
        _value(registry, "sglang:dspark_verify_rows_total", rows="kept_out_of_moe")
        == 1.0
    )
    m.flush()  # nothing new: unchanged
    assert _registry_counts(registry, 3) == [[2.0, 2.0, 1.0], [2.0, 1.0, 0.0]]
    m.set_draft_temperature_scale(0.8)
    assert _value(registry, "sglang:dspark_draft_temperature_scale") == 0.8


def test_decode_log_suffix_reports_the_interval():
    m, registry = _metrics(gamma=2)
    m.observe_verify([_Req(0), _Req(1)], [2, 0], [3, 2])
    assert m.interval_log_suffix() == (
        "dspark accept by position: 0.50 1.00, verify rows kept out of MoE: 0.17, "
    )
    # Written by the log too, and the next interval starts empty.
    assert _registry_counts(registry, 2) == [[2.0, 1.0], [1.0, 1.0]]
    m.observe_verify([_Req(0)], [0], None)
    assert m.interval_log_suffix() == "dspark accept by position: 0.00 0.00, "
    m.set_draft_temperature_scale(1.5)
    assert m.interval_log_suffix().endswith("draft tau: 1.5, ")


def test_idle_hook_flushes():
    m, registry = _metrics(gamma=2)
    m.observe_verify([_Req(0)], [1], None)
    reporter = SchedulerMetricsReporter.__new__(SchedulerMetricsReporter)
    reporter.dspark_acceptance = m
    reporter.scheduler = SimpleNamespace(enable_fpm=False)
    reporter.stats = SimpleNamespace(fwd_occupancy=float("nan"))
    reporter.current_scheduler_metrics_enabled = False
    reporter._maybe_log_idle_metrics()
    assert _registry_counts(registry, 2) == [[1.0, 1.0], [1.0, 0.0]]


# --- meta_info ----------------------------------------------------------------


def test_meta_info_counts_from_upstreams_histograms():
    meta = {
        "spec_verify_ct": 4,
        "spec_correct_drafts_histogram": [1, 0, 2, 1],
        "spec_cap_lens_histogram": [0, 0, 1, 1, 2],
    }
    dam.add_dspark_position_counts(meta, _spec(gamma=3), True)
    # verified drafts: 1, 2, 3, 3; accepted: 0, 2, 2, 3
    assert meta[dam.META_PROPOSED] == [4, 3, 2]
    assert meta[dam.META_ACCEPTED] == [3, 3, 1]
    meta = {"spec_verify_ct": 2, "spec_correct_drafts_histogram": [1, 1]}
    dam.add_dspark_position_counts(meta, _spec(gamma=3), True)
    assert meta[dam.META_PROPOSED] == [2, 2, 2]
    assert meta[dam.META_ACCEPTED] == [1, 0, 0]


@pytest.mark.parametrize(
    "enabled, algorithm", [(False, "DSPARK"), (True, "EAGLE"), (True, None)]
)
def test_meta_info_unchanged_when_off(enabled, algorithm):
    meta = {"spec_verify_ct": 2, "spec_correct_drafts_histogram": [1, 1]}
    before = dict(meta)
    dam.add_dspark_position_counts(meta, _spec(algorithm=algorithm), enabled)
    assert meta == before


# --- a synthetic run: responses against /metrics ------------------------------


def _processor(metrics):
    return SimpleNamespace(
        metrics_reporter=SimpleNamespace(
            dspark_acceptance=metrics,
            snapshot_spec_decode_metrics=lambda batch, result: None,
        ),
        model_worker=SimpleNamespace(on_verify_complete_cpu=lambda *a, **k: None),
        advance_grammar_fsm=lambda result, batch: None,
    )


def _run(metrics, *, gamma=4, num_reqs=6, steps=30, cap=True, seed=1):
    """Verify steps through upstream's result hook; returns the requests and the tokens."""
    rng = random.Random(seed)
    reqs = [_Req(f"r{i}") for i in range(num_reqs)]
    finish_at = {i: rng.randint(3, steps) for i in range(num_reqs)}
    tokens = []
    processor = _processor(metrics)
    for step in range(steps):
        live = [r for r in reqs if not r.is_retracted][: rng.randint(1, num_reqs)]
        bs = len(live)
        ks = [rng.randint(1, gamma) if cap else gamma for _ in live]
        cs = [rng.randint(0, k) for k in ks]
        result = SimpleNamespace(
            next_token_ids=torch.arange(bs * (gamma + 1)),
            accept_lens=torch.tensor([c + 1 for c in cs]),
            speculative_output_stride=None,
            speculative_num_draft_tokens=gamma + 1,
            num_non_draft_tokens_per_req=1,
            block_accept_lens=None,
            cap_lens=(
                torch.tensor([k + 1 for k in ks], dtype=torch.int32) if cap else None
            ),
        )
        batch = SimpleNamespace(reqs=live)
        tokens.append(
            SchedulerBatchResultProcessor._resolve_spec_v2_tokens(
                processor, result, batch
            )
        )
        for i, r in enumerate(reqs):
            if finish_at[i] == step:
                r.done = True  # still in the next batches, as with overlap scheduling
        if step == steps // 2:
            reqs[-1].is_retracted = True
    return reqs, tokens


def _responses(reqs, monkeypatch, gamma, enabled=True):
    """Each request's meta_info as upstream's tokenizer builds it, plus ours."""
    monkeypatch.setattr(tokenizer_manager, "get_spec", lambda: _spec(gamma))
    monkeypatch.setattr(tokenizer_manager, "_ragged_verify_cap_accept", lambda: False)
    recv = SimpleNamespace(
        spec_verify_ct=[r.spec_verify_ct for r in reqs],
        spec_num_correct_drafts=[r.spec_num_correct_drafts for r in reqs],
        completion_tokens=[r.kv.kv_committed_len for r in reqs],
        spec_num_cap_tokens=[r.spec_num_cap_tokens for r in reqs],
        spec_num_block_accept_tokens=None,
        spec_correct_drafts_histogram=[r.spec_correct_drafts_histogram for r in reqs],
        spec_cap_lens_histogram=[r.spec_cap_lens_histogram for r in reqs],
    )
    metas = []
    for i in range(len(reqs)):
        meta = {}
        TokenizerManager._calculate_spec_decoding_metrics(None, meta, recv, i)
        dam.add_dspark_position_counts(meta, tokenizer_manager.get_spec(), enabled)
        metas.append(meta)
    return metas


def _summed(metas, gamma):
    return [
        [float(sum(m.get(key, [0] * gamma)[p] for m in metas)) for p in range(gamma)]
        for key in (dam.META_PROPOSED, dam.META_ACCEPTED)
    ]


@pytest.mark.parametrize("cap", [True, False])
def test_responses_sum_to_the_registry(monkeypatch, cap):
    gamma = 4
    m, registry = _metrics(gamma)
    reqs, _ = _run(m, gamma=gamma, cap=cap)
    m.flush()
    metas = _responses(reqs, monkeypatch, gamma)
    verified = [meta for meta, r in zip(metas, reqs) if r.spec_verify_ct]
    assert len(verified) > 1 and all(dam.META_PROPOSED in meta for meta in verified)
    summed = _summed(metas, gamma)
    assert summed == _registry_counts(registry, gamma)
    assert summed[1][0] > 0 and (summed[0][-1] < summed[0][0]) == cap


def test_a_fault_that_counts_finished_requests_breaks_the_sums(monkeypatch):
    gamma = 4

    class CountsEveryRequest(dam.DsparkAcceptanceCounts):
        def observe(self, reqs, correct_drafts, cap_lens=None):
            reqs = [SimpleNamespace(is_retracted=False, finished=lambda: False)] * len(
                reqs
            )
            super().observe(reqs, correct_drafts, cap_lens)

    m, registry = _metrics(gamma)
    m.counts = CountsEveryRequest(gamma)
    m._flushed = m._logged = m.counts.totals()
    reqs, _ = _run(m, gamma=gamma)
    m.flush()
    assert _summed(_responses(reqs, monkeypatch, gamma), gamma) != _registry_counts(
        registry, gamma
    )


# --- off ----------------------------------------------------------------------


def test_off_registers_nothing():
    registry = CollectorRegistry()
    collector = SimpleNamespace(labels=dict(LABELS))
    assert dam.build_dspark_acceptance_metrics(_spec(), None, registry) is None
    for algorithm in ("EAGLE", None):
        spec = _spec(algorithm=algorithm)
        assert dam.build_dspark_acceptance_metrics(spec, collector, registry) is None
    assert list(registry.collect()) == []
    registered = {metric.name for metric in REGISTRY.collect()}
    assert not registered & {n.removesuffix("_total") for n in NAMES}
    dam.observe_dspark_verify(None, [_Req(0)], [1], None)
    dam.flush_dspark_acceptance(None)


def test_metrics_do_not_change_the_results(monkeypatch):
    m, _ = _metrics()
    with_metrics, tokens_on = _run(m)
    without, tokens_off = _run(None)
    assert tokens_on == tokens_off
    assert [vars(r) for r in with_metrics] == [vars(r) for r in without]
    metas = _responses(without, monkeypatch, 4, enabled=False)
    assert not any(set(meta) & {dam.META_PROPOSED, dam.META_ACCEPTED} for meta in metas)


# --- the verify cap's live lengths ----------------------------------------------


def _cap(value="2", gamma=4):
    return VerifyCap(spec=verify_cap_spec(value), gamma=gamma, device="cpu")


def test_cap_lens_only_with_metrics_and_a_cap():
    on, off = SimpleNamespace(enable_metrics=True), SimpleNamespace(
        enable_metrics=False
    )
    assert dam.build_verify_cap_lens(None, on) is None
    assert dam.build_verify_cap_lens(_cap(), off) is None
    lens = dam.build_verify_cap_lens(_cap(), on)
    out = lens(3)
    assert out.dtype == torch.int32 and out.tolist() == [3, 3, 3]
    lens.verify_cap.live.fill_(5)  # the next step rewrites the buffer
    assert out.tolist() == [3, 3, 3]
