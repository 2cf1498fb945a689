"""The fork's MXFP4 MoE path for decode and verify sizes (kernels/ops/moe/mxfp4_verify_moe.py).

CPU (TRITON_INTERPRET=1, reduced shapes, the in-register decode): the result within the stated
bound of the torch reference, a row's bits independent of the other rows, dead pairs (id -1)
skipped, the expert segments of the routing, and a fault (one expert's scales doubled) refused
by the bound. GPU (``-m gpu``): Triton's mixed-input dot and the in-register decode agree bit for
bit at DeepSeek-V4.1-Flash's TP4 shape, within the bound of the reference.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sglang.kernels.ops.moe import mxfp4_verify_moe as mv

CPU = {"dot_scaled": False, "gate_up_block_n": 32, "gate_up_block_k": 128, "down_block_k": 64,
       "down_block_n": 64}  # fmt: skip
E, H, I, K = 8, 256, 96, 3


@pytest.fixture(autouse=True)
def bf16_dot_in_interpreter(monkeypatch):
    patch_interpreter_bf16_dot(monkeypatch)


def patch_interpreter_bf16_dot(monkeypatch) -> None:
    """Triton 3.6's interpreter multiplies bf16 operands of ``tl.dot`` as their uint16 bit
    patterns; give it their float32 values (exact), as the GPU's MMA reads them."""
    from triton.runtime import interpreter as interp

    original = interp.InterpreterBuilder.create_dot

    def as_f32(h):
        if h.dtype.scalar != interp.tl.bfloat16:
            return h
        data = interp._convert_float(
            h.data, interp.tl.bfloat16, interp.tl.float32, None
        )
        return interp.TensorHandle(data.view(np.float32), interp.tl.float32)

    def create_dot(self, a, b, d, *rest):
        return original(self, as_f32(a), as_f32(b), d, *rest)

    monkeypatch.setattr(interp.InterpreterBuilder, "create_dot", create_dot)


