"""--enable-loop-abort: a looping request finishes with finish_reason "loop" (patch: loop abort).

The detector is exact: on random streams built of noise and periodic runs (small alphabets,
so accidental periodicity is everywhere) it stops on the same token as a rescan of every
period. Real English text (Python's ``pydoc_data`` topics, ~180k word tokens and ~465k
characters) is never aborted at the default limits. Through the engine's own ``Req``:
multi-token accepts stop mid-run, min_new_tokens defers, ignore_eos and
``custom_params`` opt out, bad overrides fail the request with a 400, the flag off leaves
``Req`` as upstream. Flag syntax and the refusals. Over HTTP: test_serving_control_e2e.py.
"""

from __future__ import annotations

import argparse
import random
import re
from array import array
from types import SimpleNamespace

import pytest

from sglang.srt.managers import loop_abort as la
from sglang.srt.managers.schedule_batch import FINISH_LENGTH, FINISH_MATCHED_TOKEN, Req
from sglang.srt.sampling.sampling_params import SamplingParams


def rescan_first_loop(seq, p_max, n_min):
    """Reference: the first index whose periodic tail (some period <= P) reaches N tokens."""
    for n in range(len(seq)):
        for p in range(1, p_max + 1):
            k = n
            while k - p >= 0 and seq[k] == seq[k - p]:
                k -= 1
            if n - k + p >= n_min:
                return n
    return None


def noisy_stream(rng, p_max, length):
    seq = []
    while len(seq) < length:
        alphabet = rng.randint(1, 4)
        if rng.random() < 0.5:
            seq += [rng.randrange(alphabet) for _ in range(rng.randint(1, 10))]
        else:
            pattern = [
                rng.randrange(alphabet) for _ in range(rng.randint(1, p_max + 2))
            ]
            seq += (pattern * 40)[: rng.randint(1, 6 * p_max + 10)]
    return seq[:length]


@pytest.mark.parametrize("p_max", [1, 2, 5, 8, 13])
def test_detector_stops_where_a_rescan_does(p_max):
    rng = random.Random(p_max)
    for trial in range(300):
        n_min = rng.choice([3 * p_max, 3 * p_max + 1, 4 * p_max, 5 * p_max + 3])
        seq = noisy_stream(rng, p_max, 250)
        guard, start, found = la.LoopGuard(p_max, n_min), 0, None
        while (
            start < len(seq) and found is None
        ):  # accepts of 1..4 tokens, as speculative decoding
            stop = min(len(seq), start + rng.randint(1, 4))
            found, start = guard.feed(seq, start, stop), stop
        assert found == rescan_first_loop(seq, p_max, n_min), (trial, p_max, n_min, seq)


def test_periodic_tail_after_noise_is_caught_on_its_nth_token():
    rng = random.Random(7)
    noise = [rng.randrange(1000) for _ in range(3000)]
    pattern = [rng.randrange(1000) for _ in range(37)]
    seq = noise + pattern * 40
    found = la.LoopGuard(128, 512).feed(seq, 0, len(seq))
    assert found == len(noise) + 512 - 1
    # One perturbed token inside the loop restarts the count.
    seq2 = noise + pattern * 10 + [5000] + pattern * 40
    found2 = la.LoopGuard(128, 512).feed(seq2, 0, len(seq2))
    assert found2 == rescan_first_loop(seq2, 128, 512) == len(noise) + 370 + 1 + 512 - 1


def english():
    from pydoc_data import topics

    text = "\n\n".join(topics.topics.values())
    words = re.findall(r"\w+|[^\w\s]|\s+", text)
    vocab: dict[str, int] = {}
    return [vocab.setdefault(w, len(vocab)) for w in words], [ord(c) for c in text]


@pytest.mark.parametrize("limits", [(128, 512), (64, 192), (32, 96)])
def test_english_text_is_never_aborted(limits):
    words, chars = english()
    assert len(words) > 150_000 and len(chars) > 400_000
    for seq in (words, chars):
        assert la.LoopGuard(*limits).feed(seq, 0, len(seq)) is None


def test_smallest_period():
    assert [
        la.smallest_period(s) for s in ("abcabcab", "aaaa", "abcd", "abab", "a")
    ] == [3, 1, 4, 2, 1]


# ---------------------------------------------------------------- through Req


def on(p=8, n=32):
    return SimpleNamespace(
        enable_loop_abort=True, loop_abort_max_period=p, loop_abort_min_tokens=n
    )


OFF = SimpleNamespace(
    enable_loop_abort=False, loop_abort_max_period=None, loop_abort_min_tokens=None
)


@pytest.fixture(autouse=True)
def tp_rank_0():
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(
        tp_rank=0
    ):  # a scheduler process has its rank; a test states it
        yield


