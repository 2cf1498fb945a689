"""--block-fp8-mxfp8-backend b12x (32x32 ue8m0 block-fp8 linears on b12x's block_fp8_linear), up
to the hardware: the flag and its refusals, which layers take b12x, the plans per layer, and a
call's route through Fp8LinearMethod.apply against a stand-in b12x. The shared expert's
down_proj (K = 576 at TP4) reaches b12x as it is: b12x 1.5.1 pads K to 128 itself."""

from __future__ import annotations

import argparse
import sys
import types
from types import SimpleNamespace

import pytest
import torch
from conftest import with_model

from sglang.srt.layers.quantization import b12x_block_fp8 as bf
from sglang.srt.utils import b12x_pin


def test_flag_values():
    assert bf.parse_block_fp8_mxfp8_backend(" B12X") == "b12x"
    with pytest.raises(
        argparse.ArgumentTypeError,
        match="--block-fp8-mxfp8-backend 'flashinfer': accepted: b12x",
    ):
        bf.parse_block_fp8_mxfp8_backend("flashinfer")
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    assert parser.parse_args(["--model-path", "x"]).block_fp8_mxfp8_backend is None
    assert (
        parser.parse_args(
            ["--model-path", "x", "--block-fp8-mxfp8-backend", "b12x"]
        ).block_fp8_mxfp8_backend
        == "b12x"
    )
    with pytest.raises((argparse.ArgumentError, SystemExit)):
        parser.parse_args(["--model-path", "x", "--block-fp8-mxfp8-backend", "cutlass"])


def quant(quantization_config):
    return SimpleNamespace(quantization_config=quantization_config)


def test_validate(monkeypatch):
    cfg = SimpleNamespace(block_fp8_mxfp8_backend=None)
    bf.validate_block_fp8_mxfp8_backend(cfg)  # no model: read only with the flag set
    cfg.block_fp8_mxfp8_backend = "b12x"
    with pytest.raises(
        ValueError,
        match=r"does nothing here: .* \(found weight_block_size=\[128, 128\], scale_fmt=None\)",
    ):
        bf.validate_block_fp8_mxfp8_backend(
            with_model(cfg, hf_config=quant({"weight_block_size": [128, 128]}))
        )
    v41 = quant({"weight_block_size": [32, 32], "scale_fmt": "ue8m0"})
    monkeypatch.setattr(
        b12x_pin, "found_device", lambda: ((9, 0), "NVIDIA H200 (SM90)")
    )
    with pytest.raises(
        ValueError,
        match=r"--block-fp8-mxfp8-backend b12x refused: device: NVIDIA H200 \(SM90\)",
    ):
        bf.validate_block_fp8_mxfp8_backend(with_model(cfg, hf_config=v41))
    monkeypatch.setattr(
        b12x_pin, "found_device", lambda: ((12, 1), "NVIDIA GB10 (SM121)")
    )
    monkeypatch.setattr(b12x_pin, "found_b12x", lambda api, attr: ("1.5.1", ""))
    bf.validate_block_fp8_mxfp8_backend(with_model(cfg, hf_config=v41))


def test_which_weights_take_b12x():
    assert bf.serves_block_fp8_as_mxfp8([32, 32], "ue8m0")
    assert not bf.serves_block_fp8_as_mxfp8([128, 128], "ue8m0")
    assert not bf.serves_block_fp8_as_mxfp8([32, 32], None)
    assert not bf.serves_block_fp8_as_mxfp8(None, "ue8m0")
    assert bf.maybe_b12x_block_fp8(None, [32, 32], "ue8m0") is None
    assert bf.maybe_b12x_block_fp8("b12x", [128, 128], "ue8m0") is None


def test_plan_capacities():
    assert bf.plan_capacities(64, 2048) == (64, 2048)
    assert bf.plan_capacities(64, 0) == (64,)
    assert [bf.capacity_for(m, (64, 2048)) for m in (1, 64, 65, 2048)] == [
        64,
        64,
        2048,
        2048,
    ]
    with pytest.raises(
        RuntimeError, match="a call of 2049 rows exceeds the largest prepared plan"
    ):
        bf.capacity_for(2049, (64, 2048))


