"""DeepSeek-V4 wo_a from an fp8 twin (``--dsv4-wo-a-fp8-twin``): building the twins, routing, drop.

Every bf16 ``wo_a`` (target and DSpark draft) gets a twin (e4m3 + one exponent per 32x32 block),
kept only when it dequantizes to the weight bit for bit; ``_apply_wo_a_bf16_matmul`` calls the
layer's ``wo_a_twin`` first. Levels, kernels and refusals: docs/wo-a-fp8-twin.md.

DROP'S INVARIANTS. The released parameter holds a NaN stand-in (``_stand_in``), so a reader the
dispatch did not catch cannot produce plausible numbers. Every call the twin does not serve
multiplies ``stock_weight``, rebuilt into a fresh buffer per call (a shared scratch would race
between the target's and the draft's streams). Layers whose wo_a another reader takes (listed in
``_BYPASSES``) refuse to boot under drop.
"""

from __future__ import annotations

import argparse
import logging
from typing import Optional

import torch

logger = logging.getLogger(__name__)

MODES = ("off", "small", "mid", "drop")
_USAGE = (
    "accepted: off (stock wo_a), small (2..8 decode/verify rows from the fp8 twin), mid (also more "
    "rows, where the twin kernel is faster), drop (every call reads the twin; the bf16 weight is released)"
)
# Hopper, mid: rows up to which the twin (small kernel, then the wgmma kernel) was measured >= 1.1x
# faster than stock (einsum) on the H200, per group count (benchmark/results/archive/wo_a_fp8-NVIDIA_H200.json);
# other G: 16. drop serves every decode/verify row count up to MID_MAX_ROWS from the twin.
MID_FASTER_MAX = {2: 32, 4: 32, 8: 32}
MID_MAX_ROWS = 192


# Hopper, mid and drop: rows up to which the small kernel (x in the ring, up to 4 n8 tiles) beats
# the wgmma one, per group count (benchmark/results/archive/wo_a_fp8_rows_probe-NVIDIA_H200.json); other G: 8.
SMALL_KERNEL_MAX = {2: 32, 4: 32, 8: 16}


def mid_rows_faster(g: int) -> int:
    return MID_FASTER_MAX.get(g, 16)


def small_kernel_rows(g: int) -> int:
    return SMALL_KERNEL_MAX.get(g, 8)


# the targets whose wo_a the twin serves (the DSpark draft of one follows its target)
TWIN_TARGETS = ("DeepseekV4ForCausalLM",)


def parse_wo_a_fp8_twin(value) -> str:
    """type_parser of the flag: its value, exact, as argparse's choices."""
    if value not in MODES:
        raise argparse.ArgumentTypeError(f"--dsv4-wo-a-fp8-twin={value!r}: {_USAGE}")
    return value


# (server argument, its flag, why the twin cannot serve with it on) checked at startup; the
# second set only under drop
_REFUSED_WITH = (
    (
        "enable_deterministic_inference",
        "--enable-deterministic-inference",
        "the twin picks its kernel (and split) by row count, so a request's bits would depend on its batch",
    ),
    (
        "enable_torch_compile",
        "--enable-torch-compile",
        "a traced wo_a.data_ptr() is not the address the twin serves, so compiled decode would skip "
        "it (under drop: multiply the released weight's stand-in)",
    ),
)
_DROP_REFUSED_WITH = (
    (
        "enable_cp_decode_attn_tp",
        "--enable-cp-decode-attn-tp",
        "decode narrows wo_a to the rank's groups, a slice of the released weight",
    ),
    (
        "remote_instance_weight_loader_start_seed_via_transfer_engine",
        "--remote-instance-weight-loader-start-seed-via-transfer-engine",
        "peers would read the released weight's memory as wo_a",
    ),
)


def validate_wo_a_fp8_twin(server_args) -> str:
    """Resolution-hook check (Engine(...) bypasses argparse): the refusals of docs/wo-a-fp8-twin.md."""
    from sglang.srt.arg_groups.model_override_base import (
        model_config_of,
        resolving_view,
    )

    cfg = resolving_view(server_args)
    mode = parse_wo_a_fp8_twin(cfg.dsv4_wo_a_fp8_twin)
    if mode == "off":
        return mode
    model_arch = model_config_of(server_args).hf_config.architectures[0]
    if model_arch not in TWIN_TARGETS:
        raise ValueError(
            f"--dsv4-wo-a-fp8-twin={mode}: the target is {model_arch}; only {', '.join(TWIN_TARGETS)} "
            "has the wo_a projection the twin replaces, so it would do nothing; use --dsv4-wo-a-fp8-twin off"
        )
    if torch.version.hip is not None:
        raise ValueError(
            f"--dsv4-wo-a-fp8-twin={mode}: this torch is a ROCm build ({torch.version.hip}); the "
            "twin's kernels are built and measured for NVIDIA GPUs only; use --dsv4-wo-a-fp8-twin off"
        )
    for attr, flag, why in _REFUSED_WITH + (
        _DROP_REFUSED_WITH if mode == "drop" else ()
    ):
        if getattr(cfg, attr):
            raise ValueError(
                f"--dsv4-wo-a-fp8-twin={mode} cannot be used with {flag}: {why}"
            )
    if mode == "drop" and not _weight_export_honours_refusals():
        raise ValueError(
            "--dsv4-wo-a-fp8-twin=drop: this sglang's weight export (remote-instance send, "
            "save_sharded_model) does not consult a layer's _weight_export_error, so it would "
            "export the released weight's stand-in; use --dsv4-wo-a-fp8-twin mid"
        )
    return mode


