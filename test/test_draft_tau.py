"""--speculative-dspark-draft-temperature-scale (tau): the draft samples and computes q at
tau * T, the target keeps T, the output distribution is the target's.

* tau = 1: the draft's buffer *is* params.temperatures (no kernel), bitwise stock.
* Storage identity: the draft consumers (draft sampling, q of every accept path) read the
  scaled buffer, the target consumers the unscaled one, in the folded and eager paths.
* Chi-square on the emitted tokens of the engine's accept for tau in {0.5, 0.8, 1, 1.25},
  and a negative control (q at T while the draft samples at tau * T) that the same test
  rejects, on every sampled accept path: token-wise rejection, block-wise rejection
  (SGLANG_OPT_DSV41_BLOCKWISE_REJECTION: ``accept_draft_tokens`` with a RejectionNoise; its
  torch reference on CPU, the Triton kernels on the GPU) and block verification (GPU).
* alpha(tau) = E sum min(p_T, q_{tau T}) on synthetic logits (printed; real gains need real
  draft/target logits).
"""

from __future__ import annotations

import argparse
import types

import pytest
import torch
from scipy.stats import chisquare

from sglang.kernels.ops.speculative.dspark.blockwise_rejection import (
    make_rejection_noise,
)
from sglang.srt.speculative.dspark_components import (
    dspark_draft,
    dspark_draft_tau,
    dspark_sampling_accept_graph,
)
from sglang.srt.speculative.dspark_components.dspark_draft import (
    DraftBlockResult,
    resolve_draft_params,
)
from sglang.srt.speculative.dspark_components.dspark_draft_sampler import (
    DsparkDraftSampler,
)
from sglang.srt.speculative.dspark_components.dspark_sampling_accept_graph import (
    GraphSamplingInfo,
)
from sglang.srt.speculative.dspark_components.dspark_verify import accept_draft_tokens


@pytest.fixture
def tau(monkeypatch):
    def set_tau(value: float):
        monkeypatch.setattr(dspark_draft_tau, "draft_temperature_scale", lambda: value)
        return value

    return set_tau


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _sampling_info(temps, top_ks):
    return types.SimpleNamespace(temperatures=temps, top_ks=top_ks)


def _sampler(max_bs=8, gamma=3, device="cpu") -> DsparkDraftSampler:
    model = types.SimpleNamespace(
        markov_head=None, sample_from_anchor=False, confidence_head=None
    )
    return DsparkDraftSampler(
        model=model,
        gamma=gamma,
        max_bs=max_bs,
        device=device,
        noise=None,
        tp_sync=None,
        greedy_draft=False,
    )


TEMPS = torch.tensor([0.7, 1.0, 1.3, 0.0, 0.5], dtype=torch.float32)
TOPKS = torch.tensor([50, 1 << 30, 40, 1, 1 << 30])  # row 3 is a greedy row


def _args(tau, algorithm):
    return types.SimpleNamespace(
        speculative_dspark_draft_temperature_scale=tau, speculative_algorithm=algorithm
    )


def test_flag_parser_and_hook():
    p = dspark_draft_tau.parse_draft_temperature_scale
    assert p("0.8") == 0.8 and p(1.25) == 1.25
    for bad in ("0", "-1", "nan", "inf", "x", None):
        with pytest.raises(argparse.ArgumentTypeError, match="finite float > 0"):
            p(bad)
    v = dspark_draft_tau.validate_draft_temperature_scale
    v(_args(0.8, "dspark"))
    v(_args(1.0, None))
    with pytest.raises(ValueError, match="DSPARK only"):
        v(_args(0.8, "EAGLE"))
    with pytest.raises(
        argparse.ArgumentTypeError,
        match="--speculative-dspark-draft-temperature-scale: .*finite float > 0",
    ):
        v(_args(0.0, "DSPARK"))  # Engine(...) skips argparse
    from sglang.srt.arg_groups.fields.spec import Spec

    i = Spec.__struct_fields__.index("speculative_dspark_draft_temperature_scale")
    assert Spec.__struct_defaults__[i] == 1.0


