"""--enable-b12x-roce-all-gather (TP all-gathers on b12x's RoCE runtime), up to the hardware: the
flag and its refusals, which groups build the runtime, and GroupCoordinator's all-gather choosing
RoCE exactly for the shards that fit (ahead of pymscclpp / pynccl), against a stand-in runtime."""

from __future__ import annotations

import argparse
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from sglang.srt.distributed.device_communicators import b12x_roce_gather as rg
from sglang.srt.utils import b12x_pin


def cfg(**kw):
    base = dict(enable_b12x_roce_all_gather=True, tp_size=4, nnodes=4)
    base.update(kw)
    return SimpleNamespace(**base)


def test_validate(monkeypatch):
    rg.validate_b12x_roce_all_gather(
        cfg(enable_b12x_roce_all_gather=False, tp_size=1, nnodes=1)
    )
    with pytest.raises(ValueError, match="does nothing with --tp 1"):
        rg.validate_b12x_roce_all_gather(cfg(tp_size=1))
    with pytest.raises(
        ValueError,
        match=r"needs TP ranks on different nodes joined by RoCE \(found --nnodes 1\)",
    ):
        rg.validate_b12x_roce_all_gather(cfg(nnodes=1))
    with pytest.raises(ValueError, match="serves 2..16 ranks, found --tp 32"):
        rg.validate_b12x_roce_all_gather(cfg(tp_size=32))
    monkeypatch.setattr(b12x_pin, "found_device", lambda: (None, "no CUDA device"))
    with pytest.raises(
        ValueError,
        match="--enable-b12x-roce-all-gather refused: device: no CUDA device",
    ):
        rg.validate_b12x_roce_all_gather(cfg())
    monkeypatch.setattr(
        b12x_pin, "found_device", lambda: ((12, 1), "NVIDIA GB10 (SM121)")
    )
    monkeypatch.setattr(b12x_pin, "found_b12x", lambda api, attr: ("1.5.1", ""))
    rg.validate_b12x_roce_all_gather(cfg(tp_size=3, nnodes=3))


def test_flag_on_command_line():
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    assert parser.parse_args(["--model-path", "x"]).enable_b12x_roce_all_gather is False
    assert parser.parse_args(
        ["--model-path", "x", "--enable-b12x-roce-all-gather"]
    ).enable_b12x_roce_all_gather


def test_only_the_tp_group_builds_a_runtime(monkeypatch):
    import sglang.srt.runtime_context as rc

    monkeypatch.setattr(
        rc,
        "get_exec",
        lambda: pytest.fail("asked for a group that never gathers on RoCE"),
    )
    assert rg.maybe_roce_gather("tp", 1, None, None) is None
    assert rg.maybe_roce_gather("ep", 4, None, None) is None
    ctx = SimpleNamespace(published=False)
    monkeypatch.setattr(
        rc,
        "get_context",
        lambda: SimpleNamespace(is_config_namespace_published=lambda ns: ctx.published),
    )
    assert (
        rg.maybe_roce_gather("tp", 4, None, None) is None
    )  # no server flags published: off
    ctx.published = True
    monkeypatch.setattr(
        rc,
        "get_exec",
        lambda: SimpleNamespace(
            comm=SimpleNamespace(enable_b12x_roce_all_gather=False)
        ),
    )
    assert rg.maybe_roce_gather("tp", 4, None, None) is None


class FakeRuntime:
    """b12x.comm.roce.AllReduce stand-in: its should_all_gather size rule; all_gather tiles the
    shard world times (what an all-gather of equal shards gives)."""

    def __init__(self, world=3, max_gather_bytes=1024):
        self.world, self.max_gather_bytes, self.calls = world, max_gather_bytes, []

    def should_all_gather(self, inp, dim=-1):
        return inp.is_contiguous() and rg.gather_shape_fits(
            inp.numel() * inp.element_size(), self.max_gather_bytes
        )

    def all_gather(self, inp, *, dim=-1, out=None, plan):
        self.calls.append((tuple(inp.shape), dim, plan))
        out.copy_(torch.cat([inp] * self.world, dim=0))
        return out


