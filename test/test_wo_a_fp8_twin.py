"""--dsv4-wo-a-fp8-twin: wo_a read from an exact fp8 twin (patch 0002).

CPU (TRITON_INTERPRET=1, reduced shapes): flag parsing, twin exactness, kernel against a float64
reference, determinism, routing rules (MXFP8 requests, prefill, 1 row stay stock), the dispatch
wiring with the flag off. GPU (-m gpu, H200): the bf16 path against upstream's
wo_a_bf16_small_batch (at most 1 ulp on at most 1 % of outputs), G = 2/4/8 and 2..192 rows
against the exact result, determinism; the MXFP8 bitwise property is an expected failure (the
dispatch therefore keeps MXFP8 calls on stock).
"""

from __future__ import annotations

import argparse

import pytest
import torch

from conftest import HAS_CUDA
from sglang.kernels.ops.gemm import dsv4_wo_a_fp8 as k
from sglang.srt.models import deepseek_v4_wo_a_twin as twin_mod

DEV = "cuda" if HAS_CUDA else "cpu"


def twin_weight(g, r, d, seed=0, device=DEV):
    """A bf16 weight that is exactly e4m3 x 2**e per 32x32 block (as V4.1's dequantized wo_a)."""
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(g, r, d, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    e = torch.randint(-14, -6, (g, r // 32, d // 32), generator=gen)
    scale = torch.exp2(e.float()).repeat_interleave(32, 1).repeat_interleave(32, 2)
    return (q.float() * scale).to(torch.bfloat16).to(device)


def ref64(x, w):
    return torch.einsum("tgd,grd->tgr", x.double(), w.double())


def assert_near_exact(y, x, w, what):
    """y within one bf16 ulp of the exact result plus fp32 accumulation error (K * 2**-24 * sum|x w|)."""
    ref = ref64(x, w)
    mag = torch.einsum("tgd,grd->tgr", x.double().abs(), w.double().abs())
    ulp = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(1e-30))) - 7)
    err = (y.double() - ref).abs()
    bad = err > ulp + x.shape[-1] * 2.0**-24 * mag
    assert not bad.any(), f"{what}: {int(bad.sum())} outputs outside the bound, worst {float((err - ulp).max())}"


def ulps(a, b):
    """|a - b| in bf16 ulps of the larger magnitude (0 where identical)."""
    a, b = a.float(), b.float()
    mag = torch.maximum(a.abs(), b.abs()).clamp_min(1e-30)
    ulp = torch.exp2(torch.floor(torch.log2(mag)) - 7)
    return ((a - b).abs() / ulp).round()


# ---------------------------------------------------------------- flag


def test_flag_values_and_errors():
    assert [twin_mod.parse_wo_a_fp8_twin(v) for v in ("off", "small", "MID ")] == ["off", "small", "mid"]
    with pytest.raises(ValueError, match="accepted: off .* small .* mid"):
        twin_mod.parse_wo_a_fp8_twin("on")
    from sglang.srt.arg_groups.fields.exec_ import ExecKernel, _wo_a_fp8_twin_arg

    assert ExecKernel().dsv4_wo_a_fp8_twin == "off"
    with pytest.raises(argparse.ArgumentTypeError, match="accepted"):
        _wo_a_fp8_twin_arg("drop2")


def test_flag_on_command_line():
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(["--model-path", "x", "--dsv4-wo-a-fp8-twin", "small"])
    assert ns.dsv4_wo_a_fp8_twin == "small"
    assert parser.parse_args(["--model-path", "x"]).dsv4_wo_a_fp8_twin == "off"
    with pytest.raises((argparse.ArgumentError, SystemExit)):
        parser.parse_args(["--model-path", "x", "--dsv4-wo-a-fp8-twin", "yes"])


# ---------------------------------------------------------------- twin


def test_twin_exact_or_none():
    w = twin_weight(2, 64, 1024, device="cpu")
    w8, e = twin_mod.make_twin(w)
    assert w8.dtype == torch.float8_e4m3fn and e.shape == (2, 2, 32) and e.dtype == torch.uint8
    back = (w8.float() * torch.exp2(e.float() - 127).repeat_interleave(32, 1).repeat_interleave(32, 2))
    assert torch.equal(back.to(torch.bfloat16).view(torch.int16), w.view(torch.int16))
    w[0, 5, 7] = 1.0 + 2**-7  # 8 significant bits: no e4m3 value with this block's exponent
    assert twin_mod.make_twin(w) is None
    z = torch.zeros(1, 32, 1024, dtype=torch.bfloat16)
    z[0, 0, 0] = -0.0
    assert twin_mod.make_twin(z) is not None


class _Attn(torch.nn.Module):
    def __init__(self, w):
        super().__init__()
        self.n_local_groups, self.o_lora_rank = w.shape[0], w.shape[1]
        self.wo_a = torch.nn.Linear(w.shape[2], w.shape[0] * w.shape[1], bias=False)
        self.wo_a.weight.data = w.reshape(-1, w.shape[2]).clone()


