"""tools/cap_advisor.py: the log read as the engine writes it, the engine's conf: rule, the pick on
a synthetic log whose optimum is known in closed form (and moves when the step table does), the
bounds where a candidate needs drafts a step never verified, and refused inputs."""

from __future__ import annotations

import json

import cap_advisor as ca
import numpy as np
import pytest
from conftest import REPO

GAMMA = 5
# Two groups of ten steps. Survival products: A 1, 1, 1, 0.5, 0.25; B 0.5, 0.25, ..., 1/32 (powers
# of two, so no threshold below ties with one in float32).
CONF_A = [1.0, 1.0, 1.0, 0.5, 0.5]
CONF_B = [0.5] * 5
# Both groups accept alike (the confidence says nothing): P(a >= j) = .9 .8 .7 .2 .1, so
# F(k) = mean min(a, k) = .9, 1.7, 2.4, 2.6, 2.7.
ACCEPTED = [0, 1, 2, 3, 3, 3, 3, 3, 4, 5]
F = {1: 0.9, 2: 1.7, 3: 2.4, 4: 2.6, 5: 2.7}
# step ms per rows = 1 + k: linear (30 + 5 rows), so a threshold's step at its mean rows is the
# mean of its groups' steps, and its TPOT lies between theirs: no threshold beats the best K.
LINEAR = {2: 40.0, 3: 45.0, 4: 50.0, 5: 55.0, 6: 60.0}
# (k of group A, k of group B) per threshold, read off the survival products above
SPLITS = {
    "conf:0.6": (3, 1),
    "conf:0.3": (4, 1),
    "conf:0.2": (5, 2),
    "conf:0.1": (5, 3),
    "conf:0.05": (5, 4),
    "conf:0.01": (5, 5),
}
FIXED = ["1", "2", "3", "4", "5"]


def _write_log(path, records) -> None:
    np.asarray(records, dtype="<f4").tofile(path)


def _log(path, cap_b: int = GAMMA):
    """Both groups verified in full, except group B capped at ``cap_b`` drafts (accepted is
    then min(a, cap_b), as the engine logs it)."""
    recs = [CONF_A + [GAMMA + 1, a] for a in ACCEPTED]
    recs += [CONF_B + [cap_b + 1, min(a, cap_b)] for a in ACCEPTED]
    _write_log(path, recs)
    return path


def _table(path, table) -> str:
    path.write_text(json.dumps({str(k): v for k, v in table.items()}))
    return str(path)


def _run(tmp_path, *extra, table=LINEAR, candidates=FIXED + list(SPLITS), log=None):
    log = log or _log(tmp_path / "cap.f32")
    argv = [str(log), "--gamma", str(GAMMA), "--step-table"]
    argv += [_table(tmp_path / "steps.json", table), *extra]
    for c in candidates:
        argv += ["--candidate", c]
    return ca.run(argv)


def _rows(advice) -> dict:
    return {r.candidate: r for r in advice.rows}


def _tpot(table, k_a: int, k_b: int) -> float:
    return (table[k_a + 1] + table[k_b + 1]) / (2 + F[k_a] + F[k_b])


def test_cap_3_is_best_and_conf_0_1_best_among_thresholds(tmp_path, capsys):
    advice = _run(tmp_path, "--recorded", "conf:0")
    rows = _rows(advice)
    for k in map(int, FIXED):
        assert rows[str(k)].accepted == pytest.approx(F[k])
        assert rows[str(k)].tpot_ms == pytest.approx(LINEAR[k + 1] / (1 + F[k]))
    for name, (k_a, k_b) in SPLITS.items():
        assert rows[name].drafts == pytest.approx((k_a + k_b) / 2)
        assert rows[name].tpot_ms == pytest.approx(_tpot(LINEAR, k_a, k_b))
    # closed form: K 3 = 50 / 3.4 = 14.71; the next, K 4 = 55 / 3.6 = 15.28
    assert advice.best.candidate == "3" and advice.rows[0].candidate == "3"
    assert advice.rows[1].candidate == "4" and advice.rows[1].tpot_ms > 15.2
    thresholds = [r for r in advice.rows if r.candidate.startswith("conf:0.")]
    assert thresholds[0].candidate == "conf:0.1"
    assert thresholds[1].tpot_ms - thresholds[0].tpot_ms > 0.2
    # the recorded setting (every draft verified) is marked and priced as K 5
    assert advice.current.candidate == "conf:0"
    assert advice.current.tpot_ms == pytest.approx(rows["5"].tpot_ms)
    out = capsys.readouterr().out
    assert "| 3 | 3.00 | 2.400 | 50.000 | 14.706 | BEST;" in out
    assert "| conf:0 | 5.00 |" in out and "current;" in out


