"""--dsv4-hc-fused-stats: DeepSeek-V4.1's hyper-connection mix statistics in one pass over K
for prefill-size inputs, the same bits as upstream's split-K kernels.

Upstream's K slices are walked in the same order per row tile and go to upstream's own reduce.
Serves from a row threshold (``MEASURED_MIN_ROWS``); an unmeasured GPU refuses to load. The first
eager call of each kernel variant is compared bit for bit with upstream's (stock for good on a
difference, never captured unverified). How and figures: docs/hc_fused.md.
"""

from __future__ import annotations

import argparse
import logging
from typing import Callable, Optional

import torch

logger = logging.getLogger(__name__)

_USAGE = (
    "accepted: off; auto (the one-pass kernel from the row count measured on this GPU); "
    "or a row count >= 1 (the one-pass kernel from that many rows)"
)

ROUTES = ("bf16x3", "tf32x3")

# (torch.cuda.get_device_name(), route) -> rows from which the one-pass kernel beat upstream's by
# 3 % at every larger measured row count, None where it never did ("min_rows" in
# benchmark/results/hc_fused-<device>.json, docs/hc_fused.md). A GPU not listed is not measured.
MEASURED_MIN_ROWS: dict[tuple[str, str], Optional[int]] = {
    ("NVIDIA H200", "bf16x3"): 65536,
    ("NVIDIA H200", "tf32x3"): None,
}


def parse_hc_fused_stats(value) -> str:
    """type_parser of the flag: "off", "auto" or a row count."""
    v = str(value).strip().lower()
    if v in ("off", "auto"):
        return v
    if v.isdigit() and int(v) >= 1:
        return str(int(v))
    raise argparse.ArgumentTypeError(f"--dsv4-hc-fused-stats={value!r}: {_USAGE}")


def validate_hc_fused_stats(server_args) -> str:
    """Resolution-hook check: refused where the flag would do nothing, with the reason."""
    from sglang.fork import parsed_flag
    from sglang.srt.arg_groups.model_override_base import (
        model_config_of,
        resolving_view,
    )

    cfg = resolving_view(server_args)
    mode = parsed_flag(server_args, "dsv4_hc_fused_stats", parse_hc_fused_stats)
    if mode == "off":
        return mode
    hf_config = model_config_of(server_args).hf_config
    model_arch = hf_config.architectures[0]
    if model_arch != "DeepseekV4ForCausalLM":
        raise ValueError(
            f"--dsv4-hc-fused-stats={mode}: only DeepSeek-V4.1 computes hyper-connection mix "
            f"statistics; this model is {model_arch}; use --dsv4-hc-fused-stats off"
        )
    if not getattr(hf_config, "hc_pre_from_prev_sublayer", False):
        raise ValueError(
            f"--dsv4-hc-fused-stats={mode}: this DeepSeek-V4 checkpoint does not predict its "
            "hyper-connection mix from the previous sublayer (hc_pre_from_prev_sublayer is "
            "false: DeepSeek-V4, not V4.1), so the mix-statistics kernels never run; use "
            "--dsv4-hc-fused-stats off"
        )
    if torch.version.hip is not None:
        raise ValueError(
            f"--dsv4-hc-fused-stats={mode}: this torch is a ROCm build; ROCm reduces the mix "
            "statistics with its own kernels, which the one-pass kernel does not reproduce; "
            "use --dsv4-hc-fused-stats off"
        )
    if getattr(cfg, "device", None) not in (None, "cuda"):
        raise ValueError(
            f"--dsv4-hc-fused-stats={mode}: needs --device cuda, got {cfg.device}; use "
            "--dsv4-hc-fused-stats off"
        )
    return mode


