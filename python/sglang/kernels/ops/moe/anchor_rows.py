"""Dead verify rows take their anchor row's routing, in place, for routers that cannot read a
live length (DeepSeek-V4's hash-routed layers: ids from ``tid2eid[token]``).

Called once after routing: row ``r * S`` is copied over every row ``r * S + j`` with
``j >= live_lens[r]`` of each [M, ...] output (weights and ids), so dead rows add no experts. An
anchor (j = 0) is never dead (L >= 1), so rows read in place are never written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _anchor_rows_kernel(
    a_ptr,
    b_ptr,
    live_ptr,
    stride_a,
    stride_b,
    COLS_A: tl.constexpr,
    COLS_B: tl.constexpr,
    BLOCK: tl.constexpr,
    STRIDE: tl.constexpr,
):
    row = tl.program_id(0)
    anchor = (row // STRIDE) * STRIDE
    if row - anchor >= tl.load(live_ptr + row // STRIDE):
        cols = tl.arange(0, BLOCK)
        va = tl.load(a_ptr + anchor * stride_a + cols, mask=cols < COLS_A)
        tl.store(a_ptr + row * stride_a + cols, va, mask=cols < COLS_A)
        vb = tl.load(b_ptr + anchor * stride_b + cols, mask=cols < COLS_B)
        tl.store(b_ptr + row * stride_b + cols, vb, mask=cols < COLS_B)


def anchor_rows_(
    a: torch.Tensor, b: torch.Tensor, live_lens: torch.Tensor, stride: int
) -> None:
    """In place: rows past their request's live length become a copy of its first row."""
    m = a.shape[0]
    assert (
        b.shape[0] == m and a.ndim == b.ndim == 2
    ), "anchor_rows_ wants two [M, cols] tensors"
    assert (
        a.stride(1) == 1
        and b.stride(1) == 1
        and a.device == b.device == live_lens.device
    )
    assert stride >= 1 and m % stride == 0 and m // stride <= live_lens.numel(), (
        f"anchor_rows_: M = {m} rows is not whole requests of {stride} rows "
        f"covered by {live_lens.numel()} live lengths"
    )
    if m == 0:
        return
    block = triton.next_power_of_2(max(a.shape[1], b.shape[1]))
    _anchor_rows_kernel[(m,)](
        a,
        b,
        live_lens,
        a.stride(0),
        b.stride(0),
        COLS_A=a.shape[1],
        COLS_B=b.shape[1],
        BLOCK=block,
        STRIDE=int(stride),
        num_warps=1,
    )