class FakeBlockFp8:
    """b12x.gemm.block_fp8_linear / b12x.preparation stand-ins: pack_weight keeps what it was
    given, run computes x @ dequant(w).T in fp32 from the 32x32 block scales."""

    def __init__(self):
        self.packed, self.prepared, self.runs = [], [], []
        bfl = types.ModuleType("b12x.gemm.block_fp8_linear")
        bfl.pack_weight = self.pack_weight
        bfl.Caps = lambda **kw: SimpleNamespace(**kw)
        bfl.plan = lambda caps: SimpleNamespace(
            caps=caps, request=lambda **kw: ("req", caps.max_tokens, kw["name"])
        )
        bfl.run = self.run
        prep = types.ModuleType("b12x.preparation")
        prep.PreparationSession = lambda device: SimpleNamespace(
            __enter__=None, prepare=self.prepared.append
        )
        prep.PreparedCall = lambda **kw: SimpleNamespace(**kw)
        gemm = types.ModuleType("b12x.gemm")
        gemm.block_fp8_linear = bfl
        self.modules = {
            "b12x": types.ModuleType("b12x"),
            "b12x.gemm": gemm,
            "b12x.gemm.block_fp8_linear": bfl,
            "b12x.preparation": prep,
        }

    def pack_weight(self, weight, scale, *, block_size):
        self.packed.append((weight, scale, block_size))
        return SimpleNamespace(weight=weight, scale=scale)

    def run(self, x, packed, *, plan, bias=None):
        self.runs.append((x.shape[0], plan.caps.max_tokens))
        w = packed.weight.float() * packed.scale.repeat_interleave(
            32, 0
        ).repeat_interleave(32, 1)
        out = x.float() @ w.T
        return (out if bias is None else out + bias).to(x.dtype)


class _Session:
    def __init__(self, sink):
        self.sink = sink

    def __enter__(self):
        return self

    def prepare(self, requests):
        self.sink.append(requests)


@pytest.fixture
def fake_b12x(monkeypatch):
    fake = FakeBlockFp8()
    fake.modules["b12x.preparation"].PreparationSession = lambda device: _Session(
        fake.prepared
    )
    for name, mod in fake.modules.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(bf, "_SESSIONS", {})
    return fake


def v41_layer(n, k, prefix):
    g = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=g) * 8).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.exp2(torch.randint(-8, 0, (n // 32, k // 32), generator=g).float())
    return SimpleNamespace(
        weight=torch.nn.Parameter(w, requires_grad=False),
        weight_scale_inv=torch.nn.Parameter(s, requires_grad=False),
        prefix=prefix,
    )


def test_shared_expert_down_proj_576_reaches_b12x_unpadded(fake_b12x):
    lin = bf.B12xBlockFp8Linear((32, 32), (64, 2048))
    layer = v41_layer(5120, 576, "model.layers.3.mlp.shared_experts.down_proj")
    assert lin.prepare(layer)
    w, s, block = fake_b12x.packed[-1]
    assert w.shape == (5120, 576) and s.shape == (160, 18) and block == (32, 32)
    assert (
        w.data_ptr() == layer.weight.data_ptr()
    )  # the checkpoint's bytes, no copy or pad of ours
    assert [r[1] for r in fake_b12x.prepared[-1]] == [64, 2048]
    x = torch.randn(2, 3, 576, dtype=torch.bfloat16)
    out = lin.apply(layer, x, None)
    assert out.shape == (2, 3, 5120) and fake_b12x.runs[-1] == (6, 64)
    lin.apply(layer, torch.randn(100, 576, dtype=torch.bfloat16), None)
    assert fake_b12x.runs[-1] == (100, 2048)


def test_plain_layout_layers_stay_upstream(fake_b12x):
    lin = bf.B12xBlockFp8Linear((32, 32), (64,))
    layer = v41_layer(64, 128, "model.layers.0.self_attn.wo_a")
    layer.keep_plain_weight_layout = True
    assert (
        not lin.prepare(layer) and layer.b12x_block_fp8 is None and not fake_b12x.packed
    )


def test_fp8_linear_method_routes_to_b12x_exactly_when_prepared(fake_b12x, monkeypatch):
    """Upstream's Fp8LinearMethod.apply: a layer b12x prepared runs there; a (q, scale) input and
    a layer without b12x state take upstream's path."""
    from sglang.srt.layers.quantization.fp8 import Fp8LinearMethod

    method = object.__new__(Fp8LinearMethod)
    method.use_marlin = False
    method.b12x_block_fp8 = bf.B12xBlockFp8Linear((32, 32), (64,))
    layer = v41_layer(64, 128, "model.layers.0.mlp.shared_experts.gate_up_proj")
    method.b12x_block_fp8.prepare(layer)
    x = torch.randn(4, 128, dtype=torch.bfloat16)
    out = Fp8LinearMethod.apply(method, layer, x)
    ref = fake_b12x.run(
        x,
        SimpleNamespace(weight=layer.weight, scale=layer.weight_scale_inv),
        plan=SimpleNamespace(caps=SimpleNamespace(max_tokens=64)),
    )
    assert torch.equal(out, ref)
    runs = len(fake_b12x.runs)
    layer.b12x_block_fp8 = None
    method.block_fp8_as_mxfp8, method.use_mxfp8, method.block_quant = (
        False,
        False,
        False,
    )
    with pytest.raises(Exception):
        Fp8LinearMethod.apply(
            method, layer, x
        )  # upstream's path (not set up in this stand-in)
    assert len(fake_b12x.runs) == runs  # b12x did not run for it
