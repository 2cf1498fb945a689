"""--speculative-dspark-draft-head-fp8: quantizer, kernel vs an fp32 reference, row
invariance (CPU interpreted at small shapes; GPU at the real shard inside a CUDA graph),
the row gate, refusals, and the total variation of the fp8 vs bf16 head's softmax (reported)."""

from __future__ import annotations

import types

import pytest
import torch

from sglang.kernels.ops.speculative.dspark import draft_head_fp8 as kern
from sglang.kernels.ops.speculative.dspark.draft_head_fp8 import (
    dequantize_head_fp8,
    draft_head_fp8_logits,
    quantize_head_fp8,
)
from sglang.srt.speculative.dspark_components import dspark_draft_head_fp8 as mod

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# Small tiles for the CPU interpreter (the shipped CONFIGS are for the real shard).
SMALL = (32, 64, 4, 2)


def _head(n, k, seed=0, device=DEV):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    w[:32, :32] *= 1000  # one block far larger than the rest
    w[32:64, 32:64] = 0  # an all-zero block
    w[64:96, :32] *= 1e-3  # a block of tiny weights (a small scale)
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
    assert torch.equal(
        (deq / sb).to(torch.float8_e4m3fn).view(torch.uint8), q.view(torch.uint8)
    )
    # Each block's scale is the smallest power of two that keeps it within 448.
    amax = w.float().abs().reshape(-1)
    assert float((deq - w.float()).abs().max()) <= float(amax.max()) * 2**-3
    assert bool((s[1, 1] == 1.0))  # zero block
    assert float(s.max()) <= kern.MAX_SCALE


@pytest.mark.parametrize("rows", [1, 5, 20, 40, 64])
def test_kernel_matches_fp32_reference(rows):
    w = _head(96, 128)
    q, s = quantize_head_fp8(w)
    x = (
        torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows))
        .to(torch.bfloat16)
        .to(DEV)
    )
    cfg = None if DEV == "cuda" else SMALL
    got = draft_head_fp8_logits(x, q, s, config=cfg)
    ref = x.double() @ dequantize_head_fp8(q, s).double().T
    assert got.dtype == torch.float32 and got.shape == (rows, 96)
    assert float((got.double() - ref).abs().max()) <= 1e-5 * max(
        1.0, float(ref.abs().max())
    )
    # bf16 logits (the call site's dtype) are the fp32 sums rounded once (to nearest on the
    # GPU; the CPU interpreter truncates, so there within one bf16 ulp).
    got16 = draft_head_fp8_logits(x, q, s, config=cfg, out_dtype=torch.bfloat16)
    if DEV == "cuda":
        assert torch.equal(got16, got.to(torch.bfloat16))
    else:
        assert bool(((got16.float() - got).abs() <= got.abs() * 2**-7).all())


def test_row_invariance_small():
    w = _head(64, 96)
    q, s = quantize_head_fp8(w)
    x = (
        torch.randn(64, 96, generator=torch.Generator().manual_seed(3))
        .to(torch.bfloat16)
        .to(DEV)
    )
    cfg = (32, 32, 4, 2)  # K = 96: a block_k that divides it
    full = draft_head_fp8_logits(x, q, s, config=cfg)
    for m in (1, 5, 17, 33, 60):
        assert torch.equal(
            draft_head_fp8_logits(x[:m].contiguous(), q, s, config=cfg), full[:m]
        ), m


