"""DeepSeek-V4 MXFP4 routed experts on b12x's fused MoE (``--moe-runner-backend b12x``).

On SM12x upstream's CUTLASS path needs per-rank expert widths that are multiples of 128; b12x
runs the others. The experts are held once, and an execution plan is prepared before CUDA-graph
capture for every row count the engine runs (a call pads up to the next planned count with
expert id -1). Why, how, and what is refused: docs/b12x-moe.md.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from sglang.srt.utils.b12x_pin import require_b12x

logger = logging.getLogger(__name__)

FLAG = "--moe-runner-backend b12x"
MICRO_PIN_MAX_ROWS = (
    8  # rows up to which the dynamic path is pinned for N64-compact experts
)
LADDER_MIN = 16  # first prefill rung


def validate_b12x_moe(server_args) -> None:
    """Resolution-hook check (``Engine(...)`` bypasses argparse), when the backend is b12x."""
    from sglang.srt.arg_groups.model_override_base import resolving_view

    cfg = resolving_view(server_args)
    if cfg.moe_runner_backend != "b12x":
        return
    a2a = getattr(cfg, "moe_a2a_backend", "none")
    if a2a not in (None, "none"):
        raise ValueError(
            f"{FLAG} cannot be used with --moe-a2a-backend {a2a}: b12x's fused MoE takes the "
            "standard dispatcher's rows and expert ids; use --moe-a2a-backend none"
        )
    chunk = getattr(cfg, "chunked_prefill_size", None)
    if chunk is not None and chunk <= 0:
        raise ValueError(
            f"{FLAG} needs a bounded prefill chunk (--chunked-prefill-size > 0, found {chunk}): "
            "its execution plans are prepared up to the chunk size before serving; set "
            "--chunked-prefill-size to a positive size, e.g. 8192"
        )
    require_b12x(FLAG, "moe.fused_moe", "plan_execution")


def wants_b12x_moe(is_fp4_experts: bool, backend_value: str, prefix: str) -> bool:
    """The dispatch in ``Fp8Config.get_quant_method``: True for MXFP4 experts under the b12x
    backend; a b12x backend for other experts refuses, naming the layer."""
    if backend_value != "b12x":
        return False
    if not is_fp4_experts:
        raise ValueError(
            f"{FLAG}: layer {prefix} has experts that are not MXFP4 (b12x serves DeepSeek-V4's "
            "MXFP4 experts only); use another --moe-runner-backend"
        )
    return True


def plan_token_counts(
    decode_bs: list[int], rows_per_request: list[int], chunk: int
) -> tuple[int, ...]:
    """Row counts to prepare: each graph batch size x its rows per request, and a prefill ladder."""
    counts = {bs * r for bs in decode_bs for r in rows_per_request if bs > 0 and r > 0}
    rung = LADDER_MIN
    while rung < chunk:
        counts.add(rung)
        rung *= 2
    counts.add(chunk)
    return tuple(sorted(counts))


def pinned_config(rows: int, intermediate_per_rank: int) -> Optional[dict]:
    """b12x ``MoeDecodeConfig`` fields pinned for a count, or None for b12x's own choice."""
    if intermediate_per_rank % 128 == 64 and rows <= MICRO_PIN_MAX_ROWS:
        # dynamic instead of micro; N64-compact W4A8 requires grouped M16 routing (b12x 1.5.1)
        return {
            "backend": "dynamic",
            "route_planner": "internal",
            "max_active_clusters": None,
            "dynamic_tile_m": 16,
            "dynamic_route_mode": "grouped",
            "w4a16_route_mode": None,
            "nvfp4_share_input": False,
            "nvfp4_materialize_intermediate": False,
            "w4a16_tile_config": None,
            "w4a16_block_size_m": None,
            "w4a16_pipeline_stages": None,
        }
    return None


def plan_groups(
    counts: tuple[int, ...], intermediate_per_rank: int
) -> list[tuple[tuple[int, ...], Optional[dict]]]:
    """Counts grouped by their pin (an override is per b12x declaration)."""
    groups: dict[Optional[tuple], list[int]] = {}
    for c in counts:
        pin = pinned_config(c, intermediate_per_rank)
        groups.setdefault(
            None if pin is None else tuple(sorted(pin.items())), []
        ).append(c)
    return [(tuple(v), None if k is None else dict(k)) for k, v in groups.items()]


def padded_count(rows: int, counts: tuple[int, ...]) -> int:
    """The planned count a call of ``rows`` rows runs at (the next one up)."""
    for c in counts:
        if c >= rows:
            return c
    raise RuntimeError(
        f"{FLAG}: a call of {rows} rows exceeds the largest prepared plan ({counts[-1]} rows); "
        "the plans cover the CUDA-graph batch sizes and prefill up to --chunked-prefill-size"
    )


