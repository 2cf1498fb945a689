"""The routers' live-rows scope (``layers/moe/router_live_rows.py``): outside a scope every call
is a no-op (upstream's routing); inside, moe_fused_gate callers get the live lengths, a wrong
layout and a route without the live length raise naming the owner flag, and routers without the
input get their dead rows overwritten by the anchor's (the kernel, Triton-interpreted on CPU)."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.layers.moe import router_live_rows as lr

OWNER = "--speculative-dspark-verify-cap"


def test_outside_a_scope_nothing_changes():
    w = torch.randn(6, 2)
    ids = torch.arange(12, dtype=torch.int32).view(6, 2)
    before = (w.clone(), ids.clone())
    assert lr.router_live_kwargs(w) == {}
    lr.anchor_dead_rows_(w, ids)
    lr.refuse_dead_rows("anything", 3)
    assert torch.equal(w, before[0]) and torch.equal(ids, before[1])
    with lr.live_rows_scope(None):
        assert lr.router_live_kwargs(w) == {}


def test_in_a_scope_the_router_gets_the_live_lengths_and_refusals_name_the_flag():
    lens = torch.tensor([1, 3], dtype=torch.int64)
    with lr.live_rows_scope(lr.LiveRows(lens, 3, OWNER)):
        kw = lr.router_live_kwargs(torch.zeros(6, 4))
        assert kw["live_lens"] is lens and kw["live_stride"] == 3
        with pytest.raises(
            RuntimeError,
            match=f"{OWNER}: a target-verify router got 5 rows, not a multiple",
        ):
            lr.router_live_kwargs(torch.zeros(5, 4))
        with pytest.raises(
            RuntimeError,
            match=f"{OWNER}: .*MoE layer 7 runs the mega gate.*drop {OWNER}",
        ):
            lr.refuse_dead_rows("the mega gate", 7)
    assert lr.router_live_kwargs(torch.zeros(5, 4)) == {}  # the scope closed


def test_scopes_nest_and_restore():
    outer = lr.LiveRows(torch.ones(2, dtype=torch.int64), 2, "outer")
    with lr.live_rows_scope(outer):
        with lr.live_rows_scope(None):
            assert lr.router_live_kwargs(torch.zeros(3, 1)) == {}
        assert lr.router_live_kwargs(torch.zeros(4, 1))["live_stride"] == 2


def test_dead_rows_take_the_anchor_routing():
    """CPU: Triton-interpreted (conftest sets TRITON_INTERPRET)."""
    stride, lens = 3, torch.tensor([1, 2, 3], dtype=torch.int64)
    w = torch.randn(9, 2)
    ids = torch.arange(18, dtype=torch.int32).view(9, 2)
    ref_w, ref_i = w.clone(), ids.clone()
    with lr.live_rows_scope(lr.LiveRows(lens, stride, OWNER)):
        lr.anchor_dead_rows_(w, ids)
    rows = torch.arange(9)
    dead = rows % stride >= lens[rows // stride]
    src = torch.where(dead, rows // stride * stride, rows)
    assert torch.equal(w, ref_w[src]) and torch.equal(ids, ref_i[src])