def experts(e=E, h=H, i=I, seed=0):
    g = torch.Generator().manual_seed(seed)

    def u8(shape, lo, hi):
        return torch.randint(lo, hi, shape, dtype=torch.uint8, generator=g)

    return (
        u8((e, 2 * i, h // 2), 0, 256),
        u8((e, 2 * i, h // 32), 118, 124),
        u8((e, h, i // 2), 0, 256),
        u8((e, h, i // 32), 118, 124),
    )


def inputs(m, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(m)]).int()
    return x, ids, torch.rand(m, K, generator=g)


@pytest.mark.parametrize("limit", [None, 0.01])
def test_within_the_bound_of_the_reference(limit):
    w = experts()
    x, ids, tw = inputs(5)
    out = mv.mxfp4_verify_moe(x, ids, tw, *w, swiglu_limit=limit, config=CPU)
    ref, mag = mv.mxfp4_moe_reference(x, ids, tw, *w, swiglu_limit=limit)
    assert mv.within_bound(out, ref, mag).all()


def test_a_doubled_expert_is_refused_by_the_bound():
    """The fault: one routed expert's down scales one step higher (every value doubled)."""
    w13, s13, w2, s2 = experts()
    x, ids, tw = inputs(5)
    ref, mag = mv.mxfp4_moe_reference(x, ids, tw, w13, s13, w2, s2)
    faulty = s2.clone()
    faulty[int(ids[0, 0])] += 1
    out = mv.mxfp4_verify_moe(x, ids, tw, w13, s13, w2, faulty, config=CPU)
    assert not mv.within_bound(out, ref, mag)[0].all()


def test_a_row_is_the_same_alone_and_in_any_batch():
    w = experts()
    x, ids, tw = inputs(6)
    batch = mv.mxfp4_verify_moe(x, ids, tw, *w, config=CPU)
    for r in (0, 5):
        alone = mv.mxfp4_verify_moe(
            x[r : r + 1], ids[r : r + 1], tw[r : r + 1], *w, config=CPU
        )
        assert torch.equal(alone[0], batch[r])
    assert torch.equal(batch, mv.mxfp4_verify_moe(x, ids, tw, *w, config=CPU))


def test_dead_pairs_are_skipped():
    w = experts()
    x, ids, tw = inputs(4)
    dead = ids.clone()
    dead[1, 2] = -1
    dead[3] = -1
    out = mv.mxfp4_verify_moe(x, dead, tw, *w, config=CPU)
    ref, mag = mv.mxfp4_moe_reference(x, dead, tw, *w)
    assert mv.within_bound(out, ref, mag).all()
    assert torch.equal(out[3], torch.zeros(H, dtype=torch.bfloat16))
    # the live pairs' bits are those of the call without the dead ones' rows
    assert torch.equal(
        out[0], mv.mxfp4_verify_moe(x[:1], ids[:1], tw[:1], *w, config=CPU)[0]
    )


def test_dead_verify_rows_past_the_live_length_read_no_expert():
    """Two requests of 3 verify rows, live lengths 1 and 2: rows 1, 2 and 5 are dead; each live
    row keeps its own bits, and the result is the call with the dead rows' ids -1."""
    w = experts()
    x, ids, tw = inputs(6)
    lens = torch.tensor([1, 2], dtype=torch.int32)
    out = mv.mxfp4_verify_moe(x, ids, tw, *w, live_lens=lens, live_stride=3, config=CPU)
    dead = ids.clone()
    dead[[1, 2, 5]] = -1
    assert torch.equal(out, mv.mxfp4_verify_moe(x, dead, tw, *w, config=CPU))
    assert not out[[1, 2, 5]].any() and out[[0, 3, 4]].abs().sum() > 0


def test_prefill_sizes_take_the_sorted_path_with_the_same_bits(monkeypatch):
    """Past MAX_PAIRS (here lowered to 8) a stable sort forms one segment per expert: each
    row's bits are those of the compacted path, dead verify rows included."""
    w = experts()
    x, ids, tw = inputs(6)
    lens = torch.tensor([2, 3], dtype=torch.int32)
    small = mv.mxfp4_verify_moe(x, ids, tw, *w, config=CPU)
    small_live = mv.mxfp4_verify_moe(
        x, ids, tw, *w, live_lens=lens, live_stride=3, config=CPU
    )
    monkeypatch.setattr(mv, "MAX_PAIRS", 8)
    assert torch.equal(mv.mxfp4_verify_moe(x, ids, tw, *w, config=CPU), small)
    live = mv.mxfp4_verify_moe(
        x, ids, tw, *w, live_lens=lens, live_stride=3, config=CPU
    )
    assert torch.equal(live, small_live) and not live[2].any()


def test_segments_group_pairs_by_expert_in_order():
    ids = torch.tensor([3, 1, 5, 1, 2, -1, 3, 7, 0], dtype=torch.int32)
    pairs = 16
    sorted_pair = torch.full((pairs,), -9, dtype=torch.int32)
    seg = torch.full((3, 8), -9, dtype=torch.int32)
    n = torch.zeros(1, dtype=torch.int32)
    mv._segments[(1,)](
        ids, sorted_pair, seg[0], seg[1], seg[2], n, n, ids.numel(), 8,
        TOPK=3, STRIDE=0, PAIRS=pairs, E_PAD=16,
    )  # fmt: skip
    assert n.item() == 6
    assert seg[0, :6].tolist() == [0, 1, 2, 3, 5, 7]
    starts, ends = seg[1, :6].tolist(), seg[2, :6].tolist()
    got = {
        e: sorted_pair[s:t].tolist()
        for e, s, t in zip(seg[0, :6].tolist(), starts, ends)
    }
    assert got == {0: [8], 1: [1, 3], 2: [4], 3: [0, 6], 5: [2], 7: [7]}


@pytest.mark.gpu
def test_gpu_mixed_input_dot_is_the_in_register_decode_bitwise():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    w = [t.cuda() for t in experts(e=384, h=5120, i=576)]
    for m in (1, 6, 48, 192):
        x, ids, tw = (t.cuda() for t in inputs_gpu(m))
        a = mv.mxfp4_verify_moe(x, ids, tw, *w, config={"dot_scaled": True})
        b = mv.mxfp4_verify_moe(x, ids, tw, *w, config={"dot_scaled": False})
        assert torch.equal(a, b), m
        ref, mag = mv.mxfp4_moe_reference(x, ids, tw, *w)
        assert mv.within_bound(a, ref, mag).all(), m


def inputs_gpu(m, seed=2):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, 5120, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(384, generator=g)[:6] for _ in range(m)]).int()
    return x, ids, torch.rand(m, 6, generator=g)
