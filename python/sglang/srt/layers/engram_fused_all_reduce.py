"""--engram-fused-all-reduce: at TP > 1, the lookups of every Engram layer of a decode /
target-verify forward reduced with ONE TP all-reduce instead of one per layer; the same bits.

The prefetched rows (``--engram-prefetch``, required) go into one buffer that the first Engram
layer all-reduces with upstream's own call; every layer reads its slice.

INVARIANTS (argued in docs/engram-fused-all-reduce.md). The same bits: every table row is owned
by exactly one rank (``check_rows_partition``, at startup) and the others add an exact +0.0.
One collective order on every rank: the all-reduce runs on the main stream where upstream's first
Engram all-reduce runs, and every rank takes the fused path for the same batches. CUDA graphs:
the buffer comes from the graph's pool under capture; the all-reduce is captured as upstream's.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import Optional

import torch

logger = logging.getLogger(__name__)

FLAG = "--engram-fused-all-reduce"


def validate_engram_fused_all_reduce(server_args) -> bool:
    """Resolution-hook check: refused where it would do nothing or not give upstream's bits."""
    from sglang.srt.arg_groups.model_override_base import (
        model_config_of,
        resolving_view,
    )

    cfg = resolving_view(server_args)
    if not cfg.engram_fused_all_reduce:
        return False
    if cfg.tp_size <= 1:
        raise ValueError(
            f"{FLAG} does nothing at --tp-size {cfg.tp_size}: the Engram lookup has no "
            "all-reduce on one rank; drop the flag"
        )
    hf_config = model_config_of(server_args).hf_config
    model_arch = hf_config.architectures[0]
    layer_ids = tuple(getattr(hf_config, "engram_layer_ids", None) or ())
    if model_arch != "DeepseekV4ForCausalLM" or not layer_ids:
        raise ValueError(
            f"{FLAG}: this model ({model_arch}) has no Engram layers (DeepSeek-V4.1 "
            "checkpoints list them in engram_layer_ids); drop the flag"
        )
    prefetch = cfg.engram_prefetch  # --engram-prefetch (patch 0015, in Depends:)
    if prefetch not in ("on", "check"):
        raise ValueError(
            f"{FLAG} needs --engram-prefetch on (or check), got --engram-prefetch={prefetch}: "
            "the one all-reduce at the first Engram layer needs every layer's rows gathered "
            "after the hasher; add --engram-prefetch on"
        )
    from sglang.srt.environ import envs

    for env, what in (
        (
            "SGLANG_OPT_DSV41_ENGRAM_PEER_SHARDS",
            "each rank reads its peers' shards in place",
        ),
        ("SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE", None),
    ):
        placement = getattr(envs, env, None)  # None: a release without that placement
        if placement is None or not placement.get():
            continue
        if what is None:  # the host table: only its shared layout has no all-reduce
            layout = envs.SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT.get()
            if layout != "shared":
                continue
            what = "every rank reads the whole shared host table (SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT=shared)"
        raise ValueError(
            f"{FLAG} does nothing with {env}=1: {what}, the lookup has no all-reduce; "
            "drop the flag"
        )
    check_rows_partition(hf_config, cfg.tp_size)
    return True


def check_rows_partition(hf_config, tp_size: int) -> None:
    """Every Engram table's rows owned by exactly one of ``tp_size`` ranks (the bitwise
    argument rests on it), else ValueError naming the layer and the ranges."""
    from sglang.srt.layers.engram import EngramLayout, shard_range

    layout = EngramLayout.from_config(hf_config)
    for index, layer_id in enumerate(layout.layer_ids):
        rows = layout.num_embeddings[index]
        bounds = layout.column_bounds(index)
        ranges = [shard_range(rows, bounds, rank, tp_size) for rank in range(tp_size)]
        edges = [0] + [end for _, end in ranges]
        if (
            [start for start, _ in ranges] != edges[:-1]
            or edges[-1] != rows
            or edges != sorted(edges)
        ):
            raise ValueError(
                f"{FLAG}: Engram layer {layer_id}'s {rows} rows are not split into disjoint "
                f"ranges over {tp_size} TP ranks ({ranges}); one all-reduce would not give the "
                f"per-layer bits; drop the flag, or pick a --tp-size whose shards are disjoint"
            )


