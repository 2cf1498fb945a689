"""Fence the folded DSpark accept results from the next graph replay
(--speculative-dspark-fence-accept-results): an in-graph copy into a two-slot ring.

The next replay does not wait for the host's copy of the folded accept buffers; inside the graph
``copy_in(gate)`` copies them into ring slot ``counter % 2`` (how: docs/result-fence.md).

INVARIANTS (argued in docs/result-fence.md). Two slots suffice: step N's slot is rewritten by
step N + 2 at the earliest, and every folding scheduler loop synchronizes step N's
``copy_done`` before it launches step N + 2. One copy per consumed step: the copy is gated
like the fold, a capture's warm-up copies are accounted for, and the device counter is checked
against the host's (a mismatch raises). Lossless: the slot holds the bytes the graph wrote.
"""

from __future__ import annotations

import logging
import math
from typing import Optional

import torch
import triton
import triton.language as tl

logger = logging.getLogger(__name__)

# (attribute on DsparkVerifyEpilogue, AcceptOuts field or None)
_FIELDS = (
    ("correct_len_buf", "correct_len"),
    ("bonus_buf", "bonus"),
    ("cap_trim_lens_buf", "cap_trim_lens"),
    ("commit_lens_buf", "commit_lens"),
    ("new_seq_lens_buf", "new_seq_lens"),
    ("out_tokens_buf", "out_tokens"),
    ("block_accept_lens_buf", None),
)
_ALIGN = 16  # bytes; every field starts on a 16-byte boundary, the arena is int64 words
_BLOCK = 1024  # int64 words per loop iteration of the copy kernel
CHECK_EVERY = 64  # consumptions between device-counter read-backs


