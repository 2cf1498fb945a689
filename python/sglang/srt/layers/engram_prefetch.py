"""--engram-prefetch: every Engram layer's table gather issued right after the hasher on a side
stream, joined at the layer that reads it; the same bits as the synchronous lookup.

Only the local gather moves (decode and target-verify batches); TP all-reduces stay at the layer
and extend batches keep upstream's lookup (docs/engram_prefetch.md).

INVARIANTS. Every event recorded on the side stream is waited on by the main stream in the same
forward (each Engram layer of a decode / verify forward runs once), so a CUDA-graph capture
never ends with unjoined side-stream work; ``rows`` allocated on the side stream are
``record_stream``-ed onto the main stream at the join.
"""

from __future__ import annotations

import argparse
import logging
import time
from contextlib import nullcontext
from typing import Optional

import torch

logger = logging.getLogger(__name__)

MODES = ("off", "on", "check")
_USAGE = (
    "accepted: off; on (gather every Engram layer's rows right after the hasher on a side "
    "stream); check (as on, and also run the synchronous lookup, serve it and count differing "
    "gathers)"
)
# upstream EngramEmbedding members the side-stream gather reads (checked at build: a rebase
# that renames one refuses to load instead of serving a different lookup)
_EMBEDDING_MEMBERS = (
    "peer",
    "host_table",
    "tp_size",
    "dim",
    "new_rows",
    "_owned_rows",
    "_reduce_owned_rows",
    "_shared",
    "_table_ptrs",
    "_sort_host_reads",
)
REPORT_EVERY_S = 60.0


def parse_engram_prefetch(value) -> str:
    """type_parser of the flag: one of MODES, or ArgumentTypeError listing the accepted forms."""
    v = str(value).strip().lower()
    if v not in MODES:
        raise argparse.ArgumentTypeError(f"--engram-prefetch={value!r}: {_USAGE}")
    return v


def validate_engram_prefetch(server_args) -> str:
    """Resolution-hook check: the value, and every configuration where it would do nothing."""
    from sglang.fork import parsed_flag
    from sglang.srt.arg_groups.model_override_base import (
        model_config_of,
        resolving_view,
    )

    cfg = resolving_view(server_args)
    mode = parsed_flag(server_args, "engram_prefetch", parse_engram_prefetch)
    if mode == "off":
        return mode
    hf_config = model_config_of(server_args).hf_config
    model_arch = hf_config.architectures[0]
    layers = tuple(getattr(hf_config, "engram_layer_ids", None) or ())
    if model_arch != "DeepseekV4ForCausalLM" or not layers:
        raise ValueError(
            f"--engram-prefetch={mode}: this model ({model_arch}) has no Engram layers "
            "(DeepSeek-V4.1 checkpoints list them in engram_layer_ids); use --engram-prefetch off"
        )
    if getattr(cfg, "device", None) not in (None, "cuda"):
        raise ValueError(
            f"--engram-prefetch={mode}: needs --device cuda (a side stream), got {cfg.device}; "
            "use --engram-prefetch off"
        )
    if cfg.tp_size > 1 and (
        getattr(cfg, "attn_dp_size", 1) > 1 or getattr(cfg, "dp_size", 1) > 1
    ):
        raise ValueError(
            f"--engram-prefetch={mode} with DP attention: the Engram lookup gathers every DP "
            "rank's hash ids first (a collective per layer), which the side stream does not move; "
            "use --engram-prefetch off"
        )
    return mode


