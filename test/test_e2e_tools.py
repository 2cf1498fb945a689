"""The end-to-end harness's own logic: log triage, the two-sample test, the checkpoints' tokenizer."""

from __future__ import annotations

import gzip
import json
import math
import os
import random
import re
from pathlib import Path

import pytest
from e2e.checkpoints import DEEPSEEK_SPECIAL_TOKENS, MASK_TOKEN_ID, write_tokenizer
from e2e.matrix import (
    LOGPROB_BOUND,
    P_MIN,
    STANDINS,
    V41_MODELS,
    Row,
    chi2_same,
    evaluate,
    evidence,
    feature_lines,
    judge_speculation,
    kernel_summary,
    main,
    merge_rows,
    read_raws,
    row_env,
    rows,
    sample_test,
    write_raw,
)
from e2e.server import handled_fallbacks, log_errors


def test_log_errors_skip_only_upstreams_handled_fallback():
    handled = (
        "[t] Metadata glue-graph capture failed for key (16, '5', '5'); falling back to eager metadata "
        'prep permanently.\nTraceback (most recent call last):\n  File "x"\nRuntimeError: capture\n'
        "[t] INFO: 200 OK\n"
    )
    assert log_errors(handled) == [] and len(handled_fallbacks(handled)) == 1
    # A traceback after the next log record is an error again.
    assert log_errors(
        handled + "Traceback (most recent call last):\nValueError: boom\n"
    ) == ["Traceback (most recent call last):", "ValueError: boom"]
    assert log_errors(
        "[t] Scheduler hit an exception: Traceback (most recent call last):\n"
    )


def _draws(p_succ: float, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [0] + [1 if rng.random() < p_succ else rng.randint(2, 127) for _ in range(3)]
        for _ in range(n)
    ]


def test_two_sample_test_accepts_the_same_rule_and_refuses_a_broken_one():
    same = chi2_same(_draws(0.82, 2000, 1), _draws(0.82, 2000, 2))
    assert same["min_p"] >= P_MIN
    # What the H200's negative control does: the target sampled sharper (0.7 T) than the reference.
    broken = chi2_same(_draws(0.92, 2000, 3), _draws(0.82, 2000, 4))
    assert broken["min_p"] < P_MIN


def _served(tokens, logprobs=None):
    return {
        "model": "random",
        "tree": "fork",
        "fork_flags_line": "",
        "log_errors": [],
        "_greedy": {
            "tokens": tokens,
            "logprobs": logprobs or [[-0.5] * len(t) for t in tokens],
            "finish": ["length"],
            "completion_matches_generate": True,
            "spec": None,
        },
    }


def _row(name, **kw):
    return Row(name, [], model="random", **kw)


def test_identity_needs_tokens_and_logprobs_and_a_served_reference():
    recs = {"ref": _served([[1, 2, 3]])}
    same = _served([[1, 2, 3]])
    evaluate(_row("a", same_as=("ref",)), same, recs)
    assert same["ok"] and same["checks"]["identical_to_ref"]
    # the same tokens with one logprob off by a rounding step: not upstream's bits
    near = _served([[1, 2, 3]], [[-0.5, -0.5, -0.5000001]])
    evaluate(_row("b", same_as=("ref",)), near, recs)
    assert near["ok"] is False and near["vs_ref"]["tokens_identical"]
    missing = _served([[1, 2, 3]])
    evaluate(_row("c", same_as=("absent",)), missing, recs)
    assert missing["ok"] is False and missing["checks"] == {
        "fork_flags_line": True,
        "no_log_errors": True,
        "completion_matches_generate": True,
        "reference_absent_served": False,
    }


def test_a_bound_row_is_held_to_the_bound_over_the_common_prefix():
    recs = {"ref": _served([[1, 2, 3, 4]], [[-1.0, -1.0, -1.0, -1.0]])}
    # diverges at token 2: the logprobs there and after are of other tokens, not compared
    bound = LOGPROB_BOUND["random"]
    close = _served([[1, 2, 7, 7]], [[-1.0, -1.0 - bound / 2, -9.0, -9.0]])
    evaluate(_row("a", bound_to="ref"), close, recs)
    assert close["ok"] and close["vs_ref"]["share_compared"] == 0.5
    assert close["vs_ref"]["first_difference"] == {0: 2}
    far = _served([[1, 2, 3, 4]], [[-1.0, -1.0 - 4 * bound, -1.0, -1.0]])
    evaluate(_row("b", bound_to="ref"), far, recs)
    assert far["ok"] is False  # the first decoded token moved past the bound
    early = _served([[7, 7, 7, 7]], [[-1.0, -1.0, -1.0, -1.0]])
    evaluate(_row("c", bound_to="ref"), early, recs)
    assert (
        early["ok"] is False
    )  # a shared prefix of a quarter is the least the rule takes
    # a negative control passes only when its designated check fails
    wrong = _served([[1, 2, 3, 4]], [[-1.0, -3.0, -1.0, -1.0]])
    evaluate(_row("w", bound_to="ref", must_fail="within_bound_of_ref"), wrong, recs)
    assert wrong["ok"]
    blind = _served([[1, 2, 3, 4]], [[-1.0, -1.0, -1.0, -1.0]])
    evaluate(_row("w", bound_to="ref", must_fail="within_bound_of_ref"), blind, recs)
    assert blind["ok"] is False


def test_a_row_whose_feature_did_not_engage_fails():
    probe = "pkg.mod:Cls.method?flag"
    row = _row("a", engaged=(r"feature built",), probes=(probe,))
    ran = _served([[1]])
    log = "feature built\ne2e probe: pkg.mod:Cls.method call 1 -> None\n"
    ran["_evidence"] = {e: bool(re.search(e, log)) for e in evidence(row)}
    evaluate(row, ran, {})
    assert ran["ok"] and ran["engaged_missing"] == []
    silent = _served([[1]])
    silent["_evidence"] = {
        e: bool(re.search(e, "feature built\n")) for e in evidence(row)
    }
    evaluate(row, silent, {})
    assert silent["ok"] is False and silent["engaged_missing"] == [
        re.escape("e2e probe: pkg.mod:Cls.method call")
    ]


def test_a_graph_served_kernel_must_count_its_replays_on_the_device():
    """Under CUDA graphs the Python probe fires at the capture only: a head that was captured
    and then never replayed logs its call lines, and only the device counter shows the gap.
    """
    from e2e.matrix import P_HEAD

    row = _row("a", probes=(P_HEAD,))
    name = P_HEAD.split("?")[0]
    for count, ok in ((2, False), (99, False), (100, True), (68600, True)):
        log = f"e2e probe: {name} call 1 -> None\ne2e probe: {name} device count {count}\n"
        rec = _served([[1]])
        rec["_evidence"] = {e: bool(re.search(e, log)) for e in evidence(row)}
        evaluate(row, rec, {})
        assert rec["ok"] is ok, count
    captured_only = _served([[1]])
    log = f"e2e probe: {name} call 1 -> None\n"
    captured_only["_evidence"] = {e: bool(re.search(e, log)) for e in evidence(row)}
    evaluate(row, captured_only, {})
    assert captured_only["ok"] is False


def test_an_upstream_row_must_not_be_the_fork():
    rec = _served([[1]])
    evaluate(_row("up", tree="upstream"), rec, {})
    assert rec["ok"] is False and rec["checks"]["is_upstream"] is False
    rec = {**_served([[1]]), "fork_flags_line": None}
    evaluate(_row("up", tree="upstream"), rec, {})
    assert rec["ok"]


def test_one_of_rule_takes_either_upstream_result_and_refuses_a_third():
    """same_as_one_of: upstream served twice gave two results; a fork row must give one of
    them bit for bit, a third result fails, and a reference that did not serve fails."""
    recs = {
        "up": _served([[1, 2, 3]]),
        "up_again": _served([[1, 2, 4]], [[-0.5, -0.5, -0.25]]),
    }
    for got in (recs["up"], recs["up_again"]):
        rec = _served(got["_greedy"]["tokens"], got["_greedy"]["logprobs"])
        evaluate(_row("a", same_as_one_of=("up", "up_again")), rec, recs)
        assert rec["ok"], rec["checks"]
    third = _served([[1, 2, 3]], [[-0.5, -0.5, -0.5000001]])
    evaluate(_row("b", same_as_one_of=("up", "up_again")), third, recs)
    assert third["ok"] is False
    assert third["checks"]["identical_to_one_of_up_or_up_again"] is False
    alone = _served([[1, 2, 3]])
    evaluate(_row("c", same_as_one_of=("up", "absent")), alone, recs)
    assert alone["ok"] is False and alone["checks"]["reference_absent_served"] is False
    # recorded, not judged: the second upstream row differs from the first and still passes
    again = _served([[1, 2, 4]], [[-0.5, -0.5, -0.25]])
    again["fork_flags_line"] = None
    evaluate(_row("up_again", tree="upstream", recorded_vs=("up",)), again, recs)
    assert again["ok"] and not again["vs_up"]["tokens_identical"]


