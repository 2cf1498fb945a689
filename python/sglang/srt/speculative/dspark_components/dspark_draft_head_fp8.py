"""The DSpark draft's block logits from an fp8 copy of the target's LM head
(--speculative-dspark-draft-head-fp8).

The draft's logits for up to ``MAX_ROWS[kernel]`` rows come from an e4m3 copy of the head (one
power-of-two scale per 32x32 block); larger calls keep the bf16 head. Why and the memory it
costs: docs/draft-head-fp8.md.

INVARIANTS. A row's logits are the same bits whatever the row count (exact bf16 products,
fixed K order) and one device uses one kernel for every call, so batching within
1..MAX_ROWS[kernel] never changes a draft token. The target keeps its bf16 head: the output stays
lossless because the draft samples and computes q from the same fp8 logits (rejection
sampling is exact for any proposal).
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

# Rows the fp8 head serves, per kernel: past them it is no faster than cuBLAS bf16
# (benchmark/results/archive/draft_head_fp8-NVIDIA_H200.json). Larger calls keep the bf16 head: never
# slower than stock.
MAX_ROWS = {"wgmma": 64, "mma.sync": 32}


class DraftHeadFp8:
    """The fp8 copy of one rank's LM head shard and the call that reads it."""

    def __init__(self, weight: torch.Tensor, max_rows: int | None = None) -> None:
        from sglang.kernels.ops.speculative.dspark.draft_head_fp8 import (
            MAX_SCALE,
            quantize_head_fp8,
        )

        q, self.scales = quantize_head_fp8(weight.detach())
        if (
            float(self.scales.max()) > MAX_SCALE
        ):  # the kernel's scale * 2**112 must stay finite
            raise ValueError(
                f"--speculative-dspark-draft-head-fp8: LM head block scale {float(self.scales.max())} "
                f"> {MAX_SCALE} (|weight| up to {float(weight.abs().max())}): not supported"
            )
        self.kernel = (
            "wgmma"
            if _wgmma_available(weight.device) and weight.shape[1] % 128 == 0
            else "mma.sync"
        )
        if self.kernel == "wgmma":
            from sglang.kernels.ops.gemm.e4m3_to_bf16 import permute_k

            q = permute_k(q)  # the layout the wgmma kernel reads (same values)
        self.q = q
        self.max_rows = MAX_ROWS[self.kernel] if max_rows is None else int(max_rows)
        self.out_dtype = weight.dtype
        self.nbytes = self.q.numel() + self.scales.numel() * 4

    def serves(self, rows: int) -> bool:
        return 1 <= rows <= self.max_rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # Logits in the head's dtype straight from the kernel (rounded once from fp32).
        x = x.to(torch.bfloat16).contiguous()
        if self.kernel == "wgmma":
            if (
                x.data_ptr() % 16
            ):  # TMA needs 16-byte aligned rows (a view at an odd offset)
                x = x.clone()
            from sglang.kernels.ops.speculative.dspark.draft_head_fp8_wgmma import (
                draft_head_fp8_logits_wgmma,
            )

            return draft_head_fp8_logits_wgmma(
                x, self.q, self.scales, out_dtype=self.out_dtype
            )
        from sglang.kernels.ops.speculative.dspark.draft_head_fp8 import (
            draft_head_fp8_logits,
        )

        return draft_head_fp8_logits(x, self.q, self.scales, out_dtype=self.out_dtype)


def _wgmma_available(device: torch.device) -> bool:
    """The Hopper kernel: SM90 with Gluon (one kernel per device: row logits never depend on it)."""
    try:
        from sglang.kernels.ops.speculative.dspark.draft_head_fp8_wgmma import available
    except ImportError:  # a Triton without Gluon: the mma.sync kernel
        return False
    return available(device)


