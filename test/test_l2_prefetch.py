"""L2 prefetch at collective points (benchmark/l2/l2_prefetch_planner.py, l2_prefetch_kernel.py there:
not in the wheel, no engine code calls them; docs/l2_prefetch.md).

CPU: the planning logic: a learning forward records the weights read between collective
points, a replay prefetches the first budget bytes of the next span at each point, a replay that
reads other weights (or a different span count) is a logged MISMATCH that disables its key for
good, keys are independent, nested forwards are refused; the chunk table (16-byte granule,
alignment refused). GPU (-m gpu): the kernel issues cp.async.bulk.prefetch.L2 (in its PTX),
changes no byte, and the prefetcher forks and joins inside a CUDA-graph capture.
"""

from __future__ import annotations

import logging
import sys

import pytest
import torch
from conftest import REPO

sys.path.insert(0, str(REPO / "benchmark" / "l2"))
from l2_prefetch_kernel import CHUNK_BYTES, chunk_table  # noqa: E402
from l2_prefetch_planner import L2PrefetchPlanner, weight_of  # noqa: E402

MB = 1 << 20


def _forward(planner, key, spans):
    """One forward: weights before the first collective, then one span per collective."""
    mode = planner.begin(key)
    prefetched = []
    for i, span in enumerate(spans):
        if i:
            prefetched.append(planner.collective())
        for w in span:
            planner.weight(w)
    return mode, prefetched, planner.end()


W = {
    n: (0x1000 * (i + 1) << 20, size, n)
    for i, (n, size) in enumerate(
        [
            ("embed", 8 * MB),
            ("qkv", 4 * MB),
            ("router", 2 * MB),
            ("shared", 5 * MB),
            ("o", 30 * MB),
        ]
    )
}
SPANS = [[W["embed"]], [W["router"], W["shared"]], [W["o"]], [W["qkv"]]]


def test_learn_then_prefetch_the_first_budget_bytes_of_each_span():
    p = L2PrefetchPlanner(budget_bytes=6 * MB)
    assert _forward(p, ("decode", 8), SPANS) == ("learn", [[], [], []], "learned")
    mode, prefetched, status = _forward(p, ("decode", 8), SPANS)
    assert (mode, status) == ("apply", "match")
    router, shared, o, qkv = W["router"], W["shared"], W["o"], W["qkv"]
    assert prefetched == [
        [(router[0], 2 * MB), (shared[0], 4 * MB)],
        [(o[0], 6 * MB)],
        [(qkv[0], 4 * MB)],
    ]


def test_mismatch_disables_the_key_and_logs(caplog):
    p = L2PrefetchPlanner()
    _forward(p, "k", SPANS)
    other = [SPANS[0], [W["shared"], W["router"]], SPANS[2], SPANS[3]]
    with caplog.at_level(logging.WARNING, logger="l2_prefetch_planner"):
        assert _forward(p, "k", other)[2] == "mismatch"
    assert (
        "MISMATCH for 'k': span 0 read ['shared', 'router'] where the plan has ['router', 'shared']"
        in caplog.text
    )
    assert _forward(p, "k", SPANS) == (None, [[], [], []], None)  # for good
    assert p.mode_for("k") is None and "k" not in p.plans


def test_span_count_mismatch_and_keys_are_independent():
    p = L2PrefetchPlanner()
    _forward(p, 1, SPANS)
    _forward(p, 2, SPANS[:2])
    assert _forward(p, 2, SPANS[:2])[2] == "match"
    assert _forward(p, 1, SPANS[:3])[2] == "mismatch"
    assert p.mode_for(2) == "apply" and p.mode_for(3) == "learn"


def test_nested_forward_and_bad_budget_are_refused():
    p = L2PrefetchPlanner()
    p.begin("a")
    with pytest.raises(RuntimeError, match="begins inside forward 'a'"):
        p.begin("b")
    with pytest.raises(ValueError, match="positive"):
        L2PrefetchPlanner(0)


def test_weight_of_refuses_a_strided_view():
    t = torch.zeros(4, 8)
    assert weight_of(t, "w") == (t.data_ptr(), 128, "w")
    with pytest.raises(ValueError, match="not contiguous"):
        weight_of(t.t(), "wt")


def test_chunk_table():
    addrs, sizes = chunk_table(
        [(0x10000, 2 * CHUNK_BYTES + 100), (0x900000, 15)], "cpu"
    )
    assert addrs.tolist() == [0x10000, 0x10000 + CHUNK_BYTES, 0x10000 + 2 * CHUNK_BYTES]
    assert sizes.tolist() == [
        CHUNK_BYTES,
        CHUNK_BYTES,
        96,
    ]  # 100 rounded down to 16; 15 -> nothing
    assert addrs.dtype == torch.int64 and sizes.dtype == torch.int32
    with pytest.raises(ValueError, match="16-byte aligned"):
        chunk_table([(0x10008, 64)], "cpu")


def test_prefetcher_defaults_to_the_current_cuda_device(monkeypatch):
    """No device given: the current CUDA device (a regression: a (type, index) tuple is not a
    torch.device argument, which only the GPU test caught)."""
    from l2_prefetch_planner import L2Prefetcher

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: ("stream", device))
    pf = L2Prefetcher(L2PrefetchPlanner(budget_bytes=4 * MB))
    assert pf.device == torch.device("cuda", 3) and pf.stream == (
        "stream",
        torch.device("cuda", 3),
    )
    assert L2Prefetcher(
        L2PrefetchPlanner(budget_bytes=MB), "cuda:1"
    ).device == torch.device("cuda", 1)


# ------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
def test_gpu_kernel_emits_the_bulk_prefetch_and_changes_nothing():
    import l2_prefetch_kernel as k

    w = torch.randn(6 * MB // 2, device="cuda", dtype=torch.bfloat16)
    before = w.clone()
    addrs, sizes = k.chunk_table([(w.data_ptr(), w.numel() * 2)], "cuda")
    k.l2_prefetch(addrs, sizes)
    torch.cuda.synchronize()
    assert torch.equal(w.view(torch.int16), before.view(torch.int16))
    compiled = k._l2_prefetch_kernel[(1,)](
        addrs, sizes, addrs.numel(), LANES=k.LANES, num_warps=1
    )
    assert "cp.async.bulk.prefetch.L2.global" in compiled.asm["ptx"]


@pytest.mark.gpu
def test_gpu_prefetcher_in_a_captured_graph():
    from l2_prefetch_planner import L2Prefetcher

    ws = [
        torch.randn(2048, 1536, device="cuda", dtype=torch.bfloat16) for _ in range(4)
    ]
    x = torch.randn(4, 2048, device="cuda", dtype=torch.bfloat16)
    pf = L2Prefetcher(L2PrefetchPlanner(budget_bytes=4 * MB))

    def forward():
        pf.begin("decode-4")
        h, outs = x, []
        for i, w in enumerate(ws):
            pf.at_collective()  # stand-in collective point
            pf.weight(w, f"w{i}")
            outs.append(h @ w)
        return outs, pf.end()

    ref, status = forward()
    assert status == "learned"
    assert forward()[1] == "match"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs, status = forward()
    assert status == "match"
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(outs, ref):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
