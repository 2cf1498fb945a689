"""fp8 copy of the draft's LM head (e4m3, one power-of-two scale per 32x32 block) and the
portable draft-logits GEMM that reads it (--speculative-dspark-draft-head-fp8): served on SM89
and run by the CPU tests; on Hopper the flag serves draft_head_fp8_wgmma.py.

EXACT. Each weight tile is dequantized in registers to bf16 exactly, bf16 products are exact in
the fp32 accumulator, and K runs in one fixed order whatever the row count or configuration: a
row's logits are the same bits at every row count (how, and why: docs/draft-head-fp8.md).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

# e4m3 x4 -> two bf16x2 words times a scale word carrying 2**112 (exact; shared with the wo_a twin)
from sglang.kernels.ops.gemm.e4m3_to_bf16 import E4M3X4_TO_BF16_ASM

BLOCK = 32  # quantization block (rows and columns)
FP8_MAX = 448.0
ROW_TILE = 16
MAX_M_TILES = 4  # up to 64 rows per call with the head streamed once
# Largest scale with scale * 2**112 finite in bf16 (the packed conversion's bias change).
MAX_SCALE = 2.0**15

# (block_n, block_k, num_warps, num_stages, weights by TMA) per number of 16-row tiles: the
# best worst case over both shards on the H200 (benchmark/results/archive/tune_draft_head_fp8-NVIDIA_H200.json).
CONFIGS: dict[int, tuple[int, ...]] = {
    1: (128, 256, 8, 3, 1),
    2: (128, 128, 4, 4, 0),
    3: (256, 128, 8, 4, 1),
    4: (128, 128, 4, 4, 0),
}

CVT_TRITON, CVT_ASM, CVT_EMULATED = 0, 1, 2


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
def _dequant_bf16(q, s, CVT: tl.constexpr):
    """q [BN, BK/32, 32] e4m3, s [BN, BK/32] fp32 powers of two -> q * s in bf16 (exact)."""
    if CVT == 0:  # Triton's conversion (a scalar F2F per weight)
        return q.to(tl.bfloat16) * s.to(tl.bfloat16)[:, :, None]
    elif CVT == 1:
        s_b = tl.broadcast_to(
            (s * 5.192296858534828e33).to(tl.bfloat16)[:, :, None], q.shape
        )  # * 2**112
        return tl.inline_asm_elementwise(
            E4M3X4_TO_BF16_ASM,
            "=r,=r,r,r,r",
            [q.to(tl.uint8, bitcast=True), s_b],
            dtype=tl.bfloat16,
            is_pure=True,
            pack=4,
        )
    else:  # the asm's bit moves in Triton ops, the multiply in fp32 (exact either way): the
        # CPU interpreter has no inline asm and no bf16 arithmetic
        h = q.to(tl.float16).to(tl.uint16, bitcast=True)
        b = (((h & 0x7FFF) >> 3) | (h & 0x8000)).to(tl.uint16)
        w = (
            b.to(tl.bfloat16, bitcast=True).to(tl.float32)
            * (s * 5.192296858534828e33)[:, :, None]
        )
        return w.to(tl.bfloat16)


@triton.jit
def _tile_dot(acc, x_ptr, stride_xm, m0, M, offs_k, w_t, CVT: tl.constexpr):
    rows = m0 + tl.arange(0, 16)
    x = tl.load(
        x_ptr + rows[:, None] * stride_xm + offs_k[None, :],
        mask=rows[:, None] < M,
        other=0.0,
    )
    if (
        CVT == 2
    ):  # the interpreter's bf16 dot is wrong; fp32 operands hold the same values
        return tl.dot(x.to(tl.float32), w_t.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(x, w_t, acc)  # bf16 x bf16 -> fp32: exact products, fixed K order


@triton.jit
def _tile_store(out_ptr, stride_om, m0, M, offs_n, n_mask, acc):
    rows = m0 + tl.arange(0, 16)
    tl.store(
        out_ptr + rows[:, None] * stride_om + offs_n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=(rows[:, None] < M) & n_mask[None, :],
    )


@triton.jit(do_not_specialize=["M"])
def _draft_head_fp8_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    M,
    N,
    K: tl.constexpr,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_om,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    M_TILES: tl.constexpr,
    CVT: tl.constexpr,
    W_TMA: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_kb = tl.arange(0, BLOCK_K // 32)
    acc0 = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    acc1 = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    acc3 = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if (
            W_TMA
        ):  # w_ptr is a TensorDescriptor [N, K] with [BLOCK_N, BLOCK_K] boxes (zero past N)
            q = w_ptr.load([pid * BLOCK_N, k0])
        else:
            q = tl.load(
                w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :],
                mask=n_mask[:, None],
                other=0.0,
            )
        s = tl.load(
            s_ptr + (offs_n // 32)[:, None] * stride_sn + (k0 // 32 + offs_kb)[None, :],
            mask=n_mask[:, None],
            other=1.0,
        )
        w = _dequant_bf16(tl.reshape(q, (BLOCK_N, BLOCK_K // 32, 32)), s, CVT)
        w_t = tl.trans(
            tl.reshape(w, (BLOCK_N, BLOCK_K))
        )  # converted once, shared by every row tile
        acc0 = _tile_dot(acc0, x_ptr, stride_xm, 0, M, offs_k, w_t, CVT)
        if M_TILES >= 2:
            acc1 = _tile_dot(acc1, x_ptr, stride_xm, 16, M, offs_k, w_t, CVT)
        if M_TILES >= 3:
            acc2 = _tile_dot(acc2, x_ptr, stride_xm, 32, M, offs_k, w_t, CVT)
        if M_TILES >= 4:
            acc3 = _tile_dot(acc3, x_ptr, stride_xm, 48, M, offs_k, w_t, CVT)
    _tile_store(out_ptr, stride_om, 0, M, offs_n, n_mask, acc0)
    if M_TILES >= 2:
        _tile_store(out_ptr, stride_om, 16, M, offs_n, n_mask, acc1)
    if M_TILES >= 3:
        _tile_store(out_ptr, stride_om, 32, M, offs_n, n_mask, acc2)
    if M_TILES >= 4:
        _tile_store(out_ptr, stride_om, 48, M, offs_n, n_mask, acc3)


def _weight_descriptor(q: torch.Tensor, block_n: int, block_k: int):
    """The head's TMA descriptor per box, kept on the (persistent) head tensor itself."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    cache = q.__dict__.setdefault("_draft_head_fp8_tma", {})
    desc = cache.get((block_n, block_k))
    if desc is None:
        desc = cache[(block_n, block_k)] = TensorDescriptor.from_tensor(
            q, [block_n, block_k]
        )
    return desc


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def _native_cvt(device: torch.device) -> int:
    """The asm's mul.bf16x2 needs SM90; SM89 takes Triton's conversion (as exact)."""
    return CVT_ASM if torch.cuda.get_device_capability(device) >= (9, 0) else CVT_TRITON