@pytest.mark.parametrize(
    "table, best",
    [
        (
            {r: 50.0 + 0.5 * r for r in LINEAR},
            "5",
        ),  # rows nearly free: verify every draft
        (
            {r: 10.0 + 20.0 * r for r in LINEAR},
            "2",
        ),  # rows dear: 70 / 2.7 beats 90 / 3.4
    ],
)
def test_the_pick_moves_with_the_step_table(tmp_path, table, best):
    advice = _run(tmp_path, table=table)
    assert advice.best.candidate == best != "3"
    assert advice.best.tpot_ms == pytest.approx(
        table[int(best) + 1] / (1 + F[int(best)])
    )


def test_cap_min_floors_the_threshold_rule(tmp_path):
    plain = _rows(_run(tmp_path, candidates=["conf:0.6"]))["conf:0.6"]
    floored = _rows(_run(tmp_path, "--cap-min", "2", candidates=["conf:0.6"]))
    assert plain.drafts == pytest.approx(2.0)  # (3 + 1) / 2
    assert floored["conf:0.6"].drafts == pytest.approx(2.5)  # (3 + 2) / 2
    assert floored["conf:0.6"].accepted == pytest.approx((F[3] + F[2]) / 2)


def test_drafts_from_confidence_is_the_engines_rule():
    import torch

    from sglang.srt.speculative.dspark_components import dspark_verify_cap as engine

    gen = np.random.default_rng(1)
    conf = gen.random((4000, GAMMA)).astype(np.float32)
    conf[::7] = np.float32(0.5)  # products land exactly on 0.5, 0.25, ... (ties)
    conf[::11, 2] = np.float32(1.5)  # clamped to 1
    conf[::13, 1] = np.float32(-0.25)  # clamped to 0
    cases = ["conf:0.25", "conf:0.5", "conf:0", "conf:1", "conf:0.25,0.125,0.5,0.03"]
    for text in cases:
        for k_min in (1, 2, 4):
            spec = engine.verify_cap_spec(text)
            want = engine.drafts_from_confidence(
                torch.from_numpy(conf), engine.threshold_vector(spec, GAMMA), k_min
            ).numpy()
            c = ca.parse_candidate(text, GAMMA)
            got = ca.drafts_from_confidence(
                conf, ca.threshold_vector(c.thresholds, GAMMA), k_min
            )
            assert (got == want).all(), (text, k_min)
    # the comparison sees a wrong rule: a strict > instead of >=
    thr = ca.threshold_vector((0.25,), GAMMA)
    strict = np.clip(np.cumprod(conf.clip(0, 1), axis=1) > thr, 0, 1).cumprod(1).sum(1)
    assert (np.clip(strict, 1, GAMMA) != ca.drafts_from_confidence(conf, thr, 1)).any()


def test_reads_the_log_the_engine_writes(tmp_path):
    import torch

    from sglang.srt.speculative.dspark_components import dspark_verify_cap as engine

    path = tmp_path / "engine.f32"
    cap = engine.VerifyCap(
        spec=engine.verify_cap_spec("conf:0.3"),
        gamma=GAMMA,
        k_min=1,
        log_path=str(path),
        device="cpu",
    )
    gen = np.random.default_rng(3)
    want = []
    for bs in (3, 8, 1):
        conf = torch.from_numpy(gen.random((bs, GAMMA), dtype=np.float32))
        cap.begin_step(bs, conf)
        live = cap.live[:bs].clone()
        raw = torch.from_numpy(gen.integers(0, GAMMA + 1, bs))
        correct = torch.minimum(raw, live - 1)  # the accept caps it (cap_correct_len)
        cap.log_step(conf, correct)
        want += [(conf[i].tolist(), int(live[i]), int(correct[i])) for i in range(bs)]
    cap._log.close()
    rec = ca.read_cap_log(path, GAMMA)
    assert rec.live.tolist() == [w[1] for w in want]
    assert rec.accepted.tolist() == [w[2] for w in want]
    assert np.array_equal(rec.confidence, np.float32([w[0] for w in want]))
    ca.check_recorded(ca.parse_candidate("conf:0.3", GAMMA), rec, 1)
    with pytest.raises(ca.AdvisorError, match="does not give the logged live lengths"):
        ca.check_recorded(ca.parse_candidate("conf:0.6", GAMMA), rec, 1)


