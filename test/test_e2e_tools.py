"""The end-to-end harness's own logic: log triage, the two-sample test, the checkpoints' tokenizer."""

from __future__ import annotations

import random

import pytest
from e2e.checkpoints import DEEPSEEK_SPECIAL_TOKENS, MASK_TOKEN_ID, write_tokenizer
from e2e.matrix import (
    P_MIN,
    chi2_same,
    evaluate,
    feature_lines,
    kernel_summary,
    main,
    merge_rows,
    rows,
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


def _served(tokens, model="agree"):
    return {
        "model": model,
        "fork_flags_line_ok": True,
        "log_errors": [],
        "greedy": {"tokens": tokens, "completion_matches_generate": True},
    }


def test_greedy_identity_is_checked_only_against_the_rows_a_row_names():
    recs = {
        "random_off": _served([[1, 2, 3]], "random"),
        "random_nospec": _served([[1, 2, 3]], "random"),
    }
    for name in recs:
        evaluate(name, recs[name], recs, ())
    differs = _served([[1, 9, 3]], "random")
    evaluate(
        "random_all_on", differs, recs, ()
    )  # a cap and `drop`: where it differs is recorded, not failed
    assert differs["ok"] and differs["greedy_first_difference_from_off"] == {0: 1}
    bitwise = _served([[1, 9, 3]], "random")
    evaluate("random_fence", bitwise, recs, ("off",))
    assert bitwise["ok"] is False and bitwise["greedy_identical_to_off"] is False
    named = {r.name: r.identical_to for r in rows()}
    # the wo_a twin on Hopper: rounding-level against upstream's cuBLAS route (docs/wo-a-fp8-twin.md)
    assert (
        named["random_fence"] == ("off",)
        and named["random_wo_a_small"] == named["random_all_on"] == ()
    )
    assert named["all_on"] == ("off", "nospec")


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
