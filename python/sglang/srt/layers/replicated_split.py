"""Split a replicated linear's output tiles over the TP ranks at small M (``--replicated-linear-split``).

Each TP rank runs the layer's own ``apply`` on its 128-row tiles of the output, then one TP
all-gather; larger calls and pre-quantized inputs stay stock (how: docs/replicated-split.md).

EXACTNESS AND COST ARE CHECKED, NEVER ASSUMED. The first eager call of each layer at each row
count compares the split output with stock bit for bit and times both; the ranks agree with MIN
all-reduces, so a (layer, rows) pair is split on every rank or on none.

CUDA GRAPHS. Decisions are made on eager calls only (the warm-up runs before capture); a capture
replays the decided path, and a row count first seen inside a capture is captured stock on every
rank (no collective can run inside a capture to agree on anything else). FlashInfer's autotune
pass decides nothing (it runs stock). The slices are views taken on the deciding call: a later
weight update that rebinds a parameter's storage is not seen.
"""

from __future__ import annotations

import argparse
import logging
import re
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import msgspec
import torch
from torch import nn

logger = logging.getLogger(__name__)

FLAG = "--replicated-linear-split"
TILE = 128
DEFAULT_MAX_ROWS = 96
CHECK_RANDOM_INPUTS = 3
TIMING_REPS = 7
SPEED_MARGIN = 0.03
_SUFFIX = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
ACCEPTED = (
    "off, or SUFFIX[,SUFFIX...][:MAX_ROWS]: the ReplicatedLinear layers whose prefix ends with "
    f"a SUFFIX (e.g. wqkv_a,main_proj), split at up to MAX_ROWS rows (1..4096, default {DEFAULT_MAX_ROWS})"
)

# Suffixes that matched a layer in this process (the startup check that each listed one did).
_matched: Dict[str, int] = {}


# --------------------------------------------------------------------------- the flag


def replicated_linear_split_rule(value) -> Optional[Tuple[Tuple[str, ...], int]]:
    """``(suffixes, max_rows)`` the flag's text names, or None for off."""
    text = "off" if value is None else str(value).strip()
    if text.lower() in ("", "off"):
        return None
    names, _, rows = text.partition(":")
    suffixes = tuple(s.strip() for s in names.split(","))
    bad = argparse.ArgumentTypeError(
        f"invalid {FLAG} value {value!r}: expected {ACCEPTED}"
    )
    if (
        not suffixes
        or any(not _SUFFIX.match(s) for s in suffixes)
        or len(set(suffixes)) != len(suffixes)
    ):
        raise bad
    max_rows = DEFAULT_MAX_ROWS
    if rows:
        try:
            max_rows = int(rows)
        except ValueError:
            raise bad from None
        if not 1 <= max_rows <= 4096:
            raise bad
    return suffixes, max_rows


class ReplicatedSplitRule(msgspec.Struct, frozen=True):
    """The flag's parsed value when on, held by the server arguments (``str``: its form)."""

    suffixes: Tuple[str, ...]
    max_rows: int

    def __str__(self) -> str:
        return _canonical((self.suffixes, self.max_rows))


def parse_replicated_linear_split(value) -> Union[str, ReplicatedSplitRule]:
    """type_parser of the flag: "off", or the rule every reader uses, parsed once; a parsed
    value comes back as it is."""
    if isinstance(value, ReplicatedSplitRule):
        return value
    rule = replicated_linear_split_rule(value)
    return "off" if rule is None else ReplicatedSplitRule(*rule)


def split_rule(value) -> Optional[Tuple[Tuple[str, ...], int]]:
    """``(suffixes, max_rows)`` of the flag's resolved value, None for off; a text other than
    off never reaches here (resolution parses ``Engine(...)``'s), and raises if it does.
    """
    if isinstance(value, ReplicatedSplitRule):
        return value.suffixes, value.max_rows
    if value is None or str(value).strip().lower() in ("", "off"):
        return None
    raise TypeError(f"{FLAG}={value!r} was not parsed by the server's resolution")


def _canonical(parsed) -> str:
    return "off" if parsed is None else f"{','.join(parsed[0])}:{parsed[1]}"


