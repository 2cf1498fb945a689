"""Block-fp8 linears served as MXFP8 on b12x's ``gemm.block_fp8_linear`` (``--block-fp8-mxfp8-backend b12x``).

On SM12x each eligible layer's weight is packed once by b12x after load and a call runs the
smaller of two prepared plans that holds its rows. Layers the model reads directly
(``keep_plain_weight_layout``), other block shapes and pre-quantized inputs stay on upstream's
path. How, figures and refusals: docs/b12x-mxfp8-linear.md.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from sglang.srt.arg_groups.b12x_block_fp8_args import (
    FLAG,
    parse_block_fp8_mxfp8_backend,
)
from sglang.srt.utils.b12x_pin import require_b12x

logger = logging.getLogger(__name__)


def serves_block_fp8_as_mxfp8(block_size, scale_fmt) -> bool:
    """A 32x32 ue8m0 block-fp8 weight is an MXFP8 operand b12x's linear takes."""
    return (
        block_size is not None and list(block_size) == [32, 32] and scale_fmt == "ue8m0"
    )


def validate_block_fp8_mxfp8_backend(server_args) -> None:
    """Resolution-hook check; the quantization_config is read only when the flag is set."""
    from sglang.srt.arg_groups.model_override_base import (
        model_config_of,
        resolving_view,
    )

    cfg = resolving_view(server_args)
    value = cfg.block_fp8_mxfp8_backend
    if value is None:
        return
    parse_block_fp8_mxfp8_backend(value)  # Engine(...) bypasses argparse
    hf_config = model_config_of(server_args).hf_config
    q = getattr(hf_config, "quantization_config", None) or {}
    block, fmt = q.get("weight_block_size"), q.get("scale_fmt")
    if not serves_block_fp8_as_mxfp8(block, fmt):
        raise ValueError(
            f"{FLAG} b12x does nothing here: the checkpoint's linears are not 32x32 ue8m0 "
            f"block-fp8 (found weight_block_size={block}, scale_fmt={fmt}); drop the flag"
        )
    require_b12x(f"{FLAG} b12x", "gemm.block_fp8_linear", "plan")


def plan_capacities(decode_rows: int, chunk: int) -> tuple[int, ...]:
    """The row capacities of a layer's plans: decode / verify calls, then prefill."""
    return tuple(sorted({max(1, decode_rows), max(1, decode_rows, chunk)}))


def capacity_for(rows: int, capacities: tuple[int, ...]) -> int:
    for c in capacities:
        if rows <= c:
            return c
    raise RuntimeError(
        f"{FLAG} b12x: a call of {rows} rows exceeds the largest prepared plan ({capacities[-1]}); "
        "plans cover the CUDA-graph batch sizes and prefill up to --chunked-prefill-size"
    )


def maybe_b12x_block_fp8(
    backend: Optional[str], block_size, scale_fmt
) -> Optional["B12xBlockFp8Linear"]:
    """The b12x linear for a block-fp8 linear method when the flag is on and the weights fit."""
    if backend != "b12x" or not serves_block_fp8_as_mxfp8(block_size, scale_fmt):
        return None
    from sglang.srt.runtime_context import get_exec, get_schedule, get_spec

    decode_bs = max(get_exec().graph.cuda_graph_config.decode.bs or [1])
    rows = max(1, int(getattr(get_spec(), "speculative_num_draft_tokens", None) or 1))
    chunk = int(get_schedule().chunked_prefill_size or 0)
    return B12xBlockFp8Linear(
        tuple(block_size), plan_capacities(decode_bs * rows, chunk)
    )


# Internal, not read by upstream code: b12x's session per device, kept (closing frees the plans).
_SESSIONS: dict[int, object] = {}


class B12xBlockFp8Linear:
    """One block-fp8 linear method's b12x path; per-layer state lives on the layer."""

    def __init__(self, block_size: tuple[int, int], capacities: tuple[int, ...]):
        self.block_size = block_size
        self.capacities = capacities

    def prepare(self, layer) -> bool:
        """Pack the weight and prepare its plans; False (upstream) where b12x cannot take it."""
        layer.b12x_block_fp8 = None
        if getattr(layer, "keep_plain_weight_layout", False):
            return False
        from b12x.gemm import block_fp8_linear
        from b12x.preparation import PreparationSession, PreparedCall

        n, k = layer.weight.shape
        device = layer.weight.device
        packed = block_fp8_linear.pack_weight(
            layer.weight.data, layer.weight_scale_inv.data, block_size=self.block_size
        )
        session = _SESSIONS.get(device.index)
        if session is None:  # lives with the process: closing it releases the plans
            session = _SESSIONS[device.index] = PreparationSession(
                device=device
            ).__enter__()
        plans, requests = {}, []
        for cap in self.capacities:
            plan = block_fp8_linear.plan(
                block_fp8_linear.Caps(
                    device=device,
                    max_tokens=cap,
                    in_features=k,
                    out_features=n,
                    block_size=self.block_size,
                    output_mode="functional",
                )
            )

            def call(state, cap=cap):
                x = torch.randn(cap, k, dtype=torch.bfloat16, device=device) * 0.125
                return PreparedCall(run=lambda: state.run(x, packed), owners=(x,))

            plans[cap] = plan
            requests.append(
                plan.request(
                    name=f"{getattr(layer, 'prefix', 'linear')}:{cap}",
                    prepare_call=call,
                )
            )
        session.prepare(tuple(requests))
        layer.b12x_block_fp8 = (packed, plans)
        return True

    def apply(
        self, layer, x: torch.Tensor, bias: Optional[torch.Tensor]
    ) -> torch.Tensor:
        from b12x.gemm import block_fp8_linear

        packed, plans = layer.b12x_block_fp8
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        out = block_fp8_linear.run(
            x2,
            packed,
            plan=plans[capacity_for(x2.shape[0], self.capacities)],
            bias=bias,
        )
        return out.reshape(*x.shape[:-1], out.shape[-1])