class HcFusedStats:
    """One model's feature: the threshold per route and each variant's self-check state."""

    def __init__(self, mode: str, device_name: str):
        self.mode, self.device_name = mode, device_name
        if mode == "auto":
            self.min_rows = {r: MEASURED_MIN_ROWS.get((device_name, r)) for r in ROUTES}
            if all(v is None for v in self.min_rows.values()):
                measured = any((device_name, r) in MEASURED_MIN_ROWS for r in ROUTES)
                raise RuntimeError(
                    f"--dsv4-hc-fused-stats auto: on {device_name} the one-pass kernel never beat "
                    "upstream's at any measured row count, so it would never serve; leave the flag off"
                    if measured
                    else f"--dsv4-hc-fused-stats auto: the one-pass kernel's row threshold is not "
                    f"measured on {device_name} (run benchmark/hc/bench_hc_fused.py there and add its "
                    "min_rows to MEASURED_MIN_ROWS in sglang/srt/models/deepseek_v4_hc_fused.py), "
                    "or give the threshold: --dsv4-hc-fused-stats ROWS; refusing to guess"
                )
        else:
            self.min_rows = {r: int(mode) for r in ROUTES}
        self.state: dict[tuple[str, int], str] = {}

    def describe(self) -> str:
        def one(route: str) -> str:
            n = self.min_rows[route]
            if n is not None:
                return f"{route} from {n} rows"
            if (self.device_name, route) in MEASURED_MIN_ROWS:
                return f"{route} stock (never faster on {self.device_name})"
            return f"{route} stock (not measured on {self.device_name})"

        return ", ".join(one(r) for r in ROUTES)

    def wants(self, route: str, rows: int) -> bool:
        n = self.min_rows[route]
        return n is not None and rows >= n

    def serve(
        self, variant: tuple[str, int], rows: int, ours: Callable, stock: Callable
    ):
        """ours() where ``variant`` is verified; the self-check where it is new; None (stock)."""
        state = self.state.get(variant)
        if state == "stock":
            return None
        if state == "verified":
            return ours()
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return None  # never capture an unchecked kernel: the graph keeps stock
        mine = ours()
        ref = stock()
        differ, total = _differing_bits(mine, ref)
        if differ:
            self.state[variant] = "stock"
            logger.error(
                "dsv4 hc fused stats: the one-pass %s kernel (row tile %d) differs from upstream's "
                "in %d of %d values at %d rows; that kernel stays stock for the rest of this process",
                variant[0],
                variant[1],
                differ,
                total,
                rows,
            )
            return ref
        self.state[variant] = "verified"
        logger.info(
            "dsv4 hc fused stats: the one-pass %s kernel (row tile %d) matched upstream's bit for "
            "bit at %d rows; serving it from %d rows",
            variant[0],
            variant[1],
            rows,
            self.min_rows[_route_of(variant[0])],
        )
        return mine

    # ---- what upstream's mix-statistics functions (kernels/ops/layernorm/mhc.py) call first when
    # handed this object; ``stock`` calls the same function without it, so it runs upstream's.

    def mix_stats_sinkhorn_bf16x3(
        self, x, weight_parts, scale, base, sinkhorn_iters, rms_eps, hc_eps, hc_mult
    ):
        if not self.wants("bf16x3", x.shape[0]):
            return None
        from sglang.kernels.ops.layernorm import mhc
        from sglang.kernels.ops.layernorm.mhc_one_pass import hc_mix_one_pass_bf16x3
        from sglang.srt.runtime_context import get_platform

        m, k = x.shape
        if get_platform().is_sm90 and 32 <= m < 4096:
            # Upstream's 64-row tile (SM90 below 4096 rows) stays stock: there upstream's own
            # kernel is not bitwise repeatable, so no bitwise check can vouch for a replacement
            # (docs/hc_fused.md).
            return None
        block_m = mhc._HC_MIX_BF16X3_BLOCK_M

        def ours():
            part, sq = hc_mix_one_pass_bf16x3(x, weight_parts, block_m)
            return _reduce_sinkhorn(
                part,
                sq,
                scale,
                base,
                (2 + hc_mult) * hc_mult,
                k,
                hc_mult,
                sinkhorn_iters,
                rms_eps,
                hc_eps,
            )

        def stock():
            return mhc.hc_mix_stats_sinkhorn_bf16x3(
                x, weight_parts, scale, base, sinkhorn_iters, rms_eps, hc_eps, hc_mult
            )

        return self.serve(("bf16x3", block_m), m, ours, stock)

    def mix_stats(self, x_flat, hc_fn, eps):
        if x_flat.shape[0] == 0 or not self.wants("tf32x3", x_flat.shape[0]):
            return None
        import triton

        from sglang.kernels.ops.layernorm import mhc
        from sglang.kernels.ops.layernorm.mhc_one_pass import hc_mix_one_pass

        m, k = x_flat.shape
        block_m = mhc._block_m_for(m)

        def ours():
            mix = hc_fn.shape[0]
            part, sq = hc_mix_one_pass(x_flat, hc_fn)
            mixes = torch.empty((m, mix), dtype=torch.float32, device=x_flat.device)
            mhc._hc_mix_stats_reduce_kernel[(triton.cdiv(m, block_m),)](
                part,
                sq,
                mixes,
                m,
                1.0 / k,
                eps,
                MIX=mix,
                MIX_PAD=max(16, triton.next_power_of_2(mix)),
                NUM_SLICES=1,
                BLOCK_M=block_m,
                num_warps=4,
            )
            return mixes

        def stock():
            return mhc.hc_mix_stats(x_flat, hc_fn, eps)

        return self.serve(("tf32x3", block_m), m, ours, stock)

    def mix_stats_sinkhorn(
        self, x_flat, hc_fn, hc_scale, hc_base, hc_mult, sinkhorn_iters, rms_eps, hc_eps
    ):
        if x_flat.shape[0] == 0 or not self.wants("tf32x3", x_flat.shape[0]):
            return None
        from sglang.kernels.ops.layernorm import mhc
        from sglang.kernels.ops.layernorm.mhc_one_pass import hc_mix_one_pass

        if mhc._is_hip:
            return None
        m, k = x_flat.shape
        block_m = mhc._block_m_for(m)

        def ours():
            part, sq = hc_mix_one_pass(x_flat, hc_fn)
            # scale and base as upstream's hc_mix_stats_sinkhorn passes them to the same kernel
            return _reduce_sinkhorn(
                part,
                sq,
                hc_scale.float().contiguous(),
                hc_base.float().contiguous(),
                hc_fn.shape[0],
                k,
                hc_mult,
                sinkhorn_iters,
                rms_eps,
                hc_eps,
            )

        def stock():
            return mhc.hc_mix_stats_sinkhorn(
                x_flat,
                hc_fn,
                hc_scale,
                hc_base,
                hc_mult,
                sinkhorn_iters,
                rms_eps,
                hc_eps,
            )

        return self.serve(("tf32x3-sinkhorn", block_m), m, ours, stock)