def test_rows_hold_their_promises():
    named = {r.name: r for r in rows()}
    # flags off and every row that promises upstream's bits: tokens and logprobs identical
    for name in (
        "random_off",
        "random_tau_0.7",
        "random_fast_load",
        "random_serial_load",
        "random_loop_abort",
        "random_thinking_aliases",
    ):
        assert named[name].same_as == ("random_up_off",), name
    assert named["random_nospec"].same_as == ("random_up_nospec",)
    # DeepSeek-V4.1: flags off and every V4.1 feature held to upstream without speculation bit
    # for bit, upstream's known flip an expected failure; the V4 checkpoints' refusals stay
    for name in (
        "v41_off",
        "v41_engram_prefetch",
        "v41_engram_prefetch_check",
        "v41_hc_fused_stats",
        "v41_agree_off",
        "v41_partial_off",
        "v41_agree_engram_prefetch",
    ):
        r = named[name]
        assert r.model in V41_MODELS and r.same_as == (f"{r.model}_up_nospec",), name
        assert r.upstream_defect == "v41_dspark_graph_flip" and not r.same_as_one_of
        assert r.recorded_vs == (f"{r.model}_up_off",) and r.accepts == "reference"
    # upstream's V4.1 DSpark on three servers per checkpoint, each held to the same rule
    for model in V41_MODELS:
        servers = [named[f"{model}_up_off{s}"] for s in ("", "_again", "_third")]
        for r in servers:
            assert r.tree == "upstream" and r.same_as == (f"{model}_up_nospec",)
            assert r.upstream_defect == "v41_dspark_graph_flip"
        assert [r.recorded_vs for r in servers] == [()] + [(f"{model}_up_off",)] * 2
    # the diagnosis: upstream with the Engram commit inside the verify graph, on two servers
    for name in ("v41_up_engram_graph", "v41_up_engram_graph_again"):
        r = named[name]
        assert r.tree == "upstream" and r.model == "v41" and not r.same_as_one_of
        assert r.env == {"SGLANG_OPT_DSV41_POST_FORWARD_CUDA_GRAPH": "1"}
        assert r.recorded_vs == ("v41_up_off", "v41_up_nospec")
        assert (
            row_env(r, {}, {"upstream": Path("/up")}).get(
                "SGLANG_OPT_DSV41_POST_FORWARD_CUDA_GRAPH"
            )
            == "1"
        )
    assert named["v41_nospec"].same_as == ("v41_up_nospec",)
    store = named["v41_row_store"]
    assert store.same_as == ("v41_up_off_eager",) and "disabled" in store.args
    assert all(
        named[f"v41_up_{n}"].tree == "upstream" for n in ("off", "nospec", "off_eager")
    )
    for flag in (
        "--engram-prefetch",
        "--dsv4-hc-fused-stats",
        "--engram-row-store-dir",
    ):
        served = [r for r in rows() if flag in r.args and not r.refused_with]
        assert served and all(r.model in V41_MODELS and r.engaged for r in served)
        assert any(flag in r.args and r.refused_with for r in rows()), flag
    # the harness's own control: upstream twice, the same bits
    again = named["random_up_nospec_again"]
    assert again.tree == "upstream" and again.same_as == ("random_up_nospec",)
    # the fence folds nothing on a DeepSeek-V4 checkpoint: refused there, in no serving row
    assert "refuse_fence_v4" in named
    assert all(
        "--speculative-dspark-fence-accept-results" not in r.args
        for r in rows()
        if not r.refused_with
    )
    # the agree checkpoint: upstream's tokens, logprobs within the scheduling bound
    assert named["off"].tokens_as == named["off"].same_as + ("up_off",)
    assert named["off"].bound_to == "up_off" and named["nospec"].bound_to == "up_nospec"
    # rounding-level rows: the bound against upstream, not an exemption
    for name in (
        "random_wo_a_small",
        "random_wo_a_drop",
        "random_cap_3",
        "random_cap_conf",
        "random_head_fp8",
        "random_all_on",
    ):
        assert named[name].bound_to == "random_up_off", name
    assert named["random_wo_a_wrong"].fault and named["random_wo_a_wrong"].must_fail
    assert named["s_tau_wrong_q"].fault == "tau_q_at_T"
    # every DSpark flag has a random row and a sampled row; every serving fork row shows evidence
    for flag in (
        "--speculative-dspark-verify-cap",
        "--speculative-dspark-draft-head-fp8",
        "--speculative-dspark-draft-temperature-scale",
        "--dsv4-wo-a-fp8-twin",
    ):
        assert any(flag in r.args for r in rows() if r.model == "random"), flag
        assert any(flag in r.args for r in rows() if r.model == "sample"), flag
    for r in rows():
        if (
            r.tree == "fork"
            and not r.refused_with
            and any(
                a.startswith("--")
                and a
                not in (
                    "--speculative-algorithm",
                    "--reasoning-parser",
                    "--cuda-graph-backend-decode",
                    "--max-running-requests",
                )
                for a in r.args
            )
        ):
            assert (
                r.engaged or r.probes or r.requests or "--enable-loop-abort" in r.args
            ), r.name


