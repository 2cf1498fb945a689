"""--enable-thinking-aliases: client thinking switches -> DeepSeek's `thinking` (patch: thinking alias).

The mapping table of docs/thinking-alias.md on real ``ChatCompletionRequest`` objects (the
protocol's own validators run first, as on the server): each switch alone, the request
beating the server defaults, disagreements and malformed values refused. The flag off leaves
the request untouched (upstream); the resolution hook refuses the flag for models that do not
read `thinking`. Over HTTP with the V4.1 encoder: test_serving_control_e2e.py.
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest
from sglang.srt.entrypoints.openai.thinking_alias import (
    apply_thinking_aliases,
    explicit_thinking_parsers,
    validate_thinking_aliases,
)

MSG = [{"role": "user", "content": "hi"}]


# A release whose chat request has no top-level `thinking` field drops it (the other switches map).
HAS_THINKING_FIELD = "thinking" in ChatCompletionRequest.model_fields


def req(**kw) -> ChatCompletionRequest:
    if "thinking" in kw and not HAS_THINKING_FIELD:
        pytest.skip("this release's ChatCompletionRequest has no `thinking` field")
    return ChatCompletionRequest(model="m", messages=MSG, **kw)


def thinking_of(request, defaults=None):
    apply_thinking_aliases(request, defaults)
    return (request.chat_template_kwargs or {}).get("thinking")


@pytest.mark.parametrize(
    "kw, expected",
    [
        ({}, None),
        ({"chat_template_kwargs": {"thinking": True}}, True),
        ({"chat_template_kwargs": {"thinking": False}}, False),
        ({"chat_template_kwargs": {"enable_thinking": True}}, True),
        ({"chat_template_kwargs": {"enable_thinking": False}}, False),
        ({"thinking": {"type": "enabled"}}, True),
        ({"thinking": {"type": "disabled", "budget_tokens": 100}}, False),
        ({"thinking": True}, True),
        ({"reasoning_effort": "high"}, True),
        ({"reasoning_effort": 0.3}, True),
        ({"reasoning_effort": "none"}, False),
        ({"reasoning": {"effort": "low"}}, True),
        (
            {
                "chat_template_kwargs": {"enable_thinking": True, "thinking": True},
                "reasoning_effort": "max",
            },
            True,
        ),
    ],
)
def test_each_switch(kw, expected):
    assert thinking_of(req(**kw)) is expected


def test_chat_template_kwargs_effort_counts():
    # The server moves chat_template_kwargs.reasoning_effort to reasoning_effort before the
    # aliases run (OpenAIServingChat._convert_to_internal_request): the same request then.
    r = req(chat_template_kwargs={"reasoning_effort": "high"})
    r.reasoning_effort = r.chat_template_kwargs.pop("reasoning_effort")
    assert thinking_of(r) is True


def test_request_beats_server_defaults():
    assert thinking_of(req(), {"enable_thinking": True}) is True
    assert thinking_of(req(), {"reasoning_effort": "high"}) is True
    assert thinking_of(req(), {"thinking": False, "reasoning_effort": "none"}) is False
    assert (
        thinking_of(
            req(chat_template_kwargs={"enable_thinking": False}), {"thinking": True}
        )
        is False
    )
    assert thinking_of(req(), {"other": 1}) is None
    assert thinking_of(req(), None) is None


def test_other_kwargs_are_kept():
    r = req(chat_template_kwargs={"enable_thinking": True, "foo": 1})
    assert thinking_of(r) is True and r.chat_template_kwargs == {
        "enable_thinking": True,
        "foo": 1,
        "thinking": True,
    }


@pytest.mark.parametrize(
    "kw, match",
    [
        (
            {
                "chat_template_kwargs": {"enable_thinking": True},
                "thinking": {"type": "disabled"},
            },
            r"disagree: chat_template_kwargs.enable_thinking \(on\), thinking.type=disabled \(off\)",
        ),
        (
            {
                "reasoning_effort": "none",
                "chat_template_kwargs": {"enable_thinking": True},
            },
            "disagree",
        ),
        ({"thinking": {"type": "adaptive"}}, "'enabled' or 'disabled'"),
        ({"thinking": "on"}, "thinking must be true or false"),
        (
            {"chat_template_kwargs": {"enable_thinking": 1}},
            "enable_thinking must be true or false",
        ),
    ],
)
def test_refused_requests(kw, match):
    with pytest.raises(ValueError, match=match):
        apply_thinking_aliases(req(**kw), None)
    with pytest.raises(ValueError, match="disagree"):
        apply_thinking_aliases(req(), {"enable_thinking": True, "thinking": False})


def test_parsers_and_refusal():
    assert explicit_thinking_parsers() == ["deepseek-v3", "deepseek-v4", "deepseek-v41"]
    validate_thinking_aliases(
        SimpleNamespace(enable_thinking_aliases=False, reasoning_parser=None)
    )
    validate_thinking_aliases(
        SimpleNamespace(enable_thinking_aliases=True, reasoning_parser="deepseek-v41")
    )
    for parser in (None, "qwen3"):
        with pytest.raises(
            ValueError,
            match="--reasoning-parser deepseek-v3 / deepseek-v4 / deepseek-v41",
        ):
            validate_thinking_aliases(
                SimpleNamespace(enable_thinking_aliases=True, reasoning_parser=parser)
            )


def test_flag_off_is_upstream():
    """The chat handler calls the aliases only with the flag on; upstream then ignores enable_thinking."""
    import inspect

    from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat

    src = inspect.getsource(OpenAIServingChat._process_messages)
    assert (
        "if get_serving().enable_thinking_aliases:\n            apply_thinking_aliases("
        in src
    )
    r = req(chat_template_kwargs={"enable_thinking": True})
    assert r.chat_template_kwargs == {
        "enable_thinking": True
    }  # no `thinking`: V4.1 would not think


def test_flag_on_the_command_line():
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    assert parser.parse_args(["--model-path", "m"]).enable_thinking_aliases is False
    assert (
        parser.parse_args(
            ["--model-path", "m", "--enable-thinking-aliases"]
        ).enable_thinking_aliases
        is True
    )
