"""TP all-gathers over b12x's RoCE one-shot runtime (``--enable-b12x-roce-all-gather``).

``GroupCoordinator._all_gather_into_tensor`` asks ``gather_into`` first: a dim-0 gather that
fits the runtime runs on RoCE (built before any CUDA-graph capture), anything else keeps
upstream's path. Gathers are exact copies. Why, how and refusals: docs/b12x-roce-all-gather.md.
"""

from __future__ import annotations

import logging
import socket
from contextlib import nullcontext
from typing import Optional

import torch

from sglang.srt.utils.b12x_pin import require_b12x

logger = logging.getLogger(__name__)

FLAG = "--enable-b12x-roce-all-gather"
GROUP = "tp"


def validate_b12x_roce_all_gather(server_args) -> None:
    """Resolution-hook check (``Engine(...)`` bypasses argparse)."""
    from sglang.srt.arg_groups.model_override_base import resolving_view

    cfg = resolving_view(server_args)
    if not cfg.enable_b12x_roce_all_gather:
        return
    tp, nnodes = cfg.tp_size, cfg.nnodes
    if tp < 2:
        raise ValueError(
            f"{FLAG} does nothing with --tp {tp}: there is no all-gather; drop the flag"
        )
    if nnodes < 2:
        raise ValueError(
            f"{FLAG} needs TP ranks on different nodes joined by RoCE (found --nnodes {nnodes}); "
            "drop the flag on one node"
        )
    if tp > 16:
        raise ValueError(
            f"{FLAG}: b12x's RoCE runtime serves 2..16 ranks, found --tp {tp}; drop the flag"
        )
    require_b12x(FLAG, "comm.roce", "AllReduce")


def gather_shape_fits(nbytes: int, max_gather_bytes: int) -> bool:
    """The shard sizes RoCE takes (b12x's should_all_gather's size rule)."""
    return 0 < nbytes <= max_gather_bytes


def maybe_roce_gather(
    group_name: Optional[str], world_size: int, cpu_group, device
) -> Optional["RoceGather"]:
    """The TP group's RoCE gather when the flag is on, else None."""
    if group_name != GROUP or world_size < 2:
        return None
    from sglang.srt.runtime_context import get_context, get_exec

    # Groups built outside a server (tools, tests) have no published flags: the flag is off.
    if not get_context().is_config_namespace_published("exec"):
        return None
    if not get_exec().comm.enable_b12x_roce_all_gather:
        return None
    return RoceGather(cpu_group, device)


class RoceGather:
    """One b12x RoCE runtime for a process group, its gather plan prepared at construction."""

    def __init__(self, cpu_group, device):
        import torch.distributed as dist
        from b12x.comm import roce
        from b12x.preparation import PreparationSession, PreparedCall

        self.runtime = roce.AllReduce.from_exchange_group(
            exchange_group=cpu_group, device=device
        )
        hosts = [None] * dist.get_world_size(group=cpu_group)
        dist.all_gather_object(hosts, socket.gethostname(), group=cpu_group)
        query = roce.query_from_runtime(
            self.runtime,
            surface="AllReduce.all_gather",
            topology="roce_rdma",
            peer_hosts=hosts,
            call={"dim": 0, "max_gather_bytes": self.runtime.max_gather_bytes},
        )
        self.plan = roce.plan(query, runtime=self.runtime)
        probe = torch.zeros(256, dtype=torch.bfloat16, device=device)
        self.session = PreparationSession(
            device=device
        ).__enter__()  # lives with the group
        self.session.prepare(
            (
                self.plan.request(
                    name=f"roce all-gather {device}",
                    prepare_call=lambda state: PreparedCall(
                        run=lambda: state.all_gather(probe), owners=(probe,)
                    ),
                ),
            )
        )
        self.max_gather_bytes = self.runtime.max_gather_bytes
        logger.info(
            "%s: RoCE all-gather for %d ranks (hosts %s), shards up to %d bytes",
            FLAG,
            len(hosts),
            ",".join(hosts),
            self.max_gather_bytes,
        )

    def gather_into(self, output: torch.Tensor, input: torch.Tensor) -> bool:
        """Gather ``input`` (dim 0) into ``output`` on RoCE when it fits; False leaves it to NCCL."""
        if not (
            output.is_contiguous() and self.runtime.should_all_gather(input, dim=0)
        ):
            return False
        self.runtime.all_gather(input, dim=0, out=output, plan=self.plan)
        return True

    def capture(self):
        return self.runtime.capture()


def capture_context(roce_gather: Optional[RoceGather]):
    return nullcontext() if roce_gather is None else roce_gather.capture()
