"""Proof that the GPU bundle runs upstream kernels from the assembled tree on the H200:
upstream's own ``wo_a_bf16_small_batch`` against a torch reference."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("m", range(2, 9))
def test_stock_wo_a_small_batch_matches_torch(m):
    from sglang.kernels.ops.gemm.dsv4_wo_a import wo_a_bf16_small_batch

    torch.manual_seed(m)
    # Activations as the model hands them over: a row stride wider than G * 4096.
    x = torch.randn(m, 3, 4096, device="cuda", dtype=torch.bfloat16)[:, :2]
    w = torch.randn(2, 1024, 4096, device="cuda", dtype=torch.bfloat16) / 64
    out = wo_a_bf16_small_batch(x, w)
    ref = torch.einsum("tgd,grd->tgr", x.double(), w.double())
    assert out.dtype == torch.bfloat16 and out.shape == (m, 2, 1024)
    err = (out.double() - ref).norm() / ref.norm()
    assert err < 4e-3  # bf16 output rounding; fp32 accumulation inside
    # Each output is the fp32 sum rounded once to bf16: within one bf16 ulp of the exact value.
    ulp = torch.finfo(torch.bfloat16).eps * ref.abs().clamp_min(2**-20)
    assert ((out.double() - ref).abs() <= ulp).float().mean() > 0.99
