"""DeepSeek-V4 weights copied one tensor at a time (``--weight-loader-disable-async-load``).

The loader copies each tensor before it reads the next: the same copies in the same order
(bitwise the same weights), at most one tensor's CPU pages alive (why: docs/serial-weight-load.md).
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

# The loaders that submit copies to a pool and read this flag.
ARCHITECTURES = ("DeepseekV4ForCausalLM",)


def async_weight_load_enabled() -> bool:
    """False under ``--weight-loader-disable-async-load``; True (upstream) otherwise."""
    from sglang.srt.runtime_context import get_context, get_model

    if not get_context().is_config_namespace_published("model"):
        return True
    if not get_model().weight_loader_disable_async_load:
        return True
    from sglang.srt.utils import log_info_on_rank0

    log_info_on_rank0(
        logger,
        "--weight-loader-disable-async-load: each checkpoint tensor is copied before the next is read",
    )
    return False


def validate_weight_loader_disable_async_load(server_args: Any) -> None:
    """Resolution-hook check: refused where the flag would do nothing."""
    from sglang.srt.arg_groups.model_override_base import (
        model_config_of,
        resolving_view,
    )

    cfg = resolving_view(server_args)
    if not cfg.weight_loader_disable_async_load:
        return
    model_arch = model_config_of(server_args).hf_config.architectures[0]
    if model_arch not in ARCHITECTURES:
        raise ValueError(
            f"--weight-loader-disable-async-load: the {model_arch} loader does not copy weights "
            f"on a thread pool that this flag controls (it does for: {', '.join(ARCHITECTURES)}); "
            "drop the flag"
        )
    if cfg.load_format == "dummy":
        raise ValueError(
            "--weight-loader-disable-async-load with --load-format dummy would do nothing: no "
            "checkpoint is read; drop the flag"
        )