def validate_replicated_linear_split(server_args) -> None:
    """Resolution-hook check: refused where it does nothing or ranks could disagree on rows."""
    from sglang.srt.arg_groups.model_override_base import resolving_view

    cfg = resolving_view(server_args)
    value = cfg.replicated_linear_split
    if not isinstance(value, ReplicatedSplitRule):  # Engine(...) skips argparse
        value = parse_replicated_linear_split(value)
        if value == "off":
            return
        from sglang.srt.arg_groups.overrides import declare_resolution

        declare_resolution(
            server_args,
            "validate_replicated_linear_split",
            replicated_linear_split=value,
        )
    parsed = split_rule(value)
    value = _canonical(parsed)
    if cfg.tp_size < 2:
        raise ValueError(
            f"{FLAG}={value} does nothing with --tp {cfg.tp_size}: there is no rank to split over; "
            f"use {FLAG} off"
        )
    attn_dp = getattr(cfg, "attn_dp_size", 1) or 1
    if attn_dp > 1 or getattr(cfg, "enable_dp_attention", False):
        raise ValueError(
            f"{FLAG}={value}: with attention data parallelism (--attn-dp-size {attn_dp}) the TP "
            "ranks run different rows through these layers, and the split needs the same rows "
            f"on every rank; use {FLAG} off"
        )
    if getattr(cfg, "device", None) not in (None, "cuda"):
        raise ValueError(
            f"{FLAG}={value}: needs --device cuda, got {cfg.device}; use {FLAG} off"
        )


def check_replicated_split_layers(is_draft_worker: bool) -> None:
    """After a model runner loads its model: once the last model of the server is loaded (the
    draft's, when there is one), every listed suffix must have matched some layer."""
    from sglang.srt.runtime_context import get_context, get_exec, get_spec

    if not get_context().is_config_namespace_published("exec"):
        return
    parsed = split_rule(get_exec().comm.replicated_linear_split)
    if parsed is None:
        return
    check_matched(parsed, get_spec().speculative_algorithm, is_draft_worker, _matched)


def check_matched(
    parsed,
    speculative_algorithm: Optional[str],
    is_draft_worker: bool,
    matched: Dict[str, int],
) -> None:
    """The check of ``check_replicated_split_layers`` on explicit inputs."""
    algo = (speculative_algorithm or "").upper()
    if not is_draft_worker and algo not in ("", "NONE", "NGRAM"):
        return  # the draft model loads next and may hold the listed layers
    missing = [s for s in parsed[0] if s not in matched]
    if missing:
        raise ValueError(
            f"{FLAG}={_canonical(parsed)}: no ReplicatedLinear layer of the loaded model(s) has a "
            f"prefix ending in {', '.join(missing)} (matched: "
            f"{', '.join(f'{s} x{n}' for s, n in sorted(matched.items())) or 'none'})"
        )
    logger.info(
        "%s: %s split at up to %d rows where the first call at a row count finds it bitwise and faster",
        FLAG,
        ", ".join(f"{s} x{matched[s]}" for s in parsed[0]),
        parsed[1],
    )


def prefix_matches(prefix: str, suffixes: Sequence[str]) -> Optional[str]:
    """The listed suffix that ``prefix`` ends with, on a dot boundary."""
    for s in suffixes:
        if prefix == s or prefix.endswith("." + s):
            return s
    return None


def maybe_replicated_split(
    layer: nn.Module, prefix: str
) -> Optional["ReplicatedSplit"]:
    """The layer's split when the flag lists it, else None (the stock layer)."""
    from sglang.srt.runtime_context import get_context, get_exec

    # Layers built outside a server (tools, tests) have no published flags: the flag is off.
    if not get_context().is_config_namespace_published("exec"):
        return None
    parsed = split_rule(get_exec().comm.replicated_linear_split)
    if parsed is None:
        return None
    suffix = prefix_matches(prefix, parsed[0])
    if suffix is None:
        return None
    from sglang.srt.runtime_context import get_parallel

    _matched[suffix] = _matched.get(suffix, 0) + 1
    return ReplicatedSplit(layer, prefix, parsed[1], get_parallel().tp_group)


# --------------------------------------------------------------------------- the split