def _weight_export_honours_refusals() -> bool:
    """Whether upstream's weight export refuses a layer that sets ``_weight_export_error``
    (drop relies on it: a released layer must not be exported)."""
    from sglang.srt.model_executor.model_runner_components.weight_exporter import (
        WeightExporter,
    )

    return hasattr(WeightExporter, "_weight_export_unsupported_reason")


class WoAFp8Twin:
    """One layer's twin (``wo_a_twin``): Hopper's ``packed`` words or portable ``weight8``. A call
    on any tensor but ``weight_ptr``'s (after drop, the stand-in's) is stock."""

    __slots__ = (
        "name",
        "mode",
        "weight_ptr",
        "weight8",
        "packed",
        "exp",
        "counters",
        "shape",
        "dropped",
    )

    def __init__(
        self,
        name,
        mode,
        weight_ptr,
        weight8,
        packed,
        exp,
        counters,
        shape,
        dropped=False,
    ):
        self.name, self.mode, self.weight_ptr = name, mode, weight_ptr
        self.weight8, self.packed, self.exp = weight8, packed, exp
        self.counters, self.shape, self.dropped = counters, shape, dropped

    def __call__(
        self, o, wo_a, is_decode, is_target_verify, is_prefill, fuse_mxfp8_quant
    ):
        """This call's result from the twin, or None for the stock path (``apply_wo_a_fp8_twin``)."""
        return apply_wo_a_fp8_twin(
            self,
            o,
            wo_a,
            is_decode=is_decode,
            is_target_verify=is_target_verify,
            is_prefill=is_prefill,
            fuse_mxfp8_quant=fuse_mxfp8_quant,
        )

    def stock_weight(self, wo_a: torch.Tensor) -> torch.Tensor:
        """The weight the stock path multiplies (``stock_weight``)."""
        return stock_weight(self, wo_a)

    def dequant(self) -> torch.Tensor:
        """The bf16 weight [G, R, D] in a fresh buffer (one per call: the target and draft streams
        must not share a scratch buffer)."""
        from sglang.kernels.ops.gemm import dsv4_wo_a_fp8 as k

        if self.packed is not None:
            return k.wo_a_fp8_dequant_packed(self.packed, self.exp)
        return k.wo_a_fp8_dequant(self.weight8, self.exp)

    def nbytes(self) -> int:
        return sum(
            a.numel() * a.element_size()
            for a in (self.weight8, self.packed, self.exp, self.counters)
            if a is not None
        )


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


# layer attributes that send wo_a to a reader other than _apply_wo_a_bf16_matmul (attribute,
# value that does, what reads the weight): drop cannot release the weight under any of them
_BYPASSES = (
    ("use_fused_wo_a", True, "the fused rope + wo_a kernel (SGLANG_DSV41_FUSED_WO_A)"),
    ("use_mega_attention", True, "the mega attention backend's quantize_wo_a"),
    ("use_npu_arch35_mxfp8_wo_a", True, "the NPU MXFP8 wo_a"),
    (
        "_use_fast_kernel",
        False,
        "the DSpark draft's einsum (SGLANG_DSPARK_FAST_KERNEL=0)",
    ),
)


def _stand_in(w: torch.Tensor) -> torch.Tensor:
    """A dropped weight's shape over one NaN: its own address (the dispatch finds the twin), zero
    strides (no fast path takes it), NaN (no missed reader gives plausible numbers)."""
    one = torch.full((1,), float("nan"), dtype=w.dtype, device=w.device)
    return one.as_strided(tuple(w.shape), (0,) * w.ndim)


