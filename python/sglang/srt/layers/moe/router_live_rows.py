"""Live rows of a target-verify router call: dead verify rows take their anchor row's routing.

A request's verify block is ``stride`` consecutive rows (its anchor, then its drafts). A
speculative feature that verifies fewer drafts than the block holds (the DSpark verify cap)
marks rows at or past a request's live length dead: the accept discards their outputs, so they
must not add experts. The feature opens ``live_rows_scope`` around the target's verify forward;
the routers ask this module per call, and outside a scope every call is a no-op (the routers run
upstream's code):

* ``router_live_kwargs(gating_output)``: ``moe_fused_gate``'s ``live_lens=`` / ``live_stride=``;
* ``anchor_dead_rows_(weights, ids)``: routers without that input (hash layers), one launch after;
* ``refuse_dead_rows(route, layer_id)``: a route that can do neither raises (CUDA-graph capture
  runs every route first, so this refuses at startup, naming the layer).

WHY A SCOPE, NOT AN OBJECT HANDED DOWN: the routers sit at the bottom of upstream's call chain
(model, decoder layer, MoE, TopK, ``select_experts``) and no call on it carries a per-forward
argument; handing the live rows down would edit every signature on it in upstream files.

INVARIANTS: upstream code calls only the three public functions above, one per hunk, and reads
nothing else of this module. Only the target model's verify cap opens a scope, around one verify
forward, and ``live_rows_scope`` restores the previous value on exit, so a decode, a prefill, a
draft forward or another model sees None (upstream's routing); the model runner runs one forward
at a time per process. A scope is opened only around a forward whose rows are request-major with
a fixed stride (the static ragged-verify layout); every router call checks ``M % stride == 0``.
The live lengths are read by address, so a CUDA graph captured inside a scope sees each replay's
values.
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