def tile_ranges(n: int, world: int) -> List[Tuple[int, int]]:
    """Each rank's output rows ``[lo, hi)``: whole 128-row tiles, counts differing by at most one."""
    tiles = -(-n // TILE)
    base, extra = divmod(tiles, world)
    out, t = [], 0
    for r in range(world):
        k = base + (r < extra)
        out.append((min(t * TILE, n), min((t + k) * TILE, n)))
        t += k
    return out


def _slice_tensor(
    name: str, t: torch.Tensor, n: int, lo: int, hi: int, what: str
) -> torch.Tensor:
    """``t``'s part for output rows [lo, hi): by rows, by g-row blocks, or by 128-row tiles (the
    swizzled MXFP8 scales); a tensor with no such dim does not depend on the row."""
    if t.dim() == 0 or t.numel() == 1:
        return t
    tiles = -(-n // TILE)
    for g in (1, 2, 4, 8, 16, 32, 64, 128):
        dims = [d for d, size in enumerate(t.shape) if size == -(-n // g)]
        if len(dims) == 1:
            return t.narrow(dims[0], lo // g, -(-hi // g) - lo // g)
        if len(dims) > 1 and dims[0] != 0:
            raise ValueError(
                f"{FLAG}: {what}.{name} {tuple(t.shape)}: more than one dim could be the output rows"
            )
        if (
            dims
        ):  # [N, K] first (upstream's layout); a transposed square view fails the self-check
            return t.narrow(0, lo // g, -(-hi // g) - lo // g)
    if "swizzled" in name and t.numel() % tiles == 0 and t.is_contiguous():
        per = t.numel() // tiles
        part = t.reshape(-1)[lo // TILE * per : -(-hi // TILE) * per]
        return part if t.dim() == 1 else part.view(-1, *t.shape[1:])
    if any(size % tiles == 0 and size >= tiles for size in t.shape) and "scale" in name:
        raise ValueError(
            f"{FLAG}: {what}.{name} {tuple(t.shape)}: a scale layout this split does not know"
        )
    return t


def slice_layer(layer: nn.Module, lo: int, hi: int, what: str = "layer") -> nn.Module:
    """A shallow twin of ``layer`` whose weight, scales and bias are views of rows [lo, hi)."""
    n = layer.output_size
    sub = nn.Module.__new__(type(layer))
    sub.__dict__.update(layer.__dict__)
    sub._parameters, sub._buffers, sub._modules = {}, dict(layer._buffers), {}
    sub.replicated_split = None
    for name, p in layer._parameters.items():
        if p is None:
            sub._parameters[name] = None
            continue
        q = nn.Parameter(
            _slice_tensor(name, p.data, n, lo, hi, what), requires_grad=False
        )
        q.__dict__.update({k: v for k, v in p.__dict__.items() if k not in q.__dict__})
        sub._parameters[name] = q
    for name, b in layer._buffers.items():
        if b is not None:
            sub._buffers[name] = _slice_tensor(name, b, n, lo, hi, what)
    for name, v in layer.__dict__.items():
        if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter):
            sub.__dict__[name] = _slice_tensor(name, v, n, lo, hi, what)
    for attr in ("output_size", "output_size_per_partition"):
        if hasattr(layer, attr):
            sub.__dict__[attr] = hi - lo
    if hasattr(layer, "output_partition_sizes"):
        sub.__dict__["output_partition_sizes"] = [hi - lo]
    return sub


def flashinfer_tuning() -> bool:
    """Whether FlashInfer's autotuner is choosing tactics now (the pre-capture dummy forward)."""
    try:
        from flashinfer.autotuner import AutoTuner
    except ImportError:
        return False
    return bool(AutoTuner.get().is_tuning_mode)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


def time_call(
    fn: Callable[[], object], device: torch.device, reps: int = TIMING_REPS
) -> float:
    """Median microseconds of ``fn`` (CUDA events on a GPU, the host clock elsewhere)."""
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                enable_timing=True
            )
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


Timer = Callable[[str, Callable[[], object], torch.device], float]


class ReplicatedSplit:
    """One layer's split: its tile ranges, this rank's slice and the decision per row count."""

    def __init__(
        self,
        layer: nn.Module,
        name: str,
        max_rows: int,
        group,
        timer: Optional[Timer] = None,
    ):
        self.layer, self.name, self.max_rows, self.group = layer, name, max_rows, group
        self.world, self.rank = group.world_size, group.rank_in_group
        n = layer.output_size
        if -(-n // TILE) < self.world:
            raise ValueError(
                f"{FLAG}: {name} has {n} output rows, {-(-n // TILE)} tile(s) of {TILE} for "
                f"{self.world} TP ranks: every rank needs at least one tile"
            )
        self.ranges = tile_ranges(n, self.world)
        self.widths = [hi - lo for lo, hi in self.ranges]
        self.timer = timer or (lambda _which, fn, device: time_call(fn, device))
        self.sub: Optional[nn.Module] = None
        self.decisions: Dict[int, bool] = {}

    # The upstream call site: ReplicatedLinear.forward.
    def apply(self, x, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            return self._stock(x, bias)
        m = x.numel() // x.shape[-1]
        if not 0 < m <= self.max_rows:
            return self._stock(x, bias)
        use = self.decisions.get(m)
        if use is None:
            if x.is_cuda and torch.cuda.is_current_stream_capturing():
                return self._stock(x, bias)  # undecided: captured stock on every rank
            if flashinfer_tuning():
                return self._stock(
                    x, bias
                )  # tactics not settled yet: decide after the tuning pass
            use = self.decisions[m] = self._decide(x, bias, m)
        return self._split(x, bias) if use else self._stock(x, bias)

    def _stock(self, x, bias):
        return self.layer.quant_method.apply(self.layer, x, bias)

    def _local(self, x: torch.Tensor, bias) -> torch.Tensor:
        sub_bias = None if bias is None else self.sub.bias
        return self.layer.quant_method.apply(self.sub, x, sub_bias)

    def _gather(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        m, width, wmax = (
            x.numel() // x.shape[-1],
            self.widths[self.rank],
            max(self.widths),
        )
        y = y.reshape(m, width)
        if width < wmax:
            padded = y.new_zeros(m, wmax)
            padded[:, :width] = y
            y = padded
        gathered = y.new_empty(self.world * m, wmax)
        self.group.all_gather_into_tensor(gathered, y.contiguous())
        gathered = gathered.view(self.world, m, wmax)
        if all(w == wmax for w in self.widths):
            out = gathered.permute(1, 0, 2).reshape(m, self.world * wmax)
        else:
            out = torch.cat(
                [gathered[r, :, :w] for r, w in enumerate(self.widths)], dim=1
            )
        return out.view(*x.shape[:-1], out.shape[-1])

    def _split(self, x: torch.Tensor, bias) -> torch.Tensor:
        return self._gather(self._local(x, bias), x)

    def _agree_min(self, values: List[float]) -> List[float]:
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group.cpu_group)
        return t.tolist()

    def _decide(self, x: torch.Tensor, bias, m: int) -> bool:
        gen = torch.Generator().manual_seed(m)  # the same random inputs on every rank
        inputs = [x] + [
            torch.randn(x.shape, generator=gen).to(dtype=x.dtype, device=x.device)
            for _ in range(CHECK_RANDOM_INPUTS)
        ]
        locals_, why = [], ""
        try:
            if self.sub is None:
                lo, hi = self.ranges[self.rank]
                self.sub = slice_layer(self.layer, lo, hi, self.name)
            locals_ = [self._local(xi, bias) for xi in inputs]
        except (
            Exception
        ) as e:  # a layout or kernel that refuses the slice: stock, on every rank
            why = f"{type(e).__name__}: {e}"
        if self._agree_min([0.0 if why else 1.0])[0] < 1:
            if why:
                logger.warning(
                    "%s: %s stays stock, the slice of rank %d fails: %s",
                    FLAG,
                    self.name,
                    self.rank,
                    why,
                )
            self._log(m, "stock (a rank's slice failed)")
            return False
        gathered = [
            self._gather(y, xi) for y, xi in zip(locals_, inputs)
        ]  # every rank, every input
        same = all(
            _same_bits(g, self._stock(xi, bias)) for g, xi in zip(gathered, inputs)
        )
        if not same:
            logger.warning(
                "%s: %s at %d rows: the split differs from stock on rank %d",
                FLAG,
                self.name,
                m,
                self.rank,
            )
        if self._agree_min([1.0 if same else 0.0])[0] < 1:
            self._log(
                m,
                "stock (self-check failed: the split is not bitwise the stock layer on every rank)",
            )
            return False
        t_stock = self.timer("stock", lambda: self._stock(x, bias), x.device)
        t_split = self.timer("split", lambda: self._split(x, bias), x.device)
        neg_split, stock = self._agree_min([-t_split, t_stock])
        slowest_split = -neg_split
        use = slowest_split <= (1.0 - SPEED_MARGIN) * stock
        self._log(
            m,
            f"{'split' if use else 'stock'} (split {slowest_split:.1f} us on the slowest rank, "
            f"stock {stock:.1f} us on the fastest; tiles {'/'.join(str(-(-w // TILE)) for w in self.widths)})",
        )
        return use

    def _log(self, m: int, what: str) -> None:
        if self.rank == 0:
            logger.info("%s: %s at %d rows: %s", FLAG, self.name, m, what)