class EngramPrefetch:
    """One model's prefetch: the Engram layers it serves, its side stream and check counts."""

    def __init__(self, mode: str, engrams: list, device: torch.device):
        self.mode = mode
        self.engrams = engrams
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.checked = torch.zeros((), dtype=torch.int64, device=device)
        self.differing = torch.zeros((), dtype=torch.int64, device=device)
        self._reported = (time.monotonic(), 0)

    def issue(self, hash_ids: torch.Tensor, forward_batch) -> Optional["Prefetched"]:
        """Gather every Engram layer's rows on the side stream; None keeps upstream's lookup."""
        if self.mode == "check":
            self._maybe_report()
        mode = forward_batch.forward_mode
        if (
            hash_ids is None
            or hash_ids.shape[0] == 0
            or not (mode.is_decode() or mode.is_target_verify())
            or getattr(forward_batch, "engram_staged_rows", None) is not None
        ):
            return None
        main = (
            torch.cuda.current_stream(self.device) if self.stream is not None else None
        )
        if self.stream is not None:
            self.stream.wait_stream(main)  # the hash ids are written on the main stream
            hash_ids.record_stream(self.stream)
        pending = {}
        with (
            torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()
        ):
            for engram in self.engrams:
                rows, reduce = _local_rows(
                    engram.embed, hash_ids[:, engram.layer_hash_index]
                )
                event = None
                if self.stream is not None:
                    event = torch.cuda.Event()
                    event.record(self.stream)
                pending[engram.layer_hash_index] = (rows, reduce, event)
        return Prefetched(self, pending, main)

    def _maybe_report(self) -> None:
        now = time.monotonic()
        if now - self._reported[0] < REPORT_EVERY_S:
            return
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return
        self.report()
        self._reported = (now, self._reported[1])

    def report(self) -> tuple[int, int]:
        """(gathers checked, gathers whose bits differed) so far; logs them (a device sync)."""
        checked, differing = int(self.checked), int(self.differing)
        if differing:
            logger.error(
                "engram prefetch check: %d of %d gathers differed from the synchronous "
                "lookup (the synchronous values were served)",
                differing,
                checked,
            )
        else:
            logger.info(
                "engram prefetch check: %d gathers, all bitwise equal to the synchronous "
                "lookup",
                checked,
            )
        return checked, differing


class Prefetched:
    """One forward's gathered rows, handed out once per Engram layer."""

    def __init__(self, owner: EngramPrefetch, pending: dict, main):
        self.owner, self.pending, self.main = owner, pending, main

    def rows(self, engram, hash_ids: torch.Tensor, forward_batch) -> torch.Tensor:
        """The layer's rows: wait for its gather, then the TP reduce at upstream's position."""
        rows, reduce, event = self.pending.pop(engram.layer_hash_index)
        if event is not None:
            self.main.wait_event(event)
            rows.record_stream(self.main)
        if reduce:
            rows = engram.embed._reduce_owned_rows(rows)
        if self.owner.mode != "check":
            return rows
        stock = engram.embed_rows(hash_ids, forward_batch, False)
        same = torch.equal if not stock.is_cuda else None
        if same is not None:
            self.owner.differing += int(
                not same(stock.view(torch.int16), rows.view(torch.int16))
            )
        else:
            self.owner.differing += (
                stock.view(torch.int16) != rows.view(torch.int16)
            ).any()
        self.owner.checked += 1
        return stock


def _local_rows(embed, ids: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The rows this rank gathers itself, and whether the TP all-reduce must still assemble them."""
    if ids.shape[0] == 0:
        return embed.new_rows(ids), False
    if embed.peer is not None:
        return embed.peer.lookup(ids), False
    if embed._shared:
        from sglang.kernels.ops.embeddings.engram_gather import engram_gather
        from sglang.kernels.ops.quantization.fp4_fake_quant import FP8_BLOCK_SIZE

        out = embed.new_rows(ids)
        engram_gather(
            *embed._table_ptrs(),
            ids.reshape(-1),
            out.view(-1, embed.dim),
            embed.dim,
            FP8_BLOCK_SIZE,
            sort_ids=embed._sort_host_reads,
        )
        return out, False
    return embed._owned_rows(ids), embed.tp_size > 1


def build_engram_prefetch(mode: str, layers, device=None) -> Optional[EngramPrefetch]:
    """The model's prefetch from the flag's parsed value (None when off or without Engram
    layers on this rank)."""
    if mode == "off":
        return None
    engrams = [
        e for e in (getattr(layer, "engram", None) for layer in layers) if e is not None
    ]
    if not engrams:
        return None
    missing = [m for m in _EMBEDDING_MEMBERS if not hasattr(engrams[0].embed, m)]
    if missing:
        raise RuntimeError(
            f"--engram-prefetch={mode}: EngramEmbedding no longer has {missing}; the side-stream "
            "gather would not be the lookup upstream runs, refusing to load"
        )
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    logger.info(
        "engram prefetch (--engram-prefetch=%s): the gathers of %d Engram layers (%s) run on a "
        "side stream right after the hasher in decode and target-verify%s",
        mode,
        len(engrams),
        ", ".join(str(e.layer_hash_index) for e in engrams),
        (
            "; check mode serves the synchronous lookup and counts differing gathers"
            if mode == "check"
            else ""
        ),
    )
    return EngramPrefetch(mode, engrams, device)


def issue_engram_prefetch(
    prefetch: Optional[EngramPrefetch], hash_ids, forward_batch
) -> Optional[Prefetched]:
    """The model's call right after the hasher: None (upstream's lookup) when off."""
    return None if prefetch is None else prefetch.issue(hash_ids, forward_batch)