def _drop(entries: list, label: str) -> tuple[int, int]:
    """Free the bf16 weight of every twin that gives it back bit for bit (docs/wo-a-fp8-twin.md)."""
    released = failed = 0
    for name, mod, view, twin in entries:
        old = mod.wo_a.weight.data
        storage = old.untyped_storage()
        why = None
        if storage.nbytes() != old.numel() * old.element_size():
            why = f"its storage ({storage.nbytes()} bytes) holds more than the weight"
        elif not torch.equal(twin.dequant().view(torch.int16), view.view(torch.int16)):
            why = "the twin's dequantisation is not bit-identical to the weight"
        if why is not None:
            logger.warning(
                "--dsv4-wo-a-fp8-twin=drop (%s): %s.wo_a: %s; keeping the bf16 weight",
                label,
                name,
                why,
            )
            failed += 1
            continue
        mod.wo_a.weight.data = _stand_in(old)
        storage.resize_(0)
        twin.dropped = True
        mod._weight_export_error = (
            f"{name}.wo_a was released by --dsv4-wo-a-fp8-twin=drop (it lives as its fp8 twin only); "
            "restart with --dsv4-wo-a-fp8-twin=mid to export or save weights"
        )
        twin.weight_ptr = mod.wo_a.weight.data_ptr()
        released += view.numel() * view.element_size()
    if released and torch.cuda.is_available():
        torch.cuda.empty_cache()
    return released, failed


def build_wo_a_fp8_twins(model: torch.nn.Module, mode, label: str) -> tuple[int, int]:
    """After load: a twin for every bf16 wo_a of ``model``. A later call changes no layer: CUDA
    graphs captured since hold what each layer had (docs/wo-a-fp8-twin.md)."""
    mode = parse_wo_a_fp8_twin(mode)
    if mode == "off":
        return 0, 0  # upstream's path: no kernel of ours is imported
    from sglang.kernels.ops.gemm import dsv4_wo_a_fp8_sm90 as sm90
    from sglang.kernels.ops.gemm.dsv4_wo_a_fp8 import counters_for, wo_a_fp8_dequant

    if mode == "drop":
        from sglang.srt.models import deepseek_v4

        if getattr(deepseek_v4, "_NPU_BF16_WO_A_GEMM", False):
            raise RuntimeError(
                "--dsv4-wo-a-fp8-twin=drop: SGLANG_OPT_NPU_BF16_WO_A_GEMM sends decode wo_a to "
                "F.linear on the weight, which drop releases; use --dsv4-wo-a-fp8-twin=mid"
            )
    first = not getattr(model, "_wo_a_fp8_twins_built", False)
    made = kept = had = late = 0
    entries, layers = [], []
    for name, mod in model.named_modules():
        if getattr(mod, "wo_a", None) is None or not hasattr(mod, "n_local_groups"):
            continue
        if getattr(mod, "wo_a_twin", None) is not None:
            had += 1
            continue
        view = _wo_a_view(mod, name, mod.n_local_groups, mod.o_lora_rank)
        if view is None:
            continue
        if not first:
            late += 1
            continue
        cap = torch.cuda.get_device_capability(view.device) if view.is_cuda else None
        if cap is not None and cap < (8, 9):
            raise RuntimeError(
                f"--dsv4-wo-a-fp8-twin={mode}: {name}.wo_a is on SM{cap[0]}{cap[1]}; the twin's "
                "e4m3 kernels need SM89 or newer; use --dsv4-wo-a-fp8-twin off"
            )
        layers.append((name, mod, view))
    if mode == "drop":  # refused before any twin is built
        for name, mod, _ in layers:
            for attr, bad, what in _BYPASSES:
                if getattr(mod, attr, not bad) == bad:
                    raise RuntimeError(
                        f"--dsv4-wo-a-fp8-twin=drop: {name}.wo_a is read by {what} ({attr}={bad}), "
                        "which would see the released weight; use --dsv4-wo-a-fp8-twin=mid"
                    )
    for name, mod, view in layers:
        twin = make_twin(view)
        if twin is not None and not torch.equal(
            wo_a_fp8_dequant(*twin).view(torch.int16), view.view(torch.int16)
        ):
            twin = None  # the kernel's own dequantisation must agree too
        if twin is None:
            kept += 1
            continue
        weight8, exp = twin
        twin = None  # a frame kept past return (see _drop) must not keep the row-major copy
        packed = None
        if (
            sm90.available(view.device)
            and view.shape[2] == sm90.D
            and view.shape[1] % 64 == 0
            and int(exp.max()) <= sm90.MAX_BIASED_EXP
        ):
            # both Hopper kernels read the packed words; the row-major copy is not kept
            packed, weight8 = sm90.pack_twin(weight8), None
            counters = sm90.mid_counters(view.shape[0], view.shape[1], view.device)
        else:
            counters = counters_for(weight8)
        t = WoAFp8Twin(
            name,
            mode,
            view.data_ptr(),
            weight8,
            packed,
            exp,
            counters,
            tuple(view.shape),
        )
        mod.wo_a_twin = t
        if getattr(mod, "_derived_weight_cache_error", None) is None:
            mod._derived_weight_cache_error = (
                f"Online weight updates are not supported with --dsv4-wo-a-fp8-twin={mode}: "
                f"{name}.wo_a is served from an fp8 twin built at load, which captured CUDA graphs "
                "read. Restart with --dsv4-wo-a-fp8-twin off to update weights online."
            )
        entries.append((name, mod, view, t))
        made += 1
    released, failed = _drop(entries, label) if mode == "drop" else (0, 0)
    model._wo_a_fp8_twins_built = True
    twin_mb = sum(t.nbytes() for *_, t in entries) / 2**20
    hopper = sum(t.packed is not None for *_, t in entries)
    logger.info(
        "--dsv4-wo-a-fp8-twin=%s (%s): fp8 twins for %d wo_a weights (%d on the Hopper kernels), "
        "%d left on bf16%s%s; twins hold %.1f MiB%s",
        mode,
        label,
        made,
        hopper,
        kept,
        f", {had} kept from before" if had else "",
        f", {late} without one since the first load stay stock" if late else "",
        twin_mb,
        (
            f"; released {released / 2**20:.1f} MiB of bf16 weights ({made - failed} layers, "
            f"{failed} kept theirs)"
            if mode == "drop"
            else ""
        ),
    )
    return made, kept