def check_draft_head_fp8_applies(model, lm_head) -> None:
    """Raise (naming what was found) where the fp8 draft head cannot apply."""
    from sglang.srt.layers.logits_processor import should_apply_lm_head_quant_method

    what = "--speculative-dspark-draft-head-fp8"
    if getattr(model, "uses_own_vocab_modules", False):
        raise ValueError(
            f"{what}: the draft uses its own vocab modules, not the target's head"
        )
    if should_apply_lm_head_quant_method(
        lm_head, getattr(lm_head, "quant_method", None)
    ):
        raise ValueError(
            f"{what}: the LM head is already quantized ({type(lm_head.quant_method).__name__})"
        )
    if getattr(model, "_use_fp32_lm_head", False):
        raise ValueError(f"{what}: SGLANG_DSPARK_FP32_LM_HEAD forces the fp32 head")
    weight = lm_head.weight
    if weight.dtype not in (torch.bfloat16, torch.float16) or weight.dim() != 2:
        raise ValueError(
            f"{what}: expected a 2-D bf16/fp16 head, found {weight.dtype} {tuple(weight.shape)}"
        )
    if weight.shape[1] % 32:
        raise ValueError(
            f"{what}: hidden size {weight.shape[1]} is not a multiple of 32"
        )
    if weight.device.type != "cuda":
        raise ValueError(f"{what}: needs CUDA, the head is on {weight.device}")
    cap = torch.cuda.get_device_capability(weight.device)
    if cap < (8, 9):
        raise ValueError(
            f"{what}: needs SM89 or newer (e4m3), found SM{cap[0]}{cap[1]}"
        )
    try:
        from sglang.srt.kernel_plugins.nvidia.binding import megakernel_draft_sampler

        megakernel = megakernel_draft_sampler(model) is not None
    except Exception:  # the plugin is optional; without it no megakernel draft runs
        megakernel = False
    if megakernel:
        raise ValueError(
            f"{what}: the NVIDIA megakernel draft sampler computes its own logits"
        )


# targets whose DSpark draft (DeepseekV4ForCausalLMDSpark) builds the fp8 copy of the head
FP8_HEAD_TARGETS = ("DeepseekV4ForCausalLM",)


def validate_draft_head_fp8(server_args) -> None:
    """Resolution-hook check: refused where no draft builds the copy, and if deterministic."""
    from sglang.srt.arg_groups.model_override_base import (
        model_config_of,
        resolving_view,
    )

    cfg = resolving_view(server_args)
    enabled = cfg.speculative_dspark_draft_head_fp8
    algorithm = cfg.speculative_algorithm
    deterministic = cfg.enable_deterministic_inference
    if not enabled:
        return
    what = "--speculative-dspark-draft-head-fp8"
    if deterministic:
        raise ValueError(
            f"{what} cannot be used with --enable-deterministic-inference: calls above "
            f"{max(MAX_ROWS.values())} rows ({min(MAX_ROWS.values())} off Hopper) keep the bf16 head, so a request's draft logits (and the tokens it accepts) "
            "would depend on how many rows its batch has"
        )
    if (algorithm or "").upper() != "DSPARK":
        raise ValueError(
            f"{what} applies to --speculative-algorithm DSPARK only (got {algorithm!r})"
        )
    arch = model_config_of(server_args).hf_config.architectures[0]
    if arch not in FP8_HEAD_TARGETS:
        raise ValueError(
            f"{what}: the target is {arch}; only the DSpark draft of {', '.join(FP8_HEAD_TARGETS)} "
            "builds the fp8 head (the dense DSpark draft keeps bf16)"
        )


def maybe_build_draft_head_fp8(model, lm_head, enabled: bool):
    """At attach_shared_modules (before capture): the fp8 head, or None when off."""
    if not enabled:
        return None
    check_draft_head_fp8_applies(model, lm_head)
    head = DraftHeadFp8(lm_head.weight)
    if getattr(lm_head, "_derived_weight_cache_error", None) is None:
        # the target's own lm_head: its runner refuses online updates before writing them. The
        # copy would keep the old head: outputs stay exact (proposals and q both come from it),
        # but acceptance would fall without a word.
        lm_head._derived_weight_cache_error = (
            "Online weight updates are not supported with --speculative-dspark-draft-head-fp8: "
            "the DSpark draft's fp8 copy of the LM head is built at load and would keep the old "
            "head. Restart without it to update weights online."
        )
    logger.info(
        "DSpark draft LM head in fp8 (e4m3, 32x32 power-of-two scales) for 1..%d rows, %s kernel: "
        "%s x %s, %.1f MB on this rank (taken from the KV pool); the target keeps bf16.",
        head.max_rows,
        head.kernel,
        *lm_head.weight.shape,
        head.nbytes / 1e6,
    )
    return head
