"""WO-A (``einsum('tgd,grd->tgr')``) from an fp8 twin of the bf16 weight: the portable Triton
kernel (Hopper runs ``dsv4_wo_a_fp8_sm90``) and the dequantisers. How: docs/wo-a-fp8-twin.md.

NOT BITWISE UPSTREAM: Triton lays out an operand upcast from fp8 with kWidth 4 (upstream's bf16
operands: kWidth 2), which reorders K inside each MMA, so the partials differ from
``_wo_a_partial``'s in the last bits and callers keep upstream's kernel for the MXFP8 epilogue.
Results are within the fp32 accumulation bound of the exact product.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
SMALL_SPLIT = 8  # upstream's split of K = 4096 into 8 x 512
SMALL_BK = 128  # upstream's chunk per tl.dot
MID_BK = 128
SMALL_BM = 16  # upstream's row tile (2..8 rows, padded)
SMALL_BN = 32
SMALL_WARPS = 4
SMALL_STAGES = 3

# rows (inclusive upper bound) -> (split, BM, BN, warps, stages); deterministic for every entry
_MID = (
    (16, (8, 16, 32, 4, 1)),
    (32, (8, 32, 32, 4, 1)),
    (64, (4, 64, 32, 4, 1)),
    (128, (4, 64, 32, 8, 1)),
    (192, (2, 64, 32, 8, 1)),
)
MID_ROWS = (9, 192)


@triton.jit
def _dot_twin(acc, x, w8, e, INTERPRETED: tl.constexpr):
    """acc + x @ (w8 * 2**(e - 127)); ``e`` holds one biased exponent per K row of the tile (the
    tile's rows lie in one 32-row block). The scale is built from its bits and the product is an
    exact bf16 value (|e4m3| >= 2**-9, scale >= 2**-117), so the dot sees the bf16 weight.
    """
    if INTERPRETED:  # the interpreter's dot multiplies bf16 bit patterns as integers
        scale = (e.to(tl.int32) << 23).to(tl.float32, bitcast=True)
        acc += tl.dot(x.to(tl.float32), w8.to(tl.float32) * scale[:, None])
    else:
        scale = (e.to(tl.int16) << 7).to(tl.bfloat16, bitcast=True)
        acc += tl.dot(x, w8.to(tl.bfloat16) * scale[:, None])
    return acc


@triton.jit
def _reduce_epilogue(
    acc,
    P,
    Y,
    C,
    M,
    m,
    n,
    tile,
    mt,
    split,
    group,
    G: tl.constexpr,
    R: tl.constexpr,
    SPLIT: tl.constexpr,
    BN: tl.constexpr,
    REDUCE: tl.constexpr,
):
    rows = m[:, None] < M
    out = (m[:, None] * G + group) * R + n[None, :]
    if SPLIT == 1:
        tl.store(Y + out, acc.to(tl.bfloat16), rows)
    else:
        tl.store(P + split * M * G * R + out, acc, rows)
        if REDUCE:
            # the last CTA of this tile to arrive adds the partials in split order 0..SPLIT-1
            tl.debug_barrier()
            counter = C + (mt * G + group) * (R // BN) + tile
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT - 1:
                total = tl.load(P + out, rows, 0.0, cache_modifier=".cg")
                for s in tl.static_range(1, SPLIT):
                    total += tl.load(
                        P + s * M * G * R + out, rows, 0.0, cache_modifier=".cg"
                    )
                tl.store(Y + out, total.to(tl.bfloat16), rows)
                tl.atomic_xchg(counter, 0)


@triton.jit
def _wo_a_fp8_small_kernel(
    X,
    W8,
    E,
    P,
    Y,
    C,
    M,
    SX,
    G: tl.constexpr,
    R: tl.constexpr,
    D: tl.constexpr,
    BN: tl.constexpr,
    REDUCE: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Upstream's split (8 x 512) and dots, every load of the CTA issued before the first dot."""
    tile, group, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    m = tl.arange(0, 16)
    n = tile * BN + tl.arange(0, BN)
    k = split * (D // 8) + tl.arange(0, 128)
    rows = m[:, None] < M
    wp = W8 + (group * R + n[None, :]) * D + k[:, None]
    xp = X + m[:, None] * SX + group * D + k[None, :]
    ep = E + (group * (R // 32) + (tile * BN) // 32) * (D // 32) + k // 32
    w0 = tl.load(wp)
    w1 = tl.load(wp + 128)
    w2 = tl.load(wp + 256)
    w3 = tl.load(wp + 384)
    x0 = tl.load(xp, rows, 0)
    x1 = tl.load(xp + 128, rows, 0)
    x2 = tl.load(xp + 256, rows, 0)
    x3 = tl.load(xp + 384, rows, 0)
    e0 = tl.load(ep)
    e1 = tl.load(ep + 4)
    e2 = tl.load(ep + 8)
    e3 = tl.load(ep + 12)
    acc = tl.zeros((16, BN), tl.float32)
    acc = _dot_twin(acc, x0, w0, e0, INTERPRETED)
    acc = _dot_twin(acc, x1, w1, e1, INTERPRETED)
    acc = _dot_twin(acc, x2, w2, e2, INTERPRETED)
    acc = _dot_twin(acc, x3, w3, e3, INTERPRETED)
    _reduce_epilogue(acc, P, Y, C, M, m, n, tile, 0, split, group, G, R, 8, BN, REDUCE)


@triton.jit
def _wo_a_fp8_kernel(
    X,
    W8,
    E,
    P,
    Y,
    C,
    M,
    SX,
    G: tl.constexpr,
    R: tl.constexpr,
    D: tl.constexpr,
    SPLIT: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    REDUCE: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Mid rows: grid (R/BN, G, row tiles x SPLIT); the next K chunk is loaded before this one's dot."""
    tile, group, mk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    mt = mk // SPLIT
    split = mk % SPLIT
    m = mt * BM + tl.arange(0, BM)
    n = tile * BN + tl.arange(0, BN)
    KS: tl.constexpr = D // SPLIT
    NCH: tl.constexpr = KS // BK
    k = split * KS + tl.arange(0, BK)
    rows = m[:, None] < M
    wp = W8 + (group * R + n[None, :]) * D + k[:, None]
    xp = X + m[:, None] * SX + group * D + k[None, :]
    ep = E + (group * (R // 32) + (tile * BN) // 32) * (D // 32) + k // 32
    w_next = tl.load(wp)
    x_next = tl.load(xp, rows, 0)
    e_next = tl.load(ep)
    acc = tl.zeros((BM, BN), tl.float32)
    for i in range(NCH):
        w8, x, e = w_next, x_next, e_next
        j = tl.minimum(i + 1, NCH - 1) * BK
        w_next = tl.load(wp + j)
        x_next = tl.load(xp + j, rows, 0)
        e_next = tl.load(ep + j // 32)
        acc = _dot_twin(acc, x, w8, e, INTERPRETED)
    _reduce_epilogue(
        acc, P, Y, C, M, m, n, tile, mt, split, group, G, R, SPLIT, BN, REDUCE
    )


def counters_for(weight8: torch.Tensor) -> torch.Tensor:
    """Arrival counters of one twin (zero; every kernel leaves them zero)."""
    g, r, _ = weight8.shape
    tiles = triton.cdiv(MID_ROWS[1], 16) * g * (r // 16)
    return torch.zeros(tiles, dtype=torch.int32, device=weight8.device)


def _check(
    x: torch.Tensor, weight8: torch.Tensor, exp: torch.Tensor, counters: torch.Tensor
):
    g, r, d = weight8.shape
    assert weight8.dtype == torch.float8_e4m3fn and weight8.is_contiguous()
    assert (
        exp.dtype == torch.uint8
        and exp.shape == (g, r // 32, d // 32)
        and exp.is_contiguous()
    )
    assert x.dtype == torch.bfloat16 and x.ndim == 3 and x.shape[1:] == (g, d)
    assert x.stride(2) == 1 and x.stride(1) == d and x.stride(0) >= g * d
    assert x.device == weight8.device == exp.device == counters.device
    assert r % 64 == 0 and d % (SMALL_SPLIT * SMALL_BK) == 0
    assert counters.dtype == torch.int32 and counters.numel() >= triton.cdiv(
        MID_ROWS[1], 16
    ) * g * (r // 16)


def _launch(x, weight8, exp, counters, split, bm, bn, warps, stages, reduce):
    m = x.shape[0]
    g, r, d = weight8.shape
    assert bn in (16, 32)  # a tile's rows lie in one 32-row scale block
    y = torch.empty((m, g, r), dtype=torch.bfloat16, device=x.device)
    partial = (
        torch.empty((split, m, g, r), dtype=torch.float32, device=x.device)
        if split > 1
        else y
    )
    if split == SMALL_SPLIT and bm == SMALL_BM and m <= 8 and d == 4096:
        _wo_a_fp8_small_kernel[(r // bn, g, split)](
            x,
            weight8,
            exp,
            partial,
            y,
            counters,
            m,
            x.stride(0),
            g,
            r,
            d,
            bn,
            reduce,
            _INTERPRETED,
            num_warps=warps,
            num_stages=stages,
        )
    else:
        _wo_a_fp8_kernel[(r // bn, g, triton.cdiv(m, bm) * split)](
            x,
            weight8,
            exp,
            partial,
            y,
            counters,
            m,
            x.stride(0),
            g,
            r,
            d,
            split,
            bm,
            bn,
            MID_BK,
            reduce,
            _INTERPRETED,
            num_warps=warps,
            num_stages=stages,
        )
    return y, partial


def wo_a_fp8_matmul(x, weight8, exp, counters, cfg=None):
    """``einsum('tgd,grd->tgr', x, twin)`` for 2..192 rows in one launch, bf16 token-major out."""
    _check(x, weight8, exp, counters)
    m = x.shape[0]
    assert 2 <= m <= MID_ROWS[1]
    if cfg is None and m <= 8:
        cfg = (SMALL_SPLIT, SMALL_BM, SMALL_BN, SMALL_WARPS, SMALL_STAGES)
    elif cfg is None:
        cfg = next(c for limit, c in _MID if m <= limit)
    return _launch(x, weight8, exp, counters, *cfg, True)[0]


def wo_a_fp8_partial(x, weight8, exp, counters):
    """The per-split FP32 partials ``[8, M, G, R]`` (2..8 rows); not ``_wo_a_partial``'s bits."""
    _check(x, weight8, exp, counters)
    assert 2 <= x.shape[0] <= 8
    return _launch(
        x,
        weight8,
        exp,
        counters,
        SMALL_SPLIT,
        SMALL_BM,
        SMALL_BN,
        SMALL_WARPS,
        SMALL_STAGES,
        False,
    )[1]


@triton.jit
def _dequant_kernel(W8, E, OUT, R: tl.constexpr, D: tl.constexpr):
    g, rb, cb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    r = rb * 32 + tl.arange(0, 32)
    c = cb * 32 + tl.arange(0, 32)
    off = (g * R + r[:, None]) * D + c[None, :]
    e = tl.load(E + (g * (R // 32) + rb) * (D // 32) + cb)
    scale = (e.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    tl.store(OUT + off, (tl.load(W8 + off).to(tl.float32) * scale).to(tl.bfloat16))


def wo_a_fp8_dequant(weight8: torch.Tensor, exp: torch.Tensor) -> torch.Tensor:
    """The bf16 weight the kernel sees, rebuilt by the kernel's own dequantisation (a fresh buffer)."""
    g, r, d = weight8.shape
    out = torch.empty((g, r, d), dtype=torch.bfloat16, device=weight8.device)
    _dequant_kernel[(g, r // 32, d // 32)](weight8, exp, out, r, d)
    return out


@triton.jit
def _dequant_packed_kernel(P, E, OUT, D: tl.constexpr):
    """One 8-row group x one 128-K chunk of ``pack_twin``'s fragment-major words -> bf16 rows."""
    rg, q = tl.program_id(0), tl.program_id(1)
    s, c = q // 4, q % 4
    blk = tl.arange(0, 4)[:, None, None, None]
    row = tl.arange(0, 8)[None, :, None, None]
    tw = tl.arange(0, 8)[None, None, :, None]
    by = tl.arange(0, 4)[None, None, None, :]
    words = tl.load(P + (((rg * 4 + c) * 4 + blk) * 8 + s) * 64 + row * 8 + tw)
    byte = (words >> (8 * by)) & 0xFF
    k = (
        s * 512
        + c * 128
        + blk * 32
        + 16 * (tw % 2)
        + 8 * (by // 2)
        + 2 * (tw // 2)
        + by % 2
    )
    r = rg * 8 + row
    e = tl.load(E + (r // 32) * (D // 32) + k // 32)
    scale = (e.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    # e4m3 decoded by its fields (exact in fp32): normal (8 + m) 2**(x - 10), subnormal m 2**-9
    ex, man = (byte >> 3) & 0xF, byte & 7
    normal = (((ex + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(ex == 0, man.to(tl.float32) * 0.001953125, normal)
    val = ((mag * scale).to(tl.int32, bitcast=True) | ((byte >> 7) << 31)).to(
        tl.float32, bitcast=True
    )
    tl.store(OUT + r * D + k, val.to(tl.bfloat16))  # the sign as a bit: -0.0 stays -0.0


def wo_a_fp8_dequant_packed(packed: torch.Tensor, exp: torch.Tensor) -> torch.Tensor:
    """The bf16 weight [G, R, 4096] rebuilt from the Hopper kernels' packed words (a fresh buffer)."""
    g, rg = packed.shape[0], packed.shape[1]
    d = 4096
    assert (
        packed.dtype == torch.int32
        and packed.is_contiguous()
        and packed.numel() == g * rg * 8 * d // 4
    )
    assert exp.dtype == torch.uint8 and exp.shape == (g, rg * 8 // 32, d // 32)
    out = torch.empty((g, rg * 8, d), dtype=torch.bfloat16, device=packed.device)
    _dequant_packed_kernel[(g * rg, 32)](packed, exp, out, d)
    return out
