"""Torch twin of chain_speculative_sampling_triton (reject_sampling.py), vectorized over rows.

Lives here, not in the wheel: no engine code calls it (test/test_verify_cap.py and
bench_block_verify.py import it from this folder).

Same decisions from the same uniforms: token-wise rejection (accept draft i when
u_i * q_i(x_i) < p_i(x_i)) and block verification (Sun et al. 2024, Algorithm 2, as the
kernel runs it: weights w_i = min(w_{i-1} p/q, 1), backward scan with the residual mass).
Used by the verify-cap tests (distribution and kernel equality) and the block-vs-token
benchmark; fp32 sums, so a kernel decision can differ only on a coin within rounding.
"""

from __future__ import annotations

import torch


def chain_verify_ref(
    *,
    candidates: torch.Tensor,  # [B, G + 1] anchor + drafts
    target_probs: torch.Tensor,  # [B, G + 1, V]
    draft_probs: torch.Tensor,  # [B, G, V]
    uniforms: torch.Tensor,  # [B, G]
    uniforms_final: torch.Tensor,  # [B]
    block_verification: bool,
    residual_from_target: bool = False,  # a deliberately wrong correction (tests only)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (accepted drafts n [B], correction / bonus token [B])."""
    b, g1, v = target_probs.shape
    gamma = g1 - 1
    rows = torch.arange(b, device=candidates.device)
    drafts = candidates[:, 1:].long()
    p_tok = target_probs[:, :gamma, :].gather(2, drafts[:, :, None])[:, :, 0]
    q_tok = draft_probs.gather(2, drafts[:, :, None])[:, :, 0]
    q_ok = (q_tok > 0.0) & (q_tok <= 1.0)
    scale = torch.ones(b, dtype=torch.float32, device=candidates.device)
    if not block_verification:
        acc = q_ok & (uniforms * q_tok < p_tok)
        n = acc.to(torch.int64).cumprod(dim=1).sum(dim=1)
    else:
        prefix = torch.empty_like(p_tok)
        w = torch.ones(b, dtype=torch.float32, device=candidates.device)
        for i in range(gamma):
            w = torch.where(
                q_ok[:, i], torch.clamp(w * p_tok[:, i] / q_tok[:, i], max=1.0), 0.0
            )
            prefix[:, i] = w
        n = torch.zeros(b, dtype=torch.int64, device=candidates.device)
        done = torch.zeros(b, dtype=torch.bool, device=candidates.device)
        for step in range(gamma, 0, -1):
            h = prefix[:, step - 1]
            coin = uniforms[:, step - 1]
            accept_prob = h.clone()
            if step < gamma:
                mid = (h > 0.0) & (h < 1.0)
                mass = torch.clamp(
                    h[:, None] * target_probs[:, step, :] - draft_probs[:, step, :],
                    min=0.0,
                ).sum(dim=1)
                accept_prob = torch.where(mid, mass / (mass + 1.0 - h), h)
            take = (~done) & (coin < h) & (coin < accept_prob)
            n = torch.where(take, step, n)
            scale = torch.where(take, h, scale)
            done = done | take
    all_acc = n == gamma
    p_row = target_probs[rows, n]
    q_row = draft_probs[rows, n.clamp(max=gamma - 1)]
    q_row = torch.where((q_row >= 0.0) & (q_row <= 1.0), q_row, 0.0)
    resid = torch.clamp(scale[:, None] * p_row - q_row, min=0.0)
    if residual_from_target:
        resid = p_row
    dist = torch.where(all_acc[:, None], p_row, resid)
    cdf = dist.cumsum(dim=1)
    target_u = uniforms_final * cdf[:, -1]
    token = (cdf <= target_u[:, None]).sum(dim=1).clamp(max=v - 1)
    return n, token
