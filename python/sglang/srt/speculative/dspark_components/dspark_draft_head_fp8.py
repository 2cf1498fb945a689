"""The DSpark draft's block logits from an fp8 copy of the target's LM head
(--speculative-dspark-draft-head-fp8).

DIAGNOSIS. The draft projects gamma rows per request through the target's vocab-parallel
bf16 LM head every step: at bs 1..4 (5..20 rows) that GEMM is bound by streaming the
head (TP4 shard 32320 x 5120 = 331 MB: ~100 us on the H200; TP1 1.3 GB: 310-400 us).

WHAT IT DOES. When the draft attaches the target's head, it builds (before CUDA-graph
capture) an e4m3 copy with one power-of-two scale per 32x32 block, held by the draft; the
draft's logits for up to ``MAX_ROWS`` (32) rows come from it through a Triton kernel that
streams it once per call with the same bits per row whatever the row count (16-row tiles,
exact bf16 products, fixed K order), so batching within 1..MAX_ROWS never changes a draft
token. Larger calls keep the bf16 head (their logits are the bf16 head's).

SPEED (H200, benchmark/results/draft_head_fp8-NVIDIA_H200.json, vs cuBLAS bf16 in one
CUDA graph): 1..16 rows 1.63-1.66x on the TP4 shard (51 vs 84 us), 1.68-1.88x at TP1
(182-185 vs 306-349 us); 17..32 rows 1.28-1.32x (66 vs 86 us, 254 vs 334 us).
The target keeps its bf16 head: the output stays lossless because the draft samples and
computes q from the same fp8 logits (rejection sampling is exact for any proposal).

COST. One fp8 copy per rank (N x K bytes + N x K / 256 bytes of scales: TP4 ~166 MB,
TP1 ~663 MB), allocated at draft load, before the memory profile: the KV pool shrinks by
that much.

Refuses at startup (naming what it found) where it cannot apply: the draft's own vocab
modules, a quantized head, SGLANG_DSPARK_FP32_LM_HEAD, the NVIDIA megakernel draft
sampler, not CUDA or below SM89, a non-bf16/fp16 head or K not a multiple of 32.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

# Rows the fp8 head serves. The kernel streams the head once for up to 64 rows (16-row tiles
# sharing each dequantized weight tile), but each tile adds ~15 us of MMA: on the H200
# (benchmark/results/draft_head_fp8-*.json) 33..48 rows were only 1.04-1.06x cuBLAS bf16 and
# 49..64 rows 0.95-1.01x, so calls above 32 rows keep the bf16 head: never slower than stock.
MAX_ROWS = 32


class DraftHeadFp8:
    """The fp8 copy of one rank's LM head shard and the call that reads it."""

    def __init__(self, weight: torch.Tensor, max_rows: int = MAX_ROWS) -> None:
        from sglang.kernels.ops.speculative.dspark.draft_head_fp8 import (
            MAX_SCALE,
            quantize_head_fp8,
        )

        self.q, self.scales = quantize_head_fp8(weight.detach())
        if float(self.scales.max()) > MAX_SCALE:  # the kernel's scale * 2**112 must stay finite
            raise ValueError(
                f"--speculative-dspark-draft-head-fp8: LM head block scale {float(self.scales.max())} "
                f"> {MAX_SCALE} (|weight| up to {float(weight.abs().max())}): not supported"
            )
        self.max_rows = int(max_rows)
        self.out_dtype = weight.dtype
        self.nbytes = self.q.numel() + self.scales.numel() * 4

    def serves(self, rows: int) -> bool:
        return 1 <= rows <= self.max_rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from sglang.kernels.ops.speculative.dspark.draft_head_fp8 import (
            draft_head_fp8_logits,
        )

        # Logits in the head's dtype straight from the kernel (rounded once from fp32).
        return draft_head_fp8_logits(
            x.to(torch.bfloat16).contiguous(), self.q, self.scales, out_dtype=self.out_dtype
        )


def check_draft_head_fp8_applies(model, lm_head) -> None:
    """Raise (naming what was found) where the fp8 draft head cannot apply."""
    from sglang.srt.layers.logits_processor import should_apply_lm_head_quant_method

    what = "--speculative-dspark-draft-head-fp8"
    if getattr(model, "uses_own_vocab_modules", False):
        raise ValueError(f"{what}: the draft uses its own vocab modules, not the target's head")
    if should_apply_lm_head_quant_method(lm_head, getattr(lm_head, "quant_method", None)):
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
        raise ValueError(f"{what}: hidden size {weight.shape[1]} is not a multiple of 32")
    if weight.device.type != "cuda":
        raise ValueError(f"{what}: needs CUDA, the head is on {weight.device}")
    cap = torch.cuda.get_device_capability(weight.device)
    if cap < (8, 9):
        raise ValueError(f"{what}: needs SM89 or newer (e4m3), found SM{cap[0]}{cap[1]}")
    try:
        from sglang.srt.kernel_plugins.nvidia.binding import megakernel_draft_sampler

        megakernel = megakernel_draft_sampler(model) is not None
    except Exception:  # the plugin is optional; without it no megakernel draft runs
        megakernel = False
    if megakernel:
        raise ValueError(f"{what}: the NVIDIA megakernel draft sampler computes its own logits")


def maybe_build_draft_head_fp8(model, lm_head, enabled: bool):
    """At attach_shared_modules (before capture): the fp8 head, or None when off."""
    if not enabled:
        return None
    check_draft_head_fp8_applies(model, lm_head)
    head = DraftHeadFp8(lm_head.weight)
    logger.info(
        "DSpark draft LM head in fp8 (e4m3, 32x32 power-of-two scales) for 1..%d rows: "
        "%s x %s, %.1f MB on this rank (taken from the KV pool); the target keeps bf16.",
        head.max_rows, *lm_head.weight.shape, head.nbytes / 1e6,
    )
    return head
