"""--speculative-dspark-fence-accept-results: the folded accept results live in a two-slot
ring the graph copies into, not in the verify graph's persistent buffers.

CPU (the ring kernel under TRITON_INTERPRET): with the fence on, no tensor handed to
GenerationBatchResult / the observers shares storage with the epilogue's buffers; the
slot alternates step by step; the values equal the real static epilogue's output
(``run_static``, bitwise, against a stock epilogue given the same inputs); a disarmed
gate copies nothing; a consumption without its copy fails loud. With it off the stock
views are returned (the same storage, the race's precondition).
GPU: the real epilogue's folded accept captured in a CUDA graph, driven like the overlap
loop (launch step N+1, then process step N) through the scheduler's own
``_copy_result_to_cpu`` with its copy stream held back by queued work: stock reads the
next replay's tokens, the ring reads each step's own.
"""

from __future__ import annotations

import types

import pytest
import torch

from sglang.srt.speculative.dspark_components.dspark_verify import (
    AcceptOuts,
    DsparkVerifyEpilogue,
    StaticVerifyIO,
    TargetVerifyExecutor,
    build_accept_outs,
)
from sglang.srt.speculative.spec_tp_sync import SpecTpSyncSite


class _NoTpSync:
    def enabled(self, site):
        return False

    def sync(self, site, tensor):
        return tensor


def _epilogue(fence: bool, device="cpu", max_bs=8, stride=4) -> DsparkVerifyEpilogue:
    return DsparkVerifyEpilogue(
        max_bs=max_bs,
        verify_num_draft_tokens=stride,
        device=device,
        tp_sync=_NoTpSync(),
        result_fence=fence,
    )


def _persistent(epi) -> list[torch.Tensor]:
    names = [
        "correct_len_buf",
        "bonus_buf",
        "cap_trim_lens_buf",
        "commit_lens_buf",
        "new_seq_lens_buf",
        "out_tokens_buf",
        "block_accept_lens_buf",
    ]
    return [getattr(epi, n) for n in names if getattr(epi, n) is not None]