def test_a_candidate_past_the_verified_drafts_is_bounded_and_never_best(tmp_path):
    """Group B recorded under conf:0.2 verified 2 drafts; 8 of its 10 steps accepted both."""
    log = _log(tmp_path / "capped.f32", cap_b=2)
    advice = _run(
        tmp_path,
        "--recorded",
        "conf:0.2",
        log=log,
        candidates=["1", "2", "3", "conf:0.2", "conf:0.1"],
    )
    rows = _rows(advice)
    assert rows["2"].accepted == pytest.approx(
        F[2]
    )  # exact: k within what was verified
    k3 = rows["3"]
    assert k3.accepted is None and k3.beyond_log == 8
    # A exact at F(3) = 2.4; B: 0, 1, then 8 steps known only as >= 2 (at most 3)
    assert k3.accepted_low == pytest.approx((2.4 + 1.7) / 2)
    assert k3.accepted_high == pytest.approx((2.4 + 2.5) / 2)
    assert k3.tpot_ms is None and k3.tpot_ms_range[0] == pytest.approx(50 / 3.45)
    assert rows["conf:0.1"].accepted is None
    # K 3's best case (14.49) beats every exact row, yet the pick is exact: conf:0.2 (16.41)
    assert advice.best.candidate == "conf:0.2" and advice.best.current
    assert advice.best.tpot_ms == pytest.approx(_tpot(LINEAR, 5, 2))
    ranked = [r.ranked for r in advice.rows]
    assert ranked == sorted(ranked, reverse=True)  # exact rows first
    with pytest.raises(ca.AdvisorError, match=r"record 0 \(offset 0\) verified 5"):
        _run(tmp_path, "--recorded", "conf:0.3", log=log, candidates=["1"])
    # the rule verifying more than the log did (group B: 3 against 2) is refused as well
    with pytest.raises(ca.AdvisorError, match=r"record 10 \(offset 280\) verified 2"):
        _run(tmp_path, "--recorded", "conf:0.1", log=log, candidates=["1"])


def test_malformed_logs_are_refused_naming_the_offset(tmp_path):
    good = _log(tmp_path / "good.f32").read_bytes()
    rec = (GAMMA + 2) * 4
    cases = {
        "truncated": (
            good[: 3 * rec + 10],
            rf"truncated at offset {3 * rec}: expected a record of {rec} bytes .* found 10",
        ),
        "empty": (b"", "empty, no records"),
    }
    recs = [CONF_A + [6, 2]] * 3
    bad_live = [*recs[:2], CONF_A + [7, 0]]
    bad_acc = [*recs[:2], CONF_A + [3, 2.5]]
    over = [*recs[:2], CONF_A + [3, 3]]
    nan = [*recs[:2], [1.0, float("nan"), 1.0, 1.0, 1.0, 6, 0]]
    for name, records, offset, what in [
        ("live", bad_live, 2 * rec + 20, "live length 7.0, expected an integer 2..6"),
        ("fraction", bad_acc, 2 * rec + 24, "accepted drafts 2.5, expected .* 0..2"),
        ("over", over, 2 * rec + 24, "accepted drafts 3.0, expected .* 0..2"),
        ("nan", nan, 2 * rec + 4, "confidence of draft 2 is nan"),
    ]:
        cases[name] = (
            np.asarray(records, dtype="<f4").tobytes(),
            rf"record 2 \(offset {offset}\): {what}",
        )
    for name, (data, message) in cases.items():
        path = tmp_path / f"{name}.f32"
        path.write_bytes(data)
        with pytest.raises(ca.AdvisorError, match=message):
            ca.read_cap_log(path, GAMMA)
    # a gamma 5 log read as gamma 4: whole 24-byte records, but the fields are misplaced
    (tmp_path / "six.f32").write_bytes(good[: 6 * rec])
    with pytest.raises(
        ca.AdvisorError, match=r"record 0 \(offset 16\): live length 0.5"
    ):
        ca.read_cap_log(tmp_path / "six.f32", 4)
    # the good log reads, and the command line refuses the bad one with exit 2
    assert ca.read_cap_log(tmp_path / "good.f32", GAMMA).steps == 20
    argv = [str(tmp_path / "truncated.f32"), "--gamma", "5", "--step-table"]
    assert ca.main([*argv, _table(tmp_path / "t.json", LINEAR)]) == 2