def _chain(n, p_modal, seed, vocab=128):
    """Markov draws like the sample checkpoint's: succ(t) = t + 1 with probability p_modal."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prev, seq = 0, []
        for _ in range(8):
            t = (prev + 1) % vocab if rng.random() < p_modal else rng.randrange(vocab)
            seq.append(t)
            prev = t
        out.append(seq)
    return out


SUCC = [(t + 1) % 128 for t in range(128)]


def _softmax_top(margin, temperature, vocab=128):
    e = math.exp(margin / temperature)
    return e / (e + vocab - 1)


def _speculative(n, seed, q_temp_sampled, q_temp_rule, margin=4.84, bias=6.6, prev0=0):
    """Token-wise rejection sampling of the sample checkpoint's target (top p) with a draft whose
    top q is ``bias`` at ``q_temp_sampled``; the accept rule reads q at ``q_temp_rule``. Exact
    when the two temperatures agree."""
    rng = random.Random(seed)
    p_top = _softmax_top(margin, 1.0)
    p_rest = (1 - p_top) / 127
    q_s, q_r = _softmax_top(bias, q_temp_sampled), _softmax_top(bias, q_temp_rule)
    q_s_rest, q_r_rest = (1 - q_s) / 127, (1 - q_r) / 127
    out = []
    for _ in range(n):
        prev, seq = prev0, []
        for _ in range(8):
            modal = rng.random() < q_s  # the draft's proposal
            accept = min(1.0, (p_top / q_r) if modal else (p_rest / q_r_rest))
            if rng.random() < accept:
                took = modal
            else:  # the residual max(p - q, 0): on the modal token where p > q there
                res_top, res_rest = max(p_top - q_r, 0), max(p_rest - q_r_rest, 0)
                took = rng.random() < res_top / (res_top + 127 * res_rest)
            t = (prev + 1) % 128 if took else (prev + 2 + rng.randrange(126)) % 128
            seq.append(t)
            prev = t
        out.append(seq)
    return out


def _speculated(tokens, accepts):
    rec = _served(tokens)
    rec["_greedy"]["accepts"] = accepts
    return rec


def test_speculation_is_judged_a_server_that_dropped_it_fails():
    """DSpark is lossless: a server that stopped speculating emits the reference's tokens and
    passes every token check; the speculation check alone refuses it."""
    counts = [[20, 40, [0, 0, 20]], [22, 41, [1, 2, 19]]]
    recs = {"ref": _speculated([[1, 2], [3, 4]], counts)}
    same = _speculated([[1, 2], [3, 4]], [list(c) for c in counts])
    evaluate(_row("a", same_as=("ref",), accepts="reference"), same, recs)
    assert same["ok"] and same["speculation"]["rule"] == "equal to ref's"
    dropped = _speculated([[1, 2], [3, 4]], [[0, 0, None], [0, 0, None]])
    evaluate(_row("b", same_as=("ref",), accepts="reference"), dropped, recs)
    assert dropped["ok"] is False and dropped["checks"] == {
        "fork_flags_line": True,
        "no_log_errors": True,
        "completion_matches_generate": True,
        "identical_to_ref": True,
        "speculation": False,
    }
    # the negative control passes only because the speculation check refuses it
    control = _speculated([[1, 2], [3, 4]], [[0, 0, None], [0, 0, None]])
    evaluate(
        _row("c", same_as=("ref",), accepts="reference", must_fail="speculation"),
        control,
        recs,
    )
    assert control["ok"]
    # one request accepting one draft fewer over the same tokens: not the reference's
    fewer = _speculated([[1, 2], [3, 4]], [[20, 40, [0, 0, 20]], [22, 40, [1, 3, 18]]])
    evaluate(_row("d", same_as=("ref",), accepts="reference"), fewer, recs)
    assert fewer["checks"]["speculation"] is False
    # other tokens (a rounding-level row on random weights): held to running only
    other = _speculated([[1, 2], [3, 5]], [[20, 30, None], [20, 30, None]])
    evaluate(_row("e", bound_to="ref", accepts="reference"), other, recs)
    assert other["checks"]["speculation"] and "runs" in other["speculation"]["rule"]
    # a flag that moves acceptance by design must still speculate; a no-speculation row must not
    for accepts, counts_, ok in (
        ("design", [[25, 10, None], [25, 10, None]], True),
        ("design", [[0, 0, None], [0, 0, None]], False),
        ("none", [[0, 0, None], [0, 0, None]], True),
        ("none", [[20, 40, None], [22, 41, None]], False),
    ):
        rec = _speculated([[1, 2], [3, 4]], counts_)
        assert judge_speculation(_row("f", accepts=accepts), rec, recs)["ok"] is ok
    # a raw record from before the check cannot pass it
    old = _served([[1, 2], [3, 4]])
    assert judge_speculation(_row("g", accepts="reference"), old, recs)["ok"] is False


def test_upstreams_v41_flip_is_an_expected_failure_never_a_pass():
    """V4.1 DSpark rows are held to upstream without speculation; a row that gives the second
    result an upstream server of the run also gave (or a pinned one) is an expected failure
    naming the defect; any other result, or another failing check, is a plain failure.
    """
    from e2e.matrix import defect_counts, greedy_digest

    flip = "v41_dspark_graph_flip"
    nospec, other = [[1, 2, 3]], [[1, 2, 9]]

    def v41(name, tokens, tree="fork"):
        rec = _served(tokens)
        rec.update(model="v41", tree=tree, args=["--speculative-algorithm", "DSPARK"])
        return rec

    def row(name, tree="fork"):
        return Row(
            name,
            [],
            model="v41",
            tree=tree,
            same_as=("v41_up_nospec",),
            upstream_defect=flip,
        )

    recs = {
        "v41_up_nospec": {**v41("n", nospec, "upstream"), "args": []},
        "v41_up_off": v41("a", nospec, "upstream"),
        "v41_up_off_again": v41("b", other, "upstream"),
    }
    for name, tree in (("v41_up_off", "upstream"), ("v41_up_off_again", "upstream")):
        recs[name]["fork_flags_line"] = None
        evaluate(row(name, tree), recs[name], recs)
    assert recs["v41_up_off"]["ok"] and "expected_failure" not in recs["v41_up_off"]
    again = recs["v41_up_off_again"]
    assert again["ok"] is False and again["expected_failure"] == flip
    # a fork row on upstream's second result: expected failure; on a third: failure
    same_flip = v41("c", other)
    evaluate(row("v41_off"), same_flip, recs)
    assert same_flip["ok"] is False and same_flip["expected_failure"] == flip
    third = v41("d", [[1, 7, 7]])
    evaluate(row("v41_off"), third, recs)
    assert third["ok"] is False and "expected_failure" not in third
    # the pinned result counts without an upstream server showing it this run
    alone = {k: v for k, v in recs.items() if k != "v41_up_off_again"}
    pinned = v41("e", other)
    import e2e.matrix as m

    saved = m.UPSTREAM_DEFECTS[flip]["results"]
    m.UPSTREAM_DEFECTS[flip]["results"] = {"v41": [greedy_digest(pinned["_greedy"])]}
    try:
        evaluate(row("v41_off"), pinned, alone)
    finally:
        m.UPSTREAM_DEFECTS[flip]["results"] = saved
    assert pinned["expected_failure"] == flip
    # the flip with another check failing too is a plain failure
    worse = v41("f", other)
    worse["log_errors"] = ["Traceback"]
    evaluate(row("v41_off"), worse, recs)
    assert "expected_failure" not in worse
    counts = defect_counts(
        [row("v41_up_off", "upstream"), row("v41_up_off_again", "upstream")],
        {n: recs[n] for n in ("v41_up_off", "v41_up_off_again")},
    )
    assert counts[flip]["by_checkpoint"] == {
        "v41": {"servers": 2, "flipped": ["v41_up_off_again"]}
    }


def test_sampling_parameters_mixed_batches_and_seed_for_seed_bits(monkeypatch):
    """A mixed row's groups are each judged against the reference of their parameters and the
    target's distribution, its greedy group must be the target's chain; a seeded row must emit
    its reference's tokens; without the target's distribution the row fails."""
    import e2e.matrix as m
    from e2e.matrix import MIXED_SETS, SAMPLED_PROMPT, char_vocab, sampled_reference

    named = {r.name: r for r in rows()}
    for k in ("t0.6", "t1.3"):
        ref = named[sampled_reference(k)]
        assert ref.tree == "upstream" and ref.sampling == k and ref.accepts == "none"
        assert named[f"s_off_{k}"].sampling == k
    assert named["s_tau_0.7_t1.3"].sampling == "t1.3"
    assert named["s_off"].seeded_same_as == "s_up_off"
    # the grouping and the references are under test here, not the filters: every set at T 1
    t1 = {"temperature": 1.0}
    monkeypatch.setattr(m, "SAMPLING_SETS", {**m.SAMPLING_SETS, "t0.6": t1, "t1.3": t1})
    prev0 = char_vocab()[SAMPLED_PROMPT[-1]]
    chain = []
    for _ in range(8):
        chain.append(SUCC[chain[-1] if chain else prev0])
    n = 2000

    def draw(seed):
        return _speculative(n, seed, 1.0, 1.0, prev0=prev0)

    recs = {
        sampled_reference(k): {"_sampled": {"tokens": draw(10 + i)}}
        for i, k in enumerate(MIXED_SETS)
        if k != "greedy"
    }
    recs["s_up_nospec"]["_target"] = _sim_dists()
    recs["s_up_off"] = {"seeded": [[1, 2], [3, 4]]}

    def mixed(wrong_set=None):
        draws = {k: iter(draw(20 + i)) for i, k in enumerate(MIXED_SETS)}
        if wrong_set:
            draws[wrong_set] = iter(_chain(n, 0.3, 7))
        tokens = []
        for i in range(n * len(MIXED_SETS)):
            k = MIXED_SETS[i % len(MIXED_SETS)]
            tokens.append(list(chain) if k == "greedy" else next(draws[k]))
        rec = {**_served([[1]]), "_sampled": {"tokens": tokens, "spec": None}}
        rec.pop("_greedy")
        rec["seeded"] = [[1, 2], [3, 4]]
        return rec

    row = Row("m", [], model="sample", greedy=False, sampled=True, sampling="mixed",
              seeded_same_as="s_up_off")  # fmt: skip
    good = mixed()
    evaluate(row, good, recs, SUCC)
    assert good["ok"], good["checks"]
    for test in ("sampled_agrees", "sampled_fits_target"):
        assert {k for k in good["checks"] if k.startswith(test)} == {
            f"{test}_{k}" for k in ("t1", "t0.6", "t1.3")
        }
    bad = mixed("t1.3")
    evaluate(row, bad, recs, SUCC)
    assert bad["checks"]["sampled_agrees_t1.3"] is False
    assert bad["checks"]["sampled_fits_target_t1.3"] is False
    assert (
        bad["checks"]["sampled_agrees_t1"] and bad["checks"]["sampled_fits_target_t1"]
    )
    other_bits = mixed()
    other_bits["seeded"] = [[1, 2], [3, 5]]
    evaluate(row, other_bits, recs, SUCC)
    assert other_bits["checks"]["seeded_identical_to_s_up_off"] is False
    del recs["s_up_nospec"]["_target"]
    blind = mixed()
    evaluate(row, blind, recs, SUCC)
    assert blind["ok"] is False
    assert blind["checks"]["target_distribution_of_s_up_nospec_served"] is False


def _sampled_accepts(n, seed, p):
    """n requests of 3 verify steps accepting 0..3 drafts each step, every draft in turn with
    probability p."""
    rng, out = random.Random(seed), []
    for _ in range(n):
        accepted = 0
        for _ in range(3):
            k = 0
            while k < 3 and rng.random() < p:
                k += 1
            accepted += k
        out.append([3, accepted])
    return out


def test_sampled_acceptance_held_to_upstreams_interval_and_a_small_shift_refused():
    n = 20000
    recs = {"s_up_off": {"_sampled": {"accepts": _sampled_accepts(n, 1, 0.6)}}}
    row = _row("s", accepts="reference")
    same = {"_sampled": {"accepts": _sampled_accepts(n, 2, 0.6)}}
    assert judge_speculation(row, same, recs)["ok"]
    # a 3 % lower per-draft acceptance (0.6 -> 0.582) is refused at 20,000 requests
    lower = {"_sampled": {"accepts": _sampled_accepts(n, 3, 0.582)}}
    verdict = judge_speculation(row, lower, recs)
    assert verdict["ok"] is False and verdict["z"] < 0, verdict
    dropped = {"_sampled": {"accepts": [[0, 0]] * n}}
    assert judge_speculation(row, dropped, recs)["ok"] is False


def test_rows_judge_their_speculation_and_the_dropped_control_is_there():
    named = {r.name: r for r in rows()}
    for r in named.values():
        if r.refused_with:
            assert r.accepts is None, r.name
        elif "--speculative-algorithm" not in r.args:
            assert r.accepts == "none", r.name
        else:
            assert r.accepts in ("reference", "design"), r.name
    assert named["cap_3"].accepts == named["s_tau_0.7"].accepts == "design"
    assert named["off"].accepts == named["s_head_fp8"].accepts == "reference"
    subtle = named["s_tau_q_3pct"]
    assert subtle.fault == "tau_q_3pct" and subtle.must_fail == "sampled_fits_target"
    control = named["off_speculation_dropped"]
    assert control.fault == "speculation_off" and control.must_fail == "speculation"


def test_the_speculation_fault_drops_every_speculative_argument():
    import subprocess
    import sys

    code = (
        "import sitecustomize, sglang.srt.server_args as m\n"
        "print(sitecustomize.without_speculation(['--model-path', 'x', "
        "'--speculative-algorithm', 'DSPARK', '--speculative-moe-runner-backend', "
        "'triton', '--tp', '1', '--speculative-use-block-verification', '--port', '9']))\n"
        "print(m.prepare_server_args.__module__)\n"
    )
    env = {**os.environ, "E2E_FAULT": "speculation_off"}
    env["PYTHONPATH"] = os.pathsep.join([str(STANDINS[0]), env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True
    )
    assert out.stdout.splitlines() == [
        "['--model-path', 'x', '--tp', '1', '--port', '9']",
        "sitecustomize",
    ], out.stderr[-2000:]


def _sim_dists():
    """The target of ``_speculative``'s simulation: after t, t + 1 at p_top, t itself never,
    the 126 others uniform."""
    top = _softmax_top(4.84, 1.0)
    rest = math.log((1 - top) / 126)
    return [
        [math.log(top) if u == (t + 1) % 128 else -math.inf if u == t else rest
         for u in range(128)]
        for t in range(128)
    ]  # fmt: skip


def test_fit_test_takes_the_exact_rule_and_refuses_a_3_percent_q_temperature_error():
    """Scored against the target's own distribution (no reference sample's noise): the exact
    rule passes; q read at 1.03 x its temperature at every drafted position is refused, as are
    the 0.97 T target and a draw the filters exclude. (The two-sample test sees 3 % too, 2 %
    barely; the fit test 2 % clearly and 1 % not: docs/gpu-testing.md.)"""
    from e2e.matrix import fit_test

    dists, n, t1 = _sim_dists(), 20000, {"temperature": 1.0}
    for seed in (2, 3):
        assert fit_test(_speculative(n, seed, 1.0, 1.0), dists, t1, 0)["min_p"] >= P_MIN
    for seed, q_rule in ((4, 1.03), (5, 1.02)):
        fit = fit_test(_speculative(n, seed, 1.0, q_rule), dists, t1, 0)
        assert fit["min_p"] < P_MIN and fit["p_modal_drafted"] < P_MIN, q_rule
    colder = _chain(n, _softmax_top(4.84, 0.97), 3)
    assert fit_test(colder, dists, t1, 0)["min_p"] < P_MIN
    # top-k 1 leaves only the modal token: any other draw is impossible
    exact = _speculative(200, 6, 1.0, 1.0)
    fit = fit_test(exact, dists, {"temperature": 1.0, "top_k": 1}, 0)
    assert fit["impossible_draws"] > 0 and fit["min_p"] == 0.0


def test_processed_mirrors_upstreams_torch_sampler_filters():
    from e2e.matrix import processed

    lp = [math.log(p) for p in (0.5, 0.2, 0.15, 0.1, 0.05)]
    close = lambda a, b: all(abs(x - y) < 1e-12 for x, y in zip(a, b))  # noqa: E731
    assert close(processed(lp, {"temperature": 1.0}), [0.5, 0.2, 0.15, 0.1, 0.05])
    assert processed(lp, {"temperature": 0.0}) == [1.0, 0, 0, 0, 0]
    # top-p keeps a token while the mass before it is at most p
    assert close(
        processed(lp, {"temperature": 1.0, "top_p": 0.65}),
        [0.5 / 0.7, 0.2 / 0.7, 0, 0, 0],
    )
    assert close(
        processed(lp, {"temperature": 1.0, "top_k": 3}),
        [0.5 / 0.85, 0.2 / 0.85, 0.15 / 0.85, 0, 0],
    )
    # min-p relative to the top token's probability
    assert close(
        processed(lp, {"temperature": 1.0, "min_p": 0.25}),
        [0.5 / 0.85, 0.2 / 0.85, 0.15 / 0.85, 0, 0],
    )
    hot = processed(lp, {"temperature": 2.0})
    w = [p**0.5 for p in (0.5, 0.2, 0.15, 0.1, 0.05)]
    assert close(hot, [x / sum(w) for x in w])  # fmt: skip


def test_sample_test_accepts_the_exact_rule_and_refuses_both_negative_controls():
    n = 20000
    reference = _speculative(n, 1, 1.0, 1.0)
    assert (
        sample_test(_speculative(n, 2, 1.0, 1.0), reference, SUCC, 0)["min_p"] >= P_MIN
    )
    # the first control: the target at 0.97 T (no speculation)
    colder = _chain(n, _softmax_top(4.84, 0.97), 3)
    assert sample_test(colder, reference, SUCC, 0)["min_p"] < P_MIN
    # the second: the draft samples at 0.7 T while the rule reads q at T
    wrong_q = _speculative(n, 4, 0.7, 1.0)
    assert sample_test(wrong_q, reference, SUCC, 0)["min_p"] < P_MIN
    # and the right rule at 0.7 T is exact
    assert (
        sample_test(_speculative(n, 5, 0.7, 0.7), reference, SUCC, 0)["min_p"] >= P_MIN
    )


def test_probes_of_the_harness(tmp_path):
    """sitecustomize wraps named functions when their module is imported and logs their
    calls."""
    import subprocess
    import sys

    (tmp_path / "probed.py").write_text(
        "class C:\n    @staticmethod\n    def s(x, flag=False):\n        return x\n"
        "    def m(self):\n        return 'm'\n\ndef f():\n    return 3\n"
    )
    code = "import probed; probed.f(); probed.C.s(1); probed.C.s(2, flag=True); probed.C().m()"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(STANDINS[0]), str(tmp_path)]),
        "E2E_PROBES": "probed:f,probed:C.s?flag,probed:C.m",
    }
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.splitlines() == [
        "e2e probe: probed:f call 1 -> 3",
        "e2e probe: probed:C.s call 1 -> 2",
        "e2e probe: probed:C.m call 1 -> 'm'",
    ]


def test_the_tau_fault_leaves_q_at_t():
    """The tau fault leaves q at T while the draft's step temperatures are scaled (patch
    0006's draft temperature staging)."""
    import subprocess
    import sys

    from upstream_api import require_patch

    require_patch("0006-dspark-scale-the-draft-s-sampling", "dspark_draft_tau")
    code = (
        "import torch, types\n"
        "from sglang.srt.speculative.dspark_components import dspark_draft_tau as t\n"
        "t.draft_temperature_scale = lambda: 0.5\n"
        "temps = torch.ones(2); params = types.SimpleNamespace(temperatures=temps, "
        "step_temperatures=torch.ones(2))\n"
        "draft = torch.zeros(2); t.stage_draft_temperatures(params, draft, 2)\n"
        "print([round(x, 4) for x in draft.tolist()], params.step_temperatures.tolist())\n"
    )
    env = {**os.environ, "E2E_FAULT": "tau_q_3pct"}
    env["PYTHONPATH"] = os.pathsep.join([str(STANDINS[0]), env.get("PYTHONPATH", "")])
    subtle = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True
    )
    # the subtle control: q at 1.03 x tau x T, the draft still at tau x T
    assert subtle.stdout.split() == [
        "[0.515,",
        "0.515]",
        "[0.5,",
        "0.5]",
    ], subtle.stderr[-2000:]
    env["E2E_FAULT"] = "tau_q_at_T"
    faulty = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True
    )
    env.pop("E2E_FAULT")
    right = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True
    )
    # q at tau x T (0.5) without the fault, at T with it; the draft samples at tau x T in both
    assert right.stdout.split() == ["[0.5,", "0.5]", "[0.5,", "0.5]"], right.stderr[
        -2000:
    ]
    assert faulty.stdout.split() == ["[1.0,", "1.0]", "[0.5,", "0.5]"], faulty.stderr[
        -2000:
    ]


