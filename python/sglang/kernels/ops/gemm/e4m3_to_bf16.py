"""Exact e4m3 -> bf16 for the fp8 copies the fork keeps of bf16 weights (the DeepSeek-V4 wo_a twin,
the DSpark draft head): every value is an e4m3 code times a power-of-two block scale, so the bf16
weight comes back bit for bit. Shared by their Triton kernels and, through ``e4m3_to_bf16_sm90``,
their Hopper (Gluon) ones.
"""

from __future__ import annotations

import torch
import triton.language as tl

# e4m3 x4 (one 32-bit word) -> two bf16x2 words times a bf16x2 scale word that carries 2**112:
# cvt to f16x2 (exact), then each f16's sign stays and its exponent/mantissa shift right by 3
# into bf16 position (the exponent keeps the f16 bias: 2**-112, undone by the scale). 5
# instructions per pair of weights, no F2F.
E4M3X4_TO_BF16_ASM = tl.constexpr(
    """{
.reg .b16 lo, hi;
.reg .b32 h0, h1, a0, a1;
mov.b32 {lo, hi}, $2;
cvt.rn.f16x2.e4m3x2 h0, lo;
cvt.rn.f16x2.e4m3x2 h1, hi;
and.b32 a0, h0, 0x7FFF7FFF;
and.b32 a1, h1, 0x7FFF7FFF;
shr.b32 a0, a0, 3;
shr.b32 a1, a1, 3;
and.b32 h0, h0, 0x80008000;
and.b32 h1, h1, 0x80008000;
or.b32 a0, a0, h0;
or.b32 a1, a1, h1;
mul.rn.bf16x2 $0, a0, $3;
mul.rn.bf16x2 $1, a1, $4;
}"""
)


def permute_k(q: torch.Tensor) -> torch.Tensor:
    """[N, K] e4m3 -> the same values with K permuted inside each 32-block: physical position
    8t + 2j + e holds logical k = 8j + 2t + e (t: thread in its quad, j: the 8-wide slot of the
    MMA fragment, e: the pair element), so thread t's fragment bytes are contiguous."""
    n, k = q.shape
    assert k % 32 == 0, k
    return q.view(n, k // 32, 4, 4, 2).permute(0, 1, 3, 2, 4).reshape(n, k).contiguous()