def test_tau_one_is_the_same_tensor_and_bitwise_stock(tau):
    tau(1.0)
    s = _sampler()
    assert s.draft_temperatures is s.params.temperatures
    s.stage_sampling_params(bs=5, sampling_info=_sampling_info(TEMPS, TOPKS))
    ref = resolve_draft_params(
        sampling_info=_sampling_info(TEMPS, TOPKS), bs=5, device="cpu"
    )
    for got, want in zip(s.params, ref):
        assert torch.equal(got[:5], want)
    params = resolve_draft_params(
        sampling_info=_sampling_info(TEMPS, TOPKS), bs=5, device="cpu"
    )
    assert dspark_draft_tau.scale_draft_params(params) is params


def test_scaled_buffer_starts_as_the_request_temperatures(tau):
    """Padded rows past bs are never staged: the draft's own buffer must start valid (a copy of
    upstream's buffer), not as uninitialised memory the graph's sampler would read."""
    tau(0.5)
    base = torch.ones(16)
    buf = dspark_draft_tau.draft_temperature_buffer(base)
    assert _storage(buf) != _storage(base) and torch.equal(buf, base)


@pytest.mark.parametrize("t", [0.5, 0.8, 1.25])
def test_draft_consumers_read_the_scaled_buffer_target_the_unscaled(
    tau, monkeypatch, t
):
    tau(t)
    s = _sampler()
    assert _storage(s.draft_temperatures) != _storage(s.params.temperatures)
    info = _sampling_info(TEMPS, TOPKS)
    s.stage_sampling_params(bs=5, sampling_info=info)
    ref = resolve_draft_params(sampling_info=info, bs=5, device="cpu")
    assert torch.equal(
        s.params.temperatures[:5], ref.temperatures
    )  # target's: unscaled
    assert torch.equal(s.draft_temperatures[:5], ref.temperatures * t)
    # Draft sampling temperature: tau * T on sampled rows, 0 (argmax) on greedy rows.
    assert torch.equal(s.params.step_temperatures[:5], ref.step_temperatures * t)
    assert s.params.step_temperatures[3] == 0

    # Folded sampling-accept region: q from the draft buffer, p from the unscaled one.
    seen = {}

    def record(**kw):
        seen.update(kw)
        raise StopIteration

    monkeypatch.setattr(dspark_sampling_accept_graph, "accept_draft_tokens", record)
    s.step_logits = torch.zeros(8, 3, 16)
    io = types.SimpleNamespace(
        candidates=torch.zeros(5, 4, dtype=torch.int64),
        logits=torch.zeros(20, 16),
        seq_lens=torch.zeros(5),
    )
    with pytest.raises(StopIteration):
        dspark_sampling_accept_graph.sampling_accept_commit_lens(
            io,
            verify_lens=None,
            gate=None,
            gated=False,
            draft_sampler=s,
            epilogue=types.SimpleNamespace(verify_cap=None),
            tp_sync=None,
            fused_argmax=False,
            block_verification=False,
            rejection_noise=None,
        )
    assert _storage(seen["draft_block"].temperatures) == _storage(s.draft_temperatures)
    assert _storage(seen["sampling_info"].temperatures) == _storage(
        s.params.temperatures
    )

    # Eager proposal: the block's temperatures (q) and the step temperatures are scaled.
    captured = {}

    def markov(**kw):
        captured.update(kw)
        bs, gamma = kw["base_logits"].shape[:2]
        return torch.zeros(bs, gamma, dtype=torch.int64), torch.zeros(bs, gamma, 16)

    monkeypatch.setattr(dspark_draft, "draft_markov_block", markov)
    block = dspark_draft.sample_draft_block(
        base_logits=torch.zeros(5, 3, 16),
        anchor_tokens=torch.zeros(5, dtype=torch.int64),
        draft_hidden=None,
        sampling_info=info,
        markov_head=None,
        noise=None,
        device="cpu",
        tp_sync=None,
        greedy_draft=False,
    )
    assert torch.equal(block.temperatures, ref.temperatures * t)
    assert torch.equal(captured["step_temperatures"], ref.step_temperatures * t)