def make_req(cfg=None, max_new_tokens=1000, min_new_tokens=0, **sampling):
    sp = SamplingParams(max_new_tokens=max_new_tokens, temperature=0, **sampling)
    sp.normalize(None)
    sp.min_new_tokens = min_new_tokens  # normalize() wants a tokenizer for it
    req = Req("r", "", array("q", [1, 2, 3]), sp, vocab_size=100, eos_token_ids={2})
    loop_abort = la.build_loop_abort(cfg or on())  # as the scheduler builds it
    if loop_abort is not None:
        loop_abort.attach(req)
    return req


def decode(req, tokens, step=1):
    for i in range(0, len(tokens), step):
        chunk = tokens[i : i + step]
        req.output_ids.extend(chunk)
        req.update_finish_state(len(chunk))
        if req.finished():
            return
    return


LOOP = [10, 11, 12] * 40


def test_req_finishes_with_loop_reason():
    req = make_req()
    decode(req, LOOP)
    assert isinstance(req.finished_reason, la.FINISH_LOOP)
    assert req.finished_len == 32 and len(req.output_ids) == 32
    assert req.finished_reason.to_json() == {
        "type": "loop",
        "period": 3,
        "length": 32,
        "message": "repetition loop: the last 32 output tokens repeat a 3-token pattern",
    }


def test_multi_token_accept_stops_mid_run():
    req = make_req()
    decode(req, LOOP, step=5)  # 35 tokens accepted when the 32nd completes the loop
    assert isinstance(req.finished_reason, la.FINISH_LOOP) and req.finished_len == 32
    assert (
        len(req.output_ids) == 35
    )  # trimmed to finished_len by the output path, as a stop token


def test_eos_and_length_keep_priority_and_limits():
    req = make_req(max_new_tokens=20)  # the length cap comes first
    decode(req, LOOP)
    assert isinstance(req.finished_reason, FINISH_LENGTH) and req.finished_len == 20
    req = make_req()
    decode(req, LOOP[:31] + [2] + LOOP)  # EOS on the 32nd token wins
    assert isinstance(req.finished_reason, FINISH_MATCHED_TOKEN)


def test_min_new_tokens_defers_the_finish():
    req = make_req(min_new_tokens=50)
    decode(req, LOOP)
    assert isinstance(req.finished_reason, la.FINISH_LOOP) and req.finished_len == 50


def test_opt_outs_and_overrides():
    for req in (
        make_req(ignore_eos=True),
        make_req(custom_params={"loop_abort": False}),
    ):
        assert req.loop_guard is None
        decode(req, LOOP)
        assert isinstance(req.finished_reason, FINISH_LENGTH) or not req.finished()
    req = make_req(ignore_eos=True, custom_params={"loop_abort": True})
    decode(req, LOOP)
    assert isinstance(req.finished_reason, la.FINISH_LOOP)
    req = make_req(custom_params={"loop_abort": {"max_period": 4, "min_tokens": 60}})
    decode(req, LOOP)
    assert isinstance(req.finished_reason, la.FINISH_LOOP) and req.finished_len == 60


@pytest.mark.parametrize(
    "bad",
    ["yes", {"max_period": 8, "min_tokens": 10}, {"period": 3}, {"max_period": 0}],
)
def test_bad_override_fails_the_request(bad):
    req = make_req(custom_params={"loop_abort": bad})
    assert req.loop_guard is None
    assert req.to_finish is not None and req.to_finish.status_code == 400
    assert "loop_abort" in req.to_finish.message


def test_flag_off_leaves_req_as_upstream():
    req = make_req(cfg=OFF, custom_params={"loop_abort": True})
    assert req.loop_guard is None and "loop_guard" not in vars(req)
    decode(req, LOOP)
    assert not req.finished()


# ---------------------------------------------------------------- flags


def test_flag_syntax():
    from sglang.srt.arg_groups import loop_abort_args as la_args

    assert (
        la_args.parse_loop_abort_max_period("64") == 64
        and la_args.parse_loop_abort_min_tokens(500) == 500
    )
    for bad in ("0", "-3", "1.5", "x", "4097"):
        with pytest.raises(
            argparse.ArgumentTypeError,
            match="--loop-abort-max-period .* an integer 1..4096",
        ):
            la_args.parse_loop_abort_max_period(bad)
    with pytest.raises(
        argparse.ArgumentTypeError,
        match="--loop-abort-min-tokens '0' .* an integer >= 1",
    ):
        la_args.parse_loop_abort_min_tokens("0")
    assert la.resolve_limits(None, None) == (128, 512)
    assert la.resolve_limits(16, None) == (16, 64)
    with pytest.raises(
        ValueError,
        match=r"--loop-abort-min-tokens 100 < 3 x --loop-abort-max-period 64.*>= 192",
    ):
        la.resolve_limits(64, 100)


