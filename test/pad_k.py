"""Pad a quantized linear's contraction dim K up to a GEMM backend's granule.

Lives in test/, not in the wheel: no backend of the fork calls it (b12x's MXFP8 GEMM takes
K = 576 as it is, docs/b12x-mxfp8-linear.md); test/test_pad_k.py keeps it proven for the
backend that will.

A backend whose kernel takes only K % granule == 0 (FlashInfer's b12x MXFP8 GEMM on SM12x needs
K % 128; DeepSeek-V4.1's shared-expert ``down_proj`` at TP4 has K = 576) declares its granule
and calls ``plan_k_pad``; the layer then keeps a ``KPad`` that pads the weight once at load
(zeros) with its block scales (unit scales for the new K blocks) and pads each call's input
through a persistent buffer whose tail is zeroed once and never written.

WHY THE RESULT IS THE SAME BITS. Every padded K position multiplies a zero weight by a zero
input, so each padded K block adds an exact 0.0 to an fp32 accumulator that starts at +0.0 and
therefore never holds -0.0: ``acc + 0.0 == acc`` bit for bit. The unit scale only has to be
finite (0 times any finite scale is 0); an input group that is all zeros quantizes to zeros
under any scale the quantizer picks. What can change the bits is the *kernel* a backend picks
for the new K (another tile or split-K); a backend must compare its padded call with its own
unpadded one (test/test_pad_k.py does it for upstream's Triton block-fp8 GEMM).

WHY ONE BUFFER PER LINEAR. ``pad_input`` returns a view of the buffer, so the previous call's
view is overwritten by the next call: correct as long as the GEMM that reads it is issued on
the same stream before the next ``pad_input`` of this linear (stream order), which holds for a
linear called once per forward on one stream. A linear called from two streams at once
(two-batch overlap) needs one ``KPad`` per stream.
"""

from __future__ import annotations

from typing import Optional

import torch

# e8m0 code of 1.0 (bias 127): the unit scale where scales are stored as exponent bytes.
E8M0_ONE = 127