def test_build_off_is_upstream_and_build_counts(monkeypatch):
    monkeypatch.setattr(twin_mod, "_TWINS", {})
    good, bad = twin_weight(2, 64, 1024, 1, "cpu"), twin_weight(2, 64, 1024, 2, "cpu")
    bad[1, 3, 3] = 1.0 + 2**-7
    model = torch.nn.ModuleDict({"a": _Attn(good), "b": _Attn(bad)})
    assert twin_mod.build_wo_a_fp8_twins(model, "off", "target") == (0, 0) and not twin_mod._TWINS
    assert twin_mod.build_wo_a_fp8_twins(model, "small", "target") == (1, 1)
    assert list(twin_mod._TWINS) == [model["a"].wo_a.weight.data_ptr()]
    model["a"].wo_a.weight.data[0, 0] = 1.0 + 2**-7  # reloaded weights without a twin: no stale twin
    assert twin_mod.build_wo_a_fp8_twins(model, "small", "target") == (0, 2) and not twin_mod._TWINS


def test_bad_layout_raises_naming_the_layer(monkeypatch):
    monkeypatch.setattr(twin_mod, "_TWINS", {})
    model = torch.nn.ModuleDict({"layer7": _Attn(twin_weight(2, 32, 1024, device="cpu"))})
    with pytest.raises(RuntimeError, match="layer7.wo_a"):
        twin_mod.build_wo_a_fp8_twins(model, "small", "target")


# ---------------------------------------------------------------- kernel (interpreted on CPU)


@pytest.mark.parametrize("m", [2, 8, 12, 40])
def test_kernel_matches_reference_and_is_deterministic(m):
    g, r, d = 2, 64, 4096 if m <= 8 else 1024  # 2..8 rows: the small kernel needs upstream's D
    w = twin_weight(g, r, d, 3)
    w8, e = twin_mod.make_twin(w)
    cnt = k.counters_for(w8)
    x = torch.randn(m, g, d, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16).to(DEV)
    y1 = k.wo_a_fp8_matmul(x, w8, e, cnt)
    y2 = k.wo_a_fp8_matmul(x, w8, e, cnt)
    assert torch.equal(y1.view(torch.int16), y2.view(torch.int16))
    assert int(cnt.abs().sum()) == 0  # the last CTA of every tile reset its counter
    assert_near_exact(y1, x, w, m)
    if m <= 8:
        p = k.wo_a_fp8_partial(x, w8, e, cnt)
        assert p.shape == (8, m, g, r)
        assert torch.allclose(p.double().sum(0), ref64(x, w), rtol=1e-5, atol=1e-3)


def test_dequant_kernel_is_exact():
    w = twin_weight(2, 64, 1024, 4)
    assert torch.equal(k.wo_a_fp8_dequant(*twin_mod.make_twin(w)).view(torch.int16), w.view(torch.int16))


# ---------------------------------------------------------------- routing


def test_routing_rules(monkeypatch):
    g, r, d = 2, 64, 1024
    w = twin_weight(g, r, d, 5)
    monkeypatch.setattr(twin_mod, "_TWINS", {})
    monkeypatch.setitem(twin_mod._MODE, "mode", "small")
    w8, e = twin_mod.make_twin(w)
    twin_mod._TWINS[w.data_ptr()] = twin_mod._Twin("l0", w8, e, k.counters_for(w8), (g, r, d))
    kw = dict(is_decode=False, is_target_verify=True, is_prefill=False, fuse_mxfp8_quant=False)

    def x(m):
        return torch.randn(m, g, d).to(torch.bfloat16).to(DEV)

    assert twin_mod.apply_wo_a_fp8_twin(x(4), w, **kw).shape == (4, g, r)
    assert twin_mod.apply_wo_a_fp8_twin(x(1), w, **kw) is None  # gemv stays
    assert twin_mod.apply_wo_a_fp8_twin(x(12), w, **kw) is None  # small only
    assert twin_mod.apply_wo_a_fp8_twin(x(4), w, **{**kw, "is_prefill": True}) is None
    assert twin_mod.apply_wo_a_fp8_twin(x(4), w, **{**kw, "fuse_mxfp8_quant": True}) is None  # MXFP8: stock
    assert twin_mod.apply_wo_a_fp8_twin(x(4), w, **{**kw, "is_target_verify": False}) is None
    assert twin_mod.apply_wo_a_fp8_twin(x(4), w.clone(), **kw) is None  # no twin for this weight
    assert twin_mod.apply_wo_a_fp8_twin(x(4)[:, :, :512], w, **kw) is None  # other layout
    monkeypatch.setitem(twin_mod._MODE, "mode", "mid")
    assert twin_mod.apply_wo_a_fp8_twin(x(12), w, **kw).shape == (12, g, r)
    assert twin_mod.apply_wo_a_fp8_twin(x(193), w, **kw) is None


