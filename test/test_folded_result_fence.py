"""--speculative-dspark-fence-accept-results: the folded accept results are a snapshot,
not views of the verify graph's persistent buffers.

CPU: with the fence on, no tensor handed to GenerationBatchResult / the observers shares
storage with the epilogue's buffers, the in-graph writers still land in them, and the
snapshot keeps step N's values when the buffers are rewritten; with it off the stock views
are returned (the same storage, the race's precondition).
GPU: the real epilogue's folded accept captured in a CUDA graph, the scheduler's own
``_copy_result_to_cpu`` with its copy stream held back by queued work: stock reads the
next replay's tokens, the fence reads this step's.
"""

from __future__ import annotations

import types

import pytest
import torch

from sglang.srt.speculative.dspark_components.dspark_verify import (
    AcceptOuts,
    DsparkVerifyEpilogue,
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
    names = ["correct_len_buf", "bonus_buf", "cap_trim_lens_buf", "commit_lens_buf",
             "new_seq_lens_buf", "out_tokens_buf", "block_accept_lens_buf"]
    return [getattr(epi, n) for n in names if getattr(epi, n) is not None]


def _storages(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


def _write_step(epi, bs: int, step: int) -> None:
    """What the folded accept writes in the graph: build_accept_outs(out=read_accept(bs))."""
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


def _executor(epi) -> TargetVerifyExecutor:
    ex = object.__new__(TargetVerifyExecutor)
    ex.verify_epilogue = epi
    return ex


def _folded(epi, bs):
    return _executor(epi).accept_and_finalize(
        folded_accept=True, bs=bs, verify_ids_2d=None, target_logits=None,
        draft_block=None, sampling_info=None, draft_input=None, layout=None,
        prefix_lens=None, draft_tokens=None,
    )


def _fields(a: AcceptOuts) -> list[torch.Tensor]:
    return [a.correct_len, a.bonus, a.cap_trim_lens, a.commit_lens, a.new_seq_lens, a.out_tokens]


def test_flag_off_returns_stock_views():
    epi = _epilogue(fence=False)
    assert epi.result_fence is None
    _write_step(epi, 4, 1)
    acc = _folded(epi, 4)
    # Stock: every field is a view of a persistent buffer (what the race needs).
    assert _storages(_fields(acc)) <= _storages(_persistent(epi))
    assert acc.bonus.data_ptr() == epi.bonus_buf.data_ptr()


@pytest.mark.parametrize("block_lens", [False, True])
def test_fence_results_share_no_storage_with_persistent_buffers(monkeypatch, block_lens):
    from sglang.srt.environ import envs

    monkeypatch.setattr(
        envs.SGLANG_OPT_DSV41_POST_FORWARD_CUDA_GRAPH, "get", lambda: block_lens
    )
    stock, epi = _epilogue(fence=False), _epilogue(fence=True)
    assert (epi.block_accept_lens_buf is not None) == block_lens
    for bs in (1, 3, 8):
        _write_step(stock, bs, 2)
        _write_step(epi, bs, 2)
        acc = _folded(epi, bs)
        ref = stock.read_accept(bs)
        results = _fields(acc)
        block = epi.result_fence.block_accept_lens(bs)
        if block_lens:
            assert torch.equal(block, stock.read_block_accept_lens(bs))
            results.append(block)
        else:
            assert block is None
        # No returned tensor shares storage with the epilogue's persistent buffers.
        assert not (_storages(results) & _storages(_persistent(epi))), bs
        for got, want in zip(_fields(acc), _fields(ref)):
            assert got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(got, want)
        # The next replay rewrites the buffers; the snapshot keeps this step's values.
        before = [t.clone() for t in results]
        _write_step(epi, bs, 3)
        assert not torch.equal(epi.bonus_buf[:bs], before[1])
        for t, b in zip(results, before):
            assert torch.equal(t, b)


def test_sampling_accept_region_returns_the_snapshot():
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
        greedy_draft=True, step_logits=None,
        params=types.SimpleNamespace(temperatures=torch.ones(8)),
    )
    region._resolve_draft_sampler = lambda: sampler
    region._tp_sync = _NoTpSync()
    region._fused_argmax = region._block_verification = False
    region._rejection_noise = None
    region._gate = torch.ones(1, dtype=torch.int32)
    region._run = lambda key, fn: _write_step(epi, 4, 5)
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

    assert Spec.__struct_defaults__[Spec.__struct_fields__.index(
        "speculative_dspark_fence_accept_results")] is False


# ---------------------------------------------------------------------------- GPU


def _race(fence: bool, tries: int, bs: int = 4) -> int:
    """Tries in which the host read a later replay's tokens instead of this step's."""
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.managers.utils import GenerationBatchResult

    dev = torch.device("cuda")
    epi = _epilogue(fence, device=dev, max_bs=8, stride=4)
    vocab = 64
    logits = torch.zeros((bs * epi.stride, vocab), device=dev)
    candidates = torch.zeros((bs, epi.stride), dtype=torch.int64, device=dev)
    seq_lens = torch.full((bs,), 100, dtype=torch.int64, device=dev)

    def stage(step: int):
        # Every row's argmax is token (step % vocab); drafts never match (-1), so the
        # step emits that token as its bonus and out_tokens[:, 0].
        logits.zero_()
        logits[:, step % vocab] = 1.0
        candidates.fill_(-1)

    fwd = torch.cuda.Stream()
    copy = torch.cuda.Stream()
    with torch.cuda.stream(fwd):
        stage(1)
        epi._accept(candidates=candidates, logits=logits,
                    draft_tokens=candidates[:, 1:].contiguous(), seq_lens=seq_lens)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=fwd):
            epi._accept(candidates=candidates, logits=logits,
                        draft_tokens=candidates[:, 1:].contiguous(), seq_lens=seq_lens)
    torch.cuda.synchronize()
    sched = types.SimpleNamespace(
        copy_stream=copy, forward_stream=fwd,
        copy_stream_ctx=torch.cuda.stream(copy), enable_async_d2h_copy=True,
    )
    batch = types.SimpleNamespace(
        return_logprob=False, return_hidden_states=False,
        spec_algorithm=types.SimpleNamespace(is_dspark=lambda: True),
    )
    wrong = 0
    for i in range(tries):
        step = 2 * i + 2
        with torch.cuda.stream(fwd):
            stage(step)
            graph.replay()
            acc = _folded(epi, bs)
            result = GenerationBatchResult(
                next_token_ids=acc.out_tokens.reshape(-1), accept_lens=acc.commit_lens,
            )
        with torch.cuda.stream(copy):
            torch.cuda._sleep(2_000_000)  # work queued ahead on the copy stream
        result.copy_done = torch.cuda.Event()  # as the scheduler's run_batch sets it
        Scheduler._copy_result_to_cpu(sched, result, batch)
        done = result.copy_done
        with torch.cuda.stream(fwd):
            stage(step + 1)  # the next step's replay does not wait for the copy
            graph.replay()
        done.synchronize()
        got = result.next_token_ids.view(bs, epi.stride)[:, 0]
        wrong += int(not bool((got == step % vocab).all()))
    torch.cuda.synchronize()
    return wrong


@pytest.mark.gpu
def test_gpu_race_with_stock_and_none_with_the_fence():
    tries = 50
    stock = _race(False, tries)
    fenced = _race(True, tries)
    print(f"host read a later replay's tokens: stock {stock}/{tries}, fence {fenced}/{tries}")
    assert stock > tries // 2, "the stand-in did not reproduce the race"
    assert fenced == 0