def _route_of(kernel: str) -> str:
    return "bf16x3" if kernel == "bf16x3" else "tf32x3"


def _differing_bits(a, b) -> tuple[int, int]:
    a = a if isinstance(a, tuple) else (a,)
    b = b if isinstance(b, tuple) else (b,)
    differ = total = 0
    for x, y in zip(a, b, strict=True):
        if x.shape != y.shape or x.dtype != y.dtype:
            return max(x.numel(), y.numel()), max(x.numel(), y.numel())
        differ += int(
            (x.contiguous().view(torch.int32) != y.contiguous().view(torch.int32)).sum()
        )
        total += x.numel()
    return differ, total


def build_hc_fused_stats(
    mode: str, previous: Optional[HcFusedStats] = None
) -> Optional[HcFusedStats]:
    """The model's feature at load (None when off) from the flag's parsed value; ``previous``
    is kept when the mode is unchanged."""
    if mode == "off":
        return None
    if previous is not None and previous.mode == mode:
        return previous
    if not torch.cuda.is_available():
        raise RuntimeError(f"--dsv4-hc-fused-stats={mode}: needs a CUDA GPU")
    feature = HcFusedStats(mode, torch.cuda.get_device_name())
    ceiling = _prefill_rows_ceiling()
    if ceiling is not None and all(
        n is None or n > ceiling for n in feature.min_rows.values()
    ):
        raise RuntimeError(
            f"--dsv4-hc-fused-stats={mode}: the one-pass kernel would serve {feature.describe()}, "
            f"but no prefill forward of this server holds more than {ceiling} rows "
            f"(--chunked-prefill-size), so it would never run; leave the flag off or raise "
            f"--chunked-prefill-size to the threshold"
        )
    logger.info(
        "dsv4 hc fused stats (--dsv4-hc-fused-stats=%s): one pass over K for %s; each kernel "
        "self-checks against upstream's on its first call",
        mode,
        feature.describe(),
    )
    return feature


def _prefill_rows_ceiling() -> Optional[int]:
    """The most rows one prefill forward can hold (the chunked prefill size), else None."""
    from sglang.srt.runtime_context import max_prefill_buffer_tokens

    try:
        rows = max_prefill_buffer_tokens()
    except (
        ValueError
    ):  # "config namespace 'schedule' not published": no server configured
        return None
    return rows or None


def _reduce_sinkhorn(
    part, sq, scale, base, mix, k, hc_mult, sinkhorn_iters, rms_eps, hc_eps
):
    """Upstream's reduce + Sinkhorn kernel over one-pass partials, launched as upstream does."""
    from sglang.kernels.ops.layernorm import mhc

    m = sq.shape[-1]  # sq: [1 slice, m rows]
    pre = torch.empty((m, hc_mult), device=part.device, dtype=torch.float32)
    post = torch.empty_like(pre)
    comb = torch.empty((m, hc_mult, hc_mult), device=part.device, dtype=torch.float32)
    mhc._hc_mix_reduce_sinkhorn_kernel[(m,)](
        part,
        sq,
        scale,
        base,
        pre,
        post,
        comb,
        m,
        1.0 / k,
        rms_eps,
        MIX=mix,
        HC=hc_mult,
        NUM_SLICES=1,
        ITERS=sinkhorn_iters,
        EPS=hc_eps,
        num_warps=1,
    )
    return pre, post, comb