def test_kernel_summary_sums_gpu_kernels_by_name(tmp_path):
    import gzip
    import json

    events = [
        {"ph": "X", "cat": "kernel", "name": "gemv", "ts": 0.0, "dur": 30.0},
        {"ph": "X", "cat": "kernel", "name": "gemv", "ts": 90.0, "dur": 10.0},
        {
            "ph": "X",
            "cat": "kernel",
            "name": "softmax",
            "ts": 20.0,
            "dur": 10.0,
        },  # another stream
        {
            "ph": "X",
            "cat": "cpu_op",
            "name": "aten::mm",
            "dur": 500.0,
        },  # not a GPU kernel
        {"ph": "i", "cat": "kernel", "name": "marker"},
    ]
    trace = tmp_path / "row-TP-0.trace.json.gz"
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": events}, f)
    s = kernel_summary(trace, top=1)
    assert s["kernel_us"] == 50.0 and s["kernels"] == 3
    assert (
        s["span_us"] == 100.0 and s["gpu_busy"] == 0.4
    )  # 0..30 and 90..100; the overlap once
    assert s["top"] == [{"name": "gemv", "us": 40.0, "calls": 2, "share": 0.8}]


def test_profile_names_only_timing_rows_of_the_run(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(
            ["--out", str(tmp_path), "--rows", "real_off", "--profile", "real_off,off"]
        )
    assert "--profile: off is not a timing row of this run" in capsys.readouterr().err
    assert not (
        tmp_path / "e2e-logs"
    ).exists()  # refused before anything was served or written


def test_feature_lines_leave_out_the_command_and_the_argument_dump():
    log = (
        "[t] $ python -m sglang.launch_server --speculative-dspark-fence-accept-results\n"
        "[t] server_args={'speculative_dspark_fence_accept_results': True}\n"
        "[t] DSpark verify cap on (3)\n"
    )
    assert feature_lines(log) == ["DSpark verify cap on (3)"]


def test_matrix_rows_cover_every_fork_flag():
    import sglang.fork as fork

    used = {a for r in rows() for a in r.args if a.startswith("--")}
    # The verify cap's minimum and log are measurement knobs of the cap, tested by its unit tests.
    missing = (
        set(fork.fork_flags())
        - used
        - {"--speculative-dspark-verify-cap-min", "--speculative-dspark-verify-cap-log"}
    )
    assert not missing, f"fork flags without an e2e row: {sorted(missing)}"


def test_deepseek_tokenizer_carries_the_chat_encoders_special_tokens(tmp_path):
    from transformers import AutoTokenizer

    assert (
        write_tokenizer(
            tmp_path, vocab_size=128, extra_special_tokens=DEEPSEEK_SPECIAL_TOKENS
        )
        == 128
    )
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tok) == 128
    ids = [tok.convert_tokens_to_ids(special) for special in DEEPSEEK_SPECIAL_TOKENS]
    assert ids == list(
        range(128 - len(DEEPSEEK_SPECIAL_TOKENS), 128)
    )  # the specials take the last ids
    assert tok.convert_ids_to_tokens(MASK_TOKEN_ID).startswith(
        "<extra_"
    )  # the draft's mask is no special
    ids = tok("hi<｜User｜>!")["input_ids"]
    assert tok.decode(ids) == "hi<｜User｜>!"


