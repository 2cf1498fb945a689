"""Map the thinking switches clients send onto ``thinking`` (``--enable-thinking-aliases``).

DeepSeek-V3 / V4 / V4.1 think only when the chat-template argument ``thinking`` is true; the
switches other clients send are written into it (the switches: docs/thinking-alias.md).

THE RULES. The request's own switches decide; only when it carries none do the same switches
in ``--default-chat-template-kwargs`` decide (so a client's ``enable_thinking: false`` beats a
server default of ``thinking: true``); with neither, nothing is written (the model's default:
no thinking). Switches that disagree, a ``thinking.type`` other than enabled / disabled, or a
non-boolean flag fail the request with a 400 naming them: a request is never served in a
mode it did not ask for. The effort itself still reaches the encoder as before.
"""

from __future__ import annotations

from typing import Any, Optional

TOGGLE = "thinking"
THINKING_TYPES = {"enabled": True, "disabled": False}


def explicit_thinking_parsers() -> list[str]:
    """Reasoning parsers whose models think only on ``thinking: true``."""
    from sglang.srt.parser.reasoning_parser import ReasoningParser

    names = []
    for name, detector in ReasoningParser.DetectorMap.items():
        try:
            default = detector().reasoning_default
        except Exception:  # a detector that needs arguments is not one of these
            continue
        if default == "explicit_thinking":
            names.append(name)
    return sorted(names)


def validate_thinking_aliases(server_args) -> None:
    """Resolution-hook check: the aliases need a parser whose model reads ``thinking``."""
    from sglang.srt.arg_groups.model_override_base import resolving_view

    cfg = resolving_view(server_args)
    if not cfg.enable_thinking_aliases:
        return
    parsers = explicit_thinking_parsers()
    if cfg.reasoning_parser not in parsers:
        raise ValueError(
            f"--enable-thinking-aliases maps client switches onto the `thinking` chat-template "
            f"argument, which only models served with --reasoning-parser {' / '.join(parsers)} read; "
            f"got --reasoning-parser {cfg.reasoning_parser}, where the flag would do nothing; "
            "set --reasoning-parser to the served model's (one of those) or drop the flag"
        )


def _flag(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise ValueError(f"{name} must be true or false, got {value!r}")


def _switches(
    ctk: dict, thinking: Any, effort: Any, where: str
) -> list[tuple[str, bool]]:
    votes = []
    if TOGGLE in ctk:
        votes.append(
            (
                f"{where}chat_template_kwargs.thinking",
                _flag("chat_template_kwargs.thinking", ctk[TOGGLE]),
            )
        )
    if "enable_thinking" in ctk:
        votes.append(
            (
                f"{where}chat_template_kwargs.enable_thinking",
                _flag("chat_template_kwargs.enable_thinking", ctk["enable_thinking"]),
            )
        )
    if thinking is not None:
        if isinstance(thinking, dict):
            kind = thinking.get("type")
            if kind not in THINKING_TYPES:
                raise ValueError(
                    f"thinking.type {kind!r} is not accepted for this model: use 'enabled' or "
                    "'disabled' (it has no adaptive mode)"
                )
            votes.append((f"thinking.type={kind}", THINKING_TYPES[kind]))
        else:
            votes.append(("thinking", _flag("thinking", thinking)))
    if effort is not None:
        votes.append((f"{where}reasoning_effort={effort}", effort != "none"))
    return votes


def _decide(votes: list[tuple[str, bool]]) -> Optional[bool]:
    if not votes:
        return None
    if len({v for _, v in votes}) > 1:
        raise ValueError(
            "thinking switches disagree: "
            + ", ".join(f"{name} ({'on' if v else 'off'})" for name, v in votes)
            + "; send one, or make them agree"
        )
    return votes[0][1]


def apply_thinking_aliases(request: Any, default_kwargs: Optional[dict]) -> None:
    """Write the request's thinking decision into ``chat_template_kwargs["thinking"]``, before
    the server's defaults are merged; ValueError (a 400) on disagreeing or malformed switches.
    """
    ctk = dict(request.chat_template_kwargs or {})
    # getattr: a release whose request model has no top-level ``thinking`` drops the field.
    thinking = getattr(request, "thinking", None)
    decision = _decide(_switches(ctk, thinking, request.reasoning_effort, ""))
    if decision is None and default_kwargs:
        defaults = default_kwargs
        decision = _decide(
            _switches(defaults, None, defaults.get("reasoning_effort"), "default ")
        )
    if decision is None:
        return
    ctk[TOGGLE] = decision
    request.chat_template_kwargs = ctk