def cfg(**kw):
    base = dict(
        enable_loop_abort=False,
        loop_abort_max_period=None,
        loop_abort_min_tokens=None,
        is_embedding=False,
        disaggregation_mode="null",
    )
    return SimpleNamespace(**{**base, **kw})


def test_refusals():
    la.validate_loop_abort(cfg())
    la.validate_loop_abort(
        cfg(enable_loop_abort=True, loop_abort_max_period=8, loop_abort_min_tokens=32)
    )
    with pytest.raises(
        ValueError,
        match="--loop-abort-min-tokens without --enable-loop-abort would do nothing",
    ):
        la.validate_loop_abort(cfg(loop_abort_min_tokens=600))
    with pytest.raises(ValueError, match="embedding"):
        la.validate_loop_abort(cfg(enable_loop_abort=True, is_embedding=True))
    with pytest.raises(ValueError, match="prefill server"):
        la.validate_loop_abort(
            cfg(enable_loop_abort=True, disaggregation_mode="prefill")
        )
    with pytest.raises(ValueError, match="3 x --loop-abort-max-period"):
        la.validate_loop_abort(
            cfg(
                enable_loop_abort=True,
                loop_abort_max_period=64,
                loop_abort_min_tokens=100,
            )
        )


def test_the_advised_limits_are_accepted():
    """Each change the N < 3P refusal advises passes the validator, the other limit kept: a
    period only where N >= 3 leaves one of at least 1 (for N 1 and 2, P <= 0 is refused).
    """
    cases = [(None, n) for n in (1, 2, 3, 100, 383)] + [(64, 100), (5, 14), (4096, 1)]
    for max_period, min_tokens in cases:
        flags = dict(loop_abort_max_period=max_period, loop_abort_min_tokens=min_tokens)
        with pytest.raises(ValueError, match="3 x --loop-abort-max-period") as refusal:
            la.validate_loop_abort(cfg(enable_loop_abort=True, **flags))
        advised = re.findall(r"(--loop-abort-[a-z-]+) [<>]= (\d+)", str(refusal.value))
        assert [f for f, _ in advised][:1] == ["--loop-abort-min-tokens"], refusal.value
        assert len(advised) == (2 if min_tokens >= 3 else 1), refusal.value
        for flag, value in advised:
            field = "loop_abort_" + flag[len("--loop-abort-") :].replace("-", "_")
            la.validate_loop_abort(
                cfg(enable_loop_abort=True, **{**flags, field: int(value)})
            )


def test_flags_on_the_command_line():
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(
        ["--model-path", "m", "--enable-loop-abort", "--loop-abort-max-period", "16"]
    )
    assert (
        ns.enable_loop_abort is True
        and ns.loop_abort_max_period == 16
        and ns.loop_abort_min_tokens is None
    )
    defaults = parser.parse_args(["--model-path", "m"])
    assert (
        defaults.enable_loop_abort,
        defaults.loop_abort_max_period,
        defaults.loop_abort_min_tokens,
    ) == (False, None, None)


def test_refusals_through_server_args_resolution(llama_config):
    """The hook's one call reads the fields by name on a real ServerArgs, through upstream's
    own resolution: a renamed field fails here."""
    from conftest import resolve_server_args

    from sglang.srt.server_args import ServerArgs

    with pytest.raises(
        ValueError, match="without --enable-loop-abort would do nothing"
    ):
        resolve_server_args(llama_config, loop_abort_min_tokens=600)
    with pytest.raises(ValueError, match="3 x --loop-abort-max-period"):
        resolve_server_args(
            llama_config,
            enable_loop_abort=True,
            loop_abort_max_period=64,
            loop_abort_min_tokens=100,
        )
    with pytest.raises(ValueError, match="prefill server"):
        la.validate_loop_abort(  # a real record (a prefill server needs more to resolve)
            ServerArgs(
                model_path=str(llama_config),
                enable_loop_abort=True,
                disaggregation_mode="prefill",
            )
        )
    sa = resolve_server_args(llama_config, enable_loop_abort=True)
    assert la.build_loop_abort(sa).limits == (128, 512)
    assert la.build_loop_abort(resolve_server_args(llama_config)) is None


def test_two_schedulers_hold_their_own_loop_abort():
    """No module state: each scheduler's LoopAbort has its own limits and counter."""
    a, b = la.LoopAbort(8, 32), la.LoopAbort(16, None)
    assert (a.limits, b.limits) == ((8, 32), (16, 64))
    req = make_req(cfg=OFF)
    a.attach(req)
    assert req.loop_guard.owner is a and req.loop_guard.max_period == 8
    assert not [
        name for name in vars(la) if name.startswith("_") and name.isupper()
    ], "module-level state in loop_abort"
