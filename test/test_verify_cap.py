"""DSpark verify cap (--speculative-dspark-verify-cap): flags, capping, exactness.

* flags: syntax and cross-flag errors (argparse and the resolution hook's validate);
* greedy: with cap k the committed tokens equal those of the same step verified with k
  drafts (ragged k per request, k = 1..gamma, an EOS mid-block), on the eager accept
  (accept_draft_tokens) and on the verify graph's static accept (DsparkVerifyEpilogue._accept);
* sampling: chi-square over seeded draws on a synthetic Markov target / draft (gamma = 5):
  the emitted tokens follow the target for token-wise and block verification, with and
  without a cap (a fixed K and a stopping rule on earlier drafts), while the rows past the
  live length carry a wrong distribution (as the anchor-routed dead rows do); a wrong
  correction rule, and a cut that looks at the draft it drops, fail the same test
  (upstream's trim after acceptance, ``trim_after``, passes it too: it is exact in
  distribution, but it is not the k-draft block rule and it reads the dead rows);
* the Triton rejection kernel with q = 0 past the live length makes the same decisions as
  the torch twin the statistical test uses, and as a verify with k drafts.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import types

import pytest
import torch
from conftest import REPO

# Not in the wheel (no engine code uses it): benchmark/dspark/ holds it.
sys.path.insert(0, str(REPO / "benchmark" / "dspark"))
from chain_verify_ref import chain_verify_ref  # noqa: E402

from sglang.srt.speculative.dspark_components import dspark_verify_cap as vc

GAMMA = 5


# ---------------------------------------------------------------- flags


def test_parse_accepts_the_documented_forms():
    assert vc.verify_cap_spec("3").fixed == 3
    assert vc.verify_cap_spec("conf:0.1").thresholds == (0.1,)
    assert vc.verify_cap_spec("conf:0.25,0.25,0.03,0.06").thresholds == (
        0.25,
        0.25,
        0.03,
        0.06,
    )
    assert (
        vc.parse_verify_cap("conf:0.1") == "conf:0.1"
    )  # the type_parser keeps the text


@pytest.mark.parametrize(
    "bad", ["0", "x", "conf:", "conf:1.5", "conf:-0.1", "conf:a,b", "2.5"]
)
def test_parse_rejects_malformed_values_listing_the_forms(bad):
    with pytest.raises(argparse.ArgumentTypeError, match="accepted forms"):
        vc.parse_verify_cap(bad)
    with pytest.raises(
        argparse.ArgumentTypeError, match="accepted forms"
    ):  # Engine(...) skips argparse
        _validate(bad)


# the validator's old keyword -> the upstream / fork field it reads
_FIELDS = dict(
    cap_min="speculative_dspark_verify_cap_min",
    log_path="speculative_dspark_verify_cap_log",
    algorithm="speculative_algorithm",
    attn_dp_size="attn_dp_size",
    max_running_requests="max_running_requests",
    moe_a2a_backend="moe_a2a_backend",
    tp_size="tp_size",
    device="device",
)


def _validate(
    cap, *, gamma=GAMMA, ragged_mode="static", arch="DeepseekV4ForCausalLM", **kw
):
    """validate_verify_cap on a stand-in with the fields it reads (the real-resolution test
    below holds the names to upstream's), the ragged mode and the target's architecture.
    """
    from unittest import mock

    # imported before the patch below: a module importing model_config_of by name while it is
    # patched would keep the stand-in for the rest of the session
    import sglang.srt.arg_groups.overrides  # noqa: F401
    import sglang.srt.arg_groups.pipeline  # noqa: F401
    from sglang.srt.speculative import ragged_verify

    fields = dict(
        speculative_dspark_verify_cap=cap,
        speculative_dspark_verify_cap_min=None,
        speculative_dspark_verify_cap_log=None,
        speculative_algorithm="DSPARK",
        speculative_num_draft_tokens=gamma + 1,
        attn_dp_size=1,
        max_running_requests=None,
        moe_a2a_backend="none",
        tp_size=1,
        device="cuda",
    )
    fields.update({_FIELDS[k]: v for k, v in kw.items()})
    config = types.SimpleNamespace(
        hf_config=types.SimpleNamespace(architectures=[arch])
    )
    with mock.patch.object(
        ragged_verify,
        "read_ragged_verify_mode",
        lambda: types.SimpleNamespace(value=ragged_mode),
    ), mock.patch(
        "sglang.srt.arg_groups.model_override_base.model_config_of",
        lambda sa: config,
    ):
        return vc.validate_verify_cap(types.SimpleNamespace(**fields))


def test_validate_cross_flag_rules():
    assert _validate(None) is None
    assert _validate("5").fixed == 5
    assert _validate("conf:0.1,0.2,0.3,0.4").thresholds == (0.1, 0.2, 0.3, 0.4)
    assert _validate("3", max_running_requests=vc.MAX_REQUESTS).fixed == 3
    for cap, kw, msg in [
        ("6", {}, "1..gamma"),
        ("conf:0.1,0.2", {}, "one threshold or gamma - 1"),
        ("3", {"algorithm": "EAGLE"}, "needs --speculative-algorithm DSPARK"),
        ("3", {"ragged_mode": "compact"}, "SGLANG_RAGGED_VERIFY_MODE=static"),
        ("3", {"log_path": "/tmp/x"}, "needs a conf: cap"),
        ("conf:0.1", {"cap_min": 0}, "verify-cap-min must be in 1..gamma"),
        ("3", {"attn_dp_size": 2}, "dp attention"),
        ("3", {"max_running_requests": vc.MAX_REQUESTS + 1}, "at most 1024 requests"),
        (None, {"cap_min": 2}, "need --speculative-dspark-verify-cap"),
        ("3", {"cap_min": 2}, "with the fixed cap 3 every request verifies 3"),
        (
            "conf:0.1",
            {"log_path": "/nonexistent-dir/cap.bin"},
            "/nonexistent-dir is not a writable",
        ),
        (
            "3",
            {"moe_a2a_backend": "deepep", "tp_size": 4},
            "--moe-a2a-backend deepep at tp 4",
        ),
        ("3", {"device": "npu:0"}, "NPU top-k route"),
        ("3", {"arch": "Qwen3MoeForCausalLM"}, "target is Qwen3MoeForCausalLM"),
    ]:
        with pytest.raises(ValueError, match=msg):
            _validate(cap, **kw)


def test_validate_accepts_what_the_cap_serves(tmp_path):
    """A DeepSeek-V4 target, an a2a backend on one rank (no scatter before the router), a log
    in a writable directory."""
    assert _validate("3", moe_a2a_backend="deepep", tp_size=1).fixed == 3
    assert _validate(
        "conf:0.1",
        moe_a2a_backend="none",
        tp_size=8,
        log_path=str(tmp_path / "cap.bin"),
    )


def test_validate_through_server_args_resolution(llama_config, monkeypatch):
    """The hook's one call reads upstream's fields by name: through ServerArgs' real resolution
    (refused without DSPARK), and on a real ServerArgs record for the DSPARK-only fields, so a
    renamed upstream field fails here."""
    from conftest import resolve_server_args

    from sglang.srt.server_args import ServerArgs

    with pytest.raises(ValueError, match="needs --speculative-algorithm DSPARK"):
        resolve_server_args(llama_config, speculative_dspark_verify_cap="3")
    with pytest.raises(ValueError, match="need --speculative-dspark-verify-cap"):
        resolve_server_args(llama_config, speculative_dspark_verify_cap_min=2)
    resolve_server_args(llama_config)
    sa = ServerArgs(
        model_path=str(llama_config),
        speculative_algorithm="DSPARK",
        speculative_num_draft_tokens=GAMMA + 1,
        speculative_dspark_verify_cap="3",
        tp_size=4,
        moe_a2a_backend="deepep",
    )
    import sglang.srt.arg_groups.model_override_base as mob

    monkeypatch.setattr(
        mob,
        "model_config_of",
        lambda sa: types.SimpleNamespace(
            hf_config=types.SimpleNamespace(architectures=["DeepseekV4ForCausalLM"])
        ),
    )
    with pytest.raises(ValueError, match="--moe-a2a-backend deepep at tp 4"):
        vc.validate_verify_cap(sa)


def test_bad_flag_value_is_an_argparse_error():
    r = subprocess.run(
        [
            sys.executable,
            "-W",
            "ignore",
            "-m",
            "sglang.launch_server",
            "--model-path",
            "m",
            "--speculative-dspark-verify-cap",
            "conf:2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(REPO / "tools" / "standins"), "PATH": "/usr/bin:/bin"},
    )
    assert r.returncode == 2
    assert (
        "argument --speculative-dspark-verify-cap" in r.stderr
        and "accepted forms" in r.stderr
    )


def test_stopping_rule_reads_earlier_positions_only():
    conf = torch.tensor(
        [
            [0.9, 0.9, 0.2, 0.9, 0.9],
            [0.05, 0.9, 0.9, 0.9, 0.9],
            [1.0, 1.0, 1.0, 1.0, 1.0],
        ]
    )
    thr = vc.threshold_vector(vc.verify_cap_spec("conf:0.5"), GAMMA)
    k = vc.drafts_from_confidence(conf, thr, k_min=1)
    assert k.tolist() == [2, 1, 5]
    # Per-position thresholds: draft 1 always verified, then t2..t5.
    thr = vc.threshold_vector(vc.verify_cap_spec("conf:0.9,0.0,0.0,0.0"), GAMMA)
    assert vc.drafts_from_confidence(conf, thr, k_min=1).tolist() == [1, 1, 5]
    assert vc.drafts_from_confidence(conf, thr, k_min=3).tolist() == [3, 3, 5]
    # Changing the confidence of draft i+1.. never changes whether draft i is verified.
    conf2 = conf.clone()
    conf2[:, 3:] = 0.0
    thr = vc.threshold_vector(vc.verify_cap_spec("conf:0.5"), GAMMA)
    assert vc.drafts_from_confidence(conf2, thr, 1).tolist() == [2, 1, 3]


# ---------------------------------------------------------------- greedy equivalence


class _NoSync:
    def enabled(self, site):
        return False

    def sync(self, site, tensor):
        return None


def _install(live: torch.Tensor):
    cap = vc.VerifyCap(spec=vc.VerifyCapSpec(fixed=GAMMA), gamma=GAMMA, device="cpu")
    cap.live[: live.numel()].copy_(live)
    return cap


def _greedy_case(bs, vocab=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    cand = torch.randint(0, vocab, (bs, GAMMA + 1), generator=g)
    logits = torch.randn((bs * (GAMMA + 1), vocab), generator=g)
    # Make long accepted runs likely: the target argmax follows the drafts mostly.
    tgt = logits.view(bs, GAMMA + 1, vocab)
    for r in range(bs):
        for i in range(GAMMA):
            if torch.rand((), generator=g) < 0.8:
                tgt[r, i, cand[r, i + 1]] += 10.0
    cand[0, 3] = 2  # an EOS-like token mid-block: nothing special in acceptance
    return cand, logits


def _draft_block(cand, vocab):
    from sglang.srt.speculative.dspark_components.dspark_draft import DraftBlockResult

    fields = DraftBlockResult.__struct_fields__
    kw = {f: None for f in fields}
    kw.update(
        draft_tokens=cand[:, 1:],
        greedy_mask=torch.ones(cand.shape[0], dtype=torch.bool),
    )
    if "greedy_draft" in fields:
        kw["greedy_draft"] = True
    return DraftBlockResult(**kw)


def _reference_k_drafts(cand, logits, live):
    """Greedy verify of each request with only k = live - 1 drafts: (accepted, bonus)."""
    bs = cand.shape[0]
    pred = logits.view(bs, GAMMA + 1, -1).argmax(-1)
    acc, bonus = [], []
    for r in range(bs):
        k = int(live[r]) - 1
        n = 0
        while n < k and int(cand[r, n + 1]) == int(pred[r, n]):
            n += 1
        acc.append(n)
        bonus.append(int(pred[r, n]))
    return torch.tensor(acc), torch.tensor(bonus)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_eager_accept_equals_a_k_draft_verify(seed):
    from sglang.srt.speculative.dspark_components.dspark_verify import (
        accept_draft_tokens,
    )

    bs = 12
    cand, logits = _greedy_case(bs, seed=seed)
    live = torch.tensor([2, 3, 4, 5, 6, 1 + 1, 6, 3, 4, 5, 2, 6])[
        :bs
    ]  # ragged, k = 1..5
    cap = _install(live)
    correct_len, bonus, _trim = accept_draft_tokens(
        candidates=cand,
        target_logits=logits,
        draft_block=_draft_block(cand, 11),
        sampling_info=None,
        draft_input=None,
        gamma=GAMMA,
        verify_num_draft_tokens=GAMMA + 1,
        verify_cap=cap,
    )
    ref_len, ref_bonus = _reference_k_drafts(cand, logits, live)
    assert torch.equal(correct_len.long(), ref_len) and torch.equal(
        bonus.long(), ref_bonus
    )
    # flags off: upstream's result (no cap)
    full_len, _, _ = accept_draft_tokens(
        candidates=cand,
        target_logits=logits,
        draft_block=_draft_block(cand, 11),
        sampling_info=None,
        draft_input=None,
        gamma=GAMMA,
        verify_num_draft_tokens=GAMMA + 1,
    )
    ref_full, _ = _reference_k_drafts(cand, logits, torch.full((bs,), GAMMA + 1))
    assert torch.equal(full_len.long(), ref_full)
    assert bool((full_len > correct_len).any())  # the cap did cut somewhere


def test_greedy_static_graph_accept_is_capped():
    from sglang.srt.speculative.dspark_components.dspark_verify import (
        DsparkVerifyEpilogue,
    )

    bs = 8
    cand, logits = _greedy_case(bs, seed=5)
    live = torch.tensor([2, 3, 4, 5, 6, 2, 4, 6])
    epilogue = dict(
        max_bs=16,
        verify_num_draft_tokens=GAMMA + 1,
        device="cpu",
        tp_sync=_NoSync(),
        fused_accept_tail=True,
    )
    ep = DsparkVerifyEpilogue(**epilogue, verify_cap=_install(live))
    assert not ep._serves_accept_tail(bs)  # the fused tail never trims: it steps aside
    seq_lens = torch.arange(bs, dtype=torch.int64) + 100
    commit = ep._accept(
        candidates=cand,
        logits=logits,
        draft_tokens=cand[:, 1:].contiguous(),
        seq_lens=seq_lens,
    )
    ref_len, ref_bonus = _reference_k_drafts(cand, logits, live)
    out = ep.read_accept(bs)
    assert torch.equal(out.correct_len.long(), ref_len)
    assert torch.equal(out.bonus.long(), ref_bonus)
    assert torch.equal(commit.long(), ref_len + 1)
    assert torch.equal(out.new_seq_lens, seq_lens + ref_len + 1)
    # Committed tokens: accepted drafts then the bonus, as a k-draft verify emits them.
    for r in range(bs):
        n = int(ref_len[r])
        assert out.out_tokens[r, :n].tolist() == cand[r, 1 : n + 1].tolist()
        assert int(out.out_tokens[r, n]) == int(ref_bonus[r])
    stock = DsparkVerifyEpilogue(**epilogue)
    assert stock._serves_accept_tail(bs)  # flags off: upstream's choice


# ---------------------------------------------------------------- sampling exactness

V = 4
N_TOKENS = 3


def _markov(seed):
    g = torch.Generator().manual_seed(seed)
    P = torch.softmax(torch.randn((V, V), generator=g) * 1.2, dim=1)
    Q = torch.softmax(torch.randn((V, V), generator=g) * 1.2, dim=1)
    return P, Q, g


# What a dead verify row's logits come from under the cap: the anchor's experts, i.e. not the
# target. Rows past the live length get this distribution; an exact rule never reads them.
WRONG = torch.softmax(
    torch.randn((V, V), generator=torch.Generator().manual_seed(99)) * 3, 1
)


def _cap_live(drafts, mode):
    """Live length per chain: a fixed K, or a stopping rule on earlier drafts only."""
    b = drafts.shape[0]
    if mode is None:
        return torch.full((b,), GAMMA + 1)
    if isinstance(mode, int):
        return torch.full((b,), mode + 1)
    if mode == "peek":
        # WRONG on purpose: verify draft i only if drafts 1..i (itself included) are not
        # token 0, i.e. the cut looks at the token it drops.
        lead = (drafts != 0).to(torch.int64).cumprod(dim=1).sum(dim=1)
        return 1 + lead.clamp(min=1)
    # verify draft i (i >= 2) while drafts 1..i-1 are not token 0
    lead = (drafts[:, : GAMMA - 1] != 0).to(torch.int64).cumprod(dim=1).sum(dim=1)
    return 1 + (1 + lead).clamp(max=GAMMA)


def _sample_sequences(P, Q, g, n_chains, *, block, cap, broken=None):
    """Emit N_TOKENS tokens per chain by repeated verify steps from context 0."""
    out = torch.full((n_chains, N_TOKENS), -1, dtype=torch.int64)
    filled = torch.zeros(n_chains, dtype=torch.int64)
    ctx = torch.zeros(n_chains, dtype=torch.int64)
    while bool((filled < N_TOKENS).any()):
        b = n_chains
        drafts = torch.empty((b, GAMMA), dtype=torch.int64)
        prev = ctx
        for i in range(GAMMA):
            drafts[:, i] = torch.multinomial(Q[prev], 1, generator=g)[:, 0]
            prev = drafts[:, i]
        cand = torch.cat([ctx[:, None], drafts], dim=1)
        target = P[cand]  # row i conditions on anchor/drafts <= i
        draft_probs = Q[cand[:, :GAMMA]]
        live = _cap_live(drafts, cap)
        dead = torch.arange(GAMMA + 1)[None, :] >= live[:, None]
        target = torch.where(dead[:, :, None], WRONG[cand], target)
        u = torch.rand((b, GAMMA), generator=g)
        uf = torch.rand((b,), generator=g)
        if broken == "trim_after":
            # upstream's cutoff for block verification: verify all, then trim to k
            n, tok = chain_verify_ref(
                candidates=cand,
                target_probs=target,
                draft_probs=draft_probs,
                uniforms=u,
                uniforms_final=uf,
                block_verification=block,
            )
            k = live - 1
            trimmed = n > k
            n = torch.minimum(n, k)
            tok = torch.where(
                trimmed, drafts.gather(1, k[:, None].clamp(max=GAMMA - 1))[:, 0], tok
            )
        else:
            n, tok = chain_verify_ref(
                candidates=cand,
                target_probs=target,
                draft_probs=vc.mask_dead_draft_probs(draft_probs, live),
                uniforms=u,
                uniforms_final=uf,
                block_verification=block,
                residual_from_target=broken == "residual_from_p",
            )
        emitted = torch.cat([drafts, torch.zeros((b, 1), dtype=torch.int64)], dim=1)
        emitted.scatter_(1, n[:, None], tok[:, None])
        for j in range(GAMMA + 1):
            slot = filled + j
            write = (j <= n) & (slot < N_TOKENS)
            out[write, slot[write]] = emitted[write, j]
        filled = torch.clamp(filled + n + 1, max=N_TOKENS)
        ctx = tok
    return out


def _chi_square_p(samples, P):
    idx = (samples[:, 0] * V + samples[:, 1]) * V + samples[:, 2]
    counts = torch.bincount(idx, minlength=V**N_TOKENS).double()
    a, b, c = torch.meshgrid(
        torch.arange(V), torch.arange(V), torch.arange(V), indexing="ij"
    )
    expect = (P[0, a] * P[a, b] * P[b, c]).reshape(-1).double() * samples.shape[0]
    stat = ((counts - expect) ** 2 / expect).sum()
    df = torch.tensor((V**N_TOKENS - 1) / 2.0, dtype=torch.float64)
    return float(torch.special.gammaincc(df, stat / 2.0))


N_CHAINS = 60000


@pytest.mark.parametrize("block", [False, True], ids=["token", "block"])
@pytest.mark.parametrize("cap", [None, 2, "rule"], ids=["nocap", "k2", "stoprule"])
def test_emitted_tokens_follow_the_target(block, cap):
    P, Q, g = _markov(seed=11)
    samples = _sample_sequences(P, Q, g, N_CHAINS, block=block, cap=cap)
    assert _chi_square_p(samples, P) > 1e-3


def test_trim_after_block_acceptance_is_exact_in_distribution_too():
    P, Q, g = _markov(seed=11)
    samples = _sample_sequences(
        P, Q, g, N_CHAINS, block=True, cap=2, broken="trim_after"
    )
    assert _chi_square_p(samples, P) > 1e-3


@pytest.mark.parametrize(
    "block,cap,broken",
    [
        (False, None, "residual_from_p"),
        (True, 2, "residual_from_p"),
        (False, "peek", None),
        (True, "peek", None),
    ],
    ids=[
        "token-wrong-residual",
        "block-wrong-residual",
        "token-cut-peeks",
        "block-cut-peeks",
    ],
)
def test_the_same_test_catches_a_wrong_rule(block, cap, broken):
    P, Q, g = _markov(seed=11)
    samples = _sample_sequences(P, Q, g, N_CHAINS, block=block, cap=cap, broken=broken)
    assert _chi_square_p(samples, P) < 1e-6


# ---------------------------------------------------------------- the kernel = the twin


def _kernel(cand, target, draft_probs, u, uf, block):
    from sglang.kernels.ops.speculative.reject_sampling import (
        chain_speculative_sampling_triton,
    )

    b, t = cand.shape
    d = cand.device
    predicts = torch.full((b * t,), -1, dtype=torch.int32, device=d)
    accept_index = torch.full((b, t), -1, dtype=torch.int32, device=d)
    accept_num = torch.zeros((b,), dtype=torch.int32, device=d)
    ridx = torch.arange(b * t, dtype=torch.int64, device=d).view(b, t)
    chain_speculative_sampling_triton(
        predicts,
        accept_index,
        accept_num,
        cand,
        ridx,
        None,
        None,
        u,
        uf,
        target,
        draft_probs,
        1.0,
        1.0,
        True,
        block_verification=block,
    )
    n = accept_num.long()
    tok = predicts.long()[accept_index.long()[torch.arange(b, device=d), n]]
    return n, tok


@pytest.mark.parametrize(
    "block,device",
    [
        pytest.param(False, "cpu", id="token-cpu"),
        pytest.param(False, "cuda", id="token-gpu", marks=pytest.mark.gpu),
        # the block branch does not run under the Triton interpreter
        pytest.param(True, "cuda", id="block-gpu", marks=pytest.mark.gpu),
    ],
)
def test_kernel_with_dead_q_matches_the_twin_and_a_k_draft_verify(block, device):
    g = torch.Generator().manual_seed(3)
    b, vocab = 48, 16
    target = torch.softmax(torch.randn((b, GAMMA + 1, vocab), generator=g) * 2, dim=-1)
    draft = torch.softmax(torch.randn((b, GAMMA, vocab), generator=g) * 2, dim=-1)
    cand = torch.zeros((b, GAMMA + 1), dtype=torch.int64)
    cand[:, 1:] = torch.multinomial(draft.view(-1, vocab), 1, generator=g).view(
        b, GAMMA
    )
    u = torch.rand((b, GAMMA), generator=g)
    uf = torch.rand((b,), generator=g)
    live = torch.randint(2, GAMMA + 2, (b,), generator=g)
    masked = vc.mask_dead_draft_probs(draft, live)
    dev = [x.to(device) for x in (cand, target, masked, u, uf)]
    kn, ktok = (x.cpu() for x in _kernel(*dev, block))
    rn, rtok = chain_verify_ref(
        candidates=cand,
        target_probs=target,
        draft_probs=masked,
        uniforms=u,
        uniforms_final=uf,
        block_verification=block,
    )
    assert torch.equal(kn, rn) and torch.equal(ktok, rtok)
    assert bool((kn <= live - 1).all())
    # = the same rule on a block of k drafts (same uniforms for the first k coins).
    for k in range(1, GAMMA + 1):
        rows = (live - 1) == k
        if not bool(rows.any()):
            continue
        tn, ttok = chain_verify_ref(
            candidates=cand[rows, : k + 1],
            target_probs=target[rows, : k + 1],
            draft_probs=draft[rows, :k],
            uniforms=u[rows, :k],
            uniforms_final=uf[rows],
            block_verification=block,
        )
        assert torch.equal(tn, kn[rows]) and torch.equal(ttok, ktok[rows]), k


# ---------------------------------------------------------------- upstream APIs


def test_a_deprecation_warning_from_our_modules_fails_the_tests():
    """conftest turns a DeprecationWarning raised from a module of the series into an error;
    upstream's own stay warnings."""
    import warnings

    with pytest.raises(DeprecationWarning):
        warnings.warn_explicit(
            "old API",
            DeprecationWarning,
            "dspark_verify_cap.py",
            1,
            module="sglang.srt.speculative.dspark_components.dspark_verify_cap",
        )
    with pytest.warns(DeprecationWarning):
        warnings.warn_explicit(
            "old API",
            DeprecationWarning,
            "topk.py",
            1,
            module="sglang.srt.layers.moe.topk",
        )


def test_live_lengths_are_broadcast_over_the_parallel_contexts_tp_group():
    """The cap finds the TP group through get_parallel() (get_tp_group() is deprecated)."""
    from sglang.srt.runtime_context import get_parallel

    group = types.SimpleNamespace(world_size=2)
    with get_parallel().override(tp_group=group):
        cap = vc.VerifyCap(
            spec=vc.verify_cap_spec("conf:0.5"), gamma=GAMMA, device="cpu"
        )
        assert cap._group() is group
    cap = vc.VerifyCap(spec=vc.verify_cap_spec("conf:0.5"), gamma=GAMMA, device="cpu")
    assert (
        cap._group() is None
    )  # no parallel state in this process: one rank, no broadcast


def test_our_modules_call_no_getter_upstream_deprecates(series):
    """Upstream wraps these getters to warn once per process, so a test can miss the warning;
    read the list upstream keeps and look for the names in our code instead."""
    import ast

    from sglang.srt.distributed import parallel_state

    deprecated = set(parallel_state._CONTEXT_NAME_OF)
    calls = [
        f"{own}:{node.lineno}: {node.id}"
        for p in series
        for own in p.owns
        if own.endswith(".py")
        for node in ast.walk(ast.parse((REPO / own).read_text()))
        if isinstance(node, ast.Name) and node.id in deprecated
    ]
    assert calls == []


def test_the_cap_is_built_once_and_held_by_the_target_model():
    """No process-wide cap: ``build_verify_cap`` hands it to the model that declares
    ``verify_cap``, refuses a model that does not, and is None with the flag off."""
    spec = types.SimpleNamespace(
        speculative_dspark_verify_cap="conf:0.4",
        speculative_num_draft_tokens=GAMMA + 1,
        speculative_dspark_verify_cap_min=2,
        speculative_dspark_verify_cap_log=None,
    )
    model = types.SimpleNamespace(verify_cap=None)
    cap = vc.build_verify_cap(spec, device="cpu", target_model=model)
    assert model.verify_cap is cap and cap.gamma == GAMMA and cap.k_min == 2
    assert cap.needs_confidence and vc.verify_cap_needs_confidence("conf:0.4")
    assert not vc.verify_cap_needs_confidence("2")
    assert not vc.verify_cap_needs_confidence(None)
    other = vc.build_verify_cap(spec, device="cpu")
    assert other is not cap  # two workers in one process do not share a cap
    with pytest.raises(ValueError, match="--speculative-dspark-verify-cap.*Namespace"):
        vc.build_verify_cap(spec, device="cpu", target_model=types.SimpleNamespace())
    off = types.SimpleNamespace(**{**vars(spec), "speculative_dspark_verify_cap": None})
    assert vc.build_verify_cap(off, device="cpu", target_model=model) is None
    assert not [
        name
        for name, value in vars(vc).items()
        if isinstance(value, vc.VerifyCap) or name in ("_CAP", "get_verify_cap")
    ]
    assert vc.verify_cap_cutoff(None, 3) is None
    assert torch.equal(vc.verify_cap_cutoff(cap, 3), cap.live[:3])
