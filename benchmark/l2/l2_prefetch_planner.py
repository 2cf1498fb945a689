"""L2 prefetch at collective points: while a collective runs, a side-stream kernel pulls the
first megabytes of the weights that the next linears read into L2.

Lives here, not in the wheel: it is not wired to the engine's collectives, and on one H200 it
did not help (docs/l2_prefetch.md).

At decode sizes a linear is a stream of its weight, and the first bytes arrive cold after every
collective; the collective itself leaves HBM idle. ``L2PrefetchPlanner`` learns, per forward key
(a captured graph's shape), the weights read between consecutive collective points (a learning
forward records them in order), and later forwards of that key replay the plan:
``L2Prefetcher`` forks a side stream at each collective point, issues
``cp.async.bulk.prefetch.L2`` for the first ``budget_bytes`` of the next span's weights
(l2_prefetch_kernel.py, beside this file), and joins it at the next collective point (or the end of
the forward).

INVARIANTS. A prefetch never changes memory or results; a plan only decides which bytes are
warm. A replayed forward also records its spans; if they differ from the plan (another weight,
order or span count) ``end`` reports ``mismatch``, logs it and disables the key: later forwards
of that key run without prefetch (a graph already captured with the stale plan prefetches the
learned weights, which still exist: wasted bandwidth, never a wrong value). Every fork is joined
in the same forward, so a CUDA-graph capture never ends with side-stream work outstanding.
Chunk tables are built when a plan is learned (eager), never during capture.
"""

from __future__ import annotations

import logging
from typing import Hashable, Optional

import torch

logger = logging.getLogger(__name__)

DEFAULT_BUDGET_BYTES = 6 << 20

Weight = tuple[int, int, str]  # (address, bytes, name)


def weight_of(tensor: torch.Tensor, name: str = "") -> Weight:
    if not tensor.is_contiguous():
        raise ValueError(
            f"L2 prefetch: weight {name or tuple(tensor.shape)} is not contiguous"
        )
    return tensor.data_ptr(), tensor.numel() * tensor.element_size(), name


class L2PrefetchPlanner:
    """Learns and checks the weights read between collective points, per forward key."""

    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES):
        if budget_bytes <= 0:
            raise ValueError(
                f"L2 prefetch: budget {budget_bytes} bytes must be positive"
            )
        self.budget_bytes = budget_bytes
        self.plans: dict[Hashable, tuple[tuple[Weight, ...], ...]] = {}
        self.disabled: set = set()
        self._key = None
        self._mode = None
        self._spans: list[list[Weight]] = []

    def mode_for(self, key) -> Optional[str]:
        """'apply' (a plan exists), 'learn' (none yet) or None (disabled after a mismatch)."""
        if key in self.disabled:
            return None
        return "apply" if key in self.plans else "learn"

    def begin(self, key) -> Optional[str]:
        if self._key is not None:
            raise RuntimeError(
                f"L2 prefetch: forward {key!r} begins inside forward {self._key!r}"
            )
        self._key, self._mode, self._spans = key, self.mode_for(key), [[]]
        return self._mode

    def weight(self, weight: Weight) -> None:
        if self._mode is not None:
            self._spans[-1].append(weight)

    def collective(self) -> list[tuple[int, int]]:
        """Close the current span; the (address, bytes) ranges to prefetch for the one that
        starts here (empty while learning or without a plan for it)."""
        if self._mode is None:
            return []
        self._spans.append([])
        if self._mode != "apply":
            return []
        spans = self.plans[self._key]
        index = (
            len(self._spans) - 2
        )  # spans after collectives: plan index 0 = after the first
        return self.ranges(spans[index]) if index < len(spans) else []

    def ranges(self, span) -> list[tuple[int, int]]:
        """The first ``budget_bytes`` of a span's weights, in the order they are read."""
        out, left = [], self.budget_bytes
        for addr, nbytes, _ in span:
            if left <= 0:
                break
            take = min(nbytes, left)
            out.append((addr, take))
            left -= take
        return out

    def end(self) -> Optional[str]:
        """'learned', 'match', 'mismatch' or None (disabled key)."""
        key, mode, spans = self._key, self._mode, self._spans
        self._key = self._mode = None
        self._spans = []
        if mode is None:
            return None
        seen = tuple(
            tuple(s) for s in spans[1:]
        )  # what precedes the first collective has no fork
        if mode == "learn":
            self.plans[key] = seen
            return "learned"
        plan = self.plans[key]
        if seen == plan:
            return "match"
        self.disabled.add(key)
        del self.plans[key]
        logger.warning(
            "L2 prefetch MISMATCH for %r: %s; this shape runs without prefetch from now on",
            key,
            _first_difference(plan, seen),
        )
        return "mismatch"


def _first_difference(plan, seen) -> str:
    for i, (a, b) in enumerate(zip(plan, seen)):
        if a != b:
            return f"span {i} read {[w[2] or hex(w[0]) for w in b]} where the plan has {[w[2] or hex(w[0]) for w in a]}"
    return f"{len(seen)} spans where the plan has {len(plan)}"


class L2Prefetcher:
    """The planner plus a side stream: fork a prefetch at each collective point, join it at the
    next one."""

    def __init__(self, planner: L2PrefetchPlanner, device=None):
        from l2_prefetch_kernel import chunk_table

        self.planner = planner
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device)
        self._chunk_table = chunk_table
        self._tables: dict = {}
        self._pending: Optional[torch.cuda.Event] = None
        self._index = 0

    def begin(self, key) -> Optional[str]:
        self._index = 0
        return self.planner.begin(key)

    def weight(self, tensor: torch.Tensor, name: str = "") -> None:
        self.planner.weight(weight_of(tensor, name))

    def at_collective(self) -> None:
        """Call right before a collective is enqueued on the current stream."""
        main = torch.cuda.current_stream(self.device)
        self._join(main)
        key = self.planner._key
        ranges = self.planner.collective()
        index, self._index = self._index, self._index + 1
        if not ranges:
            return
        table = self._tables.get((key, index))
        if table is None:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"L2 prefetch: no chunk table for {key!r} span {index} at capture time; "
                    "plans must be learned (and their tables built) before capture"
                )
            table = self._tables[(key, index)] = self._chunk_table(ranges, self.device)
        from l2_prefetch_kernel import l2_prefetch

        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            l2_prefetch(*table)
            event = torch.cuda.Event()
            event.record(self.stream)
        self._pending = event

    def end(self) -> Optional[str]:
        self._join(torch.cuda.current_stream(self.device))
        key = self.planner._key
        status = self.planner.end()
        if status == "learned":
            self.build_tables(key)
        elif status == "mismatch":
            for k in [k for k in self._tables if k[0] == key]:
                del self._tables[k]
        return status

    def build_tables(self, key) -> None:
        """Chunk tables of every span of ``key``'s plan (eager: before any capture replays it)."""
        for index, span in enumerate(self.planner.plans.get(key, ())):
            ranges = self.planner.ranges(span)
            if ranges:
                self._tables[(key, index)] = self._chunk_table(ranges, self.device)

    def _join(self, main) -> None:
        if self._pending is not None:
            main.wait_event(self._pending)
            self._pending = None
