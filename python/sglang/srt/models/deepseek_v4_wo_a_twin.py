"""DeepSeek-V4 wo_a from an fp8 twin (``--dsv4-wo-a-fp8-twin``): building the twins and routing.

DIAGNOSIS. V4.1 ships wo_a as e4m3 with one ue8m0 scale per 32x32 block; the engine dequantizes
it to bf16 at load, so every decode / verify / draft call streams 16.8 MB per layer and rank
(G = 2) where the checkpoint has 8.4 MB of information.
WHAT IT DOES. After the weights load, every bf16 ``wo_a`` of the target and of the DSpark draft
gets a twin (e4m3 values + one exponent per 32x32 block), kept only when dequantizing it gives the
bf16 weight back bit for bit. ``_apply_wo_a_bf16_matmul`` asks ``apply_wo_a_fp8_twin`` first:
decode / target-verify / draft calls with 2..8 rows (``small``), also 9..192 rows (``mid``), go to
``sglang.kernels.ops.gemm.dsv4_wo_a_fp8``; prefill, one row, any other shape or layout, and
layers without an exact twin stay on the stock path.
LOSSLESS. Same operand values (the twin is exact), fp32 accumulation: the bf16 result is within
1 bf16 ulp of upstream's ``wo_a_bf16_small_batch`` on 0.018 % of outputs (H200, M = 2..8) and of
einsum's exact result for G = 2/4/8 and 2..192 rows; deterministic (fixed split order). Calls
that want the fused MXFP8 epilogue stay stock (partials not bit-identical, see the test).
MEASURED (H200, 43 layers, CUDA graph; benchmark/results/wo_a_fp8-NVIDIA_H200.json): NOT faster
yet. G = 2, 2..8 rows: twin 9.4-9.6 us vs stock 7.9-8.1 us (0.84x) vs 3.84 us for a pure read
of the twin's bytes; G = 8: 21.3-22.3 us vs einsum 18.3-18.6 us; mid rows slower than einsum.
Keep the flag off until the kernel reaches its read floor.
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
    __slots__ = ("name", "weight8", "exp", "counters", "shape")

    def __init__(self, name, weight8, exp, counters, shape):
        self.name, self.weight8, self.exp, self.counters, self.shape = name, weight8, exp, counters, shape


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
        _TWINS[view.data_ptr()] = _Twin(name, twin[0], twin[1], counters_for(twin[0]), tuple(view.shape))
        made += 1
    mb = sum(t.weight8.numel() + t.exp.numel() for t in _TWINS.values()) / 2**20
    logger.info(
        "--dsv4-wo-a-fp8-twin=%s (%s): fp8 twins for %d wo_a weights, %d left on bf16 (twins hold %.0f MB in all)",
        mode, label, made, kept, mb,
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
    """The twin's bf16 result for this call, or None for the stock path. Calls that ask for the
    fused MXFP8 epilogue stay stock: the twin kernel's split partials were measured not bit-identical
    to ``_wo_a_partial``'s on the H200 (last-bit differences), so that path is not proven lossless."""
    twin = _TWINS.get(wo_a.data_ptr())
    if twin is None or fuse_mxfp8_quant or is_prefill or not (is_decode or is_target_verify):
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
    from sglang.kernels.ops.gemm import dsv4_wo_a_fp8 as k

    return k.wo_a_fp8_matmul(o, twin.weight8, twin.exp, twin.counters)