def test_row_gate_and_refusals():
    head = types.SimpleNamespace(
        weight=torch.zeros(64, 64, dtype=torch.bfloat16), quant_method=None
    )
    model = types.SimpleNamespace(uses_own_vocab_modules=False, _use_fp32_lm_head=False)
    assert mod.maybe_build_draft_head_fp8(model, head, False) is None
    # The gate serves 1..MAX_ROWS of its kernel (each covers them all in one pass over the head).
    from sglang.kernels.ops.speculative.dspark import draft_head_fp8_wgmma as wg

    assert 20 <= mod.MAX_ROWS["mma.sync"] <= kern.ROW_TILE * kern.MAX_M_TILES
    assert mod.MAX_ROWS["wgmma"] == wg.MAX_ROWS
    for top in mod.MAX_ROWS.values():
        gate = types.SimpleNamespace(max_rows=top)
        assert mod.DraftHeadFp8.serves(gate, 1) and mod.DraftHeadFp8.serves(gate, 20)
        assert not mod.DraftHeadFp8.serves(gate, 0)
        assert not mod.DraftHeadFp8.serves(gate, top + 1)
    with pytest.raises(ValueError, match="own vocab modules"):
        mod.check_draft_head_fp8_applies(
            types.SimpleNamespace(uses_own_vocab_modules=True), head
        )
    with pytest.raises(ValueError, match="FP32_LM_HEAD"):
        mod.check_draft_head_fp8_applies(
            types.SimpleNamespace(uses_own_vocab_modules=False, _use_fp32_lm_head=True),
            head,
        )
    bad = types.SimpleNamespace(
        weight=torch.zeros(64, 64, dtype=torch.float32), quant_method=None
    )
    with pytest.raises(ValueError, match="bf16/fp16"):
        mod.check_draft_head_fp8_applies(model, bad)
    odd = types.SimpleNamespace(
        weight=torch.zeros(64, 48, dtype=torch.bfloat16), quant_method=None
    )
    with pytest.raises(ValueError, match="multiple of 32"):
        mod.check_draft_head_fp8_applies(model, odd)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs CUDA"):
            mod.check_draft_head_fp8_applies(model, head)
    from sglang.srt.arg_groups.fields.spec import Spec

    i = Spec.__struct_fields__.index("speculative_dspark_draft_head_fp8")
    assert Spec.__struct_defaults__[i] is False


def _args(enabled, algorithm, deterministic=False):
    return types.SimpleNamespace(
        speculative_dspark_draft_head_fp8=enabled,
        speculative_algorithm=algorithm,
        enable_deterministic_inference=deterministic,
    )


def test_flag_refused_where_no_draft_builds_the_copy(monkeypatch):
    """Only DSPARK with a DeepSeek-V4 target builds the fp8 head (in DeepseekV4ForCausalLMDSpark);
    elsewhere the flag is refused at startup instead of being ignored."""
    import sglang.srt.arg_groups.model_override_base as mob

    arch = {"a": "DeepseekV4ForCausalLM"}
    monkeypatch.setattr(
        mob,
        "model_config_of",
        lambda sa: types.SimpleNamespace(
            hf_config=types.SimpleNamespace(architectures=[arch["a"]])
        ),
    )
    mod.validate_draft_head_fp8(_args(False, "EAGLE", False))
    mod.validate_draft_head_fp8(_args(True, "DSPARK", False))
    with pytest.raises(ValueError, match="DSPARK only .got 'EAGLE'."):
        mod.validate_draft_head_fp8(_args(True, "EAGLE", False))
    arch["a"] = "Qwen3MoeForCausalLM"
    with pytest.raises(
        ValueError, match="target is Qwen3MoeForCausalLM; only the DSpark draft"
    ):
        mod.validate_draft_head_fp8(_args(True, "DSPARK", False))


def test_refuses_deterministic_inference():
    """Above MAX_ROWS the bf16 head serves, so a row's draft logits would follow its batch's row
    count: with --enable-deterministic-inference the flag is refused when the arguments resolve,
    naming both (the real resolution: test_deterministic_inference_is_refused_at_resolution).
    """
    with pytest.raises(
        ValueError, match="cannot be used with --enable-deterministic-inference"
    ):
        mod.validate_draft_head_fp8(_args(True, "DSPARK", True))
    mod.validate_draft_head_fp8(_args(False, "DSPARK", True))  # off: nothing to refuse