def test_histograms_price_fixed_caps_only(tmp_path):
    counts = [ACCEPTED.count(a) for a in range(GAMMA + 1)]
    responses = [{"meta_info": {"spec_correct_drafts_histogram": counts}}] * 2
    hist = tmp_path / "responses.json"
    hist.write_text(json.dumps(responses))
    argv = ["--histogram", str(hist), "--gamma", "5"]
    argv += ["--step-table", _table(tmp_path / "t.json", LINEAR)]
    advice = ca.run(argv)
    assert advice.best.candidate == "3" and advice.steps == 20
    assert _rows(advice)["3"].accepted == pytest.approx(F[3])
    with pytest.raises(ca.AdvisorError, match="needs the confidences"):
        ca.run([*argv, "--candidate", "conf:0.1"])
    # recorded under K 2: a step with 3 accepted drafts cannot be in it
    with pytest.raises(ca.AdvisorError, match="more than 2 accepted drafts"):
        ca.run([*argv, "--recorded", "2"])


def test_step_time_from_the_cost_model(tmp_path):
    """DeepSeek-V4's widths (those the cap's MoE benchmark ran): the step of K 3 is the
    uncapped step minus 43 layers' measured saving at bs 1."""
    config = {
        "num_attention_heads": 64,
        "head_dim": 512,
        "hidden_size": 7168,
        "o_groups": 8,
        "o_lora_rank": 1024,
        "moe_intermediate_size": 768 * 4,
        "n_routed_experts": 384,
        "num_experts_per_tok": 6,
        "vocab_size": 129280,
        "num_hidden_layers": 43,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    result = json.loads(
        (REPO / "benchmark/results/archive/verify_cap_moe-NVIDIA_H200.json").read_text()
    )
    row = next(r for r in result["rows"] if (r["bs"], r["k"]) == (1, 3))
    saved_ms = 43 * (row["moe_us_no_cap"] - row["moe_us_cap"]) / 1e3
    argv = [str(_log(tmp_path / "cap.f32")), "--gamma", "5", "--base-step-ms", "50"]
    argv += ["--bs", "1", "--tp", "4", "--candidate", "3", "--candidate", "5"]
    rows = _rows(ca.run([*argv, "--config", str(tmp_path / "config.json")]))
    assert saved_ms > 1.0
    assert rows["3"].step_ms == pytest.approx(50 - saved_ms)
    assert rows["5"].step_ms == pytest.approx(50.0)
    # V4.1-Flash's experts were never measured: nothing to compare, refused
    with pytest.raises(ca.AdvisorError, match="nothing to compare"):
        ca.run(argv)


def test_json_output_and_unpriced_rows(tmp_path, capsys):
    table = {r: v for r, v in LINEAR.items() if r != 2}  # no row for K 1
    _run(tmp_path, "--json", table=table, candidates=["1", "3"])
    out = json.loads(capsys.readouterr().out)
    assert out["best"] == "3" and out["current"] == "as logged"
    k1 = next(r for r in out["candidates"] if r["candidate"] == "1")
    assert k1["step_ms"] is None and "outside the table's 3..6" in k1["note"]
    assert out["candidates"][-1]["candidate"] == "1"


def test_the_recorded_rule_check_allows_a_rounding_tie_only(tmp_path):
    """The GPU may round a product one way where numpy rounds it the other: a live length one
    short of the rule is accepted only where the product is within TIE_SLACK of the threshold.
    """
    above = float(np.nextafter(np.float32(0.3), np.float32(1)))  # 1 ulp above 0.3
    recorded = ca.parse_candidate("conf:0.3", GAMMA)
    for second, ok in ((above, True), (0.31, False)):
        # the rule verifies draft 2 (product >= 0.3), the log says one draft was verified
        path = tmp_path / f"{second}.f32"
        _write_log(path, [[1.0, second, 0.1, 0.1, 0.1, 2, 0]])
        rec = ca.read_cap_log(path, GAMMA)
        assert ca.candidate_drafts(recorded, rec, 1).tolist() == [2]
        if ok:
            ca.check_recorded(recorded, rec, 1)
        else:
            with pytest.raises(
                ca.AdvisorError, match="verified 1 drafts, the rule gives 2"
            ):
                ca.check_recorded(recorded, rec, 1)


def test_no_best_without_a_priced_candidate(tmp_path):
    rec = ca.read_cap_log(_log(tmp_path / "cap.f32"), GAMMA)
    cands = [ca.parse_candidate(c, GAMMA) for c in FIXED]
    advice = ca.advise(rec, cands, lambda rows: (None, "no step time"))
    assert advice.best is None and all(not r.ranked for r in advice.rows)
    priced = ca.advise(rec, cands, lambda rows: (10.0 * rows, "linear"))
    assert priced.best is not None