def plan_k_pad(k: int, granule: int, block_k: int) -> Optional[int]:
    """The padded K for a weight of contraction dim ``k`` whose scales cover ``block_k``-wide K
    blocks, on a backend that takes K % ``granule`` == 0; None when ``k`` already fits.
    Raises where the padded K would split a scale block (the scales could not be re-blocked).
    """
    if granule <= 0 or block_k <= 0 or k <= 0:
        raise ValueError(
            f"pad-K: granule {granule}, block_k {block_k} and K {k} must be positive"
        )
    if k % granule == 0:
        return None
    padded = -(-k // granule) * granule
    if padded % block_k:
        raise ValueError(
            f"pad-K: K {k} padded to the granule {granule} is {padded}, not a multiple of the "
            f"weight's {block_k}-wide scale blocks: the scales cannot be re-blocked"
        )
    return padded


def pad_weight_k(weight: torch.Tensor, padded_k: int) -> torch.Tensor:
    """[N, K] -> [N, padded_k]: the weight, then zeros (a new contiguous tensor)."""
    if weight.ndim != 2 or weight.shape[1] > padded_k:
        raise ValueError(
            f"pad-K: weight {tuple(weight.shape)} cannot be padded to K = {padded_k}"
        )
    out = torch.zeros(
        (weight.shape[0], padded_k), dtype=weight.dtype, device=weight.device
    )
    out[:, : weight.shape[1]] = weight
    return out


def pad_block_scales_k(
    scale: torch.Tensor,
    weight_shape: tuple[int, int],
    block: tuple[int, int],
    padded_k: int,
) -> torch.Tensor:
    """Block scales ``[ceil(N / bn), ceil(K / bk)]`` of a weight ``[N, K]`` -> the scales of the
    padded weight ``[ceil(N / bn), padded_k / bk]``: the same scales, then a unit scale for each
    new K block. ``block`` is (bn, bk): (128, 128) or (32, 32) for block fp8, (1, 32) for MXFP8
    per-row e8m0 scales. Floating scales get 1.0, e8m0 scales (uint8 exponent bytes or
    float8_e8m0fnu) the code of 1.0. Packed or swizzled layouts are refused: pad before them.
    """
    n, k = weight_shape
    bn, bk = block
    want = (-(-n // bn), -(-k // bk))
    if scale.ndim != 2 or tuple(scale.shape) != want:
        raise ValueError(
            f"pad-K: a weight {weight_shape} with {bn}x{bk} scale blocks needs scales {want}, "
            f"found {tuple(scale.shape)} (pad before a backend packs or swizzles them)"
        )
    if padded_k % bk:
        raise ValueError(
            f"pad-K: padded K {padded_k} is not a multiple of the scale block {bk}"
        )
    if scale.dtype in (torch.float32, torch.bfloat16, torch.float16):
        raw, unit = scale, 1.0
    elif scale.dtype in (torch.uint8, torch.float8_e8m0fnu):
        raw, unit = scale.view(torch.uint8), E8M0_ONE
    else:
        raise ValueError(
            f"pad-K: scales of dtype {scale.dtype} are not a plain block layout (float or e8m0)"
        )
    out = torch.full(
        (want[0], padded_k // bk), unit, dtype=raw.dtype, device=scale.device
    )
    out[:, : want[1]] = raw
    return out.view(scale.dtype)


class KPad:
    """One linear's K padding: ``pad_weights`` once after load, ``pad_input`` per call.

    ``rows`` is the input buffer's capacity (the largest batch of a captured graph), allocated
    with ``dtype`` on ``device`` when the layer is built; a call with more rows (eager prefill)
    gets a fresh zero-tailed copy instead (``oversized_calls`` counts them).
    """

    def __init__(
        self,
        name: str,
        k: int,
        padded_k: int,
        rows: int,
        dtype: torch.dtype = torch.bfloat16,
        device: Optional[torch.device] = None,
    ):
        if padded_k <= k:
            raise ValueError(f"pad-K {name}: padded K {padded_k} must exceed K {k}")
        self.name, self.k, self.padded_k = name, k, padded_k
        # Allocated and zeroed here, at load: never inside a CUDA-graph capture.
        self.buffer = torch.zeros((rows, padded_k), dtype=dtype, device=device)
        self.oversized_calls = 0

    def pad_weights(
        self, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight [N, K], its block scales) -> (weight [N, padded_k], scales for it)."""
        if weight.ndim != 2 or weight.shape[1] != self.k:
            raise ValueError(
                f"pad-K {self.name}: expected a weight [N, {self.k}], found {tuple(weight.shape)}"
            )
        return (
            pad_weight_k(weight, self.padded_k),
            pad_block_scales_k(scale, tuple(weight.shape), block, self.padded_k),
        )

    def pad_input(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., padded_k], zeros in the tail. Pad *before* quantizing: an fp8
        input's scales would describe the unpadded groups."""
        if x.shape[-1] != self.k:
            raise ValueError(
                f"pad-K {self.name}: input K {x.shape[-1]} is not the weight's {self.k}"
            )
        if not x.dtype.is_floating_point or x.element_size() < 2:
            raise ValueError(
                f"pad-K {self.name}: input of dtype {x.dtype} is already quantized; pad the "
                "bf16/fp16/fp32 input before quantizing it"
            )
        if x.dtype != self.buffer.dtype or x.device != self.buffer.device:
            raise ValueError(
                f"pad-K {self.name}: input {x.dtype} on {x.device}, buffer "
                f"{self.buffer.dtype} on {self.buffer.device}"
            )
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.k)
        m = x2.shape[0]
        if m > self.buffer.shape[0]:
            self.oversized_calls += 1
            out = torch.zeros((m, self.padded_k), dtype=x.dtype, device=x.device)
            out[:, : self.k] = x2
            return out.view(*lead, self.padded_k)
        self.buffer[:m, : self.k].copy_(
            x2
        )  # the tail [:, k:] is never written: it stays zero
        return self.buffer[:m].view(*lead, self.padded_k)