def check_row_invariance_in_graphs(
    n: int, configs=None, rows=(1, 2, 5, 16, 17, 20, 32, 33, 48, 64)
):
    """The mma.sync kernel (served on SM89, tuned by tune_draft_head_fp8.py): each row's logits
    (fp32 and bf16) are the same bits at every row count, eager and replayed from a CUDA graph;
    returns (bf16 head, fp8 copy, x, fp32 logits of 64 rows)."""
    k = 5120
    w = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
    q, s = kern.quantize_head_fp8(w)
    x = torch.randn(64, k, device="cuda").to(torch.bfloat16)

    def cfg(m):
        mt = kern.triton.cdiv(m, kern.ROW_TILE)
        return (configs or {}).get(mt) or kern.CONFIGS[mt]

    ref = draft_head_fp8_logits(x, q, s, config=cfg(64))
    for m in rows:
        for dtype in (torch.float32, torch.bfloat16):
            xm = x[:m].clone()
            out = torch.empty((m, n), dtype=dtype, device="cuda")
            draft_head_fp8_logits(xm, q, s, out=out, config=cfg(m))
            assert torch.equal(out, ref[:m].to(dtype)), (n, m, dtype, "eager")
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                draft_head_fp8_logits(xm, q, s, out=out, config=cfg(m))
            out.zero_()
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, ref[:m].to(dtype)), (n, m, dtype, "graph")
    exact = x.double() @ dequantize_head_fp8(q, s).double().T
    assert float((ref.double() - exact).abs().max()) <= 1e-5 * float(exact.abs().max())
    return w, (q, s), x, ref


@pytest.mark.gpu
@pytest.mark.parametrize("n", [32320, 129280])
def test_gpu_row_invariance_in_a_cuda_graph(n):
    check_row_invariance_in_graphs(n)


def test_cpu_head_takes_the_portable_kernel_and_layout():
    w = (torch.randn(64, 128) * 0.02).to(torch.bfloat16)
    head = mod.DraftHeadFp8(w)
    q, s = kern.quantize_head_fp8(w)
    assert head.kernel == "mma.sync" and torch.equal(
        head.q.view(torch.uint8), q.view(torch.uint8)
    )
    assert torch.equal(head.scales, s)


def test_permute_k_puts_each_threads_fragment_bytes_together():
    from sglang.kernels.ops.gemm.e4m3_to_bf16 import permute_k

    q = torch.randint(0, 127, (64, 128), dtype=torch.uint8).view(torch.float8_e4m3fn)
    qp = permute_k(q).view(torch.uint8)
    q8 = q.view(torch.uint8)
    for blk in range(4):
        for t in range(4):
            for j in range(4):
                for e in range(2):
                    assert torch.equal(
                        qp[:, blk * 32 + 8 * t + 2 * j + e],
                        q8[:, blk * 32 + 8 * j + 2 * t + e],
                    )


