"""fp8 copy of the draft's LM head (e4m3, one power-of-two scale per 32x32 block) and the
draft-logits GEMM that reads it (--speculative-dspark-draft-head-fp8).

Partial sums stay in FP32: each K chunk of a 16-row tile is one tf32 dot of the bf16
activation with the weights dequantized by their power-of-two block scales (both exact in
tf32, so the products are exact), added in a fixed K order, so a row's logits never
depend on how many rows share the call. All row tiles of a call reuse each weight tile
loaded once, so the head streams from HBM once per call for up to 16 * MAX_M_TILES rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 32  # quantization block (rows and columns)
FP8_MAX = 448.0
ROW_TILE = 16
MAX_M_TILES = 4  # up to 64 rows per call with the head streamed once


def quantize_head_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] bf16/fp32 -> (e4m3 [N, K], fp32 scales [ceil(N/32), K/32]); every scale is a
    power of two with |w / scale| <= 448, so dequantization (q * scale) is exact."""
    n, k = weight.shape
    assert k % BLOCK == 0, f"K={k} is not a multiple of {BLOCK}"
    nb = triton.cdiv(n, BLOCK)
    w = torch.zeros((nb * BLOCK, k), dtype=torch.float32, device=weight.device)
    w[:n] = weight.float()
    blocks = w.view(nb, BLOCK, k // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3))
    # Smallest power of two with amax / scale <= 448 (scale 1 for an all-zero block).
    exp = torch.ceil(torch.log2(torch.clamp(amax, min=1e-30) / FP8_MAX))
    scales = torch.where(amax > 0, torch.exp2(exp), torch.ones_like(amax))
    q = (blocks / scales[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.view(nb * BLOCK, k)[:n].to(torch.float8_e4m3fn).contiguous()
    return q, scales.contiguous()


def dequantize_head_fp8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    s = scales.repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)
    return q.float() * s


@triton.jit
def _tile_dot(acc, x_ptr, stride_xm, m0, M, k0, offs_k, w_deq):
    rows = m0 + tl.arange(0, 16)
    x = tl.load(
        x_ptr + rows[:, None] * stride_xm + (k0 + offs_k)[None, :],
        mask=rows[:, None] < M,
        other=0.0,
    )
    # bf16 activations and dequantized e4m3 weights are exact in tf32: exact products.
    return acc + tl.dot(x.to(tl.float32), tl.trans(w_deq), input_precision="tf32")


@triton.jit
def _draft_head_fp8_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr,
    M, N, K: tl.constexpr,
    stride_xm, stride_wn, stride_sn, stride_om,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    M_TILES: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    offs_kb = tl.arange(0, BLOCK_K // 32)
    acc0 = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    acc1 = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    acc3 = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = tl.load(
            w_ptr + offs_n[:, None] * stride_wn + (k0 + offs_k)[None, :],
            mask=n_mask[:, None],
            other=0.0,
        ).to(tl.float32)
        s = tl.load(
            s_ptr + (offs_n // 32)[:, None] * stride_sn + (k0 // 32 + offs_kb)[None, :],
            mask=n_mask[:, None],
            other=0.0,
        )
        # One power-of-two scale per 32 columns: exact dequantisation.
        w_deq = tl.reshape(
            tl.reshape(w, (BLOCK_N, BLOCK_K // 32, 32)) * s[:, :, None], (BLOCK_N, BLOCK_K)
        )
        acc0 = _tile_dot(acc0, x_ptr, stride_xm, 0, M, k0, offs_k, w_deq)
        if M_TILES >= 2:
            acc1 = _tile_dot(acc1, x_ptr, stride_xm, 16, M, k0, offs_k, w_deq)
        if M_TILES >= 3:
            acc2 = _tile_dot(acc2, x_ptr, stride_xm, 32, M, k0, offs_k, w_deq)
        if M_TILES >= 4:
            acc3 = _tile_dot(acc3, x_ptr, stride_xm, 48, M, k0, offs_k, w_deq)
    rows = tl.arange(0, 16)
    out_cols = offs_n[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + out_cols, acc0,
             mask=(rows[:, None] < M) & n_mask[None, :])
    if M_TILES >= 2:
        r = rows + 16
        tl.store(out_ptr + r[:, None] * stride_om + out_cols, acc1,
                 mask=(r[:, None] < M) & n_mask[None, :])
    if M_TILES >= 3:
        r = rows + 32
        tl.store(out_ptr + r[:, None] * stride_om + out_cols, acc2,
                 mask=(r[:, None] < M) & n_mask[None, :])
    if M_TILES >= 4:
        r = rows + 48
        tl.store(out_ptr + r[:, None] * stride_om + out_cols, acc3,
                 mask=(r[:, None] < M) & n_mask[None, :])


def draft_head_fp8_logits(
    x: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    out: torch.Tensor | None = None,
    block_n: int = 64,
    block_k: int | None = None,
    num_warps: int = 4,
    num_stages: int = 4,
) -> torch.Tensor:
    """fp32 logits [M, N] = x [M, K] (bf16) @ dequant(q, scales)^T for M <= 64."""
    m, k = x.shape
    n = q.shape[0]
    assert x.dtype == torch.bfloat16 and x.stride(1) == 1, (x.dtype, x.stride())
    assert q.dtype == torch.float8_e4m3fn and q.is_contiguous() and q.shape[1] == k
    assert scales.dtype == torch.float32 and scales.shape == (triton.cdiv(n, BLOCK), k // BLOCK)
    assert x.device == q.device == scales.device
    assert 1 <= m <= ROW_TILE * MAX_M_TILES, f"{m} rows: the fp8 head serves 1..64"
    if block_k is None:
        block_k = next(b for b in (128, 64, 32) if k % b == 0)
    assert block_k % BLOCK == 0 and k % block_k == 0, (k, block_k)
    if out is None:
        out = torch.empty((m, n), dtype=torch.float32, device=x.device)
    assert out.shape == (m, n) and out.dtype == torch.float32 and out.stride(1) == 1
    _draft_head_fp8_kernel[(triton.cdiv(n, block_n),)](
        x, q, scales, out, m, n, k,
        x.stride(0), q.stride(0), scales.stride(0), out.stride(0),
        BLOCK_N=block_n, BLOCK_K=block_k, M_TILES=triton.cdiv(m, ROW_TILE),
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