def test_merge_keeps_the_earlier_rows_this_run_did_not_serve_and_refuses_another_build():
    earlier = {
        "fork_version": "v1",
        "device": "H200",
        "standins": True,
        "rows": {
            "off": {"ok": True},
            "real_off": {"ok": None, "skipped": "budget"},
            "cap_3": {"ok": False},
        },
    }
    report = {
        "fork_version": "v1",
        "device": "H200",
        "standins": True,
        "rows": {"real_off": {"ok": True}, "cap_3": {"ok": None, "skipped": "budget"}},
    }
    merge_rows(report, earlier)
    assert report["rows"] == {
        "real_off": {"ok": True},
        "cap_3": {"ok": False},
        "off": {"ok": True},
    }
    with pytest.raises(SystemExit, match="fork_version"):
        merge_rows({**report, "fork_version": "v2"}, earlier)
    with pytest.raises(SystemExit, match="commit"):
        merge_rows({**report, "commit": "c2"}, earlier)


def test_the_bundles_upstream_overlay_turns_the_fork_tree_back_into_the_release(
    tmp_path,
):
    """The overlay e2e.sh lays over a copy of the fork tree: upstream's version of each edited
    file, and the files the series adds removed; applied, the tree is the release's again.
    """
    import tarfile

    from forklib.bundle import _upstream_overlay
    from forklib.git import git

    tree = tmp_path / "tree"
    pkg = tree / "python" / "sglang"
    pkg.mkdir(parents=True)
    git(tree, "init", "-q")
    (pkg / "up.py").write_text("x = 1\n")
    (pkg / "kept.py").write_text("k = 1\n")
    git(tree, "add", "-A")
    git(tree, "commit", "-qm", "upstream")
    (pkg / "up.py").write_text("x = 2  # the fork's edit\n")
    (pkg / "ours.py").write_text("y = 1\n")
    git(tree, "add", "-A")
    git(tree, "commit", "-qm", "a patch")
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    assert _upstream_overlay(tree, bundle) == 1
    with tarfile.open(bundle / "upstream-tree.tar.xz") as tar:
        assert tar.getnames() == ["python/sglang/up.py"]
        assert tar.extractfile("python/sglang/up.py").read() == b"x = 1\n"
    assert (bundle / "upstream-added.txt").read_text() == "python/sglang/ours.py\n"


# The block a GPU machine records when it serves (not this machine's: evaluation must keep it).
SERVED_BY = {
    "fork_version": "1.0.0+fork.2.abcdef0",
    "device": "NVIDIA H200",
    "torch": "2.11.0",
    "triton": "3.6.0",
    "python": "3.12.3",
    "commit": "0123456789abcdef0123456789abcdef01234567",
}


def test_raw_files_of_two_sittings_are_judged_as_one_matrix(tmp_path):
    meta = {"fork_version": "1.0.0+fork.2.abcdef0", "device": "D", "standins": True}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    write_raw(
        tmp_path / "a",
        meta,
        [1, 2],
        {"ref": {"tokens": [1]}, "x": {"tokens": [2]}},
        SERVED_BY,
    )
    write_raw(
        tmp_path / "b",
        meta,
        None,
        {"x": {"tokens": [3]}, "y": {"tokens": [4]}},
        SERVED_BY,
    )
    a, b = tmp_path / "a" / "e2e-raw-D.json.gz", tmp_path / "b" / "e2e-raw-D.json.gz"
    got_meta, recs, succ, served_by = read_raws([a, b])
    assert got_meta == meta and succ == [1, 2] and served_by == SERVED_BY
    assert recs == {"ref": {"tokens": [1]}, "x": {"tokens": [3]}, "y": {"tokens": [4]}}
    for key, value in (("fork_version", "1.0.0+fork.3.1234567"), ("commit", "c2")):
        other = tmp_path / key
        other.mkdir()
        write_raw(other, {**meta, key: value}, None, {}, SERVED_BY)
        with pytest.raises(SystemExit, match=key):
            read_raws([a, other / "e2e-raw-D.json.gz"])


def test_evaluate_records_the_serving_machine_not_the_evaluating_one(tmp_path):
    """``--evaluate`` on a CPU from a GPU run's raw file: the result's provenance is the GPU
    machine's as it recorded it; the CPU that judged goes in ``evaluated_by``."""
    from e2e import matrix
    from e2e import provenance as prov

    meta = {
        "fork_version": SERVED_BY["fork_version"],
        "device": "NVIDIA_H200",
        "torch": "2.11.0",
        "triton": "3.6.0",
        "python": "3.12.3",
        "commit": SERVED_BY["commit"],
        "standins": True,
        "sampled_requests": 1,
    }
    write_raw(
        tmp_path, meta, None, {"off": {"skipped": "over the time budget"}}, SERVED_BY
    )
    raw = tmp_path / "e2e-raw-NVIDIA_H200.json.gz"
    assert prov.check_files([raw]) == {}  # the raw file carries its provenance itself
    out = tmp_path / "eval"
    matrix.main(["--out", str(out), "--rows", "off", "--evaluate", str(raw)])
    written = json.loads((out / "e2e-NVIDIA_H200.json").read_text())
    assert written["provenance"] == SERVED_BY and prov.check(written) == []
    assert written["evaluated_by"] == prov.provenance()
    assert written["evaluated_by"]["device"] != SERVED_BY["device"]

    # a raw file from before raw files carried the block: its meta, without a harness commit,
    # is what the result records; it fails the check instead of taking this machine's commit
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    old = {k: v for k, v in meta.items() if k != "commit"}
    with gzip.open(legacy / "e2e-raw-NVIDIA_H200.json.gz", "wt") as f:
        json.dump({"meta": old, "succ": None, "rows": {"off": {"skipped": "x"}}}, f)
    matrix.main(
        ["--out", str(legacy / "o"), "--rows", "off", "--evaluate"]
        + [str(legacy / "e2e-raw-NVIDIA_H200.json.gz")]
    )
    written = json.loads((legacy / "o" / "e2e-NVIDIA_H200.json").read_text())
    assert written["provenance"]["device"] == "NVIDIA_H200"
    assert prov.check(written) == ["provenance.commit missing or empty"]


@pytest.fixture(scope="module")
def v41_checkpoint(tmp_path_factory):
    """The matrix's V4.1 checkpoint (its seed), written once for this file's tests."""
    from e2e.checkpoints import TINY_ENGRAM, write_dsv4

    return write_dsv4(
        tmp_path_factory.mktemp("v41") / "v41",
        agree=False,
        seed=4,
        engram=TINY_ENGRAM,
    )


