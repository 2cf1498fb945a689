"""Live rows of a target-verify router call: dead verify rows take their anchor row's routing.

Inside ``live_rows_scope`` rows at or past a request's live length route as its anchor. Upstream's
routers call ``router_live_kwargs``, ``anchor_dead_rows_`` or ``refuse_dead_rows``, each a no-op
outside a scope (which router calls which: docs/verify-cap.md).

INVARIANTS. Upstream code reads nothing else of this module. A scope (the one module-level value,
docs/verify-cap.md says why not an object) is opened only by the target model's verify cap around
one verify forward whose rows are request-major with a fixed stride (every router call checks
``M % stride == 0``), and restored on exit: a decode, a prefill, a draft or another model sees
upstream's routing. The live lengths are read by address, so a captured graph sees each replay's.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator, Optional

import torch


@dataclasses.dataclass(frozen=True)
class LiveRows:
    lens: (
        torch.Tensor
    )  # [>= requests] int, live rows per request (1..stride), read by address
    stride: int  # verify rows per request
    owner: str  # the feature that opened the scope, named in errors (its flag)


# Internal, not read by upstream code: the open scope (None outside), set by live_rows_scope.
_ACTIVE: Optional[LiveRows] = None


@contextlib.contextmanager
def live_rows_scope(live: Optional[LiveRows]) -> Iterator[None]:
    """Routers in this scope route dead rows as their anchor (``None``: upstream's routing)."""
    global _ACTIVE
    prev, _ACTIVE = _ACTIVE, live
    try:
        yield
    finally:
        _ACTIVE = prev


def _checked(m: int) -> Optional[LiveRows]:
    live = _ACTIVE
    if live is not None and m % live.stride != 0:
        raise RuntimeError(
            f"{live.owner}: a target-verify router got {m} rows, not a multiple of the verify "
            f"stride {live.stride}; dead-row routing needs the static verify layout."
        )
    return live


def router_live_kwargs(gating_output: torch.Tensor) -> dict:
    """``moe_fused_gate`` keyword arguments for this call: ``{}`` outside a scope."""
    live = _checked(gating_output.shape[0])
    return {} if live is None else {"live_lens": live.lens, "live_stride": live.stride}


def anchor_dead_rows_(weights: torch.Tensor, ids: torch.Tensor) -> None:
    """After a router without a live-length input: dead rows take their anchor's outputs."""
    live = _checked(weights.shape[0])
    if live is None:
        return
    from sglang.kernels.ops.moe.anchor_rows import anchor_rows_

    anchor_rows_(weights, ids, live.lens, live.stride)


def refuse_dead_rows(route: str, layer_id: Optional[int] = None) -> None:
    """Call on a route that cannot take the live length; raises inside a scope."""
    live = _ACTIVE
    if live is not None:
        raise RuntimeError(
            f"{live.owner}: the target-verify router of MoE layer {layer_id} runs {route}, "
            "which cannot take the live length (dead verify rows would add their own experts); "
            f"choose a configuration that routes through moe_fused_gate or drop {live.owner}."
        )
