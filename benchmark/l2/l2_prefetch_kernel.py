"""Prefetch byte ranges of device memory into L2 with ``cp.async.bulk.prefetch.L2`` (SM90+).

Lives here, not in the wheel: nothing in the engine calls it (docs/l2_prefetch.md).

One lane per chunk issues one bulk prefetch (the TMA unit of its SM fetches the range into L2;
no register or shared memory is written), so a plan of a few MB costs a handful of CTAs. The
prefetch is a hint: it never changes memory, and the reads that follow are the same.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK_BYTES = 16 << 10  # one bulk prefetch per lane
LANES = 32  # chunks per CTA, one per lane of its one warp (6 MB: 12 CTAs)


@triton.jit
def _l2_prefetch_kernel(addr_ptr, size_ptr, n, LANES: tl.constexpr):
    offs = tl.program_id(0) * LANES + tl.arange(0, LANES)
    mask = offs < n
    addr = tl.load(addr_ptr + offs, mask=mask, other=0)
    size = tl.load(size_ptr + offs, mask=mask, other=0)
    tl.inline_asm_elementwise(
        asm="""{
        .reg .pred p;
        setp.ne.u32 p, $2, 0;
        @p cp.async.bulk.prefetch.L2.global [$1], $2;
        mov.u32 $0, 0;
        }""",
        constraints="=r,l,r",
        args=[addr, size],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


def chunk_table(ranges: list[tuple[int, int]], device, chunk: int = CHUNK_BYTES):
    """(addresses int64 [n], sizes int32 [n]) for ``ranges`` of (address, bytes): each range
    cut into ``chunk``-byte pieces, the last rounded down to 16 bytes (the instruction's
    granule); addresses must be 16-byte aligned."""
    addrs, sizes = [], []
    for addr, nbytes in ranges:
        if addr % 16:
            raise ValueError(f"L2 prefetch: address {addr:#x} is not 16-byte aligned")
        nbytes -= nbytes % 16
        for off in range(0, nbytes, chunk):
            addrs.append(addr + off)
            sizes.append(min(chunk, nbytes - off))
    return (
        torch.tensor(addrs, dtype=torch.int64, device=device),
        torch.tensor(sizes, dtype=torch.int32, device=device),
    )


def l2_prefetch(addrs: torch.Tensor, sizes: torch.Tensor) -> None:
    """Issue the prefetches of a chunk table (from ``chunk_table``) on the current stream."""
    assert addrs.is_cuda and addrs.dtype == torch.int64 and sizes.dtype == torch.int32
    n = addrs.numel()
    if n:
        _l2_prefetch_kernel[(triton.cdiv(n, LANES),)](
            addrs, sizes, n, LANES=LANES, num_warps=1
        )