def test_the_v41_checkpoint_holds_what_upstreams_v41_modules_load(
    v41_checkpoint, tmp_path, monkeypatch
):
    """The tiny DeepSeek-V4.1 checkpoint through upstream's own code: its config loads as
    ``DeepseekV41Config`` (hc_pre_from_prev_sublayer, Engram fields), ``EngramLayout`` and
    ``EngramHasher`` build from it, every Engram layer's tensors map (upstream's name remap) onto
    the parameters of upstream's ``Engram`` module with their shapes and dtypes, load through
    their weight loaders and serve a forward on CPU; no ``hc_head`` tensor is written (V4.1's
    modules have none, target or draft)."""
    import json
    from types import SimpleNamespace

    import torch
    from e2e.checkpoints import TINY_DSV4, TINY_ENGRAM
    from safetensors import safe_open
    from transformers import AutoTokenizer

    import sglang.srt.layers.engram as eg
    from sglang.srt.model_loader.weight_utils import default_weight_loader
    from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
    from sglang.srt.utils.hf_transformers.config import get_config

    path = v41_checkpoint
    hf = get_config(str(path), trust_remote_code=False)
    assert type(hf).__name__ == "DeepseekV41Config" and hf.model_type == "deepseek_v41"
    assert hf.architectures == ["DeepseekV4ForCausalLM"]
    assert hf.hc_pre_from_prev_sublayer is True and hf.q_head_norm is False
    assert list(hf.engram_layer_ids) == TINY_ENGRAM["layer_ids"]
    assert hf.vision_n_layers == 0  # no image token: Engram gates every row
    assert json.loads((path / "config.json").read_text())["dspark_block_size"] == 5

    # the three features' startup checks accept this config (on the V4 checkpoints they refuse)
    from sglang.srt.layers.engram_prefetch import validate_engram_prefetch
    from sglang.srt.layers.engram_row_store import validate_engram_row_store
    from sglang.srt.models.deepseek_v4_hc_fused import validate_hc_fused_stats

    cfg = SimpleNamespace(
        engram_prefetch="on",
        dsv4_hc_fused_stats="1",
        device="cuda",
        tp_size=1,
        engram_row_store_dir=str(tmp_path),
        engram_row_store_cache_gib="0.0001",
        enable_torch_compile=False,
    )
    cfg._model_config = SimpleNamespace(hf_config=hf)  # what model_config_of hands back
    assert validate_engram_prefetch(cfg) == "on"
    assert validate_hc_fused_stats(cfg) == "1"
    cfg.engram_prefetch = "off"  # the row store refuses the prefetch (a row of its own)
    validate_engram_row_store(cfg)

    layout = eg.EngramLayout.from_config(hf)
    for i in range(len(layout.layer_ids)):
        rows = hf.engram_num_embeddings[i]
        assert eg.shard_range(rows, layout.column_bounds(i), 0, 1) == (0, rows)
    tokenizer = AutoTokenizer.from_pretrained(path)
    hasher = eg.EngramHasher(
        layout, tokenizer, hf.engram_pad_token_id, hf.engram_compressed_vocab_size
    )
    # upstream's hash kernels take power-of-two n-gram sizes and heads, fp8 rows a power of two wide
    n, heads = layout.max_ngram_size, layout.n_heads
    assert n & (n - 1) == 0 and heads & (heads - 1) == 0
    assert layout.head_dim & (layout.head_dim - 1) == 0 and layout.head_dim % 32 == 0

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}
    assert not [k for k in stored if "hc_head" in k]
    assert {k.split(".engram.")[0] for k in stored if ".engram." in k} == {
        f"layers.{i}" for i in TINY_ENGRAM["layer_ids"]
    }

    # upstream's Engram modules at TP1 outside a server (the fork's row store off)
    monkeypatch.setattr(
        eg,
        "get_parallel",
        lambda: SimpleNamespace(tp_size=1, tp_rank=0, attn_dp_size=1, tp_group=None),
    )
    monkeypatch.setattr(
        eg,
        "get_exec",
        lambda: SimpleNamespace(
            offload=SimpleNamespace(
                engram_row_store_dir=None, engram_row_store_cache_gib=None
            )
        ),
        raising=False,
    )
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, 100, (24,), generator=gen)
    windows = torch.stack([tokens.roll(s) for s in range(n)], dim=-1)
    blocked = torch.arange(24).unsqueeze(-1) < torch.arange(n)
    hash_ids, _ = hasher.hash_windows(windows, blocked)
    assert hash_ids.shape == (24, len(layout.layer_ids), (n - 1) * heads)
    dim, hc = TINY_DSV4["hidden_size"], hf.hc_mult
    for i, layer in enumerate(layout.layer_ids):
        assert int(hash_ids[:, i].max()) < hf.engram_num_embeddings[i]
        prefix = f"layers.{layer}.engram."
        default = torch.get_default_dtype()
        torch.set_default_dtype(
            torch.bfloat16
        )  # as the loader builds the model (bf16 config)
        try:
            engram = eg.Engram(hf, layer, layout, prefix=f"model.{prefix}")
        finally:
            torch.set_default_dtype(default)
        params = dict(engram.named_parameters())
        names = {k for k in stored if k.startswith(prefix)}
        mapped = {
            DeepseekV4ForCausalLM.remap_weight_name_to_dpsk_hf_format(k): k
            for k in names
        }
        assert set(mapped) == {f"model.{prefix}{p}" for p in params}, layer
        for name, key in mapped.items():
            param, loaded = params[name.removeprefix(f"model.{prefix}")], stored[key]
            assert loaded.shape == param.shape, (key, loaded.shape, param.shape)
            assert loaded.dtype == param.dtype, (key, loaded.dtype, param.dtype)
            getattr(param, "weight_loader", default_weight_loader)(param, loaded)
        x = torch.randn(24, hc, dim, generator=gen).to(torch.bfloat16)
        out = engram(x, hash_ids[:, i], None, input_ids=tokens)
        assert out.shape == x.shape and torch.isfinite(out.float()).all()
        assert not torch.equal(out, x)  # the gated value reached the residual streams


def test_every_v41_row_resolves_through_upstreams_pipeline(
    v41_checkpoint, tmp_path, monkeypatch
):
    """Each V4.1 row's server arguments, as the matrix starts it, through upstream's resolution
    on the V4.1 checkpoint with the platform read as CUDA (no device is touched): none is refused,
    and decoder SWA bounded replay, which upstream turns on for V4.1 on CUDA and which the tiny
    checkpoint cannot serve (no kv_source_layer_ids), is off on every row."""
    from e2e import matrix

    import sglang.srt.arg_groups.deepseek_v4_hook as hook
    from sglang.srt.arg_groups.model_override_base import resolved_view
    from sglang.srt.server_args import prepare_server_args

    real = hook.get_platform()

    class Cuda:
        def __getattr__(self, name):
            return {"is_cuda": True, "is_hip": False}.get(name, getattr(real, name))

    monkeypatch.setattr(hook, "get_platform", Cuda)
    monkeypatch.setattr(matrix, "ROW_STORE_DIR", str(tmp_path))

    def resolve(model_args, row_args):
        argv = ["--model-path", str(v41_checkpoint), "--device", "cuda"]
        argv += matrix.SERVE_ARGS + matrix.MEM_ARGS["v41"] + matrix.GRAPH_ARGS["v41"]
        sa = prepare_server_args(argv + model_args + row_args)
        sa.resolve_once()
        return resolved_view(sa)

    assert resolve([], matrix.DSPARK).enable_decoder_swa_bounded_replay is True
    v41 = [r for r in matrix.rows() if r.model in V41_MODELS]
    assert len(v41) == 24
    # the V4.1 checkpoints share one config: each distinct argument list once
    assert len({tuple(matrix.MODEL_ARGS[r.model]) for r in v41}) == 1
    distinct = {tuple(r.args): r.name for r in v41}
    for args, name in distinct.items():
        view = resolve(matrix.MODEL_ARGS["v41"], list(args))
        assert view.enable_decoder_swa_bounded_replay is False, name


def _dspark_exposition(hist, cap_lens=None, tau=1.0, gamma=5):
    """A /metrics page from the scheduler's DSpark acceptance metrics after ``hist[c]`` request
    verify steps accepted c drafts (each verifying ``cap_lens - 1`` drafts, or every one).
    """
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, generate_latest
    from upstream_api import require_patch

    require_patch(
        "0024-dspark-acceptance-by-draft-position-in", "the DSpark acceptance metrics"
    )
    from sglang.srt.speculative.dspark_components import dspark_acceptance_metrics

    class Req:
        is_retracted = False

        def finished(self):
            return False

    registry = CollectorRegistry()
    spec = SimpleNamespace(
        speculative_algorithm="DSPARK",
        speculative_num_draft_tokens=gamma + 1,
        speculative_dspark_draft_temperature_scale=tau,
    )
    labels = {"model_name": "m", "engine_type": "unified", "tp_rank": "0"}
    m = dspark_acceptance_metrics.build_dspark_acceptance_metrics(
        spec, SimpleNamespace(labels=labels), registry
    )
    for c, n in enumerate(hist):
        lens = None if cap_lens is None else [cap_lens] * n
        m.observe_verify([Req()] * n, [c] * n, lens)
    m.flush()
    return generate_latest(registry).decode()