def settings_from_runtime() -> dict:
    """Row counts of this server (handed to each MoE method when it is built)."""
    from sglang.srt.runtime_context import get_exec, get_schedule, get_spec

    decode_bs = list(get_exec().graph.cuda_graph_config.decode.bs or [1])
    rows = [1]
    draft_tokens = getattr(get_spec(), "speculative_num_draft_tokens", None)
    if draft_tokens:
        rows.append(int(draft_tokens))
    chunk = int(get_schedule().chunked_prefill_size or 0)
    return {"counts": plan_token_counts(decode_bs, rows, max(chunk, LADDER_MIN))}


# Internal, not read by upstream code: one scratch set per (model root, geometry, tokens).
_SCRATCH: dict[tuple, tuple[torch.Tensor, ...]] = {}
# Internal, not read by upstream code: b12x's session per device, kept (closing frees the plans).
_SESSIONS: dict[int, object] = {}


class Mxfp4B12xMoEMethod:
    """MXFP4 experts on ``b12x.moe.fused_moe`` (recipe w4a8_mx)."""

    def __init__(self, fp8_method, prefix: str, counts: tuple[int, ...]):
        self._fp8 = fp8_method
        self.prefix = prefix
        self.counts = counts
        self.experts = None
        self.plans: dict[int, object] = {}

    @property
    def load_up_proj_weight_first(self) -> bool:
        """FC1 loaded as [up; gate]: b12x's kernel order (its W13Layout.W13)."""
        return True

    def create_weights(
        self,
        layer,
        num_experts,
        hidden_size,
        intermediate_size_per_partition,
        params_dtype,
        **extra_weight_attrs,
    ):
        if hidden_size % 128 or intermediate_size_per_partition % 64:
            raise ValueError(
                f"{FLAG}: layer {self.prefix}: b12x's MXFP4 MoE needs hidden % 128 == 0 and "
                f"intermediate % 64 == 0, found hidden={hidden_size}, "
                f"intermediate per rank={intermediate_size_per_partition}"
            )
        self._fp8.create_weights(
            layer,
            num_experts,
            hidden_size,
            intermediate_size_per_partition,
            params_dtype,
            fp4_scale_dtype=torch.float8_e8m0fnu,
            **extra_weight_attrs,
        )

    def create_moe_runner(self, layer, moe_runner_config) -> None:
        if moe_runner_config.num_fused_shared_experts:
            raise ValueError(
                f"{FLAG}: layer {self.prefix} fuses shared experts; b12x runs routed experts only"
            )
        self.moe_runner_config = moe_runner_config

    def get_moe_runner_backend(self, layer):
        from sglang.srt.layers.moe.utils import MoeRunnerBackend

        return MoeRunnerBackend.B12X

    def get_moe_routing_method_type(self, layer, requested_method):
        return requested_method

    def process_weights_after_loading(self, layer) -> None:
        from b12x.moe import fused_moe

        self._fp8.process_weights_after_loading(layer)
        cfg = self.moe_runner_config
        w13, w2 = layer.w13_weight.data, layer.w2_weight.data
        e, two_n = w13.shape[0], w13.shape[1]
        n, k = two_n // 2, w2.shape[1]
        self.geometry = (e, k, n)
        plan = fused_moe.plan_weights(
            source=fused_moe.PackedSource(
                format=fused_moe.PackedSourceFormat.MXFP4_E8M0_K32,
                w13_layout=fused_moe.W13Layout.W13,
            ),
            activation=fused_moe.ActivationSpec(
                mode=fused_moe.ActivationMode.A8,
                nonlinearity="silu",
                io_dtype=torch.bfloat16,
                swiglu_limit=getattr(cfg, "swiglu_limit", None),
            ),
            geometry=fused_moe.MoEGeometry(
                num_experts=e, hidden_size=k, intermediate_size=n
            ),
        )
        ones = torch.ones(e, dtype=torch.float32, device=w13.device)
        self.experts = fused_moe.prepare_weights(
            plan=plan,
            weights=fused_moe.PackedWeights(
                w13=w13,
                w2=w2,
                w13_block_scales=layer.w13_weight_scale_inv.data.view(torch.uint8),
                w2_block_scales=layer.w2_weight_scale_inv.data.view(torch.uint8),
                w13_global_scales=ones,
                w2_global_scales=ones.clone(),
                immutable_input_scales=True,
            ),
        )
        packing = plan.prepared_format.packing.value
        if packing not in ("source_native", "mma_view"):
            # b12x holds its own packed copy: keep the weights once
            for name in (
                "w13_weight",
                "w2_weight",
                "w13_weight_scale_inv",
                "w2_weight_scale_inv",
            ):
                p = getattr(layer, name)
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            torch.cuda.empty_cache()
        self._prepare_plans(layer, fused_moe)
        logger.info(
            "%s: %s, %d experts x %d, %d plans (%s)",
            FLAG,
            self.prefix,
            e,
            n,
            len(self.plans),
            packing,
        )

    def _prepare_plans(self, layer, fused_moe) -> None:
        from b12x.preparation import PreparationSession, PreparedCall

        e, k, n = self.geometry
        top_k = int(self.moe_runner_config.top_k)
        device = layer.w13_weight.device
        session = _SESSIONS.get(device.index)
        if session is None:  # lives with the process: closing it releases the plans
            session = _SESSIONS[device.index] = PreparationSession(
                device=device
            ).__enter__()
        root = self.prefix.split(".", 1)[0]
        requests = []
        for counts, pin in plan_groups(self.counts, n):
            decl = fused_moe.plan_execution(
                experts=self.experts,
                capacity=fused_moe.ExecutionCapacity(
                    max_tokens=counts[-1],
                    top_k=top_k,
                    warmup_token_counts=counts,
                    route_num_experts=0,
                ),
                routing=fused_moe.RoutingSpec(apply_router_weight_on_input=False),
                override=None if pin is None else fused_moe.MoeDecodeConfig(**pin),
            )
            variants = getattr(decl, "variants", None)
            self.plans.update(
                {int(c): p for c, p in variants.items()}
                if variants
                else {counts[-1]: decl}
            )

            def call(tokens):
                def prepare(state):
                    scratch = _scratch(root, self.geometry, tokens, state, device)
                    hidden = (
                        torch.randn(tokens, k, dtype=torch.bfloat16, device=device)
                        * 0.125
                    )
                    ids = (
                        (
                            torch.arange(tokens, device=device)[:, None]
                            + torch.arange(top_k, device=device)[None, :]
                        )
                        .remainder_(e)
                        .to(torch.int32)
                    )
                    weights = torch.full(
                        (tokens, top_k), 1.0 / top_k, dtype=torch.float32, device=device
                    )
                    out = torch.empty_like(hidden)
                    binding = state.bind(
                        scratch=scratch,
                        a=hidden,
                        experts=self.experts,
                        topk_weights=weights,
                        topk_ids=ids,
                        output=out,
                        input_scales_static=True,
                    )
                    return PreparedCall(
                        run=binding.run,
                        output=out,
                        owners=(scratch, hidden, ids, weights, out, binding),
                    )

                return prepare

            if hasattr(decl, "token_counts"):
                requests.append(
                    decl.request(
                        name=f"{self.prefix}:{counts[0]}",
                        prepare_calls={c: call(c) for c in decl.token_counts},
                    )
                )
            else:
                requests.append(
                    decl.request(
                        name=f"{self.prefix}:{counts[0]}", prepare_call=call(counts[-1])
                    )
                )
        session.prepare(tuple(requests))

    def apply(self, layer, dispatch_output):
        from b12x.moe import fused_moe
        from b12x.preparation import require_prepared

        from sglang.srt.layers.moe.token_dispatcher.standard import StandardCombineInput

        x = dispatch_output.hidden_states
        topk = dispatch_output.topk_output
        rows = x.shape[0]
        count = padded_count(rows, self.counts)
        ids, weights = topk.topk_ids.to(torch.int32), topk.topk_weights.float()
        if count != rows:
            x = torch.cat([x, x.new_zeros(count - rows, x.shape[1])])
            ids = torch.cat([ids, ids.new_full((count - rows, ids.shape[1]), -1)])
            weights = torch.cat(
                [weights, weights.new_zeros(count - rows, weights.shape[1])]
            )
        plan = self.plans[count]
        state = require_prepared(plan, "moe.decode", x.device)
        scratch = _scratch(
            self.prefix.split(".", 1)[0], self.geometry, count, state, x.device
        )
        out = torch.empty(count, x.shape[1], dtype=x.dtype, device=x.device)
        binding = fused_moe.bind(
            plan,
            scratch=scratch,
            a=x.contiguous(),
            experts=self.experts,
            topk_weights=weights.contiguous(),
            topk_ids=ids.contiguous(),
            output=out,
            input_scales_static=True,
        )
        fused_moe.run(binding=binding)
        return StandardCombineInput(hidden_states=out[:rows])


def _scratch(
    root: str, geometry: tuple, tokens: int, state, device
) -> tuple[torch.Tensor, ...]:
    key = (root, geometry, tokens)
    scratch = _SCRATCH.get(key)
    if scratch is None:
        scratch = _SCRATCH[key] = tuple(
            torch.empty(spec.shape, dtype=spec.dtype, device=device)
            for spec in state.scratch.scratch_specs()
        )
    return scratch
