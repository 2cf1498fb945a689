"""DeepSeek-V4 MXFP4 routed experts on the fork's Triton MoE (``--moe-runner-backend triton_mxfp4``).

On Hopper upstream runs these experts on FlashInfer's CUTLASS mixed-input path, which needs the
per-rank expert width to be a multiple of 128: DeepSeek-V4.1-Flash at TP4 (576 per rank) does not
load. This backend keeps the checkpoint's layout (packed e2m1, ue8m0 scales per 32, gate rows
then up rows) and serves every call with ``mxfp4_verify_moe``, which reads each routed expert's
bytes once per forward and no padding. Figures and what is refused: docs/triton-mxfp4-moe.md.

INVARIANTS. The weights are held once, as loaded. Before serving, each layer's kernel is checked
on its live weights against the exact dequantised product (``mxfp4_moe_reference``: bf16
activations times the exact MXFP4 values with fp32 sums, what upstream's W4A16 paths compute up
to their summation order) within ``BOUND``; a layer that fails refuses to start, naming itself.
"""

from __future__ import annotations

import logging

import torch

from sglang.kernels.ops.moe.mxfp4_verify_moe import (
    BOUND,
    mxfp4_moe_reference,
    mxfp4_verify_moe,
    within_bound,
)
from sglang.srt.layers.moe.router_live_rows import router_live_kwargs

logger = logging.getLogger(__name__)

FLAG = "--moe-runner-backend triton_mxfp4"
TARGETS = (
    "DeepseekV4ForCausalLM",
)  # models whose MXFP4 experts Fp8Config hands to this method
PROBE_ROWS = 4  # rows of the first-use check (top-k experts each)


def validate_triton_mxfp4_moe(server_args) -> None:
    """Resolution-hook check, when the backend is triton_mxfp4."""
    from sglang.srt.arg_groups.model_override_base import (
        model_config_of,
        resolving_view,
    )

    cfg = resolving_view(server_args)
    if cfg.moe_runner_backend != "triton_mxfp4":
        return
    arch = model_config_of(server_args).hf_config.architectures[0]
    if arch not in TARGETS:
        raise ValueError(
            f"{FLAG}: the target is {arch}; only {', '.join(TARGETS)} has the MXFP4 experts it "
            "serves, so it would do nothing; use --moe-runner-backend auto"
        )
    a2a = getattr(cfg, "moe_a2a_backend", "none")
    if a2a not in (None, "none"):
        raise ValueError(
            f"{FLAG} cannot be used with --moe-a2a-backend {a2a}: it takes the standard "
            "dispatcher's rows and expert ids; use --moe-a2a-backend none"
        )
    if getattr(cfg, "device", "cuda") not in (None, "cuda"):
        raise ValueError(f"{FLAG} runs on CUDA GPUs, found --device {cfg.device}")


def wants_triton_mxfp4_moe(
    is_fp4_experts: bool, backend_value: str, prefix: str
) -> bool:
    """The dispatch in ``Fp8Config.get_quant_method``: True for MXFP4 experts under this
    backend; the backend for other experts refuses, naming the layer."""
    if backend_value != "triton_mxfp4":
        return False
    if not is_fp4_experts:
        raise ValueError(
            f"{FLAG}: layer {prefix} has experts that are not MXFP4 (this backend serves "
            "DeepSeek-V4's MXFP4 experts only); use another --moe-runner-backend"
        )
    return True


class Mxfp4TritonMoEMethod:
    """MXFP4 experts in the checkpoint's layout on ``mxfp4_verify_moe``."""

    def __init__(self, fp8_method, prefix: str):
        self._fp8 = fp8_method
        self.prefix = prefix

    @property
    def load_up_proj_weight_first(self) -> bool:
        """FC1 as the checkpoint ships it: gate rows, then up rows."""
        return False

    def create_weights(
        self,
        layer,
        num_experts,
        hidden_size,
        intermediate_size_per_partition,
        params_dtype,
        **extra_weight_attrs,
    ):
        if hidden_size % 256 or intermediate_size_per_partition % 32:
            raise ValueError(
                f"{FLAG}: layer {self.prefix}: the kernel needs hidden % 256 == 0 and "
                f"intermediate % 32 == 0, found hidden={hidden_size}, "
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
                f"{FLAG}: layer {self.prefix} fuses shared experts; this backend runs routed "
                "experts only"
            )
        self.moe_runner_config = moe_runner_config

    def get_moe_runner_backend(self, layer):
        from sglang.srt.layers.moe.utils import MoeRunnerBackend

        return MoeRunnerBackend.TRITON_MXFP4

    def get_moe_routing_method_type(self, layer, requested_method):
        return requested_method

    def _weights(self, layer) -> tuple[torch.Tensor, ...]:
        return (
            layer.w13_weight.data.view(torch.uint8),
            layer.w13_weight_scale_inv.data.view(torch.uint8),
            layer.w2_weight.data.view(torch.uint8),
            layer.w2_weight_scale_inv.data.view(torch.uint8),
        )

    def process_weights_after_loading(self, layer) -> None:
        self._fp8.process_weights_after_loading(layer)
        self.swiglu_limit = getattr(self.moe_runner_config, "swiglu_limit", None)
        self._check_live_weights(layer)

    def _check_live_weights(self, layer) -> None:
        """The kernel against the exact product on this layer's own experts, before serving."""
        weights = self._weights(layer)
        experts, hidden = weights[0].shape[0], weights[2].shape[1]
        top_k = int(self.moe_runner_config.top_k)
        dev = weights[0].device
        gen = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(PROBE_ROWS, hidden, generator=gen, device=dev).bfloat16()
        ids = (
            torch.arange(PROBE_ROWS * top_k, device=dev).view(PROBE_ROWS, top_k)
            * (experts // (PROBE_ROWS * top_k) or 1)
        ) % experts
        ids = ids.to(torch.int32)
        tw = torch.rand(PROBE_ROWS, top_k, generator=gen, device=dev)
        out = mxfp4_verify_moe(x, ids, tw, *weights, swiglu_limit=self.swiglu_limit)
        ref, mag = mxfp4_moe_reference(
            x, ids, tw, *weights, swiglu_limit=self.swiglu_limit
        )
        ok = within_bound(out, ref, mag)
        if not bool(ok.all()):
            bad = (~ok).nonzero()[0].tolist()
            raise RuntimeError(
                f"{FLAG}: layer {self.prefix} failed its check on the live weights: output "
                f"{tuple(bad)} is {out[tuple(bad)].item():.6g}, the exact product "
                f"{ref[tuple(bad)].item():.6g}, beyond {BOUND:g} x {mag[tuple(bad)].item():.6g}; "
                "serve this model with another --moe-runner-backend"
            )
        logger.info(
            "%s: %s, %d experts x %d, checked on its weights",
            FLAG,
            self.prefix,
            experts,
            weights[0].shape[1] // 2,
        )

    def apply(self, layer, dispatch_output):
        from sglang.srt.layers.moe.token_dispatcher.standard import StandardCombineInput

        topk = dispatch_output.topk_output
        out = mxfp4_verify_moe(
            dispatch_output.hidden_states.contiguous(),
            topk.topk_ids,
            topk.topk_weights,
            *self._weights(layer),
            swiglu_limit=self.swiglu_limit,
            # inside the verify cap's scope its dead rows read and compute nothing
            **router_live_kwargs(topk.topk_ids),
        )
        return StandardCombineInput(hidden_states=out)