def test_folded_proposal_hands_the_draft_buffer(tau, monkeypatch):
    tau(0.8)
    s = _sampler()
    s.step_logits = torch.zeros(8, 3, 16)
    s.stage_sampling_params(bs=4, sampling_info=_sampling_info(TEMPS[:4], TOPKS[:4]))
    prop = object.__new__(dspark_draft.DraftBlockProposer)
    prop.draft_model = types.SimpleNamespace(embed_tokens=None, confidence_head=None)
    prop.sample_from_anchor = False
    prop.gamma = 3
    prop._greedy_draft = False
    prop._draft_sampler = s
    prop._run_forward = lambda **kw: types.SimpleNamespace(
        draft_block_ids=torch.zeros(4, 4, dtype=torch.int64), can_run_graph=True
    )
    from sglang.srt.environ import envs

    monkeypatch.setattr(envs.SGLANG_DSPARK_FOLDED_PROPOSAL, "get", lambda: True)
    out = prop.propose(
        batch=None,
        draft_input=None,
        verify_window=None,
        bs=4,
        device="cpu",
        target_model=None,
        sampling_info=None,
    )
    assert out.folded
    assert _storage(out.draft_block.temperatures) == _storage(s.draft_temperatures)
    assert _storage(out.draft_block.temperatures) != _storage(s.params.temperatures)


# ------------------------------------------------------------ distribution equality

V = 6
T = 0.9


def _logits(gen, device):
    zp = torch.randn(V, generator=gen) * 1.5
    zq = zp + torch.randn(V, generator=gen) * 1.0  # a draft that is close, not equal
    return zp.to(device), zq.to(device)


ACCEPTS = ("token", "blockwise", "block")


def _emitted(
    t: float, n: int, *, control: bool, device="cpu", accept="token", seed=0
) -> tuple[torch.Tensor, torch.Tensor]:
    """First emitted token of n requests (gamma = 1) through the engine's accept, with the
    draft temperature staged by the sampler at tau = t. control: q computed at T instead.
    accept: token-wise rejection, block-wise rejection (a RejectionNoise, as the worker
    passes it under SGLANG_OPT_DSV41_BLOCKWISE_REJECTION) or block verification."""
    assert accept in ACCEPTS, accept
    gen = torch.Generator().manual_seed(1234)
    zp, zq = _logits(gen, device)
    dspark_draft_tau.draft_temperature_scale = (
        lambda: t
    )  # restored by the caller's fixture
    s = _sampler(max_bs=n, gamma=1, device=device)
    s.stage_sampling_params(
        bs=n,
        sampling_info=_sampling_info(
            torch.full((n,), T, device=device), torch.full((n,), 1 << 30, device=device)
        ),
    )
    torch.manual_seed(seed)
    # The draft samples at the staged step temperature (what MarkovSampleStep reads).
    step_t = s.params.step_temperatures[:n].view(n, 1)
    draft = torch.multinomial(torch.softmax(zq.view(1, V) / step_t, -1), 1).view(n)
    q_temps = s.params.temperatures[:n] if control else s.draft_temperatures[:n]
    block = DraftBlockResult(
        draft_tokens=draft.view(n, 1),
        corrected_logits=zq.view(1, 1, V).expand(n, 1, V).contiguous(),
        greedy_mask=s.params.greedy_mask[:n],
        temperatures=q_temps,
        greedy_draft=False,
    )
    candidates = torch.stack([torch.zeros_like(draft), draft], 1)
    noise = make_rejection_noise(seed, device) if accept == "blockwise" else None
    target_logits = zp.view(1, V).expand(2 * n, V).contiguous()
    correct_len, bonus, _ = accept_draft_tokens(
        candidates=candidates,
        target_logits=target_logits,
        draft_block=block,
        sampling_info=GraphSamplingInfo(temperatures=s.params.temperatures[:n]),
        draft_input=None,
        gamma=1,
        verify_num_draft_tokens=2,
        block_verification=accept == "block",
        rejection_noise=noise,
    )
    if noise is not None:  # the block-wise path ran (each call advances its counter)
        assert int(noise.counter[0]) == 1
    first = torch.where(correct_len >= 1, draft, bonus)
    return first.cpu(), torch.softmax(zp.float().cpu() / T, -1)


