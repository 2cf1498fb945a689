"""Upstream sglang 0.5.23's Hopper MXFP4 MoE paths (Humming, Marlin), standalone.

``humming_moe`` / ``marlin_moe`` take the experts as the checkpoint ships them (w13
[E, 2I, H/2] uint8 e2m1, element 2j in the low nibble, gate rows then up rows; ue8m0 scale
[E, 2I, H/32] uint8; w2 [E, H, I/2]; scale [E, H, I/32]), prepare them outside any graph
with upstream's own preparation functions and return an ``UpstreamMoE``: ``(x bf16 [T, H],
topk_ids int32 [T, k], topk_weights fp32 [T, k]) -> bf16 [T, H]``, upstream's runner
forward, no host sync (kernels JIT-compile on the first call: make it before capture).
Nothing calls sgl_kernel; where upstream does, the substitute is named. Layout: neither
method sets load_up_proj_weight_first, so upstream's w13 is [gate; up] like ours, an int8
view of the same bytes with e8m0 scales (Humming's loader passes fp32 2^(e-127): the same
byte for e >= 1), so ours go in as views, unconverted. topk_weights are final: no routed
scaling factor is applied (Marlin folds it into them upstream, Humming multiplies by it in
moe_fused_mul_sum). Requirements (the GPU image has numpy, jinja2, regex, cuda-bindings,
nvidia-ml-py, filelock, tqdm, tabulate, nvrtc): Humming needs humming-kernels 0.1.12 (.whl/
humming_kernels-0.1.12-py3-none-manylinux_2_28_x86_64.whl, 322,656 B); Marlin and Humming's
align="jit" need nvcc and apache-tvm-ffi 0.1.11 (apache_tvm_ffi-0.1.11-cp312-abi3-manylinux_
2_24_x86_64.manylinux_2_28_x86_64.whl, 2,697,683 B, in build/gpu-bundle/wheels). What is
missing raises ``UpstreamUnavailable``, whose message is the reason.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace
from typing import Callable

import torch

T = torch.Tensor
Forward = Callable[[T, T, T], T]
E8M0 = torch.float8_e8m0fnu
SUBS = ("w13", "w2")
OPS = "sglang.kernels.ops.moe."


class UpstreamUnavailable(RuntimeError):
    """An upstream path cannot run here: the message says why."""


@dataclass
class UpstreamMoE:
    name: str
    forward: Forward
    layer: torch.nn.Module  # holds the prepared tensors
    shapes: dict[str, tuple[int, ...]]  # prepared tensors; the (N, K) run and padded
    weight_bytes_per_expert: int  # prepared weights + scales of one expert
    checkpoint_bytes_per_expert: int  # the same, as the checkpoint ships them
    notes: str = ""

    def __call__(self, x: T, topk_ids: T, topk_weights: T) -> T:
        return self.forward(x, topk_ids, topk_weights)


def _import(name: str, why: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001  a missing piece is a reason, not a crash
        raise UpstreamUnavailable(f"{why}: import {name} failed: {exc!r}") from exc


def _layer(ts: tuple[T, ...], scale: str) -> tuple[torch.nn.Module, int, int, int]:
    """The FusedMoE attributes upstream's preparations read, holding views of ``ts``."""
    w13 = ts[0]
    if not torch.cuda.is_available() or not w13.is_cuda:
        raise UpstreamUnavailable("the experts must be on a CUDA device")
    e, i, h = w13.shape[0], w13.shape[1] // 2, w13.shape[2] * 2
    want = ((e, 2 * i, h // 2), (e, 2 * i, h // 32), (e, h, i // 2), (e, h, i // 32))
    names = ("w13_weight", f"w13_{scale}", "w2_weight", f"w2_{scale}")
    layer = torch.nn.Module()
    for name, t, shape, dtype in zip(names, ts, want, (torch.int8, E8M0) * 2):
        if tuple(t.shape) != shape or t.dtype not in (torch.uint8, torch.int8):
            got = (t.dtype, tuple(t.shape))
            raise UpstreamUnavailable(f"{name} is {got}, want uint8 {shape}")
        setattr(layer, name, torch.nn.Parameter(t.view(dtype), requires_grad=False))
    layer.num_local_experts, layer.intermediate_size_per_partition = e, i
    layer.hidden_size, layer.params_dtype, layer.with_bias = h, torch.bfloat16, False
    layer.layer_name = "model.layers.0.mlp.experts"
    return layer, e, i, h


def _sizes(layer: torch.nn.Module, ts: tuple[T, ...]) -> tuple[dict, int, int]:
    """The prepared tensors' shapes, their bytes per expert, the checkpoint's bytes."""
    ps = {n: t for n, t in layer.named_parameters() if n.startswith(("w13_", "w2_"))}
    nbytes = sum(t.numel() * t.element_size() for t in ps.values()) // ts[0].shape[0]
    ckpt = sum(t[0].numel() * t.element_size() for t in ts)
    return {n: tuple(t.shape) for n, t in ps.items()}, nbytes, ckpt


def _buffers(ids: T, block: int, e: int, words: int) -> tuple[T, ...]:
    """moe_align_block_size's outputs, sized as upstream sizes them (E + 1 buckets)."""
    n = ids.numel()
    cap = n * block if n < e + 1 else n + (e + 1) * (block - 1)
    cap = (cap + 3) // 4 * 4
    sizes = (cap, -(-cap // block), words)
    return tuple(torch.empty(s, dtype=torch.int32, device=ids.device) for s in sizes)


def align_jit(ids: T, block: int, e: int, prefix_count: bool = False) -> tuple[T, ...]:
    """Upstream's in-tree JIT of the sgl_kernel moe_align humming.py calls: the same
    layout (that call's ignore_invalid_expert changes nothing without -1 ids)."""
    from sglang.kernels.ops.moe.moe_align import moe_align_block_size

    s, x, n = _buffers(ids, block, e, 2 if prefix_count else 1)
    cumsum = torch.empty(e + 2, dtype=torch.int32, device=ids.device)
    kw = {"write_inactive_prefix_count": prefix_count}
    moe_align_block_size(ids, e + 1, block, s, x, n, cumsum, True, **kw)
    return s, x, n


def align_torch(ids: T, block: int, e: int) -> tuple[T, ...]:
    """That layout in torch ops, no host sync: each expert's pairs ascending (the CUDA
    kernel's order within an expert is arbitrary), padded to ``block`` with ``numel``;
    each block's expert (-1 past the total, where upstream leaves it unset); the total.
    """
    flat = ids.flatten().long()
    sorted_ids, expert_ids, total = _buffers(ids, block, e, 1)
    counts = torch.zeros(e, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block - 1) // block * block
    ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    ex = flat[order]
    rank = (
        torch.arange(flat.numel(), device=flat.device) - (counts.cumsum(0) - counts)[ex]
    )
    dest = ends[ex] - padded[ex] + rank  # the pair's slot: its expert's start + rank
    sorted_ids.fill_(flat.numel()).scatter_(0, dest, order.int())
    starts = torch.arange(expert_ids.numel(), device=flat.device) * block
    found = torch.searchsorted(ends, starts, right=True)
    expert_ids.copy_(torch.where(starts < ends[-1], found, -1))
    total.copy_(ends[-1:])
    return sorted_ids, expert_ids, total


def humming_moe(
    w13: T, s13: T, w2: T, s2: T, swiglu_limit: float | None,
    align: str = "jit", used_configs_only: bool = False,
) -> UpstreamMoE:  # fmt: skip
    """``--moe-runner-backend humming``: prepare_humming_moe_layer (N padded to 256, K
    to 128), then moe_runner/humming.py's indexed path: align, w13, act_and_mul_triton,
    w2, moe_fused_mul_sum. ``align``: "jit" or "torch" (upstream: sgl_kernel's AOT).
    ``used_configs_only``: give the kernel only the tuning row it picks (lo < rows <=
    hi), not all ~22 it JIT-compiles at once: the same kernel, less compiling."""
    experts = (w13, s13, w2, s2)
    layer, e, i, h = _layer(experts, "weight_scale")
    if align not in ("jit", "torch"):
        raise ValueError(f"align={align!r}: 'jit' or 'torch'")
    why = "Humming (humming-kernels 0.1.12)"
    gemm_type = _import("humming.config", why).GemmType.INDEXED
    hm = _import("humming.layer", why).HummingMethod
    utils = _import("sglang.srt.layers.quantization.humming_utils", why)
    act = _import(OPS + "fused_moe_triton_kernels", why).act_and_mul_triton
    mul_sum = _import(OPS + "moe_fused_mul_sum", why).moe_fused_mul_sum
    if align == "jit":
        _import("tvm_ffi", f"{why} with align='jit' (apache-tvm-ffi 0.1.11)")
        _import(OPS + "moe_align", why)
    aligner = align_jit if align == "jit" else align_torch
    try:
        utils.prepare_humming_moe_layer(layer, {"quant_method": "mxfp4"})
        get = hm.get_default_tuning_configs  # as HummingRunnerCore, use_f16_accum off
        tuning = {n: get(layer, gemm_type=gemm_type, sublayer_name=n) for n in SUBS}
    except Exception as exc:  # noqa: BLE001
        raise UpstreamUnavailable(f"{why}: preparing failed: {exc!r}") from exc
    text = (
        json.dumps
    )  # not a result: humming takes its tuning and compute configs as JSON text
    every = {n: text(t) for n, t in tuning.items()}
    single = {n: [text([row]) for row in t] for n, t in tuning.items()}
    compute = text({"use_f16_accum": False, "gemm_type": gemm_type.value})
    limit = None if swiglu_limit is None else float(swiglu_limit)

    def forward(x: T, ids: T, weights: T) -> T:
        t, k = ids.shape
        m = ids.numel()  # upstream's estimate_local_valid_shape_m
        row = {n: [lo < m <= hi for lo, hi, _ in tuning[n]].index(True) for n in SUBS}
        cfg = {n: single[n][row[n]] if used_configs_only else every[n] for n in SUBS}
        block = tuning["w13"][row["w13"]][2]["block_shape"][0]
        sorted_ids, expert_ids, npad = aligner(ids, block, e)
        bf16 = dict(dtype=torch.bfloat16, device=x.device)
        gate_up, act_out = torch.empty(m, 2 * i, **bf16), torch.empty(m, i, **bf16)
        down, out = torch.empty(m, h, **bf16), torch.empty(t, h, **bf16)
        kw = dict(layer=layer, sorted_ids=sorted_ids, expert_ids=expert_ids)
        kw |= dict(num_tokens_padded=npad, compute_config=compute, valid_shape_m=m)
        steps = (("w13", x.view(-1, h), gate_up, k), ("w2", act_out, down, 1))
        for n, a, c, top_k in steps:
            if n == "w2":
                act(gate_up, act_out, {}, activation="silu", swiglu_limit=limit)
            a, a_s = hm.may_quant_input(layer=layer, inputs=a, sublayer_name=n)
            step = dict(sublayer_name=n, top_k=top_k, tuning_config=cfg[n])
            hm.forward_layer(inputs=a, input_scale=a_s, outputs=c, **step, **kw)
        mul_sum(down.view(t, k, h), weights, out, ids, routed_scaling_factor=None)
        return out

    shapes, nbytes, ckpt = _sizes(layer, experts)
    for n, meta in layer.humming_metas.items():  # (N, K) as run, then the padding
        shapes[n + "_nk"] = (meta.shape_n, meta.shape_k)
        shapes[n + "_pad_nk"] = (meta.pad_shape_n, meta.pad_shape_k)
    notes = f"align={align}, used_configs_only={used_configs_only}"
    notes += "" if limit is not None else ", no swiglu_limit: Triton SiLU"
    return UpstreamMoE("upstream_humming", forward, layer, shapes, nbytes, ckpt, notes)


# sgl_kernel scalar_types.float4_e2m1f, of which the kernel reads only the id: exponent
# 2 | mantissa 1 << 8 | signed << 16 | finite_values_only << 49 (= host::kFE2M1f.id()).
FE2M1F = SimpleNamespace(id=2 | 1 << 8 | 1 << 16 | 1 << 49)


def marlin_moe(w13: T, s13: T, w2: T, s2: T, swiglu_limit: float | None) -> UpstreamMoE:
    """``--moe-runner-backend marlin``: prepare_moe_mxfp4_layer_for_marlin (I padded to
    64; gptq_marlin_repack per expert, a tvm-ffi JIT in 0.5.23; marlin_permute_scales),
    then moe_runner/marlin.py and fused_marlin_moe's MXFP4 path."""
    experts = (w13, s13, w2, s2)
    layer, e, i, h = _layer(experts, "weight_scale_inv")
    cap = torch.cuda.get_device_capability(w13.device)
    if cap != (9, 0):  # upstream also serves SM120 (with a torch activation)
        raise UpstreamUnavailable(
            f"this replicates upstream's SM90 Marlin path, not {cap}"
        )
    if h % 64 or i % 32:  # check_moe_marlin_supports_layer(allow_tile_padding=True)
        raise UpstreamUnavailable(f"Marlin needs H % 64 == 0 == I % 32 ({h}, {i})")
    why = "Marlin (upstream's in-tree tvm-ffi JIT kernels)"
    _import("tvm_ffi", f"{why} need apache-tvm-ffi 0.1.11")
    prep = _import("sglang.srt.layers.quantization.marlin_utils_fp4", why)
    mgemm = _import(OPS + "moe_wna16_marlin", why).moe_wna16_marlin_gemm
    acts = _import("sglang.kernels.ops.activation.activation", why)
    topk_sum = _import(OPS + "moe_topk_sum", why).moe_topk_sum
    single = _import(OPS + "moe_align_single_token", why).moe_align_single_token
    small = _import(OPS + "moe_align_small_numel", why)
    _import(OPS + "moe_align", why)
    try:
        prep.prepare_moe_mxfp4_layer_for_marlin(layer)
    except Exception as exc:  # noqa: BLE001
        raise UpstreamUnavailable(f"{why}: preparing failed: {exc!r}") from exc
    w1, s1 = layer.w13_weight, layer.w13_weight_scale
    w2m, s2m = layer.w2_weight, layer.w2_weight_scale
    n, kh = w2m.shape[1] * 16, w1.shape[1] * 16  # padded intermediate, hidden
    sms = torch.cuda.get_device_properties(w13.device).multi_processor_count
    limit = swiglu_limit
    prefix = {"write_inactive_prefix_count": True}

    def align(ids: T, block: int) -> tuple[T, ...]:  # as fused_marlin_moe dispatches
        if ids.shape[0] == 1 and ids.dtype == torch.int32:
            return single(ids, block, return_inactive_prefix_count=True)
        if ids.numel() <= small.SMALL_NUMEL_LIMIT and e + 1 > 64:
            s, x, cnt = _buffers(ids, block, e, 2)
            small.moe_align_small_numel(ids, e + 1, block, s, x, cnt, **prefix)
            return s, x, cnt
        return align_jit(ids, block, e, prefix_count=True)

    def forward(x: T, ids: T, weights: T) -> T:
        m, k = ids.shape
        for block in (8, 16, 32, 48, 64):
            if m * k / e / block < 0.9:
                break
        sorted_ids, expert_ids, npad = align(ids, block)
        workspace = torch.zeros(sms * 4, dtype=torch.int32, device=x.device)  # per call
        cache13 = torch.empty(m * k * max(2 * n, kh), dtype=x.dtype, device=x.device)
        c1 = cache13[: m * k * 2 * n].view(-1, 2 * n)
        c3 = cache13[: m * k * kh].view(-1, kh)
        c2 = torch.empty(m * k, n, dtype=x.dtype, device=x.device)

        def gemm(a: T, c: T, w: T, s: T, top_k: int, mnk: tuple[int, ...], down: bool):
            return mgemm(
                a, c, w, None, s, None, None, None, None, workspace, sorted_ids,
                expert_ids, npad, weights, block, top_k, down, False, FE2M1F, *mnk,
                is_k_full=True, use_atomic_add=False, use_fp32_reduce=True,
                is_zp_float=False, expert_ids_are_sorted=True,
                zero_inactive_output=down, has_inactive_prefix_count=True,
            )  # fmt: skip

        gemm(x, c1, w1, s1, k, (m, 2 * n, kh), False)
        if limit is None:
            acts.silu_and_mul(c1, c2)
        else:  # swiglu_limit_func on SM90 (n % 16 == 0 as I % 32 == 0, padded to 64)
            acts.silu_and_mul_with_activation_rounding(c1, c2, clamp_limit=limit)
        gemm(c2, c3, w2m, s2m, 1, (m * k, kh, n), True)  # applies topk_weights
        return topk_sum(c3.view(-1, k, kh), torch.empty_like(x))

    shapes, nbytes, ckpt = _sizes(layer, experts)
    shapes["intermediate_and_pad"] = (n, n - i)
    return UpstreamMoE("upstream_marlin", forward, layer, shapes, nbytes, ckpt)
