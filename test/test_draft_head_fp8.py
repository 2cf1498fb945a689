"""--speculative-dspark-draft-head-fp8: quantizer, kernel vs an fp32 reference, row
invariance (CPU interpreted at small shapes; GPU at the real shard inside a CUDA graph),
refusals, and the total variation of the fp8 vs bf16 head's softmax (reported)."""

from __future__ import annotations

import types

import pytest
import torch

from sglang.kernels.ops.speculative.dspark.draft_head_fp8 import (
    dequantize_head_fp8,
    draft_head_fp8_logits,
    quantize_head_fp8,
)
from sglang.srt.speculative.dspark_components import dspark_draft_head_fp8 as mod

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _head(n, k, seed=0, device=DEV):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    w[:32, :32] *= 1000  # one block far larger than the rest
    w[32:64, 32:64] = 0  # an all-zero block
    return w.to(torch.bfloat16).to(device)


def test_quantizer_power_of_two_scales_bounded_exact_dequant():
    w = _head(100, 128, device="cpu")
    q, s = quantize_head_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert s.shape == (4, 4) and s.dtype == torch.float32
    assert bool((torch.log2(s).frac() == 0).all())  # powers of two
    assert float(q.float().abs().max()) <= 448.0
    deq = dequantize_head_fp8(q, s)
    # Exact dequantisation: q * s is representable, dividing back gives q bit for bit.
    sb = s.repeat_interleave(32, 0)[:100].repeat_interleave(32, 1)
    assert torch.equal((deq / sb).to(torch.float8_e4m3fn).view(torch.uint8), q.view(torch.uint8))
    # Each block's scale is the smallest power of two that keeps it within 448.
    amax = w.float().abs().reshape(-1)
    assert float((deq - w.float()).abs().max()) <= float(amax.max()) * 2**-3
    assert bool((s[1, 1] == 1.0))  # zero block


@pytest.mark.parametrize("rows", [1, 5, 20, 40])
def test_kernel_matches_fp32_reference(rows):
    w = _head(96, 128)
    q, s = quantize_head_fp8(w)
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16).to(DEV)
    got = draft_head_fp8_logits(x, q, s)
    ref = x.double() @ dequantize_head_fp8(q, s).double().T
    assert got.dtype == torch.float32 and got.shape == (rows, 96)
    assert float((got.double() - ref).abs().max()) <= 1e-5 * max(1.0, float(ref.abs().max()))


def test_row_invariance_small():
    w = _head(64, 96)
    q, s = quantize_head_fp8(w)
    x = torch.randn(60, 96, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).to(DEV)
    full = draft_head_fp8_logits(x, q, s)
    for m in (1, 5, 17, 33):
        assert torch.equal(draft_head_fp8_logits(x[:m].contiguous(), q, s), full[:m]), m


def test_refusals():
    head = types.SimpleNamespace(weight=torch.zeros(64, 64, dtype=torch.bfloat16), quant_method=None)
    model = types.SimpleNamespace(uses_own_vocab_modules=False, _use_fp32_lm_head=False)
    assert mod.maybe_build_draft_head_fp8(model, head, False) is None
    with pytest.raises(ValueError, match="own vocab modules"):
        mod.check_draft_head_fp8_applies(types.SimpleNamespace(uses_own_vocab_modules=True), head)
    with pytest.raises(ValueError, match="FP32_LM_HEAD"):
        mod.check_draft_head_fp8_applies(
            types.SimpleNamespace(uses_own_vocab_modules=False, _use_fp32_lm_head=True), head)
    bad = types.SimpleNamespace(weight=torch.zeros(64, 64, dtype=torch.float32), quant_method=None)
    with pytest.raises(ValueError, match="bf16/fp16"):
        mod.check_draft_head_fp8_applies(model, bad)
    odd = types.SimpleNamespace(weight=torch.zeros(64, 48, dtype=torch.bfloat16), quant_method=None)
    with pytest.raises(ValueError, match="multiple of 32"):
        mod.check_draft_head_fp8_applies(model, odd)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs CUDA"):
            mod.check_draft_head_fp8_applies(model, head)
    from sglang.srt.arg_groups.fields.spec import Spec

    i = Spec.__struct_fields__.index("speculative_dspark_draft_head_fp8")
    assert Spec.__struct_defaults__[i] is False


@pytest.mark.gpu
@pytest.mark.parametrize("n", [32320, 129280])
def test_gpu_row_invariance_in_a_cuda_graph_and_tv(n):
    k = 5120
    w = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
    head = mod.DraftHeadFp8(w)
    x = torch.randn(64, k, device="cuda").to(torch.bfloat16)
    ref = draft_head_fp8_logits(x, head.q, head.scales)
    outs = {}
    for m in (1, 5, 16, 20, 60, 64):
        xm = x[:m].clone()
        out = torch.empty((m, n), dtype=torch.float32, device="cuda")
        draft_head_fp8_logits(xm, head.q, head.scales, out=out)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            draft_head_fp8_logits(xm, head.q, head.scales, out=out)
        out.zero_()
        g.replay()
        torch.cuda.synchronize()
        outs[m] = out
        assert torch.equal(out, ref[:m]), m
    exact = x.double() @ dequantize_head_fp8(head.q, head.scales).double().T
    assert float((ref.double() - exact).abs().max()) <= 1e-5 * float(exact.abs().max())
    bf16 = (x @ w.T).float()
    tv = 0.5 * (torch.softmax(ref, -1) - torch.softmax(bf16, -1)).abs().sum(-1)
    print(f"N={n}: TV(softmax fp8 head, softmax bf16 head) mean {float(tv.mean()):.2e} "
          f"max {float(tv.max()):.2e}; fp8 copy {head.nbytes / 1e6:.1f} MB")