def _pvalue(first, p):
    counts = torch.bincount(first, minlength=V).double()
    return chisquare(counts.numpy(), (p.double() * counts.sum()).numpy()).pvalue


@pytest.fixture
def restore_tau():
    orig = dspark_draft_tau.draft_temperature_scale
    yield
    dspark_draft_tau.draft_temperature_scale = orig


# Triton runs interpreted on CPU (~10 ms per request): small n; the GPU test takes 200k.
N_CPU = 800
N_CONTROL_CPU = 1500  # noncentrality ~0.055 per sample at tau 0.5: ~80 here


@pytest.mark.parametrize("t", [0.5, 0.8, 1.0, 1.25])
def test_chi_square_emitted_tokens_follow_the_target(restore_tau, t):
    first, p = _emitted(t, N_CPU, control=False)
    assert _pvalue(first, p) > 1e-3, t


def test_chi_square_rejects_the_negative_control(restore_tau):
    # q at T while the draft samples at 0.5 T: the accept is no longer exact.
    first, p = _emitted(0.5, N_CONTROL_CPU, control=True)
    assert _pvalue(first, p) < 1e-4


# Block-wise rejection's CPU path is its torch reference (no interpreter): a larger n.
N_BLOCKWISE_CPU = 20_000


@pytest.mark.parametrize("t", [0.5, 0.8, 1.0, 1.25])
def test_chi_square_blockwise_rejection_follows_the_target(restore_tau, t):
    first, p = _emitted(t, N_BLOCKWISE_CPU, control=False, accept="blockwise")
    assert _pvalue(first, p) > 1e-3, t


def test_chi_square_blockwise_rejection_rejects_the_negative_control(restore_tau):
    first, p = _emitted(0.5, N_BLOCKWISE_CPU, control=True, accept="blockwise")
    assert _pvalue(first, p) < 1e-6


def test_alpha_of_tau_on_synthetic_logits():
    """alpha(tau) = E sum_v min(p_T, q_{tau T}) over random target/draft pairs (report)."""
    gen = torch.Generator().manual_seed(7)
    zp = torch.randn(256, 512, generator=gen) * 2.0
    zq = zp + torch.randn(256, 512, generator=gen) * 1.0
    rows = []
    for t in (0.5, 0.8, 1.0, 1.25):
        p = torch.softmax(zp / T, -1)
        q = torch.softmax(zq / (t * T), -1)
        rows.append((t, float(torch.minimum(p, q).sum(-1).mean())))
    print("alpha(tau) on synthetic logits:", rows)
    assert all(0.0 < a < 1.0 for _, a in rows)


@pytest.mark.gpu
@pytest.mark.parametrize("accept", ACCEPTS)
def test_gpu_chi_square(restore_tau, accept):
    n = 200_000
    for t in (0.5, 0.8, 1.0, 1.25):
        first, p = _emitted(t, n, control=False, device="cuda", accept=accept)
        assert _pvalue(first, p) > 1e-3, (t, accept)
    first, p = _emitted(0.5, n, control=True, device="cuda", accept=accept)
    assert _pvalue(first, p) < 1e-6, accept