def test_dispatch_is_wired_and_off_means_stock(monkeypatch):
    from sglang.srt.models import deepseek_v4

    g, r, d = 2, 64, 1024
    w = twin_weight(g, r, d, 6)
    xx = torch.randn(4, g, d).to(torch.bfloat16).to(DEV)
    monkeypatch.setattr(twin_mod, "_TWINS", {})
    stock = deepseek_v4._apply_wo_a_bf16_matmul(xx, w, is_decode=False, is_target_verify=True)
    assert torch.equal(stock, torch.einsum("tgd,grd->tgr", xx, w))  # flag off: upstream's einsum
    w8, e = twin_mod.make_twin(w)
    twin_mod._TWINS[w.data_ptr()] = twin_mod._Twin("l0", w8, e, k.counters_for(w8), (g, r, d))
    got = deepseek_v4._apply_wo_a_bf16_matmul(xx, w, is_decode=False, is_target_verify=True)
    assert torch.equal(got, k.wo_a_fp8_matmul(xx, w8, e, k.counters_for(w8)))


# ---------------------------------------------------------------- H200, real shapes


@pytest.mark.gpu
@pytest.mark.xfail(strict=True, reason="measured on the H200: the twin's split partials differ from "
                   "_wo_a_partial's in the last bits (16250 of 32768 at M = 2), so MXFP8 calls stay stock")
def test_gpu_mxfp8_path_bitwise_and_partials_bitwise():
    from sglang.kernels.ops.gemm import dsv4_wo_a as up

    w = twin_weight(2, 1024, 4096, 7)
    w8, e = twin_mod.make_twin(w)
    cnt = k.counters_for(w8)
    for m in range(2, 9):
        for trial in range(3):
            x = torch.randn(m, 2, 4096, device="cuda").to(torch.bfloat16)
            stock_p = torch.empty((8, m, 2, 1024), dtype=torch.float32, device="cuda")
            up._wo_a_partial[(16, 2, 8)](x, w, stock_p, m, x.stride(0), num_warps=4, num_stages=3)
            ours_p = k.wo_a_fp8_partial(x, w8, e, cnt)
            q0, s0 = up.wo_a_bf16_small_batch_mxfp8(x, w)
            q1, s1 = up._quantize_partial(ours_p)
            pbad = int((ours_p.view(torch.int32) != stock_p.view(torch.int32)).sum())
            qbad = int((q0.view(torch.uint8) != q1.view(torch.uint8)).sum())
            sbad = int((s0 != s1).sum())
            print(f"mxfp8 M={m}: partial mismatches {pbad}/{ours_p.numel()}, q {qbad}, scales {sbad}, "
                  f"max partial diff {float((ours_p - stock_p).abs().max())}")
            assert pbad == 0 and qbad == 0 and sbad == 0, (m, trial, pbad, qbad, sbad)


@pytest.mark.gpu
def test_gpu_bf16_path_ulp_bound_and_deterministic():
    """Bound: at most 1 bf16 ulp from stock, on at most 1 % of outputs (fp32 order of 8 adds)."""
    from sglang.kernels.ops.gemm import dsv4_wo_a as up

    w = twin_weight(2, 1024, 4096, 8)
    w8, e = twin_mod.make_twin(w)
    cnt = k.counters_for(w8)
    diff = total = 0
    for m in range(2, 9):
        x = torch.randn(m, 2, 4096, device="cuda").to(torch.bfloat16)
        stock = up.wo_a_bf16_small_batch(x, w)
        ours = k.wo_a_fp8_matmul(x, w8, e, cnt)
        assert torch.equal(ours.view(torch.int16), k.wo_a_fp8_matmul(x, w8, e, cnt).view(torch.int16))
        u = ulps(ours, stock)
        assert u.max() <= 1, m
        diff += int((u > 0).sum())
        total += u.numel()
    assert diff <= 0.01 * total, f"{diff} of {total} outputs differ by 1 ulp"
    print(f"bf16 path: {diff} of {total} outputs ({100 * diff / total:.3f} %) differ from stock by 1 ulp")
    assert int(cnt.abs().sum()) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("g", [4, 8])
def test_gpu_other_group_counts_and_mid(g):
    """G = 4 (padded TP3) and 8 (TP1): upstream's small kernel cannot run them; against einsum."""
    w = twin_weight(g, 1024, 4096, 9 + g)
    w8, e = twin_mod.make_twin(w)
    cnt = k.counters_for(w8)
    for m in (2, 5, 8, 9, 16, 33, 64, 100, 192):
        x = torch.randn(m, g, 4096, device="cuda").to(torch.bfloat16)
        ours = k.wo_a_fp8_matmul(x, w8, e, cnt)
        assert torch.equal(ours.view(torch.int16), k.wo_a_fp8_matmul(x, w8, e, cnt).view(torch.int16)), m
        assert_near_exact(ours, x, w, (g, m))
    assert int(cnt.abs().sum()) == 0


@pytest.mark.gpu
def test_gpu_mid_g2_deterministic_vs_einsum():
    w = twin_weight(2, 1024, 4096, 10)
    w8, e = twin_mod.make_twin(w)
    cnt = k.counters_for(w8)
    for m in (9, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192):
        x = torch.randn(m, 2, 4096, device="cuda").to(torch.bfloat16)
        a, b = k.wo_a_fp8_matmul(x, w8, e, cnt), k.wo_a_fp8_matmul(x, w8, e, cnt)
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), m
        assert_near_exact(a, x, w, m)
