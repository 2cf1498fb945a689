"""End to end on CPU: the installed fork serves a Llama with known outputs through the real
``launch_server``.

The model is ``write_cycle_llama``: real weights whose greedy next token depends only on the
current one (``CYCLES``: "0" -> "1" -> "2" -> "0", a letter walks the 26-letter cycle, any other
character -> "a"), so every greedy answer is known before the server runs and is checked
character for character, over ``/generate`` (a batch of prompts), ``/v1/completions`` (plain and
streamed) and ``/v1/chat/completions``; the expected strings are written out by hand, not derived
from the map the weights come from. The same server runs ``--enable-loop-abort`` with
``P = 8, N = 24``: a digit prompt's period-3 output finishes with reason ``loop`` on its 24th
token (over ``/generate`` and ``/v1/completions``), while the letter cycle (period 26 > P) runs to
its length, and is a loop only for a request whose own limits admit period 26. The server logs
the fork-flags line and stops with no error in its log. Startup refusals that need no GPU are
real server starts that exit non-zero with the message. The GPU matrix (``tools/e2e/matrix.py``)
serves DeepSeek-V4 + DSpark.
"""

from __future__ import annotations

import os

import pytest
from conftest import REPO, UPSTREAM
from e2e.checkpoints import char_vocab, write_cycle_llama
from e2e.server import Server, refusal

import sglang.fork as fork

pytestmark = pytest.mark.e2e

P, N = 8, 24  # loop abort: max period, min looped tokens (N >= 3P)
CPU_ARGS = [
    "--device",
    "cpu",
    "--attention-backend",
    "torch_native",
    "--sampling-backend",
    "pytorch",
    "--disable-cuda-graph",
    "--mem-fraction-static",
    "0.05",
    "--max-total-tokens",
    "4096",
]
LOOP_ARGS = [
    "--enable-loop-abort",
    "--loop-abort-max-period",
    str(P),
    "--loop-abort-min-tokens",
    str(N),
]
# The import-only stand-ins (sgl_kernel, torchvision, ...) come first, as in the tests.
CPU_ENV = {
    "SGLANG_USE_CPU_ENGINE": "1",
    "PYTHONPATH": os.pathsep.join(
        [str(REPO / "tools" / "standins"), os.environ.get("PYTHONPATH", "")]
    ),
}
# Greedy answers of the cycle model, 16 tokens each: the last prompt character picks the cycle.
# "count 1" loops with period 3, but 16 < N tokens: no loop abort.
KNOWN = {
    "The quick brown fox": "yzabcdefghijklmn",
    "Hello": "pqrstuvwxyzabcde",
    "count 1": "2012012012012012",
    "Z": "abcdefghijklmnop",
    "7 ": "abcdefghijklmnop",
}
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def greedy(max_new_tokens: int, **extra) -> dict:
    return {"max_new_tokens": max_new_tokens, "temperature": 0, **extra}


@pytest.fixture(scope="module")
def cycle_llama(tmp_path_factory):
    return write_cycle_llama(tmp_path_factory.mktemp("cycle-llama"))


