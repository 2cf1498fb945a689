"""Finish a request whose output has fallen into a repetition loop (``--enable-loop-abort``).

A request whose last ``L >= N`` (``--loop-abort-min-tokens``) output tokens repeat a period
``p <= P`` (``--loop-abort-max-period``) is finished with ``FINISH_LOOP``. A ``LoopGuard`` checks
one candidate period per token (O(1) amortized; docs/loop-abort.md).

THE INVARIANT THAT MAKES IT EXACT. With ``N >= 3P`` a loop is found on the very token where
its periodic tail first reaches ``N``, as a rescan of every period would find it: a probe
(a ``2P`` window inside the loop) falls at most ``P`` tokens after the loop is ``2P`` long,
and a live candidate is always the smallest period of the tail, so it cannot hide another
loop. ``validate_loop_abort`` refuses ``N < 3P``; the tests compare against the rescan.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from sglang.srt.arg_groups.loop_abort_args import (
    FLAG_NAMES,
    MAX_PERIOD_LIMIT,
    parse_loop_abort_max_period,
    parse_loop_abort_min_tokens,
    positive_int,
)
from sglang.srt.managers.schedule_batch import BaseFinishReason

logger = logging.getLogger(__name__)

DEFAULT_MAX_PERIOD = 128
MIN_TOKENS_PER_PERIOD = 3  # N >= 3P: the exactness invariant above
DEFAULT_TOKENS_PER_PERIOD = 4
CUSTOM_PARAMS_KEY = "loop_abort"


class FINISH_LOOP(BaseFinishReason):
    """The output repeats a ``period``-token pattern over its last ``length`` tokens."""

    def __init__(self, period: int, length: int):
        super().__init__()
        self.period = period
        self.length = length
        self.message = (
            f"repetition loop: the last {length} output tokens repeat a "
            f"{period}-token pattern"
        )

    def to_json(self):
        return {
            "type": "loop",
            "message": self.message,
            "period": self.period,
            "length": self.length,
        }


# ---------------------------------------------------------------- flags


REQUEST_NAMES = (
    f'custom_params["{CUSTOM_PARAMS_KEY}"]["max_period"]',
    f'custom_params["{CUSTOM_PARAMS_KEY}"]["min_tokens"]',
)


def resolve_limits(
    max_period: Optional[int], min_tokens: Optional[int], names=FLAG_NAMES
) -> tuple[int, int]:
    """(P, N) with their defaults (P = 128, N = 4P); a bad value or N < 3P raises, naming ``names``."""
    p = (
        DEFAULT_MAX_PERIOD
        if max_period is None
        else positive_int(names[0], max_period, MAX_PERIOD_LIMIT)
    )
    n = (
        DEFAULT_TOKENS_PER_PERIOD * p
        if min_tokens is None
        else positive_int(names[1], min_tokens)
    )
    if n < MIN_TOKENS_PER_PERIOD * p:
        # each advised value passes these checks: a period P <= N // 3 only where that is >= 1
        advice = f"{names[1]} >= {MIN_TOKENS_PER_PERIOD * p}"
        if n >= MIN_TOKENS_PER_PERIOD:
            advice += f", or {names[0]} <= {n // MIN_TOKENS_PER_PERIOD}"
        raise ValueError(
            f"{names[1]} {n} < {MIN_TOKENS_PER_PERIOD} x {names[0]} {p}: the detector needs N >= 3P "
            f"to catch every loop on the token where it reaches N (use {advice})"
        )
    return p, n


def validate_loop_abort(server_args: Any) -> None:
    """The resolution hook's check: the limits parsed once (``Engine(...)`` bypasses argparse)."""
    from sglang.srt.arg_groups.overrides import resolving_view

    cfg = resolving_view(server_args)
    tuning = [
        flag
        for flag, value in (
            ("--loop-abort-max-period", cfg.loop_abort_max_period),
            ("--loop-abort-min-tokens", cfg.loop_abort_min_tokens),
        )
        if value is not None
    ]
    if not cfg.enable_loop_abort:
        if tuning:
            raise ValueError(
                f"{' and '.join(tuning)} without --enable-loop-abort would do nothing; "
                "add --enable-loop-abort or drop them"
            )
        return
    max_period, min_tokens = cfg.loop_abort_max_period, cfg.loop_abort_min_tokens
    resolve_limits(  # Engine(...) bypasses argparse: the values are parsed here
        None if max_period is None else parse_loop_abort_max_period(max_period),
        None if min_tokens is None else parse_loop_abort_min_tokens(min_tokens),
    )
    if cfg.is_embedding:
        raise ValueError(
            "--enable-loop-abort: an embedding server decodes no tokens; drop the flag"
        )
    if cfg.disaggregation_mode == "prefill":
        raise ValueError(
            "--enable-loop-abort on a prefill server (--disaggregation-mode prefill) would do "
            "nothing: requests decode on the decode server; drop it here and set it there"
        )


# ---------------------------------------------------------------- per request