@pytest.mark.gpu
@pytest.mark.parametrize("n", [32320, 129280])
def test_gpu_served_head_row_invariance_in_a_cuda_graph_exactness_and_tv(n):
    """The kernel the flag serves on this device (wgmma on the H200), through the call site's
    object: every row count it serves (1..64 on Hopper) gives each row the same bits, eager and replayed from a CUDA
    graph; logits within 1e-5 of the fp64 product; TV of its softmax vs the bf16 head's.
    """
    k = 5120
    w = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
    head = mod.DraftHeadFp8(w)
    if torch.cuda.get_device_capability()[0] == 9:
        assert head.kernel == "wgmma"
    x = torch.randn(head.max_rows, k, device="cuda").to(torch.bfloat16)
    ref = head(x)
    rows = (1, 2, 5, 8, 9, 16, 17, 20, 31, 32, 33, 40, 63, 64, 65, 96, 97, 127, 128)
    for m in (r for r in rows if r <= head.max_rows):
        xm = x[:m].clone()
        assert torch.equal(head(xm), ref[:m]), (n, m, "eager")
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = head(xm)
        out.zero_()
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ref[:m]), (n, m, "graph")
    # a contiguous view at an offset TMA cannot read (2 bytes past alignment) gives the same bits
    odd = torch.empty(5 * k + 8, device="cuda", dtype=torch.bfloat16)[
        1 : 1 + 5 * k
    ].view(5, k)
    odd.copy_(x[:5])
    assert torch.equal(head(odd), ref[:5])
    q, s = kern.quantize_head_fp8(w)
    exact = x.double() @ dequantize_head_fp8(q, s).double().T
    if head.kernel == "wgmma":
        from sglang.kernels.ops.speculative.dspark.draft_head_fp8_wgmma import (
            draft_head_fp8_logits_wgmma,
        )

        got = draft_head_fp8_logits_wgmma(x, head.q, head.scales)  # fp32 logits
        assert torch.equal(got.to(torch.bfloat16), ref)
    else:
        got = draft_head_fp8_logits(x, q, s)
    assert float((got.double() - exact).abs().max()) <= 1e-5 * float(exact.abs().max())
    bf16 = (x @ w.T).float()
    tv = 0.5 * (torch.softmax(got, -1) - torch.softmax(bf16, -1)).abs().sum(-1)
    print(
        f"N={n} ({head.kernel}): TV(softmax fp8 head, softmax bf16 head) mean {float(tv.mean()):.2e} "
        f"max {float(tv.max()):.2e}; fp8 copy {head.nbytes / 1e6:.1f} MB"
    )


def test_conversion_follows_the_device(monkeypatch):
    """The asm's mul.bf16x2 needs SM90: SM89 takes Triton's conversion (exact as well)."""
    from sglang.kernels.ops.speculative.dspark import draft_head_fp8 as k

    for cap, want in (
        ((8, 9), k.CVT_TRITON),
        ((9, 0), k.CVT_ASM),
        ((10, 0), k.CVT_ASM),
    ):
        k._native_cvt.cache_clear()
        monkeypatch.setattr(
            torch.cuda, "get_device_capability", lambda device=None, cap=cap: cap
        )
        assert k._native_cvt(torch.device("cuda", 0)) == want, cap
    k._native_cvt.cache_clear()


def test_fp8_copy_refuses_online_weight_updates(monkeypatch):
    """The copy is built once: the target's lm_head declares upstream's
    ``_derived_weight_cache_error``, so its runner refuses online updates before writing.
    """
    from sglang.srt.model_executor.model_runner_components.weight_updater import (
        _unsupported_derived_weight_cache_error,
    )

    monkeypatch.setattr(mod, "check_draft_head_fp8_applies", lambda *a: None)
    monkeypatch.setattr(
        mod,
        "DraftHeadFp8",
        lambda w: types.SimpleNamespace(max_rows=1, kernel="mma.sync", nbytes=0),
    )
    target = torch.nn.ModuleDict({"lm_head": torch.nn.Linear(64, 64, bias=False)})
    assert _unsupported_derived_weight_cache_error(target) is None
    mod.maybe_build_draft_head_fp8(types.SimpleNamespace(), target["lm_head"], True)
    assert (
        "--speculative-dspark-draft-head-fp8"
        in _unsupported_derived_weight_cache_error(target)
    )


def test_deterministic_inference_is_refused_at_resolution(llama_config):
    """Refused when the server arguments resolve, not after the target has loaded."""
    from conftest import resolve_server_args

    with pytest.raises(
        ValueError,
        match=r"--speculative-dspark-draft-head-fp8 cannot be used with --enable-deterministic-inference",
    ):
        resolve_server_args(
            llama_config,
            speculative_dspark_draft_head_fp8=True,
            enable_deterministic_inference=True,
        )