@pytest.fixture(scope="module")
def server(cycle_llama, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "server.log"
    with Server(
        cycle_llama, CPU_ARGS + LOOP_ARGS, env=CPU_ENV, log_path=log, start_timeout=240
    ) as s:
        yield s
    assert s.proc.returncode is not None
    errors = s.errors()
    assert not errors, f"errors in the server log {log}:\n" + "\n".join(errors)


def test_startup_line_lists_the_fork_flags(server):
    line = next(l for l in server.log().splitlines() if "fork flags:" in l)
    assert f"sglang {fork.fork_version()} fork flags:" in line
    for flag in fork.fork_flags():
        assert f"{flag}=" in line


def test_generate_follows_the_cycle(server):
    outs = server.post(
        "/generate", {"text": list(KNOWN), "sampling_params": greedy(16)}
    )
    vocab = char_vocab()
    for (prompt, want), out in zip(KNOWN.items(), outs):
        assert out["text"] == want, prompt
        assert out["output_ids"] == [vocab[c] for c in want], prompt
        assert out["meta_info"]["finish_reason"]["type"] == "length"
        assert out["meta_info"]["completion_tokens"] == 16


def test_a_batch_sent_as_token_ids_answers_as_its_text(server):
    """The side-by-side timing sends a batch as ids from the server's ``/tokenize`` (one
    message to the scheduler); it must serve what the text batch serves."""
    from e2e import side_by_side as sbs

    ids = sbs.batch_ids(server, 3)
    timed = sbs.timed_request(server, ids, 6)
    text = server.post(
        "/generate", {"text": sbs.prompts_for(3), "sampling_params": greedy(6)}
    )
    assert timed["tokens"] == [o["output_ids"] for o in text]
    assert all(len(t) == 6 for t in timed["tokens"])


def test_openai_completions_follow_the_cycle(server):
    out = server.post(
        "/v1/completions",
        {"model": "default", "prompt": list(KNOWN), "max_tokens": 16, "temperature": 0},
    )
    assert out["object"] == "text_completion"
    choices = sorted(out["choices"], key=lambda c: c["index"])
    assert [c["text"] for c in choices] == list(KNOWN.values())
    assert {c["finish_reason"] for c in choices} == {"length"}
    assert out["usage"]["completion_tokens"] == 16 * len(KNOWN)
    chunks = list(
        server.stream(
            "/v1/completions",
            {"model": "default", "prompt": "Hello", "max_tokens": 8, "temperature": 0},
        )
    )
    assert (
        "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "pqrstuvw"
    )


def test_openai_chat(server):
    # The simple chat template ends the prompt in "<assistant>": ">" -> "a", then the letters.
    out = server.post(
        "/v1/chat/completions",
        {
            "model": "default",
            "max_tokens": 8,
            "temperature": 0,
            "messages": [{"role": "user", "content": "hi"}],
        },
    )
    assert out["choices"][0]["message"]["role"] == "assistant"
    assert out["choices"][0]["message"]["content"] == "abcdefgh"
    assert out["usage"]["completion_tokens"] == 8


# ---------------------------------------------------------------- loop abort


def test_a_digit_loop_is_aborted_on_its_nth_token(server):
    out = server.post("/generate", {"text": "0", "sampling_params": greedy(60)})
    assert out["text"] == ("120" * N)[:N]
    assert out["meta_info"]["finish_reason"] == {
        "type": "loop",
        "period": 3,
        "length": N,
        "message": f"repetition loop: the last {N} output tokens repeat a 3-token pattern",
    }
    assert out["meta_info"]["completion_tokens"] == N
    oa = server.post(
        "/v1/completions",
        {"model": "default", "prompt": "count 0", "max_tokens": 60, "temperature": 0},
    )
    assert oa["choices"][0]["finish_reason"] == "loop"
    assert oa["choices"][0]["text"] == ("120" * N)[:N]
    assert oa["usage"]["completion_tokens"] == N


def test_the_same_loop_opted_out_runs_to_its_length(server):
    """Negative control: the abort above comes from the guard, not from the model stopping."""
    out = server.post(
        "/generate",
        {
            "text": "0",
            "sampling_params": greedy(30, custom_params={"loop_abort": False}),
        },
    )
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert out["text"] == ("120" * 10)[:30]


def test_the_letter_cycle_is_no_loop_below_period_26(server):
    """Period 26 > P: 80 tokens (three cycles and more, over 3 x N) are not aborted; the same
    request with its own limits admitting period 26 is aborted on token 78 (= 3 x 26), so the
    first request ran long enough to be caught had its period counted."""
    body = {"text": "Z", "sampling_params": greedy(80)}
    out = server.post("/generate", body)
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert out["text"] == (LETTERS * 4)[:80]
    assert out["meta_info"]["completion_tokens"] == 80
    body["sampling_params"]["custom_params"] = {
        "loop_abort": {"max_period": 26, "min_tokens": 78}
    }
    caught = server.post("/generate", body)
    assert caught["meta_info"]["finish_reason"]["type"] == "loop"
    assert caught["meta_info"]["finish_reason"]["period"] == 26
    assert caught["text"] == out["text"][:78]


def _refused(model, args):
    r = refusal(model, CPU_ARGS + args, env=CPU_ENV, timeout=240)
    assert r.returncode != 0, r.stdout[-3000:]
    return r.stdout


def test_wrong_fork_build_is_refused_at_startup(cycle_llama):
    out = _refused(cycle_llama, ["--fork-expect-version", f"{UPSTREAM}+fork.1.0000000"])
    assert "refusing to start another patch series" in out


def test_dspark_only_flag_without_dspark_is_refused_at_startup(cycle_llama):
    out = _refused(cycle_llama, ["--speculative-dspark-verify-cap", "3"])
    assert "--speculative-dspark-verify-cap" in out and "DSPARK" in out
