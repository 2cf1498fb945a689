"""DeepSeek-V4 wo_a from an fp8 twin (``--dsv4-wo-a-fp8-twin``): building the twins and routing.

DIAGNOSIS. V4.1 ships wo_a as e4m3 with one ue8m0 scale per 32x32 block; the engine dequantizes
it to bf16 at load, so every decode / verify / draft call streams 16.8 MB per layer and rank
(G = 2) where the checkpoint has 8.4 MB of information.
WHAT IT DOES. After the weights load, every bf16 ``wo_a`` of the target and of the DSpark draft
gets a twin (e4m3 values + one exponent per 32x32 block), kept only when dequantizing it gives the
bf16 weight back bit for bit. ``_apply_wo_a_bf16_matmul`` asks ``apply_wo_a_fp8_twin`` first:
decode / target-verify / draft calls with 2..8 rows (``small``) go, on Hopper, to the Gluon kernel
``sglang.kernels.ops.gemm.dsv4_wo_a_fp8_sm90`` (also for calls that want upstream's fused MXFP8
epilogue); elsewhere, and for 9..192 rows (``mid``), to the Triton kernel ``dsv4_wo_a_fp8``.
Prefill, one row, any other shape or layout, and layers without an exact twin stay stock.
LOSSLESS. Hopper small path: bitwise identical to upstream's ``wo_a_bf16_small_batch`` and to its
MXFP8 variant (same K splits, MMA slots and partial sums; measured on the H200 at M = 2..8).
Triton kernel: within 1 bf16 ulp of upstream on 0.018 % of outputs (H200, M = 2..8) and of
einsum's exact result for G = 2/4/8 and 2..192 rows; its MXFP8 calls stay stock. Deterministic.
MEASURED (H200, 43 layers, CUDA graph; benchmark/results/wo_a_fp8-NVIDIA_H200.json): G = 2,
2..8 rows 5.84-5.97 us against 8.08-8.13 us for ``wo_a_bf16_small_batch`` (1.37x) and 8.9 us
for einsum, which is what 0.5.23 runs on Hopper there; G = 8 15.1-15.3 us against einsum's
18.5-18.9 us (1.23x). The goal (1.15x of a 3.87 us pure read) is not reached: 1.51x. ``mid``
rows are still slower than einsum: keep the flag at ``small``.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

logger = logging.getLogger(__name__)

MODES = ("off", "small", "mid")
_USAGE = "accepted: off (stock wo_a), small (2..8 rows from the fp8 twin), mid (also 9..192 decode/verify rows)"

# weight data_ptr -> _Twin; filled after load, only when the flag is on
_TWINS: dict = {}
_MODE = {"mode": "off"}


def parse_wo_a_fp8_twin(value) -> str:
    """The flag's value, or ValueError listing the accepted forms."""
    v = str(value).strip().lower()
    if v not in MODES:
        raise ValueError(f"--dsv4-wo-a-fp8-twin={value!r}: {_USAGE}")
    return v


def validate_wo_a_fp8_twin(value) -> str:
    """Resolution-hook check (Engine(...) bypasses argparse)."""
    return parse_wo_a_fp8_twin(value)


class _Twin:
    """One layer's twin. On Hopper ``packed`` holds the small-path kernel's fragment-major words and
    ``weight8`` (the row-major e4m3 the portable Triton kernel reads) is kept only for ``mid``."""

    __slots__ = ("name", "weight8", "packed", "exp", "counters", "shape")

    def __init__(self, name, weight8, packed, exp, counters, shape):
        self.name, self.weight8, self.packed, self.exp = name, weight8, packed, exp
        self.counters, self.shape = counters, shape


