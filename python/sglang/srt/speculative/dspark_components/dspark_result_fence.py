"""Fence the folded DSpark accept results from the next graph replay
(--speculative-dspark-fence-accept-results).

DIAGNOSIS. On the folded paths (the static/compact verify graph's epilogue and the
sampling-accept region) ``DsparkVerifyEpilogue.read_accept`` hands ``[:bs]`` views of
persistent graph buffers to ``GenerationBatchResult``. The scheduler's
``_copy_result_to_cpu`` queues their device-to-host copies on ``copy_stream`` behind
this step's forward, but the next step's replay, on the forward stream, never waits for
that copy. When the copy stream has work queued ahead, the host reads the *next* step's
tokens and lengths. Observability's host reads take the same views.

WHAT IT DOES. At construction the epilogue's accept buffers (correct_len, bonus,
cap_trim_lens, commit_lens, new_seq_lens, out_tokens and block_accept_lens when kept) are
re-bound to views of one byte arena, before any graph is captured, so every in-graph
writer writes into it unchanged. After a folded accept, ``snapshot(bs)`` clones the
arena once on the forward stream (one allocation, one copy kernel of a few KB) and
returns views of the clone at the same offsets: the result, the D2H copy and the
observers read the snapshot, which no replay writes; its lifetime on the copy stream is
kept by the D2H's ``record_stream``.

COST AND ALTERNATIVES. Cloning the six tensors one by one costs six allocations and
launches per step; the arena costs one. An in-graph copy into a two-slot ring would cost
no host time but touches every capture path and relies on the scheduler syncing step N's
copy before it launches step N+2; the snapshot relies on nothing but stream order.

LOSSLESS. The snapshot holds the bytes the graph wrote; the values are the same tensors'
values, only in other storage.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

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
_ALIGN = 16


class AcceptResultFence:
    """One byte arena behind the epilogue's accept buffers, cloned once per folded step."""

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
        self.arena = torch.zeros((nbytes,), dtype=torch.uint8, device=device)
        self._layout = tuple(layout)
        for name, _, offset, dtype, shape in self._layout:
            view = _view(self.arena, offset, dtype, shape)
            view.copy_(getattr(epilogue, name))
            setattr(epilogue, name, view)
        self.nbytes = nbytes
        self._dtypes = tuple({dtype for _, _, _, dtype, _ in self._layout})
        self.max_bs = int(epilogue.max_bs)
        self.last_block_accept_lens: Optional[torch.Tensor] = None
        self.num_snapshots = 0

    def snapshot(self, bs: int):
        """This step's accept outputs (rows ``[:bs]``) in storage no replay writes."""
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the accept-result fence snapshots after replay, not in capture")
        snap = self.arena.clone()
        # One typed view of the snapshot per dtype, then one slice per field.
        typed = {dtype: snap.view(dtype) for dtype in self._dtypes}
        views = {}
        for name, field, offset, dtype, shape in self._layout:
            start = offset // typed[dtype].element_size()
            if len(shape) == 1:
                views[name] = typed[dtype][start : start + bs]
            else:
                views[name] = typed[dtype][start : start + bs * shape[1]].view(bs, shape[1])
        self.last_block_accept_lens = views.get("block_accept_lens_buf")
        self.num_snapshots += 1
        if self.num_snapshots == 1:
            logger.info(
                "DSpark accept results fenced: one %d-byte snapshot per folded step "
                "(first step, bs=%d).",
                self.nbytes,
                bs,
            )
        return _accept_outs_cls()(
            **{field: views[name] for name, field, *_ in self._layout if field is not None}
        )

    def block_accept_lens(self, bs: int) -> Optional[torch.Tensor]:
        """The snapshot's block accept lengths of the last folded step, or None."""
        last = self.last_block_accept_lens
        if last is None:
            return None
        assert last.shape[0] == bs, (last.shape, bs)
        return last


def _accept_outs_cls():
    from sglang.srt.speculative.dspark_components.dspark_verify import AcceptOuts

    return AcceptOuts


def _view(arena: torch.Tensor, offset: int, dtype: torch.dtype, shape) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    size = n * torch.empty((), dtype=dtype).element_size()
    return arena[offset : offset + size].view(dtype).view(shape)


def maybe_build_accept_result_fence(epilogue, enabled: bool) -> Optional[AcceptResultFence]:
    """Built at the end of the epilogue's constructor (before any capture), or None."""
    return AcceptResultFence(epilogue) if enabled else None
