"""Flags of --weight-loader-fast-load: the accepted forms, the defaults, the model namespace's check.
Kept apart from the loader so that the ``model`` fields can import it without
importing the model loader package (which imports the server arguments).
"""

from __future__ import annotations

import argparse
import glob
import json
import os

# Measured: benchmark/results/archive/fast_load_sweep-cpu-2core.json (docs/fast-load.md).
DEFAULT_NUM_THREADS = 16
DEFAULT_SLAB_MB = 16


def _int_in(value, lo: int, hi: int, flag: str, what: str) -> int:
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if type(value) is not int or not lo <= value <= hi:
        raise argparse.ArgumentTypeError(
            f"{flag}: invalid {what} {value!r}: expected an integer in {lo}..{hi}"
        )
    return value


def parse_fast_load_num_threads(value) -> int:
    """type_parser of --weight-loader-fast-load-num-threads: an integer in 1..256."""
    return _int_in(
        value, 1, 256, "--weight-loader-fast-load-num-threads", "thread count"
    )


def parse_fast_load_slab_mb(value) -> int:
    """type_parser of --weight-loader-fast-load-slab-mb: an integer in 1..4096 (MiB)."""
    return _int_in(value, 1, 4096, "--weight-loader-fast-load-slab-mb", "slab size")


def validate_fast_load(server_args) -> None:
    """Model namespace check: refused where a flag does nothing or reads the checkpoint twice."""
    from sglang.srt.arg_groups.model_override_base import resolving_view

    cfg = resolving_view(server_args)
    threads, slab = (
        cfg.weight_loader_fast_load_num_threads,
        cfg.weight_loader_fast_load_slab_mb,
    )
    if threads is not None:  # Engine(...) bypasses argparse: the values are parsed here
        parse_fast_load_num_threads(threads)
    if slab is not None:
        parse_fast_load_slab_mb(slab)
    if not cfg.weight_loader_fast_load:
        for flag, value in (("num-threads", threads), ("slab-mb", slab)):
            if value is not None:
                raise ValueError(
                    f"--weight-loader-fast-load-{flag} {value} does nothing without --weight-loader-fast-load"
                )
        return
    if cfg.load_format not in ("auto", "safetensors"):
        raise ValueError(
            "--weight-loader-fast-load reads safetensors checkpoints (--load-format auto or "
            f"safetensors); got --load-format {cfg.load_format}"
        )
    path = cfg.model_path
    if (
        path
        and os.path.isdir(path)
        and not glob.glob(os.path.join(path, "*.safetensors"))
    ):
        found = sorted(
            glob.glob(os.path.join(path, "*.bin"))
            + glob.glob(os.path.join(path, "*.pt"))
        )
        if found:
            raise ValueError(
                f"--weight-loader-fast-load reads safetensors checkpoints; {path} holds "
                f"{os.path.basename(found[0])} and no .safetensors"
            )
    refused = {
        "--weight-loader-prefetch-checkpoints": (
            cfg.weight_loader_prefetch_checkpoints,
            "it reads every byte of every shard into the page cache, the bytes fast load skips included",
        ),
        "--weight-loader-disable-mmap": (
            cfg.weight_loader_disable_mmap,
            "fast load never maps the files",
        ),
        "--startup-weight-load-mode overlap": (
            cfg.startup_weight_load_mode == "overlap",
            "it stages whole shards in the page cache during capture",
        ),
    }
    for flag, (on, why) in refused.items():
        if on:
            raise ValueError(
                f"--weight-loader-fast-load cannot be combined with {flag}: {why}"
            )
    try:
        extra = json.loads(cfg.model_loader_extra_config or "{}")
    except ValueError:
        extra = {}
    clash = sorted(
        {"enable_multithread_load", "num_threads"}
        & set(extra if isinstance(extra, dict) else {})
    )
    if clash:
        raise ValueError(
            f"--weight-loader-fast-load replaces the multi-threaded loader: --model-loader-extra-config "
            f"{clash} would do nothing (use --weight-loader-fast-load-num-threads)"
        )