def _token_major(o: torch.Tensor, shape: tuple) -> bool:
    g, _, d = shape
    return (
        o.dtype == torch.bfloat16
        and o.ndim == 3
        and tuple(o.shape[1:]) == (g, d)
        and o.stride(2) == 1
        and o.stride(1) == d
        and o.stride(0) >= g * d
    )


def apply_wo_a_fp8_twin(
    twin: WoAFp8Twin,
    o: torch.Tensor,
    wo_a: torch.Tensor,
    *,
    is_decode: bool,
    is_target_verify: bool,
    is_prefill: bool,
    fuse_mxfp8_quant: bool,
):
    """The twin's result for this call (bf16, or upstream's MXFP8 pair), or None for stock."""
    if (
        wo_a.data_ptr() != twin.weight_ptr
        or tuple(wo_a.shape) != twin.shape
        or is_prefill
        or not (is_decode or is_target_verify)
    ):
        return None
    if not _token_major(o, twin.shape):
        return None
    mode, m = twin.mode, o.shape[0]
    g, r, _ = twin.shape
    if twin.packed is not None:
        from sglang.kernels.ops.gemm import dsv4_wo_a_fp8_sm90 as sm90

        if o.stride(0) % 16 or o.data_ptr() % 16:
            return None  # x's 16-byte copies (cp.async, TMA) need 16-byte aligned rows to compile
        if 2 <= m <= 8 or (m == 1 and twin.dropped):
            if not fuse_mxfp8_quant or m == 1:  # one row: stock's gemv returns bf16 too
                return sm90.wo_a_fp8_small_sm90(o, twin.packed, twin.exp)
            if (g, r) != (2, 1024):
                return None  # upstream's MXFP8 epilogue exists for the TP4 shape only
            from sglang.kernels.ops.gemm.dsv4_wo_a import _quantize_partial
            from sglang.srt.layers.quantization.mxfp8_input import Mxfp8SwizzledInput

            partials = sm90.wo_a_fp8_small_sm90(o, twin.packed, twin.exp, partials=True)
            return Mxfp8SwizzledInput(*_quantize_partial(partials))
        top = (
            MID_MAX_ROWS
            if twin.dropped
            else mid_rows_faster(g) if mode in ("mid", "drop") else 0
        )
        if 9 <= m <= top and not fuse_mxfp8_quant:
            if m <= small_kernel_rows(g):
                return sm90.wo_a_fp8_small_sm90(o, twin.packed, twin.exp)
            return sm90.wo_a_fp8_mid_sm90(o, twin.packed, twin.exp, twin.counters)
        return None
    if not (2 <= m <= 8 or (mode in ("mid", "drop") and 9 <= m <= MID_MAX_ROWS)):
        return None
    if fuse_mxfp8_quant or twin.weight8 is None:
        return None
    from sglang.kernels.ops.gemm import dsv4_wo_a_fp8 as k

    return k.wo_a_fp8_matmul(o, twin.weight8, twin.exp, twin.counters)


def stock_weight(twin: WoAFp8Twin, wo_a: torch.Tensor) -> torch.Tensor:
    """The weight the stock path multiplies: ``wo_a``, or a dropped one rebuilt into a fresh buffer."""
    if not twin.dropped or wo_a.data_ptr() != twin.weight_ptr:
        return wo_a
    if tuple(wo_a.shape) != twin.shape:
        raise RuntimeError(
            f"--dsv4-wo-a-fp8-twin=drop: {twin.name}.wo_a read as {tuple(wo_a.shape)}, a view of the "
            f"released {twin.shape} weight that its twin cannot rebuild"
        )
    return twin.dequant()