@triton.jit
def _ring_copy_kernel(
    arena_ptr,
    ring_ptr,
    counter_ptr,
    gate_ptr,
    N_WORDS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One program: it reads the counter, copies, then advances it (no cross-CTA race).
    if tl.load(gate_ptr) != 0:
        count = tl.load(counter_ptr)
        dst = ring_ptr + (count % 2) * N_WORDS
        for start in range(0, N_WORDS, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < N_WORDS
            tl.store(dst + offs, tl.load(arena_ptr + offs, mask=mask), mask=mask)
        tl.store(counter_ptr, count + 1)


class AcceptResultFence:
    """The epilogue's accept buffers as one arena, copied in-graph into a two-slot ring."""

    def __init__(self, epilogue) -> None:
        bufs = [(name, field, getattr(epilogue, name)) for name, field in _FIELDS]
        bufs = [(n, f, b) for n, f, b in bufs if b is not None]
        device = bufs[0][2].device
        layout, nbytes = [], 0
        for name, field, buf in bufs:
            if not buf.is_contiguous() or buf.device != device:
                raise RuntimeError(
                    f"DSpark accept-result fence: epilogue buffer {name} is not a "
                    f"contiguous tensor on {device} (found {buf.device}, strides "
                    f"{buf.stride()}); refusing to fence an unexpected layout"
                )
            layout.append((name, field, nbytes, buf.dtype, tuple(buf.shape)))
            nbytes += -(-buf.numel() * buf.element_size() // _ALIGN) * _ALIGN
        self.nbytes = nbytes
        self.arena = torch.zeros((nbytes,), dtype=torch.uint8, device=device)
        self._layout = tuple(layout)
        for name, _, offset, dtype, shape in self._layout:
            view = _view(self.arena, offset, dtype, shape)
            view.copy_(getattr(epilogue, name))
            setattr(epilogue, name, view)
        # Allocated with the epilogue, before any capture: graph-stable addresses.
        self.ring = torch.zeros((2, nbytes), dtype=torch.uint8, device=device)
        self.counter = torch.zeros((1,), dtype=torch.int64, device=device)
        self.count = 0  # folded steps the host consumed == ring copies the device ran
        self._captured = (
            False  # a capture since the last consumption: count from the device
        )
        self._views: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self.last_block_accept_lens: Optional[torch.Tensor] = None
        self._check: Optional[tuple] = None
        self._check_host = (
            torch.zeros((1,), dtype=torch.int64, pin_memory=True)
            if device.type == "cuda"
            else None
        )

    def copy_in(self, gate: torch.Tensor) -> None:
        """In the graph (or eagerly), right after the accept: arena -> ring slot, if gate."""
        if _capturing():  # its eager warm-ups ran before, uncounted
            self._captured = True
        _ring_copy_kernel[(1,)](
            self.arena.view(torch.int64), self.ring.view(torch.int64), self.counter,
            gate, N_WORDS=self.nbytes // 8, BLOCK=_BLOCK,
        )  # fmt: skip

    def snapshot(self, bs: int):
        """This step's accept outputs (rows ``[:bs]``) in the ring slot the graph wrote."""
        if _capturing():
            raise RuntimeError(
                "the accept-result ring is read after replay, not in capture"
            )
        if self._captured:
            self._count_from_device()
        slot = self.count % 2
        self.count += 1
        views = self._views.get((slot, bs))
        if views is None:
            views = self._views[(slot, bs)] = self._slot_views(slot, bs)
        self.last_block_accept_lens = views.get("block_accept_lens_buf")
        self._check_counter()
        if self.count == 1:
            logger.info(
                "DSpark accept results fenced: in-graph copy into a two-slot ring of "
                "%d bytes per slot (first step, bs=%d).",
                self.nbytes,
                bs,
            )
        return _accept_outs_cls()(
            **{
                field: views[name]
                for name, field, *_ in self._layout
                if field is not None
            }
        )

    def block_accept_lens(self, bs: int) -> Optional[torch.Tensor]:
        """The ring slot's block accept lengths of the last folded step, or None."""
        last = self.last_block_accept_lens
        if last is None:
            return None
        assert last.shape[0] == bs, (last.shape, bs)
        return last

    def _slot_views(self, slot: int, bs: int) -> dict[str, torch.Tensor]:
        views = {}
        for name, _, offset, dtype, shape in self._layout:
            full = _view(self.ring[slot], offset, dtype, shape)
            views[name] = full[:bs]
        return views

    def _count_from_device(self) -> None:
        """First consumption after a capture: this step's copy is the device counter's last
        (a sync, once per capture); copies before it that no host took were warm-ups."""
        self._captured = False
        self._check = None  # its expectation predates the warm-ups
        before = int(self.counter[0]) - 1
        if before < self.count:  # fewer copies than consumptions: not warm-ups
            self._verify(before + 1, self.count + 1)
        if before > self.count:
            logger.info(
                "DSpark accept-result ring: %d ring copies ran in the warm-ups of a CUDA-graph "
                "capture (its gate armed by the last served step); counting from the device.",
                before - self.count,
            )
        self.count = before

    def _check_counter(self) -> None:
        """Device ring copies == host consumptions, read back without a host sync."""
        if self._check_host is None:  # CPU tensors: the read is free
            self._verify(int(self.counter[0]), self.count)
            return
        if self._check is not None:
            event, expected = self._check
            if not event.query():
                return
            self._check = None
            self._verify(int(self._check_host[0]), expected)
        if self.count == 1 or self.count % CHECK_EVERY == 0:
            self._check_host.copy_(self.counter, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._check = (event, self.count)

    @staticmethod
    def _verify(device_count: int, host_count: int) -> None:
        if device_count != host_count:
            raise RuntimeError(
                "DSpark accept-result ring out of step: the device ran "
                f"{device_count} ring copies when the host had consumed {host_count} "
                "folded steps (a replay folded without the host taking its accept, or "
                "the reverse); the returned slots would hold another step's tokens"
            )


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _accept_outs_cls():
    from sglang.srt.speculative.dspark_components.dspark_verify import AcceptOuts

    return AcceptOuts


def _view(arena: torch.Tensor, offset: int, dtype: torch.dtype, shape) -> torch.Tensor:
    size = math.prod(shape) * dtype.itemsize
    return arena[offset : offset + size].view(dtype).view(shape)


def validate_fence_accept_results(server_args) -> None:
    """Resolution-hook check: only DSpark folds its accept results; refused, not ignored."""
    from sglang.srt.arg_groups.model_override_base import resolving_view

    cfg = resolving_view(server_args)
    enabled = cfg.speculative_dspark_fence_accept_results
    algorithm = cfg.speculative_algorithm
    if enabled and (algorithm or "").upper() != "DSPARK":
        raise ValueError(
            "--speculative-dspark-fence-accept-results applies to --speculative-algorithm DSPARK "
            f"only (got {algorithm!r}): no other algorithm has folded accept results to fence; "
            "drop the flag"
        )


def refuse_fence_without_fold(
    enabled: bool,
    epilogue,
    *,
    target: str,
    verify_mode: str,
    moe_draft: bool,
    graphs: bool,
) -> None:
    """Worker-start check: without the folding verify epilogue no step folds and the flag would do
    nothing, so it is refused, naming what this server has (docs/result-fence.md)."""
    if enabled and epilogue is None:
        raise ValueError(
            "--speculative-dspark-fence-accept-results fences the folded accept results, and "
            "this server folds none: DSpark folds them only with decode CUDA graphs, for a "
            "deepseek_v41 target in static verify mode with an MoE draft or in compact verify "
            f"mode (found target {target}, verify mode {verify_mode}, "
            f"{'MoE' if moe_draft else 'dense'} draft, decode CUDA graphs "
            f"{'on' if graphs else 'off'})"
        )


def maybe_build_accept_result_fence(
    epilogue, enabled: bool
) -> Optional[AcceptResultFence]:
    """Built at the end of the epilogue's constructor (before any capture), or None."""
    return AcceptResultFence(epilogue) if enabled else None