def _storages(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


class _Io:
    """A static verify graph's inputs for one batch size (what run_static reads)."""

    def __init__(self, epi, bs: int, vocab: int = 64, device="cpu"):
        self.bs, self.vocab = bs, vocab
        n = bs * epi.stride
        self.io = StaticVerifyIO(
            candidates=torch.zeros((bs, epi.stride), dtype=torch.int64, device=device),
            logits=torch.zeros((n, vocab), device=device),
            hidden=torch.zeros((n, 8), device=device),
            seq_lens=torch.zeros((bs,), dtype=torch.int64, device=device),
            req_pool_indices=torch.zeros((bs,), dtype=torch.int64, device=device),
            out_cache_loc=torch.zeros((n,), dtype=torch.int64, device=device),
            positions=torch.zeros((n,), dtype=torch.int64, device=device),
        )

    def stage(self, step: int) -> None:
        """Row r of step s: target argmax (s + r) % vocab, the first draft matches it on
        even steps, seq lens 100 + s: every output field moves with the step."""
        io, v = self.io, self.vocab
        tok = (step + torch.arange(self.bs, device=io.logits.device)) % v
        io.logits.zero_()
        io.logits.view(self.bs, -1, v).scatter_(
            2, tok.view(-1, 1, 1).expand(self.bs, io.logits.shape[0] // self.bs, 1), 1.0
        )
        io.candidates.fill_(-1)
        if step % 2 == 0:
            io.candidates[:, 1] = tok
        io.seq_lens.fill_(100 + step)


def _run_static(epi, io: _Io) -> None:
    """The static verify graph's epilogue (the real code the graph captures)."""
    epi.run_static(io.io, accept=epi._accept_static_greedy, gate=epi.inject_gate_buf)


def _write_step(epi, bs: int, step: int, gate=None) -> None:
    """What a folded accept writes in the graph: build_accept_outs(out=read_accept(bs)),
    then (fence on) the ring copy under the path's gate."""
    g = epi.gamma
    correct_len = torch.full((bs,), step % (g + 1), dtype=torch.int64)
    build_accept_outs(
        correct_len=correct_len,
        bonus=torch.arange(bs, dtype=torch.int64) + 1000 * step,
        cap_trim_lens=torch.zeros((bs,), dtype=torch.int32),
        prefix_lens=torch.arange(bs, dtype=torch.int64) * 10 + step,
        draft_tokens=torch.arange(bs * g, dtype=torch.int64).view(bs, g) + 100 * step,
        gamma=g,
        verify_num_draft_tokens=epi.stride,
        tp_sync=epi._tp_sync,
        sync_site=SpecTpSyncSite.DSPARK_ACCEPT_GRAPH,
        out=epi.read_accept(bs),
        block_accept_lens_out=epi.read_block_accept_lens(bs),
    )
    if epi.result_fence is not None:
        epi.result_fence.copy_in(
            torch.ones(1, dtype=torch.int32) if gate is None else gate
        )


def _executor(epi) -> TargetVerifyExecutor:
    ex = object.__new__(TargetVerifyExecutor)
    ex.verify_epilogue = epi
    return ex


def _folded(epi, bs):
    return _executor(epi).accept_and_finalize(
        folded_accept=True,
        bs=bs,
        verify_ids_2d=None,
        target_logits=None,
        draft_block=None,
        sampling_info=None,
        draft_input=None,
        layout=None,
        prefix_lens=None,
        draft_tokens=None,
    )


def _fields(a: AcceptOuts) -> list[torch.Tensor]:
    return [
        a.correct_len,
        a.bonus,
        a.cap_trim_lens,
        a.commit_lens,
        a.new_seq_lens,
        a.out_tokens,
    ]


def test_flag_off_returns_stock_views():
    epi = _epilogue(fence=False)
    assert epi.result_fence is None
    _write_step(epi, 4, 1)
    acc = _folded(epi, 4)
    # Stock: every field is a view of a persistent buffer (what the race needs).
    assert _storages(_fields(acc)) <= _storages(_persistent(epi))
    assert acc.bonus.data_ptr() == epi.bonus_buf.data_ptr()


@pytest.mark.parametrize("block_lens", [False, True])
def test_ring_results_are_the_graph_output_in_alternating_slots(
    monkeypatch, block_lens
):
    from sglang.srt.environ import envs

    monkeypatch.setattr(
        envs.SGLANG_OPT_DSV41_POST_FORWARD_CUDA_GRAPH, "get", lambda: block_lens
    )
    stock, epi = _epilogue(fence=False), _epilogue(fence=True)
    assert (epi.block_accept_lens_buf is not None) == block_lens
    ring = epi.result_fence
    slot_bytes = ring.ring[1].data_ptr() - ring.ring[0].data_ptr()
    prev = None
    for step, bs in enumerate((3, 3, 8, 1, 8, 8)):
        stock_io, io = _Io(stock, bs), _Io(epi, bs)
        for e, x in ((stock, stock_io), (epi, io)):
            e.begin_static_step(
                bs, True
            )  # the step folds: the verify graph's gate armed
            x.stage(step)
            _run_static(e, x)
        acc = _folded(epi, bs)
        ref = stock.read_accept(bs)
        results = _fields(acc)
        block = ring.block_accept_lens(bs)
        if block_lens:
            assert torch.equal(block, stock.read_block_accept_lens(bs))
            results.append(block)
        else:
            assert block is None
        # No returned tensor shares storage with the epilogue's persistent buffers ...
        assert not (_storages(results) & _storages(_persistent(epi))), bs
        # ... they sit in ring slot (step % 2) ...
        base = ring.ring[step % 2].data_ptr()
        assert all(base <= t.data_ptr() < base + slot_bytes for t in results), step
        # ... and hold, bit for bit, what the real epilogue wrote (stock's views).
        for got, want in zip(_fields(acc), _fields(ref)):
            assert got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(got, want)
        # The next step's copy went to the other slot: the previous results still hold.
        if prev is not None:
            for t, b in zip(*prev):
                assert torch.equal(t, b)
        prev = (results, [t.clone() for t in results])
    assert int(ring.counter[0]) == ring.count == 6


def test_disarmed_gate_copies_nothing():
    """The verify graph of a step that does not fold (gate 0) leaves the ring and its
    counter alone; the sampling-accept region's copy (all-ones gate) is the step's one.
    """
    epi = _epilogue(fence=True)
    ring = epi.result_fence
    io = _Io(epi, 4)
    epi.begin_static_step(4, False)
    io.stage(1)
    _run_static(epi, io)
    assert int(ring.counter[0]) == 0 and not ring.ring.any()
    _write_step(epi, 4, 2)  # the region, after the verify graph
    acc = _folded(epi, 4)
    assert torch.equal(acc.bonus, torch.arange(4) + 2000)


def test_consuming_without_a_copy_fails_loud():
    epi = _epilogue(fence=True)
    _write_step(epi, 4, 1)
    _folded(epi, 4)
    _write_step(
        epi, 4, 2, gate=torch.zeros(1, dtype=torch.int32)
    )  # a copy that never ran
    with pytest.raises(RuntimeError, match="ring out of step"):
        _folded(epi, 4)


def test_capture_mid_serving_counts_its_warm_ups_from_the_device(monkeypatch, caplog):
    """A CUDA-graph capture mid-serving (update_weights_from_disk(recapture_cuda_graph=True),
    elastic EP scale-up) runs the epilogue eagerly twice per shape first, under the gate the
    last folded step left armed: ring copies no host takes. The first consumption after the
    capture counts from the device (before: "ring out of step" and the scheduler died), returns
    that step's own results, and a later drift still fails loud."""
    from sglang.srt.speculative.dspark_components import (
        dspark_result_fence as fence_mod,
    )

    stock, epi = _epilogue(fence=False), _epilogue(fence=True)
    ring = epi.result_fence
    stock_io, io = _Io(stock, 4), _Io(epi, 4)
    for step in range(2):
        epi.begin_static_step(4, True)
        io.stage(step)
        _run_static(epi, io)
        _folded(epi, 4)
    for _ in range(2):  # the capture's warm-ups: the gate still armed
        _run_static(epi, io)
    with monkeypatch.context() as m:  # the capture: the copy is recorded, not run
        m.setattr(fence_mod, "_capturing", lambda: True)
        m.setattr(fence_mod, "_ring_copy_kernel", {(1,): lambda *a, **k: None})
        _run_static(epi, io)
    assert (int(ring.counter[0]), ring.count) == (4, 2)
    for e, x in ((stock, stock_io), (epi, io)):
        e.begin_static_step(4, True)
        x.stage(2)
        _run_static(e, x)
    with caplog.at_level("INFO", logger=fence_mod.__name__):
        acc = _folded(epi, 4)
    assert "2 ring copies ran in the warm-ups" in caplog.text
    assert int(ring.counter[0]) == ring.count == 5
    for got, want in zip(_fields(acc), _fields(stock.read_accept(4))):
        assert torch.equal(got, want)
    _write_step(
        epi, 4, 3, gate=torch.zeros(1, dtype=torch.int32)
    )  # a copy that never ran
    with pytest.raises(RuntimeError, match="ring out of step"):
        _folded(epi, 4)


def test_sampling_accept_region_returns_the_ring_slot():
    from sglang.srt.speculative.dspark_components.dspark_sampling_accept_graph import (
        DsparkSamplingAcceptGraph,
    )

    epi = _epilogue(fence=True)
    region = object.__new__(DsparkSamplingAcceptGraph)
    region.disabled = False
    region._epilogue = epi
    io = types.SimpleNamespace(logits=torch.zeros(4 * epi.stride, 8))
    epi.static_io[4] = io
    sampler = types.SimpleNamespace(
        greedy_draft=True,
        step_logits=None,
        params=types.SimpleNamespace(temperatures=torch.ones(8)),
    )
    region._resolve_draft_sampler = lambda: sampler
    region._tp_sync = _NoTpSync()
    region._fused_argmax = region._block_verification = False
    region._rejection_noise = None
    region._gate = torch.ones(1, dtype=torch.int32)
    region._run = lambda key, fn: _write_step(epi, 4, 5, gate=region._gate)
    acc = region.run(bs=4, target_logits=io.logits)
    assert not (_storages(_fields(acc)) & _storages(_persistent(epi)))
    assert torch.equal(acc.bonus, torch.arange(4) + 5000)


def test_fence_refuses_an_unexpected_layout():
    from sglang.srt.speculative.dspark_components.dspark_result_fence import (
        AcceptResultFence,
    )

    epi = _epilogue(fence=False)
    epi.out_tokens_buf = torch.zeros(epi.stride, epi.max_bs, dtype=torch.int64).t()
    with pytest.raises(RuntimeError, match="out_tokens_buf"):
        AcceptResultFence(epi)


def test_flag_declared_off_by_default():
    from sglang.srt.arg_groups.fields.spec import Spec

    assert (
        Spec.__struct_defaults__[
            Spec.__struct_fields__.index("speculative_dspark_fence_accept_results")
        ]
        is False
    )


# ---------------------------------------------------------------------------- GPU


def _race(fence: bool, tries: int, bs: int = 4) -> int:
    """Steps whose tokens the host read wrong, driving the overlap loop's order: launch
    step N+1 (its folded accept consumed), then process step N (sync its copy_done)."""
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.managers.utils import GenerationBatchResult

    dev = torch.device("cuda")
    epi = _epilogue(fence, device=dev, max_bs=8, stride=4)
    io = _Io(epi, bs, device=dev)
    fwd = torch.cuda.Stream()
    copy = torch.cuda.Stream()
    with torch.cuda.stream(fwd):
        # Warm up (compiles) with the gate disarmed, as at server start; then capture.
        epi.begin_static_step(bs, False)
        io.stage(1)
        _run_static(epi, io)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=fwd):
            _run_static(epi, io)
        epi.begin_static_step(bs, True)
    torch.cuda.synchronize()
    sched = types.SimpleNamespace(
        copy_stream=copy,
        forward_stream=fwd,
        copy_stream_ctx=torch.cuda.stream(copy),
        enable_async_d2h_copy=True,
    )
    batch = types.SimpleNamespace(
        return_logprob=False,
        return_hidden_states=False,
        spec_algorithm=types.SimpleNamespace(is_dspark=lambda: True),
    )
    wrong, pending = 0, None
    for step in range(2, tries + 3):
        with torch.cuda.stream(fwd):
            io.stage(step)
            graph.replay()
            acc = _folded(epi, bs)
            result = GenerationBatchResult(
                next_token_ids=acc.out_tokens.reshape(-1),
                accept_lens=acc.commit_lens,
            )
        with torch.cuda.stream(copy):
            torch.cuda._sleep(2_000_000)  # work queued ahead on the copy stream
        result.copy_done = torch.cuda.Event()  # as the scheduler's run_batch sets it
        Scheduler._copy_result_to_cpu(sched, result, batch)
        if pending is not None:  # process the previous step, as pop_and_process does
            prev, prev_step = pending
            prev.copy_done.synchronize()
            want = (prev_step + torch.arange(bs)) % io.vocab
            got = prev.next_token_ids.view(bs, epi.stride)[:, 0]
            lens = prev.accept_lens.cpu()
            wrong += int(
                not (
                    torch.equal(got, want)
                    and bool((lens == (2 if prev_step % 2 == 0 else 1)).all())
                )
            )
        pending = (result, step)
    torch.cuda.synchronize()
    if fence:
        assert int(epi.result_fence.counter[0]) == epi.result_fence.count
    return wrong


@pytest.mark.gpu
def test_gpu_race_with_stock_and_none_with_the_fence():
    tries = 50
    stock = _race(False, tries)
    fenced = _race(True, tries)
    print(
        f"host read another step's tokens: stock {stock}/{tries}, ring {fenced}/{tries}"
    )
    assert stock > tries // 2, "the stand-in did not reproduce the race"
    assert fenced == 0


@pytest.mark.gpu
def test_gpu_drift_check_fails_loud_without_a_sync():
    """On CUDA the counter is read back asynchronously (first step, every CHECK_EVERY):
    a consumption whose copy never ran is reported at a later step."""
    epi = _epilogue(True, device=torch.device("cuda"))
    epi.result_fence.snapshot(4)  # no copy ran: device 0, host 1
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="ring out of step"):
        epi.result_fence.snapshot(4)


