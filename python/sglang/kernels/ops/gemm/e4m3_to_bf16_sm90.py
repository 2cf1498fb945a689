"""Gluon (Hopper) helpers for the exact e4m3 -> bf16 of ``e4m3_to_bf16``: the layout of one 32-K
block's ``permute_k`` words as the MMA's A fragment wants them, and their dequantisation into
that fragment with the permutation undone by renaming registers (no byte shuffles). Used by the
wo_a twin's kernels and the DSpark draft head's wgmma kernel.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from sglang.kernels.ops.gemm.e4m3_to_bf16 import E4M3X4_TO_BF16_ASM


def row_bases(bv: int, nw: int) -> list[list[int]]:
    """Register bases of the rows past one 16-row fragment per warp, up to ``bv`` rows."""
    bases, r = [], 16 * nw
    while r < bv:
        bases.append([r, 0])
        r *= 2
    return bases


def words_layout(bv: int, nw: int) -> gl.DistributedLinearLayout:
    """[bv, 8] int32 words of one 32-K block in the wgmma A fragment's row order."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [8, 0]] + row_bases(bv, nw),
        lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16 << i, 0] for i in range(nw.bit_length() - 1)],
        block_bases=[],
        shape=[bv, 8],
    )


@gluon.jit
def bf16_pair(word):
    """One int32 word -> its two bf16 halves, joined (low, high)."""
    lo = word.to(gl.uint16).to(gl.bfloat16, bitcast=True)
    hi = (word >> 16).to(gl.uint16).to(gl.bfloat16, bitcast=True)
    return gl.join(lo, hi)


@gluon.jit
def dequant_block(w32, s, A_L: gl.constexpr, BV: gl.constexpr):
    """K-permuted e4m3 words + per-row scale -> the logical [BV, 32] bf16 block, wgmma A layout."""
    sb = (
        (s * 5.192296858534828e33)
        .to(gl.bfloat16)
        .to(gl.uint16, bitcast=True)
        .to(gl.int32)
    )  # * 2**112
    sb = gl.expand_dims(sb | (sb << 16), 1) + gl.zeros_like(w32)
    o0, o1 = gl.inline_asm_elementwise(
        E4M3X4_TO_BF16_ASM,
        "=r,=r,r,r,r",
        [w32, sb, sb],
        dtype=(gl.int32, gl.int32),
        is_pure=True,
        pack=1,
    )
    w = gl.join(
        bf16_pair(o0), bf16_pair(o1)
    )  # [BV, 8 (2t + w), 2 (e), 2 (o)]: j = 2w + o
    w = gl.permute(gl.reshape(w, [BV, 4, 2, 2, 2]), [0, 2, 4, 1, 3])  # [BV, w, o, t, e]
    return gl.convert_layout(gl.reshape(w, [BV, 32]), A_L)