def make_twin(w: torch.Tensor) -> Optional[tuple]:
    """bf16 ``[G, R, D]`` -> (e4m3 ``[G, R, D]``, biased exponent uint8 ``[G, R/32, D/32]``), or None
    when the twin does not reproduce ``w`` bit for bit. Exponents are kept in 2**-117..2**127 so the
    kernel's scale is a normal fp32 built from its bits."""
    g, r, d = w.shape
    wf = w.float().view(g, r // 32, 32, d // 32, 32)
    amax = wf.abs().amax(dim=(2, 4))
    mant, ex = torch.frexp(amax / 448.0)  # amax/448 = mant * 2**ex, mant in [0.5, 1)
    e = torch.where(mant == 0.5, ex - 1, ex)  # ceil(log2(amax / 448)), exactly
    e = torch.where(amax > 0, e, torch.zeros_like(e)).clamp(-117, 127)
    scale = torch.ldexp(torch.ones_like(amax), e)[:, :, None, :, None]
    q = (wf / scale).to(torch.float8_e4m3fn)
    back = (q.float() * scale).to(torch.bfloat16).view(g, r, d)
    if not torch.equal(back.view(torch.int16), w.view(torch.int16)):
        return None
    return q.view(g, r, d).contiguous(), (e + 127).to(torch.uint8).contiguous()


def _wo_a_view(module, name: str, n_groups: int, rank: int) -> Optional[torch.Tensor]:
    w = getattr(getattr(module, "wo_a", None), "weight", None)
    if w is None or w.dtype != torch.bfloat16:
        return None  # fp8 / gguf / other wo_a variants keep their own paths
    view = w.view(n_groups, rank, -1)
    g, r, d = view.shape
    if not view.is_contiguous() or r % 64 or d % 1024:
        raise RuntimeError(
            f"--dsv4-wo-a-fp8-twin: {name}.wo_a has shape {tuple(view.shape)}, strides "
            f"{view.stride()}; expected a contiguous [G, R, D] with R % 64 == 0 "
            "and D % 1024 == 0"
        )
    return view


def build_wo_a_fp8_twins(model: torch.nn.Module, mode, label: str) -> tuple[int, int]:
    """After load: a twin for every bf16 wo_a of ``model`` (target or DSpark draft). Logs one line."""
    from sglang.kernels.ops.gemm import dsv4_wo_a_fp8_sm90 as sm90
    from sglang.kernels.ops.gemm.dsv4_wo_a_fp8 import counters_for, wo_a_fp8_dequant

    mode = parse_wo_a_fp8_twin(mode)
    if mode == "off":
        return 0, 0
    _MODE["mode"] = mode
    made = kept = 0
    for name, mod in model.named_modules():
        if getattr(mod, "wo_a", None) is None or not hasattr(mod, "n_local_groups"):
            continue
        view = _wo_a_view(mod, name, mod.n_local_groups, mod.o_lora_rank)
        if view is None:
            continue
        twin = make_twin(view)
        if twin is not None and not torch.equal(
            wo_a_fp8_dequant(*twin).view(torch.int16), view.view(torch.int16)
        ):
            twin = None  # the kernel's own dequantisation must agree too
        if twin is None:
            _TWINS.pop(view.data_ptr(), None)  # a reload must not leave a stale twin behind
            kept += 1
            continue
        weight8, exp = twin
        packed = None
        if (
            sm90.available(view.device)
            and view.shape[2] == sm90.D
            and view.shape[1] % sm90.ROWS == 0
            and int(exp.max()) <= sm90.MAX_BIASED_EXP
        ):
            packed = sm90.pack_twin(weight8)
            if mode != "mid":
                weight8 = None  # the Hopper small path reads only the packed words
        counters = counters_for(weight8) if weight8 is not None else None  # the Triton kernel's
        _TWINS[view.data_ptr()] = _Twin(name, weight8, packed, exp, counters, tuple(view.shape))
        made += 1
    mb = sum(
        sum(a.numel() * a.element_size() for a in (t.weight8, t.packed, t.exp) if a is not None)
        for t in _TWINS.values()
    ) / 2**20
    hopper = sum(t.packed is not None for t in _TWINS.values())
    logger.info(
        "--dsv4-wo-a-fp8-twin=%s (%s): fp8 twins for %d wo_a weights (%d on the Hopper kernel), "
        "%d left on bf16 (twins hold %.0f MB in all)",
        mode, label, made, hopper, kept, mb,
    )
    return made, kept


def apply_wo_a_fp8_twin(
    o: torch.Tensor,
    wo_a: torch.Tensor,
    *,
    is_decode: bool,
    is_target_verify: bool,
    is_prefill: bool,
    fuse_mxfp8_quant: bool,
):
    """The twin's result for this call (bf16, or upstream's MXFP8 pair when the call asks for the
    fused epilogue), or None for the stock path. Hopper serves 2..8 rows with the Gluon kernel,
    bitwise identical to ``wo_a_bf16_small_batch`` and its MXFP8 variant; elsewhere the portable
    Triton kernel serves the bf16 calls (its partials are not bitwise, so MXFP8 calls stay stock)."""
    twin = _TWINS.get(wo_a.data_ptr())
    if twin is None or is_prefill or not (is_decode or is_target_verify):
        return None
    m = o.shape[0]
    small = 2 <= m <= 8
    if not (small or (_MODE["mode"] == "mid" and 9 <= m <= 192)):
        return None
    g, r, d = twin.shape
    if (
        tuple(wo_a.shape) != twin.shape
        or o.dtype != torch.bfloat16
        or o.ndim != 3
        or tuple(o.shape[1:]) != (g, d)
        or o.stride(2) != 1
        or o.stride(1) != d
        or o.stride(0) < g * d
    ):
        return None
    if small and twin.packed is not None:
        from sglang.kernels.ops.gemm import dsv4_wo_a_fp8_sm90 as sm90

        if not fuse_mxfp8_quant:
            return sm90.wo_a_fp8_small_sm90(o, twin.packed, twin.exp)
        if (g, r) != (2, 1024):
            return None  # upstream's MXFP8 epilogue exists for the TP4 shape only
        from sglang.kernels.ops.gemm.dsv4_wo_a import _quantize_partial
        from sglang.srt.layers.quantization.mxfp8_input import Mxfp8SwizzledInput

        partials = sm90.wo_a_fp8_small_sm90(o, twin.packed, twin.exp, partials=True)
        return Mxfp8SwizzledInput(*_quantize_partial(partials))
    if fuse_mxfp8_quant or twin.weight8 is None:
        return None
    from sglang.kernels.ops.gemm import dsv4_wo_a_fp8 as k

    return k.wo_a_fp8_matmul(o, twin.weight8, twin.exp, twin.counters)
