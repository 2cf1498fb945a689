"""Flags of --enable-loop-abort (sglang/srt/managers/loop_abort.py): the limits' accepted forms.

Kept apart from the detector so that the ``schedule`` fields can import it without importing
the scheduler's batch module (which imports the server arguments).
"""

from __future__ import annotations

import argparse
from typing import Any, Optional

FLAG_NAMES = ("--loop-abort-max-period", "--loop-abort-min-tokens")
MAX_PERIOD_LIMIT = 4096


def positive_int(
    name: str, value: Any, limit: Optional[int] = None, error: type = ValueError
) -> int:
    """``value`` as an integer in 1..``limit``, or ``error`` naming ``name`` (flag or parameter)."""
    try:
        ok = not isinstance(value, bool) and int(value) == float(value)
    except (TypeError, ValueError):
        ok = False
    if not ok or int(value) < 1 or (limit is not None and int(value) > limit):
        bound = f"1..{limit}" if limit else ">= 1"
        raise error(f"{name} {value!r} is not an accepted value: an integer {bound}")
    return int(value)


def parse_loop_abort_max_period(value: Any) -> int:
    """type_parser of --loop-abort-max-period: an integer in 1..MAX_PERIOD_LIMIT."""
    return positive_int(
        FLAG_NAMES[0], value, MAX_PERIOD_LIMIT, argparse.ArgumentTypeError
    )


def parse_loop_abort_min_tokens(value: Any) -> int:
    """type_parser of --loop-abort-min-tokens: an integer >= 1."""
    return positive_int(FLAG_NAMES[1], value, error=argparse.ArgumentTypeError)
