"""Pad-K (test/pad_k.py: not in the wheel, no engine code calls it; docs/b12x-mxfp8-linear.md): a linear's K padded to a backend's granule.

CPU: the plan (granule, scale blocks, refusals), the padded weight and scales (fp32 block
scales, e8m0 bytes, float8_e8m0fnu, a partial last block), the input buffer (tail zero across
calls, capacity, refusals), and the padded GEMM bit for bit equal to the unpadded one, in torch
(fp32 accumulation per K block, as the block-fp8 kernels do) and in a Triton block-fp8 GEMM of
upstream's structure under the interpreter (32x32 and 128x128 scale blocks). GPU (-m gpu):
upstream's own Triton block-fp8 GEMM (w8a8_block_fp8_matmul_triton, its default config, with
the Triton per-token-group quantizer) at DeepSeek-V4.1's TP4 shared-expert down_proj, N 5120,
K 576 against K 640, 1..256 rows: bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from pad_k import E8M0_ONE, KPad, pad_block_scales_k, plan_k_pad


def test_plan():
    assert plan_k_pad(576, 128, 32) == 640  # V4.1 TP4 shared-expert down_proj on b12x
    assert plan_k_pad(640, 128, 32) is None
    assert (
        plan_k_pad(576, 128, 128) == 640
    )  # 128-wide blocks: the fifth block was partial
    assert plan_k_pad(288, 128, 32) == 384  # TP8
    assert plan_k_pad(576, 64, 128) is None
    with pytest.raises(ValueError, match="cannot be re-blocked"):
        plan_k_pad(130, 48, 32)  # 144 splits a 32-wide scale block
    with pytest.raises(ValueError, match="positive"):
        plan_k_pad(576, 0, 32)


def test_scales_fp32_blocks_get_unit_scales():
    s = torch.rand(4, 18) + 0.5
    p = pad_block_scales_k(s, (128, 576), (32, 32), 640)
    assert p.shape == (4, 20) and p.dtype == torch.float32
    assert torch.equal(p[:, :18], s) and torch.equal(p[:, 18:], torch.ones(4, 2))


def test_scales_partial_last_block_keeps_its_scale():
    s = torch.rand(2, 5) + 0.5  # K 576 with 128-wide blocks: 4.5 blocks -> 5 scales
    p = pad_block_scales_k(s, (256, 576), (128, 128), 640)
    assert torch.equal(p, s)  # 640 / 128 = 5: the padding falls inside the last block


def test_scales_e8m0_bytes_and_dtype():
    codes = torch.randint(110, 140, (8, 18), dtype=torch.uint8)
    p = pad_block_scales_k(codes, (8, 576), (1, 32), 640)
    assert p.dtype == torch.uint8 and torch.equal(p[:, :18], codes)
    assert bool((p[:, 18:] == E8M0_ONE).all())
    e = pad_block_scales_k(codes.view(torch.float8_e8m0fnu), (8, 576), (1, 32), 640)
    assert e.dtype == torch.float8_e8m0fnu and torch.equal(e.view(torch.uint8), p)
    assert float(e[0, 19].float()) == 1.0


def test_scales_refusals():
    with pytest.raises(ValueError, match="needs scales"):
        pad_block_scales_k(torch.ones(4, 19), (128, 576), (32, 32), 640)
    with pytest.raises(ValueError, match="not a plain block layout"):
        pad_block_scales_k(
            torch.ones(4, 18, dtype=torch.int32), (128, 576), (32, 32), 640
        )
    with pytest.raises(ValueError, match="not a multiple"):
        pad_block_scales_k(torch.ones(4, 18), (128, 576), (32, 32), 648)


def test_input_buffer_tail_stays_zero():
    pad = KPad("layer.0.down_proj", 96, 128, rows=8, dtype=torch.float32)
    big = pad.pad_input(torch.full((8, 96), 3.0))
    assert big.data_ptr() == pad.buffer.data_ptr()
    for m in (1, 5, 8, 3):
        x = torch.randn(2, m, 96) if m == 3 else torch.randn(m, 96)
        y = pad.pad_input(x)
        assert y.shape == (*x.shape[:-1], 128) and y.data_ptr() == pad.buffer.data_ptr()
        assert torch.equal(y[..., :96], x) and not y[..., 96:].any()
    assert not pad.buffer[:, 96:].any() and pad.oversized_calls == 0
    y = pad.pad_input(torch.randn(9, 96))  # past capacity: a fresh copy, tail zero too
    assert y.data_ptr() != pad.buffer.data_ptr() and not y[:, 96:].any()
    assert pad.oversized_calls == 1


def test_input_refusals():
    pad = KPad("l", 96, 128, rows=4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="already quantized"):
        pad.pad_input(torch.zeros(2, 96, dtype=torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="input K 100"):
        pad.pad_input(torch.zeros(2, 100, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="buffer"):
        pad.pad_input(torch.zeros(2, 96, dtype=torch.float16))
    with pytest.raises(ValueError, match="must exceed"):
        KPad("l", 128, 128, rows=4)
    with pytest.raises(ValueError, match=r"expected a weight \[N, 96\]"):
        pad.pad_weights(torch.zeros(4, 128), torch.ones(1, 4), (32, 32))


# ------------------------------------------------------------- the padded GEMM, bit for bit


def _block_fp8(n, k, block, seed):
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    bn, bk = block
    s = torch.exp2(
        torch.randint(-9, -3, (-(-n // bn), -(-k // bk)), generator=gen).float()
    )
    return w, s


def _quant_groups(x, group):
    """Per-token-group e4m3 quantization (as upstream's): scale = amax / 448 per group."""
    m, k = x.shape
    g = x.float().view(m, k // group, group)
    s = g.abs().amax(-1).clamp_min(1e-10) / 448.0
    return (g / s[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(m, k), s


def _torch_block_gemm(xq, xs, w, ws, block):
    """fp32 accumulation in K-block order, acc += (x_blk @ w_blk^T) * x_scale * w_scale."""
    bn, bk = block
    m, k = xq.shape
    acc = torch.zeros(m, w.shape[0])
    for kb in range(k // bk):
        part = (
            xq[:, kb * bk : (kb + 1) * bk].float()
            @ w[:, kb * bk : (kb + 1) * bk].float().T
        )
        wsc = ws[:, kb].repeat_interleave(bn)[: w.shape[0]]
        acc = acc + part * xs[:, kb : kb + 1] * wsc[None, :]
    return acc.to(torch.bfloat16)


@triton.jit
def _block_fp8_gemm_kernel(
    A,
    B,
    C,
    As,
    Bs,
    M,
    N,
    stride_as,
    stride_bs,
    K_BLOCKS: tl.constexpr,
    GROUP_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Upstream _w8a8_block_fp8_matmul's arithmetic: one fp32 accumulator, per K block
    acc += dot(a, b) * a_s * b_s (BLOCK_K = the scale block)."""
    pm, pn = tl.program_id(0), tl.program_id(1)
    rm = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(K_BLOCKS):
        a = tl.load(
            A + rm[:, None] * (K_BLOCKS * BLOCK_K) + kb * BLOCK_K + rk[None, :],
            mask=rm[:, None] < M,
            other=0.0,
        )
        b = tl.load(
            B + rn[None, :] * (K_BLOCKS * BLOCK_K) + kb * BLOCK_K + rk[:, None],
            mask=rn[None, :] < N,
            other=0.0,
        )
        a_s = tl.load(As + rm * stride_as + kb, mask=rm < M, other=0.0)
        b_s = tl.load(Bs + (rn // GROUP_N) * stride_bs + kb, mask=rn < N, other=0.0)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
    tl.store(
        C + rm[:, None] * N + rn[None, :],
        acc.to(tl.bfloat16),
        mask=(rm[:, None] < M) & (rn[None, :] < N),
    )


def _triton_block_gemm(xq, xs, w, ws, block):
    m, k = xq.shape
    n = w.shape[0]
    bn, bk = block
    assert k % bk == 0
    c = torch.empty(m, n, dtype=torch.bfloat16, device=xq.device)
    _block_fp8_gemm_kernel[(triton.cdiv(m, 16), triton.cdiv(n, 32))](
        xq,
        w,
        c,
        xs,
        ws,
        m,
        n,
        xs.stride(0),
        ws.stride(0),
        K_BLOCKS=k // bk,
        GROUP_N=bn,
        BLOCK_M=16,
        BLOCK_N=32,
        BLOCK_K=bk,
    )
    return c


@pytest.mark.parametrize(
    "gemm", [_torch_block_gemm, _triton_block_gemm], ids=["torch", "triton"]
)
@pytest.mark.parametrize(
    "n,k,granule,block", [(64, 96, 128, (32, 32)), (32, 384, 256, (128, 128))]
)
def test_padded_gemm_bitwise(gemm, n, k, granule, block):
    padded_k = plan_k_pad(k, granule, block[1])
    w, ws = _block_fp8(n, k, block, seed=n + k)
    pad = KPad("t", k, padded_k, rows=8, dtype=torch.bfloat16)
    wp, wsp = pad.pad_weights(w, ws, block)
    assert (
        torch.equal(wp[:, :k].view(torch.uint8), w.view(torch.uint8))
        and not wp[:, k:].float().any()
    )
    for m in (1, 3, 8):
        x = (torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 2).to(
            torch.bfloat16
        )
        xq, xs = _quant_groups(x, block[1])
        xpq, xps = _quant_groups(pad.pad_input(x), block[1])
        ref = gemm(xq, xs, w, ws, block)
        out = gemm(xpq, xps, wp, wsp, block)
        assert torch.equal(out.view(torch.int16), ref.view(torch.int16)), (
            m,
            gemm.__name__,
        )


# ------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 6, 16, 64, 256])
def test_gpu_upstream_triton_block_fp8_k576_vs_640(monkeypatch, m):
    """Upstream's Triton block-fp8 GEMM (default config: its tuned K=576 file may split K, which
    no padding can match) on the padded shape gives the unpadded shape's bits."""
    from sglang.kernels.ops.gemm import fp8_kernel as gemm
    from sglang.kernels.ops.quantization.fp8_kernel import (
        _per_token_group_quant_8bit_raw,
    )

    monkeypatch.setattr(gemm, "get_w8a8_block_fp8_configs", lambda *a, **k: None)
    n, k, block = 5120, 576, [32, 32]
    padded_k = plan_k_pad(k, 128, 32)
    w, ws = _block_fp8(n, k, tuple(block), seed=1)
    w, ws = w.cuda(), ws.cuda()
    pad = KPad(
        "shared_experts.down_proj",
        k,
        padded_k,
        rows=64,
        dtype=torch.bfloat16,
        device="cuda",
    )
    wp, wsp = pad.pad_weights(w, ws, tuple(block))
    x = (torch.randn(m, k, device="cuda") * 2).to(torch.bfloat16)

    def run(inp, weight, scale):
        q, s = _per_token_group_quant_8bit_raw(inp.contiguous(), 32)
        return gemm.w8a8_block_fp8_matmul_triton(
            q, weight, s, scale, block, output_dtype=torch.bfloat16
        )

    ref, out = run(x, w, ws), run(pad.pad_input(x), wp, wsp)
    assert (m > 64) == (pad.oversized_calls == 1)
    diff = int((out.view(torch.int16) != ref.view(torch.int16)).sum())
    assert diff == 0, f"{diff} of {ref.numel()} outputs differ at {m} rows"