def coordinator(runtime):
    from sglang.srt.distributed.parallel_state import GroupCoordinator

    g = object.__new__(GroupCoordinator)
    g.ca_comm = None
    g.pymscclpp_comm = None
    g.pynccl_comm = None
    g.device_group = "the device group"
    gather = object.__new__(rg.RoceGather)
    gather.runtime, gather.plan, gather.max_gather_bytes = (
        runtime,
        "plan",
        runtime.max_gather_bytes,
    )
    g.roce_gather = gather
    return g


def test_all_gather_takes_roce_exactly_for_shards_that_fit(monkeypatch):
    from sglang.srt.distributed import parallel_state as ps

    nccl = []
    monkeypatch.setattr(
        ps, "all_gather_single", lambda out, inp, group: nccl.append(tuple(inp.shape))
    )
    monkeypatch.setattr(ps, "is_hip", lambda: False)
    rt = FakeRuntime(world=3, max_gather_bytes=1024)
    g = coordinator(rt)
    small = torch.arange(8 * 16, dtype=torch.bfloat16).view(8, 16)  # 256 bytes
    out = torch.empty(24, 16, dtype=torch.bfloat16)
    ps.GroupCoordinator._all_gather_into_tensor(g, out, small)
    assert rt.calls == [((8, 16), 0, "plan")] and not nccl
    assert torch.equal(out, torch.cat([small] * 3))
    big = torch.zeros(
        64, 16, dtype=torch.bfloat16
    )  # 2048 bytes: over the runtime's shard size
    ps.GroupCoordinator._all_gather_into_tensor(
        g, torch.empty(192, 16, dtype=torch.bfloat16), big
    )
    assert nccl == [(64, 16)] and len(rt.calls) == 1
    g.roce_gather = None  # flag off: upstream's path for every size
    ps.GroupCoordinator._all_gather_into_tensor(g, out, small)
    assert nccl == [(64, 16), (8, 16)] and len(rt.calls) == 1


def test_runtime_is_built_and_prepared_once(monkeypatch):
    """RoceGather's construction against stand-ins for b12x.comm.roce / b12x.preparation: the
    runtime from the exchange group, every rank's host in the query, the gather plan prepared.
    """
    made = {}
    roce = types.ModuleType("b12x.comm.roce")

    class AllReduce:
        @classmethod
        def from_exchange_group(cls, *, exchange_group, device):
            made["runtime"] = (exchange_group, device)
            return SimpleNamespace(max_gather_bytes=16 << 20)

    roce.AllReduce = AllReduce
    roce.query_from_runtime = lambda runtime, **kw: made.setdefault("query", kw)
    roce.plan = lambda query, *, runtime: SimpleNamespace(
        request=lambda **kw: ("req", kw["name"])
    )
    prep = types.ModuleType("b12x.preparation")

    class Session:
        def __init__(self, device):
            pass

        def __enter__(self):
            return self

        def prepare(self, requests):
            made["prepared"] = requests

    prep.PreparationSession, prep.PreparedCall = Session, lambda **kw: kw
    comm = types.ModuleType("b12x.comm")
    comm.roce = roce
    for name, mod in {
        "b12x": types.ModuleType("b12x"),
        "b12x.comm": comm,
        "b12x.comm.roce": roce,
        "b12x.preparation": prep,
    }.items():
        monkeypatch.setitem(sys.modules, name, mod)
    import torch.distributed as dist

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 3)
    monkeypatch.setattr(
        dist,
        "all_gather_object",
        lambda out, obj, group=None: out.__setitem__(
            slice(None), ["spark1", "spark2", "spark3"]
        ),
    )
    g = rg.RoceGather("cpu group", torch.device("cpu"))
    assert made["runtime"] == ("cpu group", torch.device("cpu"))
    assert made["query"]["peer_hosts"] == ["spark1", "spark2", "spark3"]
    assert (
        made["query"]["surface"] == "AllReduce.all_gather"
        and made["query"]["topology"] == "roce_rdma"
    )
    assert (
        made["prepared"] == (("req", "roce all-gather cpu"),)
        and g.max_gather_bytes == 16 << 20
    )
