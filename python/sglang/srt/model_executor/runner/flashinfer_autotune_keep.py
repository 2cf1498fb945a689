"""Keep a valid FlashInfer autotune cache across TP ranks (``--flashinfer-autotune-keep-cache``).

Upstream's gate drops every rank's cache unless the files' hashes agree, which ranks that tuned
different shapes (EP) never do. Here each rank checks that its cache passes FlashInfer's own load
decision and was written by a launch of this configuration; all ranks gather these records in one
collective and all keep, or all drop and retune. Dropping costs a retune, never a desync
(why and the checks: docs/flashinfer-autotune-keep.md).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Optional

logger = logging.getLogger(__name__)

METADATA_KEY = "_metadata"  # flashinfer.autotuner._METADATA_KEY
# Resolved fields that differ between two launches of the same configuration, and
# namespaces that do not reach a kernel (HTTP serving, logging and metrics, the fork's own).
VOLATILE_FIELDS = frozenset({"random_seed"})
IGNORED_NAMESPACES = frozenset({"serving", "observability", "fork"})
VOLATILE_ENV = frozenset({"SGLANG_RUN_ID"})
ENV_PREFIXES = ("SGLANG_", "FLASHINFER_")


def fingerprint_path(cache_path: Path) -> Path:
    return cache_path.with_suffix(".launch.json")


def _digest(obj: Any) -> str:
    return hashlib.sha256(
        json.dumps(obj, sort_keys=True, default=repr).encode()
    ).hexdigest()


def launch_fingerprint(server_args: Any, environ: Optional[dict] = None) -> str:
    """sha256 of the configuration that reaches kernels, the build and the SGLANG_* / FLASHINFER_*
    environment; equal for two launches of the same configuration."""
    from sglang.srt.arg_groups.arg_utils import namespace_of
    from sglang.srt.arg_groups.overrides import resolution_result
    from sglang.version import __version__

    config = {
        field: resolution_result(server_args, field, None)
        for field, path in namespace_of(type(server_args)).items()
        if path.split(".")[0] not in IGNORED_NAMESPACES and field not in VOLATILE_FIELDS
    }
    env = {
        k: v
        for k, v in (os.environ if environ is None else environ).items()
        if k.startswith(ENV_PREFIXES) and k not in VOLATILE_ENV
    }
    return _digest({"sglang": __version__, "config": config, "env": env})


def current_launch_fingerprint() -> str:
    from sglang.srt.runtime_context import get_server_args

    return launch_fingerprint(get_server_args())


def write_launch_fingerprint(cache_path: Path, fingerprint: str) -> None:
    """After tuning saved ``cache_path``: record which launch wrote it (atomic replace)."""
    path = fingerprint_path(cache_path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"launch_fingerprint": fingerprint}) + "\n")
    os.replace(tmp, path)


def cache_record(cache_path: Path, env: dict, fingerprint: str) -> dict:
    """What this rank would do with its cache, as the gate compares it across ranks."""
    record = {
        "loadable": False,
        "why": "",
        "stamp": "",
        "env": _digest(env),
        "launch": False,
    }
    try:
        configs = json.loads(cache_path.read_text())
    except FileNotFoundError:
        record["why"] = "no cache file"
        return record
    except (OSError, ValueError):
        record["why"] = "cache file unreadable"
        return record
    stamp = configs.get(METADATA_KEY) if isinstance(configs, dict) else None
    if not isinstance(stamp, dict):
        record["why"] = "cache file has no _metadata stamp"
        return record
    record["stamp"] = _digest(stamp)
    stale = {
        k: (stamp.get(k), v) for k, v in env.items() if stamp.get(k) not in (v, "*")
    }
    if stale:
        record["why"] = "stamp differs from this environment: " + ", ".join(
            f"{k} {old!r} != {new!r}" for k, (old, new) in sorted(stale.items())
        )
        return record
    record["loadable"] = True
    try:
        written = json.loads(fingerprint_path(cache_path).read_text()).get(
            "launch_fingerprint"
        )
    except (OSError, ValueError, AttributeError):
        written = None
    record["launch"] = written == fingerprint
    if not record["launch"]:
        record["why"] = (
            "no launch fingerprint beside it"
            if written is None
            else "written by a launch with another configuration"
        )
    return record


def keep_or_drop_autotune_cache(
    cache_path: Path, group: Any, env: dict, fingerprint: str
) -> bool:
    """One collective over ``group``: True when every rank keeps its cache, else every rank drops it."""
    import torch.distributed as dist

    mine = cache_record(cache_path, env, fingerprint)
    records: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(records, mine, group=group)
    keep = (
        all(r["loadable"] and r["launch"] for r in records)
        and len({r["stamp"] for r in records}) == 1
        and len({r["env"] for r in records}) == 1
    )
    if keep:
        _log_rank0(
            group,
            "FlashInfer autotune: every rank keeps its cache (same stamp, same launch configuration).",
        )
        return True
    if all(r["why"] == "no cache file" for r in records):
        _log_rank0(group, "FlashInfer autotune: no rank has a cache yet; tuning.")
        return False
    reasons = [f"rank {i}: {r['why']}" for i, r in enumerate(records) if r["why"]]
    if not reasons:
        reasons = ["stamps or environments differ between ranks"]
    _log_rank0(
        group,
        "FlashInfer autotune: dropping the cache on every rank and retuning ("
        + "; ".join(reasons)
        + ").",
    )
    cache_path.unlink(missing_ok=True)
    fingerprint_path(cache_path).unlink(missing_ok=True)
    return False


def _log_rank0(group: Any, message: str) -> None:
    import torch.distributed as dist

    if dist.get_rank(group) == 0:
        logger.info(message)


def validate_flashinfer_autotune_keep(server_args) -> None:
    """Resolution-hook check: refused where no cross-rank cache gate runs."""
    from sglang.srt.arg_groups.model_override_base import resolving_view

    cfg = resolving_view(server_args)
    if not cfg.flashinfer_autotune_keep_cache:
        return
    from sglang.srt.environ import envs

    why = None
    if cfg.device not in (None, "cuda"):
        why = f"FlashInfer autotunes on CUDA only (--device {cfg.device})"
    elif cfg.disable_flashinfer_autotune:
        why = "--disable-flashinfer-autotune is set"
    elif cfg.enable_deterministic_inference:
        why = "--enable-deterministic-inference turns FlashInfer autotune off"
    elif cfg.tp_size == 1:
        why = (
            "--tp-size 1 has no other rank to agree with (the cache is loaded as it is)"
        )
    elif not envs.SGLANG_FLASHINFER_AUTOTUNE_CACHE.get():
        why = "SGLANG_FLASHINFER_AUTOTUNE_CACHE=0 writes a fresh cache per run and reuses none"
    if why:
        raise ValueError(
            f"--flashinfer-autotune-keep-cache would do nothing: {why}; drop the flag"
        )
