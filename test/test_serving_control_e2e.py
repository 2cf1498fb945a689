"""End to end on CPU: loop abort, the thinking aliases and the output cap over HTTP.

One real ``launch_server`` serves ``write_cycle_llama``: weights whose greedy output follows a
fixed successor map, so every answer is known before it runs ("0" -> "120120...", a period-3
loop; a letter walks the 26-letter cycle, which is no loop for a max period of 8). Its tokenizer
carries DeepSeek-V4.1's special tokens and the server runs with ``--reasoning-parser
deepseek-v41 --tool-call-parser deepseekv41``: prompts are rendered by upstream's real V4.1
encoder (deepseek-recipe) and outputs parsed by its V4.1 parser, as for the real model. Flags:
``--enable-loop-abort --loop-abort-max-period 8 --loop-abort-min-tokens 32
--enable-thinking-aliases --enable-metrics``, and ``SGLANG_MAX_NEW_TOKENS_LIMIT=90`` (the
output cap's documented replacement, docs/output-cap.md). Requests go through the OpenAI
client, as users send them.
"""

from __future__ import annotations

import os

import pytest
from conftest import REPO
from e2e.checkpoints import write_cycle_llama
from e2e.server import Server

pytestmark = pytest.mark.e2e

openai = pytest.importorskip("openai")

CAP = 90
ARGS = [
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
    "--enable-loop-abort",
    "--loop-abort-max-period",
    "8",
    "--loop-abort-min-tokens",
    "32",
    "--enable-thinking-aliases",
    "--reasoning-parser",
    "deepseek-v41",
    "--tool-call-parser",
    "deepseekv41",
    "--enable-metrics",
]
ENV = {
    "SGLANG_USE_CPU_ENGINE": "1",
    "SGLANG_MAX_NEW_TOKENS_LIMIT": str(CAP),
    "PYTHONPATH": os.pathsep.join(
        [str(REPO / "tools" / "standins"), os.environ.get("PYTHONPATH", "")]
    ),
}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_cycle_llama(tmp_path_factory.mktemp("cycle-llama"), dsv41_tokens=True)


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "server.log"
    with Server(model, ARGS, env=ENV, log_path=log, start_timeout=300) as s:
        yield s
    errors = s.errors()
    assert not errors, f"errors in the server log {log}:\n" + "\n".join(errors)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def vocab(model):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model / "tokenizer.json")).get_vocab()


# ---------------------------------------------------------------- loop abort


def test_generate_finishes_a_loop_with_its_reason(server):
    out = server.post(
        "/generate",
        {
            "text": "count 0",
            "sampling_params": {"max_new_tokens": 100, "temperature": 0},
        },
    )
    assert out["text"] == ("120" * 11)[:32]
    reason = out["meta_info"]["finish_reason"]
    assert reason == {
        "type": "loop",
        "period": 3,
        "length": 32,
        "message": "repetition loop: the last 32 output tokens repeat a 3-token pattern",
    }
    assert out["meta_info"]["completion_tokens"] == 32


def test_openai_completion_and_stream_finish_with_loop(client):
    out = client.completions.create(
        model="default", prompt="count 0", max_tokens=100, temperature=0
    )
    assert out.choices[0].finish_reason == "loop" and out.usage.completion_tokens == 32
    chunks = list(
        client.completions.create(
            model="default",
            prompt="count 0",
            max_tokens=100,
            temperature=0,
            stream=True,
        )
    )
    assert (
        "".join(c.choices[0].text for c in chunks if c.choices) == out.choices[0].text
    )
    assert [
        c.choices[0].finish_reason
        for c in chunks
        if c.choices and c.choices[0].finish_reason
    ] == ["loop"]


def test_chat_stream_finishes_with_loop(client):
    # The chat prompt ends in "</think>" (no thinking), whose successor starts the 26-letter cycle:
    # a loop once the request's own limits admit period 26 (78 looped tokens, under the cap).
    chunks = list(
        client.chat.completions.create(
            model="default",
            max_tokens=200,
            temperature=0,
            stream=True,
            messages=[{"role": "user", "content": "hi"}],
            extra_body={
                "custom_params": {"loop_abort": {"max_period": 26, "min_tokens": 78}}
            },
        )
    )
    reasons = [
        c.choices[0].finish_reason
        for c in chunks
        if c.choices and c.choices[0].finish_reason
    ]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert reasons == ["loop"] and text == ("abcdefghijklmnopqrstuvwxyz" * 3)[:78]


