"""Scale the DSpark draft's sampling temperature (--speculative-dspark-draft-temperature-scale).

The draft samples each request at tau * T instead of T and computes q from the same scaled
tensor; the target keeps T. Rejection sampling is exact for any proposal q the draft token was
drawn from, so the output stays distributed as the target at T; tau only moves the acceptance
rate (docs/draft-temperature-scale.md).

INVARIANT. The draft scales its own persistent ``draft_temperatures``, never
``params.temperatures``, which in the folded paths also feeds the target's temperatures; at
tau = 1 the two are the same tensor (bitwise upstream). Why: docs/draft-temperature-scale.md.
"""

from __future__ import annotations

import argparse
import logging
import math

import torch

logger = logging.getLogger(__name__)

_ACCEPTED = "a finite float > 0, e.g. 0.8 (1.0 = the request's own temperature)"


def parse_draft_temperature_scale(value) -> float:
    """type_parser of the flag: a finite float > 0, or ArgumentTypeError listing the form."""
    try:
        tau = float(value)
    except (TypeError, ValueError):
        tau = math.nan
    if not math.isfinite(tau) or tau <= 0.0:
        raise argparse.ArgumentTypeError(
            f"--speculative-dspark-draft-temperature-scale: invalid draft temperature scale "
            f"{value!r}: expected {_ACCEPTED}"
        )
    return tau


def validate_draft_temperature_scale(server_args) -> None:
    """The resolution hook's check (Engine(...) bypasses argparse: the value is parsed here)."""
    from sglang.srt.arg_groups.model_override_base import resolving_view

    cfg = resolving_view(server_args)
    speculative_algorithm = cfg.speculative_algorithm
    tau = parse_draft_temperature_scale(cfg.speculative_dspark_draft_temperature_scale)
    if tau != 1.0 and (speculative_algorithm or "").upper() != "DSPARK":
        raise ValueError(
            "--speculative-dspark-draft-temperature-scale applies to "
            f"--speculative-algorithm DSPARK only (got {speculative_algorithm!r}); drop the flag"
        )


def draft_temperature_scale() -> float:
    """tau, as resolved at startup."""
    from sglang.srt.runtime_context import get_spec

    return float(get_spec().speculative_dspark_draft_temperature_scale)


def draft_temperature_buffer(temperatures: torch.Tensor) -> torch.Tensor:
    """The draft's persistent temperature buffer: ``temperatures`` itself at tau = 1."""
    tau = draft_temperature_scale()
    if tau == 1.0:
        return temperatures
    logger.info(
        "DSpark draft samples at %g x the request temperature; the target keeps it.",
        tau,
    )
    # a copy, not empty: padded rows past bs are never staged and must hold a valid temperature
    return temperatures.clone()


def stage_draft_temperatures(params, draft_temperatures: torch.Tensor, bs: int) -> None:
    """After ``resolve_draft_params`` staged ``params`` rows ``[:bs]``: the draft's rows."""
    if draft_temperatures is params.temperatures:
        return
    tau = draft_temperature_scale()
    torch.mul(params.temperatures[:bs], tau, out=draft_temperatures[:bs])
    # Draft-only (0 on argmax rows stays 0).
    params.step_temperatures[:bs].mul_(tau)


def scale_draft_params(params):
    """The eager proposal's fresh params with the draft's temperatures (same at tau = 1)."""
    tau = draft_temperature_scale()
    if tau == 1.0:
        return params
    return params._replace(
        temperatures=params.temperatures * tau,
        step_temperatures=params.step_temperatures * tau,
    )