def draft_head_fp8_logits(
    x: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
    config: tuple[int, ...] | None = None,
    cvt: int | None = None,
) -> torch.Tensor:
    """logits [M, N] = x [M, K] (bf16) @ dequant(q, scales)^T, for 1 <= M <= 64, rounded once from
    the fp32 sums; ``config`` / ``cvt`` override tiling / dequantization."""
    m, k = x.shape
    n = q.shape[0]
    assert x.dtype == torch.bfloat16 and x.stride(1) == 1, (x.dtype, x.stride())
    assert q.dtype == torch.float8_e4m3fn and q.is_contiguous() and q.shape[1] == k
    assert scales.dtype == torch.float32 and scales.shape == (
        triton.cdiv(n, BLOCK),
        k // BLOCK,
    )
    assert x.device == q.device == scales.device
    assert (
        1 <= m <= ROW_TILE * MAX_M_TILES
    ), f"{m} rows: the fp8 head serves 1..{ROW_TILE * MAX_M_TILES}"
    m_tiles = triton.cdiv(m, ROW_TILE)
    block_n, block_k, num_warps, num_stages, *rest = config or CONFIGS[m_tiles]
    block_k = min(block_k, k)
    assert block_k % BLOCK == 0 and k % block_k == 0 and block_k & (block_k - 1) == 0, (
        k,
        block_k,
    )
    # TMA boxes for the weights where the shard holds a whole box (the real shards do)
    w_tma = bool(rest and rest[0]) and n >= block_n and not _interpreting()
    if cvt is None:
        cvt = CVT_EMULATED if _interpreting() else _native_cvt(x.device)
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    assert out.shape == (m, n) and out.stride(1) == 1, (out.shape, out.stride())
    assert out.dtype in (torch.float32, torch.bfloat16, torch.float16), out.dtype
    w = _weight_descriptor(q, block_n, block_k) if w_tma else q
    _draft_head_fp8_kernel[(triton.cdiv(n, block_n),)](
        x,
        w,
        scales,
        out,
        m,
        n,
        k,
        x.stride(0),
        q.stride(0),
        scales.stride(0),
        out.stride(0),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        M_TILES=m_tiles,
        CVT=cvt,
        W_TMA=w_tma,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