@pytest.mark.gpu
def test_gpu_recapture_mid_serving_keeps_the_ring_in_step():
    """The real epilogue captured in a CUDA graph as at startup (gate disarmed), served folded,
    then captured again mid-serving with the gate armed (two eager warm-ups first, as upstream's
    capture runs them): every step reads its own tokens, the asynchronous check agrees.
    """
    dev = torch.device("cuda")
    epi = _epilogue(True, device=dev)
    io = _Io(epi, 4, device=dev)

    def capture() -> torch.cuda.CUDAGraph:
        for _ in range(2):
            _run_static(epi, io)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            _run_static(epi, io)
        return graph

    epi.begin_static_step(4, False)
    graph = capture()
    epi.begin_static_step(4, True)
    for step in range(200):
        if step == 70:
            graph = capture()
        io.stage(step)
        graph.replay()
        acc = _folded(epi, 4)
        want = (step + torch.arange(4, device=dev)) % io.vocab
        assert torch.equal(acc.out_tokens.reshape(4, -1)[:, 0], want), step
    torch.cuda.synchronize()
    # 200 steps taken, and the 2 warm-up copies of the capture at step 70, counted from the device
    assert int(epi.result_fence.counter[0]) == epi.result_fence.count == 202


def test_flag_without_dspark_is_refused_at_resolution(llama_config):
    """Real server-argument resolution: the fence does nothing without DSPARK, so it is refused."""
    from conftest import resolve_server_args

    with pytest.raises(
        ValueError, match=r"--speculative-dspark-fence-accept-results.*DSPARK"
    ):
        resolve_server_args(llama_config, speculative_dspark_fence_accept_results=True)
    resolve_server_args(llama_config)  # off: accepted


def test_worker_refuses_the_fence_where_no_step_folds():
    """Where DSpark builds no verify epilogue (a deepseek_v4 target in static mode, or no decode
    graphs) nothing folds: the flag is refused at worker start, naming what the server has.
    """
    from sglang.srt.speculative.dspark_components.dspark_result_fence import (
        refuse_fence_without_fold,
    )

    found = dict(
        target="deepseek_v4", verify_mode="static", moe_draft=True, graphs=True
    )
    with pytest.raises(
        ValueError,
        match=r"--speculative-dspark-fence-accept-results .* folds none: .*"
        r"found target deepseek_v4, verify mode static, MoE draft, decode CUDA graphs on",
    ):
        refuse_fence_without_fold(True, None, **found)
    refuse_fence_without_fold(False, None, **found)  # off: nothing to refuse
    refuse_fence_without_fold(True, _epilogue(fence=True), **found)  # it folds: served