def test_the_metrics_rows_judge_the_scrape_against_the_responses():
    from e2e.matrix import _scrape_delta, dspark_scrape, metrics_checks

    empty = dspark_scrape(_dspark_exposition([0]))
    page = dspark_scrape(_dspark_exposition([2, 1, 1], cap_lens=4, tau=0.7))
    assert page["proposed"] == [4.0, 4.0, 4.0, 0.0, 0.0]
    assert page["accepted"] == [2.0, 1.0, 0.0, 0.0, 0.0]
    assert (page["rows_live"], page["rows_kept_out_of_moe"], page["tau"]) == (
        16,
        8,
        0.7,
    )
    got = {
        "scrape": _scrape_delta(page, empty),
        "responses": {
            "proposed": [4.0, 4.0, 4.0, 0.0, 0.0],
            "accepted": [2.0, 1.0, 0, 0, 0],
        },
        "verify_steps": 4,
        "meta_info_counts": True,
        "tau": page["tau"],
        "gamma": 5,
    }
    flags = {
        "--speculative-dspark-verify-cap": "3",
        "--speculative-dspark-draft-temperature-scale": "0.7",
    }
    cap_tau = Row("m", [a for kv in flags.items() for a in kv], flags=flags)
    assert all(metrics_checks(cap_tau, got).values())
    # Each check can fail: a response count off by one, a row missing, no cap, another tau.
    off = {**got, "responses": {**got["responses"], "accepted": [2.0, 0.0, 0, 0, 0]}}
    assert not metrics_checks(cap_tau, off)["metrics_equal_responses"]
    assert not metrics_checks(cap_tau, {**got, "verify_steps": 5})[
        "metrics_rows_add_up"
    ]
    plain = Row("m", [])
    checks = metrics_checks(plain, got)
    assert not checks["metrics_rows_add_up"] and not checks["metrics_tau"]


@pytest.fixture(scope="module")
def long_checkpoint(tmp_path_factory):
    """The matrix's long checkpoint (its seed and shape), written once for this file's tests."""
    from e2e.checkpoints import LONG_DRAFT_RUNS, LONG_DSV4, write_dsv4

    return write_dsv4(
        tmp_path_factory.mktemp("long") / "long",
        agree=True,
        shape=LONG_DSV4,
        seed=7,
        draft_runs=LONG_DRAFT_RUNS,
    )


def test_the_long_checkpoint_holds_what_upstreams_compressed_layers_load(
    long_checkpoint, monkeypatch
):
    """The long checkpoint through upstream's own code: its config loads with DeepSeek-V4-Flash's
    layout of compress ratios (0, 0, 4, 128; the draft's layer 0), one C4 indexer layer, and every
    compressor and indexer tensor maps (upstream's name remap, the loader's fusion of a
    compressor's ``wkv`` and ``wgate`` into ``wkv_gate``) onto the parameters of upstream's
    ``Compressor`` (ratio 128) and ``C4Indexer`` modules with their shapes and dtypes, and loads
    through their weight loaders; the sliding-window layers and the draft carry none."""
    from types import SimpleNamespace

    import torch
    from e2e import matrix
    from e2e.checkpoints import LONG_DSV4
    from safetensors import safe_open
    from transformers import AutoTokenizer

    import sglang.srt.layers.attention.dsv4.indexer as ix
    from sglang.srt.configs.model_config import get_num_indexer_layers
    from sglang.srt.layers.attention.dsv4.compressor import Compressor
    from sglang.srt.model_loader.weight_utils import default_weight_loader
    from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
    from sglang.srt.utils.hf_transformers.config import get_config

    path = long_checkpoint
    hf = get_config(str(path), trust_remote_code=False)
    assert hf.model_type == "deepseek_v4" and hf.architectures == [
        "DeepseekV4ForCausalLM"
    ]
    assert list(hf.compress_ratios) == [0, 0, 4, 128, 0]
    assert get_num_indexer_layers(hf) == 1
    assert hf.index_topk == 512 and hf.sliding_window == hf.window_size == 128
    assert 4 * hf.index_topk < max(matrix.LONG_PROMPTS) < hf.max_position_embeddings
    assert max(matrix.LONG_PROMPTS) + matrix.LONG_TOKENS < hf.max_position_embeddings

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}
    owners = {
        k.split(".attn.")[0] for k in stored if ".compressor." in k or ".indexer." in k
    }
    assert owners == {"layers.2", "layers.3"}

    monkeypatch.setattr(
        ix,
        "get_exec",
        lambda: SimpleNamespace(
            kernel=SimpleNamespace(enable_deepseek_v4_fp4_indexer=False)
        ),
    )
    default = torch.get_default_dtype()
    torch.set_default_dtype(
        torch.bfloat16
    )  # as the loader builds the model (bf16 config)
    try:
        modules = {
            "layers.3.attn.compressor.": Compressor(
                hf,
                layer_id=3,
                is_in_indexer=False,
                freqs_cis=torch.zeros(1),
                compress_ratio=128,
                head_dim=LONG_DSV4["head_dim"],
            ),
            "layers.2.attn.indexer.": ix.C4Indexer(
                hf, layer_id=2, freqs_cis=torch.zeros(1)
            ),
        }
        # layer 2's own compressor: ratio 4, overlapping blocks (twice the widths)
        modules["layers.2.attn.compressor."] = Compressor(
            hf,
            layer_id=2,
            is_in_indexer=False,
            freqs_cis=torch.zeros(1),
            compress_ratio=4,
            head_dim=LONG_DSV4["head_dim"],
        )
    finally:
        torch.set_default_dtype(default)
    for prefix, module in modules.items():
        params = dict(module.named_parameters())
        names = {k for k in stored if k.startswith(prefix)}
        if not prefix.endswith(
            ".indexer."
        ):  # the indexer's own compressor is the indexer's
            names = {k for k in names if ".indexer." not in k}
        target = "model." + prefix.replace(".attn.", ".self_attn.")
        loaded = {}
        for key in names:
            name = DeepseekV4ForCausalLM.remap_weight_name_to_dpsk_hf_format(key)
            assert name.startswith(target), (prefix, name)
            if (
                ".compressor.w" in name
            ):  # upstream's loader: cat([wkv, wgate]) into wkv_gate
                fused = name.rsplit(".", 2)[0] + ".wkv_gate.weight"
                kv = stored[key.replace(".wgate.", ".wkv.")]
                gate = stored[key.replace(".wkv.", ".wgate.")]
                loaded[fused.removeprefix(target)] = torch.cat([kv, gate], dim=0)
            else:
                loaded[name.removeprefix(target)] = stored[key]
        assert set(loaded) == set(params), (prefix, sorted(loaded), sorted(params))
        for local, tensor in loaded.items():
            param = params[local]
            assert tensor.shape == param.shape, (
                prefix,
                local,
                tensor.shape,
                param.shape,
            )
            assert tensor.dtype == param.dtype, (
                prefix,
                local,
                tensor.dtype,
                param.dtype,
            )
            getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            if not local.endswith(
                "ape"
            ):  # upstream's ape loader reorders overlapping blocks
                assert torch.equal(param.data, tensor), (prefix, local)

    # the requests: one token a character, so the prompts are the lengths the rows expect
    tokenizer = AutoTokenizer.from_pretrained(path)
    lengths = [len(tokenizer(p)["input_ids"]) for p in matrix.long_prompts()]
    assert lengths == [
        *matrix.LONG_PROMPTS,
        matrix.LONG_SHARED + 300,
        *matrix.LONG_ABORTED,
    ]
    prompts = matrix.long_prompts()
    shared = prompts[len(matrix.LONG_PROMPTS)]
    assert shared[: matrix.LONG_SHARED] == prompts[0][: matrix.LONG_SHARED]
    assert shared[matrix.LONG_SHARED] != prompts[0][matrix.LONG_SHARED]
    # the shared prefix ends mid-block of every ratio and mid-window
    assert all(matrix.LONG_SHARED % r for r in (4, 128))


def test_every_long_row_resolves_through_upstreams_pipeline(
    long_checkpoint, monkeypatch
):
    """Each long row's server arguments, as the matrix starts it, through upstream's resolution
    on the long checkpoint with the platform read as CUDA: none is refused, the radix cache stays
    on, prefill is chunked at LONG_CHUNK and one request runs at a time."""
    from e2e import matrix

    import sglang.srt.arg_groups.deepseek_v4_hook as hook
    from sglang.srt.arg_groups.model_override_base import resolved_view
    from sglang.srt.server_args import prepare_server_args

    real = hook.get_platform()

    class Cuda:
        def __getattr__(self, name):
            return {"is_cuda": True, "is_hip": False}.get(name, getattr(real, name))

    monkeypatch.setattr(hook, "get_platform", Cuda)
    long_rows = [r for r in matrix.rows() if r.model == "long"]
    assert len(long_rows) == 8
    for row in long_rows:
        argv = ["--model-path", str(long_checkpoint), "--device", "cuda"]
        argv += matrix.SERVE_ARGS + matrix.MEM_ARGS["long"] + matrix.GRAPH_ARGS["long"]
        sa = prepare_server_args(argv + matrix.MODEL_ARGS["long"] + row.args)
        sa.resolve_once()
        view = resolved_view(sa)
        assert view.chunked_prefill_size == matrix.LONG_CHUNK, row.name
        assert view.disable_radix_cache is False, row.name
        assert view.max_running_requests == 1, row.name
        assert matrix.LONG_CHUNK % (view.page_size or 1) == 0, (
            row.name,
            view.page_size,
        )


