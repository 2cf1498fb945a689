"""benchmark/gb10/validate.py (the GB10 user's validation script): its CPU-side references and
command line; the script itself needs a GB10 / RTX Blackwell (and RoCE nodes for --feature roce)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmark" / "gb10" / "validate.py"


@pytest.fixture(scope="module")
def v():
    spec = importlib.util.spec_from_file_location("gb10_validate", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_command_line(v):
    a = v.parse_args([])
    assert a.feature is None and a.out.name == "results"
    assert v.parse_args(["--feature", "moe", "--feature", "roce"]).feature == [
        "moe",
        "roce",
    ]
    with pytest.raises(SystemExit):
        v.parse_args(["--feature", "nvfp4"])


def test_e2m1_reference_decodes_every_code(v):
    codes = torch.arange(16, dtype=torch.uint8)
    packed = (codes[0::2] | (codes[1::2] << 4)).repeat(
        2
    )  # 16 values, low nibble first, x2 = 32
    scale = torch.tensor([128], dtype=torch.uint8)  # 2**1
    got = v.dequant_e2m1(packed.view(1, 16), scale.view(1, 1))
    want = torch.tensor(v.E2M1 + tuple(-x for x in v.E2M1)).repeat(2) * 2
    assert torch.equal(got.view(-1), want)


def test_moe_reference_is_the_swiglu_expert_sum(v):
    k, n = 4, 2
    w13 = torch.zeros(2, 2 * n, k)
    w13[1, :n] = torch.eye(n, k)  # up
    w13[1, n:] = torch.eye(n, k) * 50  # gate, clamped at the limit
    w2 = torch.zeros(2, k, n)
    w2[1, :n] = torch.eye(n)
    x = torch.tensor([[1.0, 2.0, 0.0, 0.0]])
    out = v.moe_reference(
        x, w13, w2, torch.tensor([[1, -1]]), torch.tensor([[0.5, 9.0]]), limit=10.0
    )
    silu10 = torch.nn.functional.silu(torch.tensor(10.0))
    assert torch.allclose(out[0, :2], 0.5 * silu10 * torch.tensor([1.0, 2.0]))