class FusedEngramAllReduce:
    """Wraps one model's EngramPrefetch: the same gathers, one all-reduce for all layers."""

    def __init__(self, prefetch):
        self.prefetch = prefetch

    def issue(self, hash_ids: torch.Tensor, forward_batch) -> Optional["FusedRows"]:
        """The gathers copied into one buffer; None where the prefetch serves none."""
        got = self.prefetch.issue(hash_ids, forward_batch)
        return None if got is None else FusedRows(self.prefetch, got)


class FusedRows:
    """One forward's rows: one buffer, reduced once at the first layer that asks."""

    def __init__(self, prefetch, got):
        self.got = got
        self.engrams = prefetch.engrams
        gathered = [got.pending[e.layer_hash_index] for e in self.engrams]
        if not all(reduce for _, reduce, _ in gathered):
            raise RuntimeError(
                f"{FLAG}: an Engram lookup without a TP all-reduce reached the fused path"
            )
        stream = prefetch.stream
        self.shapes = [rows.shape for rows, _, _ in gathered]
        first = gathered[0][0]
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            self.buffer = torch.empty(
                sum(r.numel() for r, _, _ in gathered),
                dtype=first.dtype,
                device=first.device,
            )
            offset = 0
            for rows, _, _ in gathered:
                self.buffer[offset : offset + rows.numel()].view(rows.shape).copy_(rows)
                offset += rows.numel()
            self.event = None
            if stream is not None:
                self.event = torch.cuda.Event()
                self.event.record(stream)
        self.reduced = False

    def rows(self, engram, hash_ids: torch.Tensor, forward_batch) -> torch.Tensor:
        """The layer's rows; the first call joins the side stream and runs the one all-reduce."""
        if not self.reduced:
            self._reduce_all()
        return self.got.rows(engram, hash_ids, forward_batch)

    def _reduce_all(self) -> None:
        buffer = self.buffer
        if self.event is not None:
            main = self.got.main
            main.wait_event(self.event)
            buffer.record_stream(main)
        reduced = self.engrams[0].embed._reduce_owned_rows(buffer)
        offset = 0
        for engram, shape in zip(self.engrams, self.shapes):
            n = shape.numel()
            # handed out by the prefetch as already-reduced rows (its check mode compares them)
            self.got.pending[engram.layer_hash_index] = (
                reduced[offset : offset + n].view(shape),
                False,
                None,
            )
            offset += n
        self.reduced = True


def fuse_engram_all_reduce(enabled: bool, prefetch, layout):
    """The model's prefetch, wrapped when the flag is on."""
    if not enabled:
        return prefetch
    if prefetch is None:
        raise RuntimeError(
            f"{FLAG} needs --engram-prefetch on and an Engram layer on this rank"
        )
    from sglang.srt.layers.engram import shard_range
    from sglang.srt.runtime_context import get_parallel

    tp_rank = get_parallel().tp_rank
    for engram in prefetch.engrams:
        embed, index = engram.embed, engram.layer_hash_index
        layer = layout.layer_ids[index]
        expected = shard_range(
            layout.num_embeddings[index],
            layout.column_bounds(index),
            tp_rank,
            embed.tp_size,
        )
        found = (embed.row_start, embed.row_start + embed.rows)
        if (
            embed.tp_size <= 1
            or embed.peer is not None
            or embed._shared
            or found != expected
        ):
            raise RuntimeError(
                f"{FLAG}: Engram layer {layer} is not looked up from a TP-sharded table with a "
                f"per-layer all-reduce (tp_size={embed.tp_size}, peer shards={embed.peer is not None}, "
                f"shared host table={embed._shared}, rows {found}, shard_range {expected}); refusing to load"
            )
    logger.info(
        "engram fused all-reduce (%s): the lookups of %d Engram layers (%s) are reduced with "
        "one TP all-reduce per decode / target-verify forward, at the first Engram layer",
        FLAG,
        len(prefetch.engrams),
        ", ".join(str(layout.layer_ids[e.layer_hash_index]) for e in prefetch.engrams),
    )
    return FusedEngramAllReduce(prefetch)
