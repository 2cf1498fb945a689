from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from sglang.kernels.jit.utils import get_jit_cuda_arch, is_arch_support_pdl
from sglang.kernels.kernel_api_logging import debug_kernel_api
from sglang.kernels.ops.moe import moe_route_radix

_SCORING_FUNC_MAP = {
    "sigmoid": 0,
    "sqrtsoftplus": 1,
    "softmax": 2,
}


@triton.jit
def _sm120_router_top22_kernel(
    scores_ptr,
    bias_ptr,
    weights_ptr,
    ids_ptr,
    stride_sm,
    stride_sn,
    scale,
    RENORMALIZE: tl.constexpr,
    APPLY_SCALE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    row = tl.program_id(0)
    n = tl.arange(0, 512)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    scores = tl.load(scores_ptr + row * stride_sm + n * stride_sn).to(tl.float32)
    bias = tl.load(bias_ptr + n).to(tl.float32)
    activated = tl.sigmoid(scores)
    biased = activated + bias
    biased = tl.where(biased == biased, biased, -1e30)
    biased = tl.where(biased == 0.0, 0.0, biased)
    bits = biased.to(tl.uint32, bitcast=True)
    ordered = tl.where((bits & 0x80000000) != 0, ~bits, bits ^ 0x80000000)
    keys = (ordered.to(tl.uint64) << 32) | (0xFFFFFFFF - n.to(tl.uint32)).to(tl.uint64)
    winners = tl.topk(keys, 32)
    ids = (0xFFFFFFFF - (winners & 0xFFFFFFFF).to(tl.uint32)).to(tl.int32)
    k = tl.arange(0, 32)
    values = tl.gather(activated, ids, axis=0)
    values = tl.where(k < 22, values, 0.0)
    total = tl.sum(values, 0)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if RENORMALIZE:
        values = values / tl.where(total > 0.0, total, 1.0)
    if APPLY_SCALE:
        values = values * scale
    tl.store(weights_ptr + row * 22 + k, values, k < 22)
    tl.store(ids_ptr + row * 22 + k, ids, k < 22)


def _topk_gate_small_m(
    scores,
    bias,
    topk=22,
    renormalize=True,
    routed_scaling_factor=1.0,
    apply_routed_scaling_factor_on_output=False,
):
    assert scores.is_cuda and bias.device == scores.device
    assert scores.ndim == 2 and scores.shape[1] == 512
    assert scores.dtype == torch.float32
    assert 1 <= scores.shape[0] <= 16
    assert bias.shape == (512,) and bias.dtype == torch.float32 and bias.is_contiguous()
    assert topk == 22
    m = scores.shape[0]
    weights = torch.empty((m, 22), device=scores.device, dtype=torch.float32)
    ids = torch.empty((m, 22), device=scores.device, dtype=torch.int32)
    pdl = is_arch_support_pdl()
    _sm120_router_top22_kernel[(m,)](
        scores,
        bias,
        weights,
        ids,
        scores.stride(0),
        scores.stride(1),
        float(routed_scaling_factor),
        RENORMALIZE=bool(renormalize),
        APPLY_SCALE=bool(apply_routed_scaling_factor_on_output),
        USE_PDL=pdl,
        num_warps=1,
        **({"launch_pdl": True} if pdl else {}),
    )
    return weights, ids


@triton.jit
def _router_triton_kernel(
    scores_ptr,  # [M, N] raw logits, fp32/fp16/bf16 (upcast to fp32 on load)
    bias_ptr,  # [N]    fp32/fp16/bf16 (upcast to fp32 on load)
    bias_alt_ptr,
    input_ids_ptr,
    num_token_non_padded_ptr,
    out_weights_ptr,  # [M, K] fp32
    out_indices_ptr,  # [M, K] int32
    out_packed_ptr,  # [M, K] int32 (HAS_PACKED)
    M,
    routed_scaling_factor,
    moe_softcapping,
    N: tl.constexpr,
    K: tl.constexpr,  # total topk (includes fused shared experts)
    K_ROUTED: tl.constexpr,  # K - num_fused_shared_experts
    BLOCK_M: tl.constexpr,  # rows processed per program (row tiling)
    BLOCK_N: tl.constexpr,  # >= N, power of 2
    BLOCK_K: tl.constexpr,  # >= K, power of 2
    N_GROUP: tl.constexpr,  # expert groups (1 = ungrouped)
    TOPK_GROUP: tl.constexpr,  # groups kept per token (grouped routing)
    EXPERTS_PER_GROUP: tl.constexpr,  # N // N_GROUP
    BLOCK_G: tl.constexpr,  # >= N_GROUP, power of 2
    SCORING_FUNC: tl.constexpr,  # 0 = sigmoid, 1 = sqrtsoftplus, 2 = softmax
    SQRTSOFTPLUS_LOG1P: tl.constexpr,  # sqrtsoftplus via log1p (V4.1 numerics)
    HAS_SOFTCAP: tl.constexpr,  # tanh softcapping (softmax only)
    RENORMALIZE: tl.constexpr,
    APPLY_SCALE: tl.constexpr,  # apply_routed_scaling_factor_on_output
    HAS_BIAS: tl.constexpr,
    HAS_TOKEN_BIAS: tl.constexpr,
    BIAS_ALT_TOKEN_ID: tl.constexpr,
    HAS_PADDING: tl.constexpr,
    HAS_PACKED: tl.constexpr,
    RENORMALIZE_EPSILON: tl.constexpr,
    USE_PDL: tl.constexpr,
    stride_bias,
    stride_bias_alt,
    stride_input_ids,
    stride_sm,
    stride_sn,
    stride_wm,
    stride_wk,
    stride_im,
    stride_ik,
    stride_pm,
    stride_pk,
) -> None:
    # Row-tiled: each program handles BLOCK_M rows; all reductions run along the
    # expert (N) axis. Tiling rows keeps CTAs large enough to stay occupancy-bound
    # rather than launch-bound at small N (many tiny 1-warp CTAs otherwise).
    pid = tl.program_id(0)
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    mask_m = offs_m < M
    mask_n = offs_n < N

    # PDL may start this grid before prior kernel stores are visible. Bias can
    # be produced by a preceding cast or fill kernel, so wait before loading
    # either bias or scores.
    if USE_PDL:
        tl.extra.cuda.gdc_wait()

    # Plain softmax routing has no bias, so keep the zero value in registers
    # rather than materializing and clearing a device tensor per call.
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n * stride_bias, mask=mask_n, other=0.0).to(
            tl.float32
        )
    else:
        bias = tl.zeros([BLOCK_N], dtype=tl.float32)
    if HAS_TOKEN_BIAS:
        bias_alt = tl.load(
            bias_alt_ptr + offs_n * stride_bias_alt, mask=mask_n, other=0.0
        ).to(tl.float32)

    live_m = mask_m
    if HAS_PADDING:
        live_m = live_m & (offs_m < tl.load(num_token_non_padded_ptr))
    row_bias = bias[None, :]
    if HAS_TOKEN_BIAS:
        input_ids = tl.load(
            input_ids_ptr + offs_m * stride_input_ids, mask=live_m, other=0
        )
        row_bias = tl.where(
            (input_ids == BIAS_ALT_TOKEN_ID)[:, None], bias_alt[None, :], row_bias
        )

    row_ptr = scores_ptr + offs_m[:, None] * stride_sm + offs_n[None, :] * stride_sn
    mask2d = live_m[:, None] & mask_n[None, :]
    scores = tl.load(row_ptr, mask=mask2d, other=0.0).to(
        tl.float32
    )  # [BLOCK_M, BLOCK_N]

    if SCORING_FUNC == 0:
        # sigmoid(x) = 1 / (1 + exp(-x)); bias is for ranking only, weight is bias-free.
        activated = tl.sigmoid(scores)
        biased = activated + row_bias
    elif SCORING_FUNC == 1:
        if SQRTSOFTPLUS_LOG1P:
            # log1p preserves small positive scores for negative logits.
            sp = tl.where(scores > 20.0, scores, libdevice.log1p(libdevice.exp(scores)))
            activated = libdevice.sqrt(sp)
        else:
            # Open-coded log1p; reproduces the DeepSeek-V4 sqrtsoftplus numerics.
            z = tl.exp(-tl.abs(scores))
            u = 1.0 + z
            exact = u == 1.0
            log1p_z = tl.where(exact, z, z * tl.log(u) / tl.where(exact, 1.0, u - 1.0))
            sp = tl.maximum(scores, 0.0) + log1p_z
            activated = tl.sqrt(sp)
        biased = activated + row_bias
    else:
        # softmax over the row: weight is the softmax probability (bias kept), with
        # optional tanh softcapping. Ranking by the (softcapped, biased) logit is
        # monotonic with the softmax prob, so the topk loop below ranks on `biased`.
        logit = scores
        if HAS_SOFTCAP:
            # tanh(z) = 2*sigmoid(2z) - 1 (avoids relying on tl.math.tanh availability).
            z = logit / moe_softcapping
            logit = moe_softcapping * (2.0 * tl.sigmoid(2.0 * z) - 1.0)
        biased = logit + row_bias
        biased = tl.where(mask_n[None, :], biased, -float("inf"))
        row_max = tl.max(biased, axis=1)[:, None]  # [BLOCK_M, 1]
        exp_row = tl.where(mask_n[None, :], tl.exp(biased - row_max), 0.0)
        row_sum = tl.sum(exp_row, axis=1)[:, None]  # [BLOCK_M, 1]
        activated = exp_row / row_sum

    biased = tl.where(mask_n[None, :], biased, -float("inf"))  # [BLOCK_M, BLOCK_N]

    if SCORING_FUNC == 1 and SQRTSOFTPLUS_LOG1P:
        # Rank NaNs above finite scores, matching torch.topk.
        biased = tl.where(biased == biased, biased, float("inf"))
    else:
        biased = tl.where(biased == biased, biased, -1e30)

    # Grouped routing (DeepSeek-V3 noaux_tc): per-group score = sum of the top-2
    # biased values; keep TOPK_GROUP groups (lowest group id wins ties); mask the
    # experts of dropped groups to -inf before the top-k below. Weight is still the
    # bias-free `activated`. Constexpr N_GROUP <= 1 skips this entirely (ungrouped).
    if N_GROUP > 1:
        offs_g = tl.arange(0, BLOCK_G)  # [BLOCK_G]
        group_of_n = offs_n // EXPERTS_PER_GROUP  # [BLOCK_N]
        group_score = tl.full([BLOCK_M, BLOCK_G], -float("inf"), dtype=tl.float32)
        for g in tl.static_range(N_GROUP):
            in_g = (group_of_n[None, :] == g) & mask_n[None, :]
            vals = tl.where(in_g, biased, -float("inf"))
            top1 = tl.max(vals, axis=1)[:, None]  # [BLOCK_M, 1]
            vals2 = tl.where(vals >= top1, -float("inf"), vals)
            top2 = tl.max(vals2, axis=1)[:, None]  # [BLOCK_M, 1]
            group_score = tl.where(offs_g[None, :] == g, top1 + top2, group_score)

        gcur = group_score
        keep = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for _i in tl.static_range(TOPK_GROUP):
            gmax = tl.max(gcur, axis=1)[:, None]  # [BLOCK_M, 1]
            glane = tl.where(gcur == gmax, offs_g[None, :], N_GROUP + 1)
            win_g = tl.min(glane, axis=1)[:, None]  # [BLOCK_M, 1] lowest-id on ties
            keep = tl.where(group_of_n[None, :] == win_g, 1.0, keep)
            gcur = tl.where(offs_g[None, :] == win_g, -float("inf"), gcur)
        biased = tl.where(keep > 0.0, biased, -float("inf"))

    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    mask_k_total = offs_k < K
    mask_k_routed = offs_k < K_ROUTED
    selected_vals = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    selected_idx = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.int32)

    cur = biased  # [BLOCK_M, BLOCK_N]
    remaining = tl.broadcast_to(mask_n[None, :], (BLOCK_M, BLOCK_N))
    for k in tl.static_range(K_ROUTED):
        max_val = tl.max(cur, axis=1)[:, None]  # [BLOCK_M, 1]
        is_max = remaining & (cur == max_val)
        lane_id = tl.where(is_max, offs_n[None, :], N + 1)  # lowest expert id wins ties
        win_lane = tl.min(lane_id, axis=1)[:, None].to(tl.int32)  # [BLOCK_M, 1]
        win_activated = tl.sum(
            tl.where(offs_n[None, :] == win_lane, activated, 0.0), axis=1
        )[:, None]  # [BLOCK_M, 1]
        slot = offs_k[None, :] == k  # [1, BLOCK_K]
        selected_vals = tl.where(slot, win_activated, selected_vals)
        selected_idx = tl.where(slot, win_lane, selected_idx)
        remaining = remaining & (offs_n[None, :] != win_lane)
        cur = tl.where(remaining, cur, -float("inf"))

    routed_sum = tl.sum(tl.where(mask_k_routed[None, :], selected_vals, 0.0), axis=1)[
        :, None
    ]  # [BLOCK_M, 1]

    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()

    if RENORMALIZE:
        if RENORMALIZE_EPSILON > 0.0:
            norm = routed_sum + RENORMALIZE_EPSILON
        else:
            norm = tl.where(routed_sum > 0.0, routed_sum, 1.0)  # [BLOCK_M, 1]
        selected_vals = selected_vals / norm
    if APPLY_SCALE:
        selected_vals = selected_vals * routed_scaling_factor
    if K_ROUTED < K:
        # The shared expert's contribution is independent of routed normalization.
        is_shared = (offs_k[None, :] >= K_ROUTED) & mask_k_total[None, :]
        shared_weight = 1.0 if APPLY_SCALE else 1.0 / routed_scaling_factor
        shared_idx = (N + (offs_k - K_ROUTED)).to(tl.int32)[None, :]
        selected_vals = tl.where(is_shared, shared_weight, selected_vals)
        selected_idx = tl.where(is_shared, shared_idx, selected_idx)
    if HAS_PADDING:
        selected_vals = tl.where(live_m[:, None], selected_vals, 0.0)
        selected_idx = tl.where(live_m[:, None], selected_idx, -1)

    out_w_ptr = (
        out_weights_ptr + offs_m[:, None] * stride_wm + offs_k[None, :] * stride_wk
    )
    out_i_ptr = (
        out_indices_ptr + offs_m[:, None] * stride_im + offs_k[None, :] * stride_ik
    )
    store_mask = mask_m[:, None] & mask_k_total[None, :]
    tl.store(out_w_ptr, selected_vals, mask=store_mask)
    tl.store(out_i_ptr, selected_idx, mask=store_mask)
    if HAS_PACKED:
        # Must stay bitwise identical to fused_pack_topk.
        w_bits = selected_vals.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32)
        packed = (selected_idx << 16) | (w_bits & 0xFFFF)
        out_p_ptr = (
            out_packed_ptr + offs_m[:, None] * stride_pm + offs_k[None, :] * stride_pk
        )
        tl.store(out_p_ptr, packed, mask=store_mask)