def test_no_loop_runs_to_the_cap_and_the_opt_out_works(server):
    letters = server.post(
        "/generate",
        {"text": "hello", "sampling_params": {"max_new_tokens": 200, "temperature": 0}},
    )
    assert letters["meta_info"]["finish_reason"]["type"] == "length"
    assert (
        letters["meta_info"]["completion_tokens"] == CAP
    )  # SGLANG_MAX_NEW_TOKENS_LIMIT caps 200 to 90
    opted_out = server.post(
        "/generate",
        {
            "text": "count 0",
            "sampling_params": {
                "max_new_tokens": 200,
                "temperature": 0,
                "custom_params": {"loop_abort": False},
            },
        },
    )
    assert opted_out["meta_info"]["finish_reason"]["type"] == "length"
    assert opted_out["text"] == ("120" * 30)[:CAP]


def test_bad_override_is_a_400(client):
    with pytest.raises(openai.BadRequestError, match="loop_abort"):
        client.completions.create(
            model="default",
            prompt="count 0",
            max_tokens=50,
            temperature=0,
            extra_body={
                "custom_params": {"loop_abort": {"max_period": 8, "min_tokens": 9}}
            },
        )


def test_loop_aborts_are_logged_and_counted(server):
    server.post(
        "/generate",
        {"text": "0", "sampling_params": {"max_new_tokens": 60, "temperature": 0}},
    )
    metrics = server.get("/metrics")
    counts = [
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("sglang:num_loop_aborted_requests_total{")
    ]
    assert counts and sum(counts) >= 1
    assert "loop abort: request" in server.log()


# ---------------------------------------------------------------- thinking aliases


def chat(client, stream=False, **kw):
    return client.chat.completions.create(
        model="default",
        max_tokens=12,
        temperature=0,
        stream=stream,
        messages=[{"role": "user", "content": "hi"}],
        **kw,
    )


def prompt_end(resp, vocab):
    ids = resp.model_extra["sglext"]["input_ids"]
    return next(tok for tok, i in vocab.items() if i == ids[-1])


IDS = {"return_input_ids_in_sglext": True}


def _needs_thinking_field(body: dict) -> None:
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest

    if "thinking" in body and "thinking" not in ChatCompletionRequest.model_fields:
        pytest.skip("this release's ChatCompletionRequest has no `thinking` field")


@pytest.mark.parametrize(
    "shape",
    [
        dict(extra_body={"chat_template_kwargs": {"enable_thinking": True}, **IDS}),
        dict(extra_body={"thinking": {"type": "enabled"}, **IDS}),
        dict(reasoning_effort="high", extra_body=IDS),
        dict(extra_body={"chat_template_kwargs": {"reasoning_effort": "high"}, **IDS}),
        dict(extra_body={"chat_template_kwargs": {"thinking": True}, **IDS}),
    ],
    ids=[
        "enable_thinking",
        "thinking.type",
        "reasoning_effort",
        "ctk.reasoning_effort",
        "thinking",
    ],
)
def test_client_switches_turn_thinking_on(client, vocab, shape):
    _needs_thinking_field(shape.get("extra_body", {}))
    out = chat(client, **shape)
    assert (
        prompt_end(out, vocab) == "<think>"
    )  # V4.1's encoder opened the reasoning block
    msg = out.choices[0].message
    assert msg.model_extra["reasoning_content"] == "abcdefghijkl" and not msg.content


@pytest.mark.parametrize(
    "shape",
    [
        dict(extra_body=IDS),
        dict(extra_body={"chat_template_kwargs": {"enable_thinking": False}, **IDS}),
        dict(extra_body={"thinking": {"type": "disabled"}, **IDS}),
        dict(reasoning_effort="none", extra_body=IDS),
    ],
    ids=["no switch", "enable_thinking false", "thinking disabled", "effort none"],
)
def test_thinking_stays_off(client, vocab, shape):
    _needs_thinking_field(shape.get("extra_body", {}))
    out = chat(client, **shape)
    assert prompt_end(out, vocab) == "</think>"
    assert out.choices[0].message.content == "abcdefghijkl"


def test_streamed_thinking_via_enable_thinking(client):
    chunks = list(
        chat(
            client,
            stream=True,
            extra_body={"chat_template_kwargs": {"enable_thinking": True}},
        )
    )
    reasoning = "".join(
        c.choices[0].delta.model_extra.get("reasoning_content") or ""
        for c in chunks
        if c.choices
    )
    assert reasoning == "abcdefghijkl"


@pytest.mark.parametrize(
    "extra, match",
    [
        (
            {
                "chat_template_kwargs": {"enable_thinking": True},
                "thinking": {"type": "disabled"},
            },
            "disagree",
        ),
        ({"thinking": {"type": "adaptive"}}, "adaptive"),
        ({"chat_template_kwargs": {"enable_thinking": "yes"}}, "true or false"),
    ],
)
def test_bad_switches_are_a_400(client, extra, match):
    _needs_thinking_field(extra)
    with pytest.raises(openai.BadRequestError, match=match):
        chat(client, extra_body=extra)