def _long_record(cap_hist=None, cached=None, abort_finish="abort"):
    """A long row's greedy record as ``long_context`` returns it, with what a served row shows."""
    from e2e import matrix

    n = len(matrix.LONG_PROMPTS)
    tokens = [[5, 6, 7, 8] * 80 for _ in range(n + 3)]
    hist = cap_hist or [0, 10, 20, 30]
    return {
        "tokens": tokens,
        "logprobs": [[-0.1] * 320 for _ in tokens],
        "accepts": [[60, 140, hist] for _ in tokens],
        "long": {
            "prompt_tokens": [
                *matrix.LONG_PROMPTS,
                matrix.LONG_SHARED + 300,
                *matrix.LONG_ABORTED,
            ],
            "cached_tokens": cached or [0, 0, 0, 1280, 768, 1024],
            "aborts": {
                "abort_request": {
                    "chunks": 52,
                    "output_ids": tokens[n + 1][:150],
                    "finish": abort_finish,
                    "completion_tokens": 150,
                },
                "disconnect": {
                    "chunks": 48,
                    "output_ids": tokens[n + 2][:140],
                    "finish": None,
                    "completion_tokens": 140,
                },
            },
        },
    }


def test_long_rows_need_radix_hits_a_mid_decode_abort_and_the_cap_holding():
    """``long_checks`` passes what a served row shows and fails each thing missing: no radix hit
    on the shared prefix, an aborted request that ran to its length, a streamed prefix that is
    not the full request's, a step above a fixed cap (or a cap that never bound)."""
    from e2e.matrix import long_checks

    named = {r.name: r for r in rows()}
    off, cap = named["long_off"], named["long_cap_2"]
    assert all(long_checks(off, _long_record()).values())
    got = long_checks(cap, _long_record(cap_hist=[0, 10, 20]))
    assert all(got.values()) and "long_accepts_at_most_2" in got
    assert not long_checks(cap, _long_record())["long_accepts_at_most_2"]  # 3 accepted
    assert not long_checks(cap, _long_record(cap_hist=[0, 10]))[
        "long_accepts_at_most_2"
    ]
    missed = long_checks(off, _long_record(cached=[0, 0, 0, 0, 768, 1024]))
    assert not missed["long_radix_hits"]
    assert not long_checks(off, _long_record(abort_finish="length"))[
        "long_abort_request_mid_decode"
    ]
    wrong = _long_record()
    wrong["long"]["aborts"]["disconnect"]["output_ids"][3] = 99
    assert not long_checks(off, wrong)["long_disconnect_streamed_a_prefix"]
    short = _long_record()
    short["long"]["prompt_tokens"][0] = 2048
    assert not long_checks(off, short)["long_prompts_served"]


def test_long_rows_hold_their_promises():
    """Flags off, no speculation, the fp8 head and tau at greedy: upstream's bits; the twin and
    the cap: upstream's tokens with logprobs within the agree bound; each flag engaged; every
    row judged on its speculation like the other rows."""
    named = {r.name: r for r in rows()}
    long_rows = {n: r for n, r in named.items() if r.model == "long"}
    assert named["long_up_off"].tree == named["long_up_nospec"].tree == "upstream"
    assert named["long_off"].same_as == ("long_up_off",)
    assert named["long_nospec"].same_as == ("long_up_nospec",)
    assert named["long_nospec"].accepts == named["long_up_nospec"].accepts == "none"
    assert (
        named["long_tau_0.7"].same_as
        == named["long_head_fp8"].same_as
        == ("long_up_off",)
    )
    for flag, name in (
        ("--dsv4-wo-a-fp8-twin", "long_wo_a_small"),
        ("--speculative-dspark-draft-head-fp8", "long_head_fp8"),
        ("--speculative-dspark-verify-cap", "long_cap_2"),
        ("--speculative-dspark-draft-temperature-scale", "long_tau_0.7"),
    ):
        r = long_rows[name]
        assert flag in r.args and r.tree == "fork" and (r.engaged or r.probes), name
        if name in ("long_wo_a_small", "long_cap_2"):
            assert r.tokens_as == ("long_up_off",) and r.bound_to == "long_up_off"
    assert named["long_cap_2"].accepts == named["long_tau_0.7"].accepts == "design"
    assert named["long_off"].accepts == named["long_wo_a_small"].accepts == "reference"


def test_a_partly_agreeing_draft_proposes_what_draft_json_says(long_checkpoint):
    """``draft_runs`` on the 128-token vocabulary: the spare tokens the misses propose include
    printable tokens that are also some token's successor. Every agreeing cycle token's draft
    proposal (the top of its Markov logits) is its successor, every miss proposes a distinct spare
    token other than its successor; rows written by assignment, where one of two anchors sharing
    a proposal loses it (and which one varies between writes), do not."""
    import json

    from e2e.checkpoints import DEEPSEEK_SPECIAL_TOKENS
    from safetensors import safe_open

    path = long_checkpoint
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        code = f.get_tensor("mtp.0.markov_head.embed.weight").float()
        head = f.get_tensor("mtp.0.markov_head.head.weight").float()
    succ = json.loads((path / "succ.json").read_text())
    miss = json.loads((path / "draft.json").read_text())["miss_tokens"]
    vocab, special = len(succ), len(DEEPSEEK_SPECIAL_TOKENS)
    spare = set(range(vocab - len(miss) - special, vocab - special))
    cycle = [t for t in range(vocab) if succ[t] != t]

    def proposals(rows):
        return {t: int((rows @ code[t]).argmax()) for t in cycle}

    got = proposals(head)
    assert all(got[t] == succ[t] for t in cycle if t not in miss)
    assert all(got[t] != succ[t] and got[t] in spare for t in miss)
    assert len({got[t] for t in miss}) == len(miss)
    shared = [p for p in spare if [got[t] for t in cycle].count(p) > 1]
    assert shared  # the case the summed rows are there for
    assigned = head.clone()
    for t in cycle:  # by assignment: the later anchor overwrites a shared row
        if got[t] in shared:
            assigned[got[t]] = 40.0 * code[t]
    assert proposals(assigned) != got


class _LongServer:
    """A stand-in for a served long checkpoint: one token a character, each output token the
    successor of the one before, cached tokens the longest prefix (in pages of 64) shared with an
    earlier prompt, streams that end with finish reason abort once ``/abort_request`` names
    them, speculation reported as 2 drafts accepted per step."""

    def __init__(self):
        from e2e.checkpoints import char_vocab

        self.vocab, self.seen, self.aborted, self.posts = char_vocab(), [], set(), []

    def _ids(self, text):
        return [self.vocab[c] for c in text]

    def _cached(self, ids):
        best = (
            max(
                (
                    next(
                        (i for i, (a, b) in enumerate(zip(ids, s)) if a != b),
                        min(len(ids), len(s)),
                    )
                )
                for s in self.seen
            )
            if self.seen
            else 0
        )
        self.seen.append(ids)
        return min(best, len(ids) - 1) // 64 * 64

    def _out(self, ids, n, finish="length"):
        out = [(ids[-1] + 1 + i) % 100 + 3 for i in range(n)]
        steps = -(-n // 3)
        return {
            "output_ids": out,
            "text": "".join(chr(65 + t % 26) for t in out),
            "meta_info": {
                "prompt_tokens": len(ids),
                "completion_tokens": n,
                "cached_tokens": self._cached(ids) if finish == "length" else 0,
                "finish_reason": {"type": finish},
                "output_token_logprobs": [[-0.5, t, None] for t in out],
                "spec_verify_ct": steps,
                "spec_num_correct_drafts": 2 * steps,
                "spec_correct_drafts_histogram": [0, 0, steps],
            },
        }

    def post(self, path, body, timeout=None):
        self.posts.append(path)
        if path == "/v1/completions":
            got = self._out(self._ids(body["prompt"]), body["max_tokens"])
            return {"choices": [{"text": got["text"]}]}
        return self._out(
            self._ids(body["text"]), body["sampling_params"]["max_new_tokens"]
        )

    def post_text(self, path, body, timeout=None):
        self.posts.append(path)
        self.aborted.add(body["rid"])
        return ""

    def stream(self, path, body, timeout=None):
        ids = self._ids(body["text"])
        self.seen.append(ids)
        for n in range(1, body["sampling_params"]["max_new_tokens"] + 1):
            out = self._out(
                ids, 3 * n, finish="abort" if body["rid"] in self.aborted else None
            )
            if body["rid"] in self.aborted:
                out["meta_info"]["completion_tokens"] = 3 * n
                yield out
                return
            yield out


def test_the_long_requests_run_against_a_stand_in_server():
    """``long_context`` end to end against ``_LongServer``: the requests it sends, in order, give
    a record every long check passes (the radix hits, the abort by rid landing mid-decode, both
    streamed prefixes)."""
    from e2e import matrix

    server = _LongServer()
    g = matrix.long_context(server)
    n = len(matrix.LONG_PROMPTS)
    assert len(g["tokens"]) == len(g["logprobs"]) == len(g["accepts"]) == n + 3
    assert server.posts.count("/abort_request") == 1
    assert g["completion_matches_generate"] and g["spec"]["verify_steps"] > 0
    aborts = g["long"]["aborts"]
    assert aborts["abort_request"]["finish"] == "abort"
    assert aborts["disconnect"]["chunks"] == matrix.LONG_ABORT_AFTER
    named = {r.name: r for r in rows()}
    checks = matrix.long_checks(named["long_off"], g)
    assert checks and all(checks.values()), checks
    assert matrix.long_checks(named["long_cap_2"], g)["long_accepts_at_most_2"]