_DUMMY_I32: Dict[torch.device, torch.Tensor] = {}


def _dummy_i32(device: torch.device) -> torch.Tensor:
    # Placeholder pointer for kernel args whose constexpr flag is off.
    t = _DUMMY_I32.get(device)
    if t is None:
        t = _DUMMY_I32[device] = torch.empty(1, dtype=torch.int32, device=device)
    return t


@debug_kernel_api
def moe_fused_gate(
    scores: torch.Tensor,
    bias: Optional[torch.Tensor],
    topk: int,
    scoring_func: str = "sigmoid",
    num_fused_shared_experts: int = 0,
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
    apply_routed_scaling_factor_on_output: bool = False,
    moe_softcapping: float = 0.0,
    num_expert_group: int = 1,
    topk_group: int = 1,
    *,
    bias_alt: Optional[torch.Tensor] = None,
    input_ids: Optional[torch.Tensor] = None,
    bias_alt_token_id: Optional[int] = None,
    num_token_non_padded: Optional[torch.Tensor] = None,
    renormalize_epsilon: float = 0.0,
    packed_out: Optional[torch.Tensor] = None,
    sqrtsoftplus_log1p: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Triton fused router: scoring + bias + topk + (optional) renorm/scale.

    With ``num_expert_group > 1`` it performs DeepSeek-V3 grouped routing
    (per-group top-2-sum group scores, keep ``topk_group`` groups, then top-k
    within). ``scores`` contains raw GEMM logits.

    Rows past the device scalar ``num_token_non_padded`` return zero weights and -1 ids.
    Positive ``renormalize_epsilon`` uses ``sum + epsilon`` instead of the zero-sum guard.
    ``sqrtsoftplus_log1p`` evaluates sqrtsoftplus through ``log1p`` and ranks NaNs first
    (DeepSeek-V4.1); off, the DeepSeek-V4 formula and NaN order are kept.
    ``packed_out`` ([M, topk] int32, optional) receives the FlashInfer routed-MoE form
    ``(id << 16) | bf16_bits(weight)``, bitwise identical to ``fused_pack_topk``.
    """
    scoring_func_int = _SCORING_FUNC_MAP.get(scoring_func.lower())
    assert scoring_func_int is not None, (
        f"Unknown scoring_func '{scoring_func}', must be one of {list(_SCORING_FUNC_MAP.keys())}"
    )
    assert scores.dtype in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
    ), "scores must be float32/float16/bfloat16"
    assert scores.ndim == 2, "scores must be 2D"
    if bias is None:
        assert scoring_func.lower() == "softmax", (
            "bias is required for non-softmax routing"
        )
    else:
        # The kernel loads the bias and upcasts it to fp32 in-register (see
        # _router_triton_kernel), so a non-fp32 bias (DeepSeek-V4 stores the
        # correction bias in bf16) needs no host-side cast/copy.
        assert bias.dtype in (
            torch.float32,
            torch.float16,
            torch.bfloat16,
        ), "bias must be float32/float16/bfloat16"
        assert bias.ndim == 1, "bias must be 1D"
        assert scores.size(1) == bias.size(0), (
            "scores and bias must have same num_experts"
        )
    assert topk > num_fused_shared_experts, "topk must be > num_fused_shared_experts"
    if input_ids is not None:
        assert bias_alt is not None and bias_alt_token_id is not None
        assert bias is not None and bias_alt.shape == bias.shape
        assert input_ids.shape == (scores.size(0),)
    if packed_out is not None:
        assert packed_out.dtype == torch.int32, "packed_out must be int32"
        assert packed_out.shape == (
            scores.size(0),
            topk,
        ), "packed_out must be [M, topk]"
    if routed_scaling_factor is None:
        routed_scaling_factor = 1.0

    from sglang.srt.environ import envs

    if (
        envs.SGLANG_OPT_SM120_MTP_ROUTER_TOP22.get()
        and scores.is_cuda
        and torch.cuda.get_device_capability(scores.device) == (12, 0)
        and 2 <= scores.shape[0] <= 16
        and scores.shape[1] == 512
        and scores.dtype == torch.float32
        and scores.stride(1) == 1
        and bias is not None
        and bias.dtype == torch.float32
        and bias.is_contiguous()
        and topk == 22
        and scoring_func.lower() == "sigmoid"
        and num_fused_shared_experts == 0
        and num_expert_group <= 1
        and moe_softcapping == 0.0
        and input_ids is None
        and num_token_non_padded is None
        and renormalize_epsilon == 0.0
        and packed_out is None
        and not sqrtsoftplus_log1p
    ):
        return _topk_gate_small_m(
            scores,
            bias,
            topk=topk,
            renormalize=renormalize,
            routed_scaling_factor=routed_scaling_factor,
            apply_routed_scaling_factor_on_output=apply_routed_scaling_factor_on_output,
        )

    # K3 radix-select fast path: native-CUDA radix-select replaces the 16
    # dependent argmax rounds (single CTA per token; ids bit-identical to this
    # triton kernel incl. ties).
    # The radix kernel keeps keys register-resident and returns winners in
    # expert-id order (skipping the biased-descending sort; downstream MoE
    # kernels are order-insensitive). It is 3.1-3.5x faster than the Triton
    # kernel at [1..8192, 896] top-16 on B200.
    if (
        scoring_func.lower() == "sigmoid"
        and num_fused_shared_experts == 0
        and num_expert_group <= 1
        and moe_softcapping == 0.0
        and input_ids is None
        and num_token_non_padded is None
        and renormalize_epsilon == 0.0
        and packed_out is None
        and bias.stride(0) == 1
    ):
        radix_args = (
            scores,
            bias,
            topk,
            renormalize,
            routed_scaling_factor,
            apply_routed_scaling_factor_on_output,
        )
        if moe_route_radix.covered(scores, bias, topk):
            return moe_route_radix.route_radix(*radix_args, sorted=False)

    M, N = scores.shape
    K = topk
    K_routed = topk - num_fused_shared_experts
    if num_expert_group > 1:
        assert N % num_expert_group == 0, "num_experts must be divisible by group count"
        assert 1 <= topk_group <= num_expert_group, "invalid topk_group"
    experts_per_group = N // num_expert_group
    BLOCK_G = triton.next_power_of_2(num_expert_group)

    weights = torch.empty((M, K), dtype=torch.float32, device=scores.device)
    indices = torch.empty((M, K), dtype=torch.int32, device=scores.device)
    if M == 0:
        return weights, indices

    BLOCK_N = triton.next_power_of_2(N)  # 256 -> 256, 384 -> 512
    BLOCK_K = triton.next_power_of_2(K)  # 6 -> 8, 8 -> 8
    # Single warp per program keeps the per-row top-k reductions on cheap warp
    # shuffles; pack a few rows per program only when N is small so tiny launches
    # stay occupancy-bound. Swept on H100/B200: this beats the AOT kernels across
    # shapes, whereas larger tiles / more warps regress (register pressure).
    BLOCK_M = max(1, min(4, 256 // BLOCK_N))
    # For wide rows (e.g. Kimi K3: 896 experts, BLOCK_N 1024) the K sequential
    # argmax passes dominate and benefit from more warps despite the
    # cross-warp reduction cost.
    num_warps = 1 if BLOCK_N <= 512 else 4
    grid = (triton.cdiv(M, BLOCK_M),)
    use_pdl = is_arch_support_pdl()
    if use_pdl and scoring_func_int == 1 and N == 384 and K == 6 and M <= 8:
        # On SM103, early-launching the small DSV4.1 target router increases
        # latency when it overlaps with mHC/shared-expert work. Use ordinary
        # stream dependencies; keep PDL for the draft router and larger batches.
        arch = get_jit_cuda_arch()
        use_pdl = (arch.major, arch.minor) != (10, 3)
    extra = {"launch_pdl": True} if use_pdl else {}
    # Dynamo cannot analyze the kernel (PDL inline asm), so it writes back every
    # pointer arg; aliasing an output as an unused arg's fallback clobbers it.
    _unused_i32 = _dummy_i32(scores.device)
    _router_triton_kernel[grid](
        scores,
        bias if bias is not None else scores,
        bias_alt,
        input_ids,
        num_token_non_padded,
        weights,
        indices,
        packed_out if packed_out is not None else _unused_i32,
        M,
        float(routed_scaling_factor),
        float(moe_softcapping),
        N=N,
        K=K,
        K_ROUTED=K_routed,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        N_GROUP=num_expert_group,
        TOPK_GROUP=topk_group,
        EXPERTS_PER_GROUP=experts_per_group,
        BLOCK_G=BLOCK_G,
        SCORING_FUNC=scoring_func_int,
        SQRTSOFTPLUS_LOG1P=bool(sqrtsoftplus_log1p),
        HAS_SOFTCAP=bool(moe_softcapping != 0.0),
        RENORMALIZE=bool(renormalize),
        APPLY_SCALE=bool(apply_routed_scaling_factor_on_output),
        HAS_BIAS=bias is not None,
        HAS_TOKEN_BIAS=input_ids is not None,
        BIAS_ALT_TOKEN_ID=bias_alt_token_id,
        HAS_PADDING=num_token_non_padded is not None,
        HAS_PACKED=packed_out is not None,
        RENORMALIZE_EPSILON=renormalize_epsilon,
        USE_PDL=use_pdl,
        stride_bias=bias.stride(0) if bias is not None else 0,
        stride_bias_alt=bias_alt.stride(0) if bias_alt is not None else 0,
        stride_input_ids=input_ids.stride(0) if input_ids is not None else 0,
        stride_sm=scores.stride(0),
        stride_sn=scores.stride(1),
        stride_wm=weights.stride(0),
        stride_wk=weights.stride(1),
        stride_im=indices.stride(0),
        stride_ik=indices.stride(1),
        stride_pm=packed_out.stride(0) if packed_out is not None else 0,
        stride_pk=packed_out.stride(1) if packed_out is not None else 0,
        num_warps=num_warps,
        **extra,
    )
    return weights, indices