class LoopAbort:
    """The scheduler's loop abort: the limits and the finish counter; ``attach`` gives each new
    request its ``LoopGuard``."""

    def __init__(
        self, max_period: Optional[int] = None, min_tokens: Optional[int] = None
    ):
        self.max_period, self.min_tokens = max_period, min_tokens  # the flags, or None
        self.limits = resolve_limits(max_period, min_tokens)  # (P, N), defaults filled
        self._counter = None  # created at the first finish a metrics collector counts

    def attach(self, req: Any) -> None:
        """Give a new request its ``LoopGuard``, or none where exempt (docs/loop-abort.md)."""
        params = req.sampling_params
        custom = params.custom_params if isinstance(params.custom_params, dict) else {}
        override = custom.get(CUSTOM_PARAMS_KEY)
        if override is None:
            if params.ignore_eos:
                return
            p, n = self.limits
        elif override is False:
            return
        elif override is True:
            p, n = self.limits
        elif isinstance(override, dict) and set(override) <= {
            "max_period",
            "min_tokens",
        }:
            try:
                p, n = resolve_limits(
                    override.get("max_period", self.max_period),
                    override.get("min_tokens", self.min_tokens),
                    REQUEST_NAMES,
                )
            except ValueError as e:
                req.set_finish_with_abort(str(e))
                return
        else:
            req.set_finish_with_abort(
                f'custom_params["{CUSTOM_PARAMS_KEY}"] = {override!r} is not accepted: use '
                'false, true, or {"max_period": P, "min_tokens": N}'
            )
            return
        req.loop_guard = LoopGuard(p, n, self)

    def report(self, req: Any, period: int, length: int) -> None:
        """A request finished by its guard: one log line (TP rank 0) and the counter."""
        from sglang.srt.runtime_context import get_context, get_parallel

        if (
            get_context().is_config_namespace_published("parallel")
            and get_parallel().tp_rank != 0
        ):
            return
        logger.info(
            "loop abort: request %s finished at %d output tokens: the last %d repeat a "
            "%d-token pattern",
            req.rid,
            req.finished_len,
            length,
            period,
        )
        collector = getattr(req, "metrics_collector", None)
        if collector is not None:
            if self._counter is None:
                from prometheus_client import Counter

                self._counter = Counter(
                    name="sglang:num_loop_aborted_requests_total",
                    documentation="Requests finished by --enable-loop-abort "
                    "(finish_reason loop).",
                    labelnames=list(collector.labels),
                )
            self._counter.labels(**collector.labels).inc()


def build_loop_abort(cfg: Any) -> Optional[LoopAbort]:
    """The scheduler's ``LoopAbort`` from the resolved limits (``validate_loop_abort``
    refused any other), or None with ``--enable-loop-abort`` off."""
    if not cfg.enable_loop_abort:
        return None
    return LoopAbort(cfg.loop_abort_max_period, cfg.loop_abort_min_tokens)


def smallest_period(tokens) -> int:
    """The smallest ``q`` with ``tokens[i] == tokens[i + q]`` for every valid ``i`` (KMP)."""
    n = len(tokens)
    pi = [0] * n
    k = 0
    for i in range(1, n):
        t = tokens[i]
        while k and tokens[k] != t:
            k = pi[k - 1]
        if tokens[k] == t:
            k += 1
        pi[i] = k
    return n - pi[-1] if n else 0


class LoopGuard:
    """One request's detector; ``check`` runs in ``Req.update_finish_state`` on every rank."""

    __slots__ = (
        "max_period",
        "min_tokens",
        "owner",
        "seen",
        "period",
        "run",
        "next_probe",
    )

    def __init__(
        self, max_period: int, min_tokens: int, owner: Optional[LoopAbort] = None
    ):
        self.max_period = max_period
        self.min_tokens = min_tokens
        self.owner = owner  # the LoopAbort that reports a finish, or None
        self.seen = 0  # output tokens consumed
        self.period = 0  # live candidate period, 0 = none
        self.run = 0  # tokens i (ending at the last) with t[i] == t[i - period]
        self.next_probe = 2 * max_period - 1  # output index of the next candidate probe

    def feed(self, out, start: int, stop: int, min_len: int = 0) -> Optional[int]:
        """Consume ``out[start:stop]``; the index where a loop is first seen, or None."""
        p_max, n_min = self.max_period, self.min_tokens
        period, run, probe = self.period, self.run, self.next_probe
        found = None
        for i in range(start, stop):
            if period:
                if out[i] == out[i - period]:
                    run += 1
                else:
                    period, run, probe = 0, 0, i  # probe now: a new loop may start here
            if not period and i >= probe and i + 1 >= 2 * p_max:
                probe = i + p_max
                q = smallest_period(out[i + 1 - 2 * p_max : i + 1])
                if q <= p_max:
                    period = q
                    run = 2 * p_max - q
                    j = i + q - 2 * p_max  # the run's next position back
                    while j - q >= 0 and run + q < n_min and out[j] == out[j - q]:
                        run += 1
                        j -= 1
            if period and run + period >= n_min and i + 1 >= min_len:
                found = i
                break
        self.period, self.run, self.next_probe = period, run, probe
        self.seen = stop if found is None else found + 1
        return found

    def check(self, req: Any) -> bool:
        """Finish ``req`` with ``FINISH_LOOP`` if its new tokens complete a loop."""
        out = req.output_ids
        stop = len(out)
        if stop == self.seen + 1 and not self.period and self.seen < self.next_probe:
            self.seen = stop  # the common step: one token, no candidate, no probe due
            return False
        found = self.feed(out, self.seen, stop, req.sampling_params.min_new_tokens)
        if found is None:
            return False
        length = self.run + self.period
        req.finished_reason = FINISH_LOOP(period=self.period, length=length)
        req.finished_len = found + 1
        if self.owner is not None:
            self.owner.report(req, self.period, length)
        return True
