"""The end-to-end matrix: one real ``launch_server`` per row, DeepSeek-V4 + DSpark, every fork flag,
served beside the unpatched release.

    python -m e2e.matrix --out DIR [--rows off,cap_3,...] [--standins] [--upstream PATH]

Each row starts a server on a tiny checkpoint generated from a seed (``e2e.checkpoints``), sends
its requests over HTTP, stops it and checks its log. ``--upstream PATH`` names the pinned
release's own ``python/`` tree (the GPU bundle lays it out): rows whose ``tree`` is ``upstream``
serve that tree, the same harness and stand-ins, and are the references the fork's rows are held
to. Per row, every check is recorded under ``checks`` and the row passes when all hold:

* startup: a fork row logs the fork-flags line with the row's values, an upstream row logs none
  (it is upstream's tree); no error in the log;
* engaged: the row's feature ran: its startup line, and the harness's probes (``E2E_PROBES``: a
  line in the log when a named function of the feature first ran; under CUDA graphs, when it was
  captured) or its counters (a cap's drafts accepted per step below gamma, a loop's finish);
* greedy (the agree and random checkpoints): 16 prompts x 64 tokens with per-token logprobs.
  ``same_as`` rows must equal the reference's tokens and logprobs bit for bit (``same_as_one_of``:
  one of the references', where upstream served twice does not give one result); ``bound_to`` rows
  (rounding-level kernels) keep every logprob within ``LOGPROB_BOUND`` of the reference's while
  their tokens agree (on the agree checkpoint the tokens must agree throughout);
* sampled (the sample checkpoint): 20,000 requests x 8 tokens at temperature 1, independent
  seeds per server, against upstream served without speculative decoding (the target's own
  distribution): the share of the target's modal next token at each position, the number of
  positions that took it, and the token distributions at the first drafted positions
  (``sample_test``). Two negative controls must be refused every run: upstream without
  speculation at 0.97 T, and a fork server whose accept rule reads q at T while its draft samples
  at 0.7 T (a fault the harness injects, ``E2E_FAULT``; never a switch of the engine);
* speculation (``judge_speculation``): DSpark is lossless, so a server that silently stopped
  speculating passes every token check; each DSpark row's responses must report verify steps,
  and a greedy row's per-request accepted drafts equal its reference's where their tokens are
  equal (a sampled row's accepted drafts per step within ``SPEC_Z`` standard errors of
  upstream's). Rows of flags that move acceptance by design must speculate; rows without
  DSpark must not. A negative control that drops speculation (``speculation_off``) must be
  refused every run;
* a reference row that did not serve fails the rows that compare with it.

Rows on the real-shape checkpoint time decode instead (``timing`` rows). ``--side-by-side SETS``
serves no row: it times upstream and the fork at once on a full-depth checkpoint
(``e2e.side_by_side``). Results:
``DIR/e2e-<device>.json`` (with the provenance of the machine that served the rows: build, device,
torch, triton, harness commit) and one log per row.
``--standins`` adds the H200 harness (functional stand-ins for binary packages that do not load
there, and the switches that keep the model off them); without it the check runs on a GPU machine
with upstream's real dependencies.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import hashlib
import json
import math
import os
import re
import statistics
import string
import sys
import threading
import time
import zlib
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from . import side_by_side
from .checkpoints import (
    LONG_DRAFT_RUNS,
    LONG_DSV4,
    REAL_SHAPE_DSV4,
    TINY_DSV4,
    TINY_ENGRAM,
    char_vocab,
    write_dsv4,
)
from .provenance import FIELDS, add_overwrite_arg
from .provenance import provenance as build_provenance
from .provenance import write_result
from .server import Server, ServerDied, refusal

HERE = Path(__file__).resolve().parent
STANDINS = [HERE / "standins", HERE.parent / "standins"]

# The switches that keep a tiny bf16 DeepSeek-V4 at TP1 off binary packages the H200 harness
# does not have (DeepGEMM, TileLang mHC, FlashInfer MoE, the Rust radix tree).
HARNESS_ENV = {
    # Inductor picks some reduction configs by timing them on the device, and servers sharing a
    # GPU time them differently: one summation order per process, bits apart between servers.
    "TORCHINDUCTOR_DETERMINISTIC": "1",
    "SGLANG_ENABLE_JIT_DEEPGEMM": "0",
    "SGLANG_FP8_PAGED_MQA_LOGITS_TORCH": "1",
    "SGLANG_OPT_DEEPGEMM_HC_PRENORM": "0",
    "SGLANG_OPT_USE_TILELANG_MHC_PRE": "0",
    "SGLANG_OPT_USE_TILELANG_MHC_POST": "0",
    "SGLANG_OPT_FUSE_MHC_POST_PRE": "0",
    "SGLANG_OPT_FLASHMLA_SPARSE_PREFILL": "0",
    "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python",
    "SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK": "1",  # the sgl_kernel stand-in has no package metadata
}
SERVE_ARGS = [
    "--moe-runner-backend",
    "triton",
    "--speculative-moe-runner-backend",
    "triton",
    "--sampling-backend",
    "pytorch",
    "--dsa-topk-backend",
    "torch",
    "--cuda-graph-backend-prefill",
    "disabled",
]
# The decode batches each checkpoint's requests produce (fewer graphs: a faster start).
GRAPH_ARGS = {
    "agree": ["--cuda-graph-bs-decode", "1", "4", "--max-running-requests", "4"],
    "random": ["--cuda-graph-bs-decode", "1", "--max-running-requests", "1"],
    "v41": ["--cuda-graph-bs-decode", "1", "--max-running-requests", "1"],
    "v41_agree": ["--cuda-graph-bs-decode", "1", "--max-running-requests", "1"],
    "v41_partial": ["--cuda-graph-bs-decode", "1", "--max-running-requests", "1"],
    "long": ["--cuda-graph-bs-decode", "1", "--max-running-requests", "1"],
    "sample": ["--cuda-graph-bs-decode", "1", "2", "4", "8", "16", "32"]
    + ["--max-running-requests", "32"],
    "real": ["--cuda-graph-bs-decode", "1", "4", "16", "--max-running-requests", "16"],
}
# Sampled rows of the fp8 draft head (up to 64 draft rows on Hopper) run at most 12 requests at a
# time (5 draft rows each), so the head serves.
SMALL_BATCH = ["--max-running-requests", "12"]
DSPARK = ["--speculative-algorithm", "DSPARK"]
PROGRESS_LOCK = threading.Lock()
# Startup lines in which a fork feature says what it built (kept in the report as evidence).
FEATURE_LINE = re.compile(
    r"--dsv4-wo-a-fp8-twin=|DSpark draft LM head in fp8|DSpark verify cap on|fence|"
    r"draft temperature|DSpark draft samples at|fast_load: read|"
    r"--weight-loader-disable-async-load:|e2e probe:|engram prefetch|dsv4 hc fused stats|"
    r"engram row store"
)
# Memory per server. Several tiny servers share the GPU: a server's KV budget is the memory free
# after its load minus (1 - fraction) of the memory free before it, so a neighbour loading in
# between shrinks it; a fraction of one half leaves room for that, and the token cap keeps the pool
# itself small. The real-shape rows run alone.
_TINY_MEM_ARGS = ["--mem-fraction-static", "0.5", "--max-total-tokens", "262144"]
MEM_ARGS = {
    "agree": _TINY_MEM_ARGS,
    "random": _TINY_MEM_ARGS,
    "v41": _TINY_MEM_ARGS,
    "v41_agree": _TINY_MEM_ARGS,
    "v41_partial": _TINY_MEM_ARGS,
    "long": _TINY_MEM_ARGS,
    "sample": _TINY_MEM_ARGS,
    "real": ["--mem-fraction-static", "0.3"],
}
EAGER = ["--cuda-graph-backend-decode", "disabled"]
# What a checkpoint needs served on every row of its own, fork and upstream alike. DeepSeek-V4.1:
# upstream resolves decoder SWA bounded replay on for CUDA (arg_groups/deepseek_v4_hook.py,
# validate_deepseek_v41_features), and the model then asserts kv_source_layer_ids
# (models/deepseek_v4.py, "decoder SWA bounded replay needs kv_source_layer_ids"), which the tiny
# checkpoint, sliding-window attention only, has none of: it serves full prefill. With no
# compressed layer, upstream's request-cap sizing (pool_configurator.py, DSV4PoolConfigurator) prices
# a token at zero bytes and divides by it; an explicit --swa-full-tokens-ratio (the value upstream
# takes for DeepSeek-V4 when none is given, DSV4_DEFAULT_SWA_FULL_TOKENS_RATIO) keeps the ratio sizing.
_V41_ARGS = ["--no-enable-decoder-swa-bounded-replay", "--swa-full-tokens-ratio", "0.1"]
# The long checkpoint: every prompt prefills in chunks of LONG_CHUNK tokens.
LONG_CHUNK = 256
MODEL_ARGS = {
    "v41": _V41_ARGS,
    "v41_agree": _V41_ARGS,
    "v41_partial": _V41_ARGS,
    "long": ["--chunked-prefill-size", str(LONG_CHUNK)],
}
# Where the Engram row store's rows go (created by the run; one server writes there).
ROW_STORE_DIR = "/tmp/e2e-engram-rows"

GREEDY_PROMPTS = [
    "The quick brown fox",
    "Hello, world",
    "0123456789",
    "def f(x):",
    "Once upon a time",
    "SGLang serves",
    "DeepSeek-V4 with DSpark",
    "abcdefghijklmnop",
    "To be or not to be",
    '{"key": [1, 2, 3]}',
    "GPU",
    "e",
    "Lorem ipsum dolor sit amet",
    "#include <stdio.h>",
    "  indented",
    "The end.",
]
GREEDY_TOKENS = 64
# The rounding-level rule of ``within_bound``: the largest |logprob difference| from the reference
# row. Agree: the server splits a batch of four prompts into prefill and decode batches as the
# requests arrive, so two servers of the same tree differ by rounding there (a few 1e-6); random
# weights (one request at a time, where flags off is bit for bit upstream's): what a rounding-level
# kernel moves the first decoded token by, set from the wo_a twin's measured spread, with the
# wrong twin shown to exceed it (docs/gpu-testing.md has both figures).
LOGPROB_BOUND = {"agree": 1e-4, "random": 0.05}
MIN_SHARED_PREFIX = 0.25
SAMPLED_PROMPT = "The quick brown fo"  # codespell:ignore
SAMPLED_REQUESTS = 20000
SAMPLED_TOKENS = 8
SAMPLED_POSITIONS = (1, 2, 3)  # the first drafted positions (0 comes from the prefill)
P_MIN = 1e-5  # a sampled test's p-value below which the two distributions differ
CONTROL_TEMPERATURE = 0.97
# The sampling parameters sampled rows serve (``Row.sampling``). On the sample checkpoint the
# target's top token takes about 0.96 of the mass at T 0.6 (top-p 0.98 then keeps about half the
# tail) and about 0.24 at T 1.3 (top-k 20 and min-p 0.02 both cut the tail). "mixed" sends them
# in turn within each batch, with greedy requests among them (MIXED_SETS); each group is judged
# against the homogeneous reference of its parameters.
SAMPLING_SETS = {
    "t1": {"temperature": 1.0},
    "t0.6": {"temperature": 0.6, "top_p": 0.98},
    "t1.3": {"temperature": 1.3, "top_k": 20, "min_p": 0.02},
    "greedy": {"temperature": 0.0},
}
MIXED_SETS = ("greedy", "t1", "t0.6", "t1.3")
# Seed for seed: this many sampled requests, one at a time with seeds shared by every server,
# alternating t1 and t1.3; a row promising upstream's bits emits exactly its reference's tokens.
SEEDED_REQUESTS = 32
SAMPLED_REFERENCE = (
    "s_up_nospec"  # the target's own distribution: upstream, no speculation
)
GAMMA = TINY_DSV4["gamma"]
# Long contexts (``long_context``, the long checkpoint, sliding window 128): prompts of 5, 11 and
# 18 windows (the longest past 2,048 tokens, where layer 2's indexer picks 512 of its 575
# compressed entries), prefilled in chunks of LONG_CHUNK; LONG_TOKENS greedy tokens each (2.5
# windows). LONG_SHARED tokens of the longest prompt start a second prompt (a radix hit, cut
# mid-block of every ratio); two requests are aborted mid-decode after LONG_ABORT_AFTER streamed
# chunks, one by /abort_request and one by the client closing its connection, each then sent again
# in full (a radix hit on the aborted request's prompt).
LONG_PROMPTS = (2300, 700, 1500)
LONG_TOKENS = 320
LONG_SHARED = 1501
LONG_ABORTED = (1000, 1100)  # the aborted requests' prompt tokens
LONG_ABORT_TOKENS = 1000  # what they ask for
LONG_ABORT_AFTER = 48

# Probes (module:qualname[?kwarg], see standins/sitecustomize.py) and startup lines per feature.
P_TWIN_SMALL = "sglang.kernels.ops.gemm.dsv4_wo_a_fp8_sm90:wo_a_fp8_small_sm90"
P_TWIN_MID = "sglang.kernels.ops.gemm.dsv4_wo_a_fp8_sm90:wo_a_fp8_mid_sm90"
P_HEAD = "sglang.srt.speculative.dspark_components.dspark_draft_head_fp8:DraftHeadFp8.__call__"
P_TAU = (
    "sglang.srt.speculative.dspark_components.dspark_draft_tau:stage_draft_temperatures"
)
P_BLOCK = (
    "sglang.srt.speculative.dspark_components.dspark_verify:"
    "accept_draft_tokens?block_verification"
)
P_LOOP = "sglang.srt.managers.loop_abort:LoopGuard.feed"  # the per-token check ran
# Kernels served inside the decode and verify CUDA graphs: their probes must also count 100 or
# more calls on the device over a row's requests (sitecustomize), so a kernel that was captured but
# never replayed (or replaced at replay) fails the row.
REPLAYED_PROBES = {P_TWIN_SMALL, P_TWIN_MID, P_HEAD}
L_TWIN = (
    r"--dsv4-wo-a-fp8-twin=\w+ \([^)]*\): fp8 twins for [1-9]\d* wo_a weights \([1-9]"
)
L_HEAD = r"DSpark draft LM head in fp8"
L_CAP = r"DSpark verify cap on"
L_TAU = r"DSpark draft samples at 0\.7 x the request temperature"
L_FAST = r"fast_load: read"
L_SERIAL = r"--weight-loader-disable-async-load: each checkpoint tensor is copied"
P_PREFETCH = (
    "sglang.srt.layers.engram_prefetch:Prefetched.rows"  # a layer took its rows
)
P_ROW_STORE = "sglang.srt.layers.engram_row_store:EngramRowStore.lookup_into"
L_PREFETCH = (
    r"engram prefetch \(--engram-prefetch=(on|check)\): the gathers of 2 Engram layers"
)
L_HC_FUSED = r"dsv4 hc fused stats \(--dsv4-hc-fused-stats=1\): one pass over K"
L_HC_VERIFIED = (
    r"dsv4 hc fused stats: the one-pass tf32x3\S* kernel \(row tile \d+\) matched "
    r"upstream's bit for bit"
)
L_ROW_STORE = r"engram row store .*: \d+ rows x 33 B in .*, cache \d+ rows"


# Upstream defects the matrix meets, pinned: a row that names one and misses its ``same_as``
# reference only by giving the defect's result is an expected failure (``expected_failure``), never
# a pass. ``results``: greedy digests of the defect's result per checkpoint, as seen on the H200
# (docs/gpu-testing.md); a result an upstream row of the same run gives also counts.
UPSTREAM_DEFECTS = {
    "v41_dspark_graph_flip": {
        "what": "sglang 0.5.23, DeepSeek-V4.1 with DSpark under CUDA graphs: some server "
        "processes give a second greedy result that leaves V4.1 without speculation after a "
        "few tokens (first suspect: the Engram n-gram history committed eagerly after each "
        "graph-replayed verify)",
        "results": {"v41": ["e698d273b64553fd"]},
    }
}
V41_MODELS = ("v41", "v41_agree", "v41_partial")


@dataclasses.dataclass
class Row:
    name: str
    args: list[str]
    model: str = (
        "agree"  # agree | random | v41 | v41_agree | v41_partial | long | sample | real
    )
    tree: str = "fork"  # fork | upstream (the pinned release, --upstream)
    greedy: bool = True  # agree / random: the greedy prompts with logprobs
    sampled: bool = False  # sample: SAMPLED_REQUESTS at temperature 1
    timing: bool = False  # real: decode timing
    refused_with: str | None = None  # a start that must be refused, with this text
    flags: dict[str, str] = dataclasses.field(default_factory=dict)  # startup line
    same_as: tuple[
        str, ...
    ] = ()  # rows whose greedy tokens and logprobs this one equals
    same_as_one_of: tuple[
        str, ...
    ] = ()  # rows one of which this one equals bit for bit
    recorded_vs: tuple[str, ...] = ()  # rows compared with and recorded, not judged
    tokens_as: tuple[str, ...] = ()  # rows whose greedy tokens (only) this one equals
    bound_to: str | None = (
        None  # the row whose logprobs this one stays within the bound of
    )
    engaged: tuple[str, ...] = ()  # log regexes: the feature's evidence
    probes: tuple[str, ...] = ()  # E2E_PROBES; each must log (added to ``engaged``)
    below_gamma: bool = False  # greedy drafts accepted per step must stay below gamma
    # how its speculation is judged (``judge_speculation``): "reference" (accepted drafts as the
    # reference's), "design" (the flag moves acceptance: speculation must run), "none" (no
    # speculation); None: not judged (a refusal row)
    accepts: str | None = None
    # a known upstream defect (UPSTREAM_DEFECTS) that may make this row miss its same_as
    # reference: then an expected failure, never a pass
    upstream_defect: str | None = None
    sampling: str = "t1"  # a SAMPLING_SETS name, or "mixed" (MIXED_SETS in turn)
    seeded_same_as: str | None = None  # sampled bits seed for seed equal to this row's
    fault: str | None = None  # E2E_FAULT: a negative control
    must_fail: str | None = None  # the check a negative control must fail
    may_fail: tuple[str, ...] = ()  # checks a negative control's fault may also fail
    requests: str | None = None  # extra requests: "loop" | "thinking"
    env: dict[str, str] = dataclasses.field(default_factory=dict)  # server environment


def _flags(args) -> dict[str, str]:
    flags, i = {}, 0
    while i < len(args):
        if i + 1 < len(args) and not args[i + 1].startswith("--"):
            flags[args[i]] = args[i + 1]
            i += 2
        else:
            flags[args[i]] = "True"
            i += 1
    return flags


def _row(name, *flag_args, spec=True, extra=(), **kw) -> Row:
    args = list(flag_args)
    if spec:
        kw.setdefault(
            "accepts", "design" if ACCEPTANCE_FLAGS & set(args) else "reference"
        )
    else:
        kw.setdefault("accepts", "none")
    return Row(
        name, (DSPARK if spec else []) + args + list(extra), flags=_flags(args), **kw
    )


TWIN = ["--dsv4-wo-a-fp8-twin"]
# Flags that move how many drafts a verify step accepts, by design: their rows must speculate,
# and their acceptance is recorded, not held to the reference's.
ACCEPTANCE_FLAGS = {
    "--speculative-dspark-verify-cap",
    "--speculative-dspark-draft-temperature-scale",
    "--speculative-use-block-verification",
}
CAP_CONF = ["--speculative-dspark-verify-cap", "conf:0.1"]
FENCE = ["--speculative-dspark-fence-accept-results"]
TAU = ["--speculative-dspark-draft-temperature-scale", "0.7"]
HEAD = ["--speculative-dspark-draft-head-fp8"]
BLOCK = ["--speculative-use-block-verification"]
FAST_LOAD = [
    "--weight-loader-fast-load",
    "--weight-loader-fast-load-num-threads",
    "4",
    "--weight-loader-fast-load-slab-mb",
    "1",
]
# The fence folds nothing on these DeepSeek-V4 checkpoints (no verify epilogue): refused there,
# so it is not among the flags turned on together.
ALL_ON = TWIN + ["drop"] + CAP_CONF + TAU + HEAD + BLOCK


# The upstream DSpark servers of each V4.1 checkpoint (each its own process).
V41_UPSTREAM_SERVERS = {
    m: tuple(f"{m}_up_off{s}" for s in ("", "_again", "_third")) for m in V41_MODELS
}


def rows() -> list[Row]:
    up = dict(tree="upstream")
    # agree: tokens identical to upstream's, logprobs within the scheduling bound (the bits are
    # held on random weights, one request at a time)
    agree_off = dict(tokens_as=("up_off",), bound_to="up_off")
    agree_nospec = dict(tokens_as=("up_nospec",), bound_to="up_nospec")
    agree_bound = agree_off
    random_off = dict(model="random", same_as=("random_up_off",))
    random_bound = dict(model="random", bound_to="random_up_off")
    # DeepSeek-V4.1 with DSpark under CUDA graphs: every DSpark row, upstream's included, is held
    # to upstream without speculation bit for bit; upstream's servers have given a second result
    # there (docs/gpu-testing.md), which is an expected failure naming the defect, never a pass
    flip = "v41_dspark_graph_flip"

    def v41(model: str, name: str = "") -> dict:
        """A V4.1 DSpark row: upstream's bits without speculation; recorded against (and its
        acceptance held to, where the tokens are equal) the first upstream DSpark server.
        """
        first = V41_UPSTREAM_SERVERS[model][0]
        return dict(
            model=model,
            same_as=(f"{model}_up_nospec",),
            recorded_vs=() if name == first else (first,),
            upstream_defect=flip,
        )

    v41_off = v41("v41")
    long_bound = dict(model="long", tokens_as=("long_up_off",), bound_to="long_up_off")
    sampled = dict(model="sample", greedy=False, sampled=True)
    small = dict(extra=SMALL_BATCH)
    return [
        # ---- agree: the draft agrees with the target (greedy accepts every draft)
        _row("up_off", **up),
        _row("up_nospec", spec=False, **up),
        _row("off", **agree_off),
        _row("nospec", spec=False, **agree_nospec),
        _row(
            "wo_a_mid",
            *TWIN,
            "mid",
            engaged=(L_TWIN,),
            probes=(P_TWIN_SMALL, P_TWIN_MID),
            **agree_bound,
        ),
        _row(
            "wo_a_drop",
            *TWIN,
            "drop",
            engaged=(L_TWIN,),
            probes=(P_TWIN_SMALL, P_TWIN_MID),
            **agree_bound,
        ),
        _row(
            "cap_3",
            "--speculative-dspark-verify-cap",
            "3",
            engaged=(L_CAP,),
            below_gamma=True,
            **agree_bound,
        ),
        _row("cap_conf", *CAP_CONF, engaged=(L_CAP,), below_gamma=True, **agree_bound),
        _row("head_fp8", *HEAD, engaged=(L_HEAD,), probes=(P_HEAD,), **agree_bound),
        # negative control: a server that drops speculation emits upstream's tokens, so only
        # the speculation check can refuse it
        _row(
            "off_speculation_dropped",
            fault="speculation_off",
            must_fail="speculation",
            **agree_off,
        ),
        # greedy outputs cycle with period 100 here: at P <= 128 a long greedy request must be
        # finished as a loop, a long sampled one not; the 64-token prompts stay upstream's bits
        _row(
            "loop_abort",
            "--enable-loop-abort",
            "--loop-abort-max-period",
            "128",
            "--loop-abort-min-tokens",
            "384",
            requests="loop",
            **agree_off,
        ),
        _row(
            "thinking_aliases",
            "--enable-thinking-aliases",
            extra=["--reasoning-parser", "deepseek-v4"],
            requests="thinking",
            **agree_off,
        ),
        _row(
            "all_on",
            *ALL_ON,
            engaged=(L_TWIN, L_CAP, L_TAU, L_HEAD),
            probes=(P_TWIN_SMALL, P_TWIN_MID, P_HEAD),
            below_gamma=True,
            **agree_bound,
        ),
        _row("off_eager", extra=EAGER, tokens_as=("up_off",)),
        _row(
            "all_on_eager",
            *ALL_ON,
            extra=EAGER,
            engaged=(L_TWIN, L_CAP, L_HEAD),
            probes=(P_HEAD,),
            tokens_as=("up_off",),
        ),
        # ---- random weights: every output bit depends on every kernel (one request at a time)
        _row("random_up_off", model="random", **up),
        _row("random_up_nospec", model="random", spec=False, **up),
        # the harness's own control: upstream served twice gives the same bits, so a fork row
        # that differs from upstream differs by the fork, not by the harness
        _row(
            "random_up_nospec_again",
            model="random",
            spec=False,
            same_as=("random_up_nospec",),
            **up,
        ),
        _row("random_off", **random_off),
        _row(
            "random_nospec",
            spec=False,
            model="random",
            same_as=("random_up_nospec",),
        ),
        _row("random_tau_0.7", *TAU, engaged=(L_TAU,), probes=(P_TAU,), **random_off),
        _row("random_fast_load", *FAST_LOAD, engaged=(L_FAST,), **random_off),
        _row(
            "random_serial_load",
            "--weight-loader-disable-async-load",
            engaged=(L_SERIAL,),
            **random_off,
        ),
        _row(
            "random_loop_abort",
            "--enable-loop-abort",
            "--loop-abort-max-period",
            "8",
            "--loop-abort-min-tokens",
            "24",
            probes=(P_LOOP,),
            **random_off,
        ),
        _row(
            "random_thinking_aliases",
            "--enable-thinking-aliases",
            extra=["--reasoning-parser", "deepseek-v4"],
            requests="thinking",
            **random_off,
        ),
        _row(
            "random_wo_a_small",
            *TWIN,
            "small",
            engaged=(L_TWIN,),
            probes=(P_TWIN_SMALL,),
            **random_bound,
        ),
        _row(
            "random_wo_a_drop",
            *TWIN,
            "drop",
            engaged=(L_TWIN,),
            probes=(P_TWIN_SMALL,),
            **random_bound,
        ),
        # negative control: a twin whose group 0 comes out doubled must break the bound
        _row(
            "random_wo_a_wrong",
            *TWIN,
            "small",
            engaged=(L_TWIN,),
            probes=(P_TWIN_SMALL,),
            fault="wo_a_group_x2",
            must_fail="within_bound_of_random_up_off",
            **random_bound,
        ),
        _row(
            "random_cap_3",
            "--speculative-dspark-verify-cap",
            "3",
            engaged=(L_CAP,),
            **random_bound,
        ),
        _row("random_cap_conf", *CAP_CONF, engaged=(L_CAP,), **random_bound),
        # --enable-metrics: /metrics against the responses; metrics change no bit
        _row("random_metrics", "--enable-metrics", requests="metrics", **random_off),
        _row(
            "random_metrics_cap_tau",
            "--enable-metrics",
            "--speculative-dspark-verify-cap",
            "3",
            *TAU,
            engaged=(L_CAP, L_TAU),
            requests="metrics",
            **random_bound,
        ),
        _row(
            "random_head_fp8",
            *HEAD,
            engaged=(L_HEAD,),
            probes=(P_HEAD,),
            **random_bound,
        ),
        _row(
            "random_all_on",
            *ALL_ON,
            engaged=(L_TWIN, L_CAP, L_TAU, L_HEAD),
            probes=(P_TWIN_SMALL, P_HEAD),
            **random_bound,
        ),
        # ---- DeepSeek-V4.1 (random weights, Engram layers 1 and 2, hc_pre_from_prev_sublayer):
        # the V4.1 features served, each identical to upstream in tokens and logprobs (their
        # patches promise upstream's bits), one request at a time
        # three upstream DSpark servers: how often upstream flips is counted per run
        *(_row(n, **v41("v41", n), **up) for n in V41_UPSTREAM_SERVERS["v41"]),
        # Which of the two results a V4.1 DSpark server gives is fixed per server process.
        # Upstream commits the Engram n-gram history eagerly after each graph-replayed verify
        # unless this option moves the commit into the graph: two servers with it, recorded
        # against upstream with and without speculation (not judged)
        *(
            _row(
                name,
                model="v41",
                env={"SGLANG_OPT_DSV41_POST_FORWARD_CUDA_GRAPH": "1"},
                recorded_vs=("v41_up_off", "v41_up_nospec"),
                **up,
            )
            for name in ("v41_up_engram_graph", "v41_up_engram_graph_again")
        ),
        # DeepSeek-V4.1 whose draft agrees with its target (every greedy draft accepted) and
        # agrees in runs of 2 and 3 (accepts and rejections): the accept path and the Engram
        # history commit run every step; one request at a time, held to upstream without
        # speculation bit for bit, with acceptance equal to upstream's DSpark rows'
        *(
            row
            for model in ("v41_agree", "v41_partial")
            for row in (
                _row(f"{model}_up_nospec", model=model, spec=False, **up),
                *(_row(n, **v41(model, n), **up) for n in V41_UPSTREAM_SERVERS[model]),
                _row(f"{model}_off", **v41(model)),
            )
        ),
        _row(
            "v41_agree_engram_prefetch",
            "--engram-prefetch",
            "on",
            engaged=(L_PREFETCH,),
            probes=(P_PREFETCH,),
            **v41("v41_agree"),
        ),
        _row("v41_up_nospec", model="v41", spec=False, **up),
        _row("v41_up_off_eager", model="v41", extra=EAGER, **up),
        _row("v41_off", **v41_off),
        _row("v41_nospec", spec=False, model="v41", same_as=("v41_up_nospec",)),
        _row(
            "v41_engram_prefetch",
            "--engram-prefetch",
            "on",
            engaged=(L_PREFETCH,),
            probes=(P_PREFETCH,),
            **v41_off,
        ),
        _row(
            "v41_engram_prefetch_check",
            "--engram-prefetch",
            "check",
            engaged=(L_PREFETCH,),
            probes=(P_PREFETCH,),
            **v41_off,
        ),
        # from 1 row: every mix-statistics call (auto's H200 threshold, 65536 rows, is more than
        # one prefill of this server holds, and auto refuses to load there); each kernel variant
        # checks itself against upstream's on its first eager call
        _row(
            "v41_hc_fused_stats",
            "--dsv4-hc-fused-stats",
            "1",
            engaged=(L_HC_FUSED, L_HC_VERIFIED),
            **v41_off,
        ),
        # the lookup reads storage on the host: no full decode graph (it refuses the capture),
        # so it and its reference serve decode eagerly; a cache of ~3,000 of the ~14,000 rows
        # so lookups both hit and read the file
        _row(
            "v41_row_store",
            "--engram-row-store-dir",
            ROW_STORE_DIR,
            "--engram-row-store-cache-gib",
            "0.0001",
            extra=EAGER,
            engaged=(L_ROW_STORE,),
            probes=(P_ROW_STORE,),
            model="v41",
            same_as=("v41_up_off_eager",),
        ),
        # ---- long contexts: the long checkpoint (layer 2 compressed 4:1 with the C4 indexer,
        # layer 3 compressed 128:1, the draft agreeing in runs of 2 and 3), prompts of 700 to
        # 2,300 tokens in chunks of 256, outputs of 320, a shared prefix and two aborted requests,
        # one request at a time (``long_context``): flags off, the fp8 head and tau at greedy
        # upstream's bits; the twin (rounding) and the cap (it moves where each token is
        # verified) upstream's tokens, logprobs within the agree bound
        _row("long_up_off", model="long", **up),
        _row("long_up_nospec", model="long", spec=False, **up),
        _row("long_off", model="long", same_as=("long_up_off",)),
        _row("long_nospec", model="long", spec=False, same_as=("long_up_nospec",)),
        _row(
            "long_wo_a_small",
            *TWIN,
            "small",
            engaged=(L_TWIN,),
            probes=(P_TWIN_SMALL,),
            **long_bound,
        ),
        # the draft's Markov bias (40) decides its proposals, so the fp8 head changes none of
        # them, nor any target computation: upstream's bits
        _row(
            "long_head_fp8",
            *HEAD,
            engaged=(L_HEAD,),
            probes=(P_HEAD,),
            model="long",
            same_as=("long_up_off",),
        ),
        # the draft agrees in runs of 2 and 3: a cap of 2 cuts every run of 3
        _row(
            "long_cap_2",
            "--speculative-dspark-verify-cap",
            "2",
            engaged=(L_CAP,),
            below_gamma=True,
            **long_bound,
        ),
        _row(
            "long_tau_0.7",
            *TAU,
            engaged=(L_TAU,),
            probes=(P_TAU,),
            model="long",
            same_as=("long_up_off",),
        ),
        # ---- sampled: target top token ~0.5, draft q ~0.85 on it; against upstream without
        # speculation (the target's own distribution)
        _row("s_up_nospec", spec=False, **sampled, **up),  # + the 0.97 T control
        _row("s_up_off", **sampled, **up),
        # flags off: upstream's distribution, and upstream's bits seed for seed
        _row("s_off", seeded_same_as="s_up_off", **sampled),
        # the sampling parameters people use: T 0.6 with top-p, T 1.3 with top-k and min-p, and
        # all of them with greedy requests in one batch (a temperature applied twice, or ignored
        # in p or q, moves these; at T 1 it cannot)
        *(
            _row(sampled_reference(k), spec=False, sampling=k, **sampled, **up)
            for k in ("t0.6", "t1.3")
        ),
        *(_row(f"s_off_{k}", sampling=k, **sampled) for k in ("t0.6", "t1.3")),
        _row(
            "s_tau_0.7_t1.3",
            *TAU,
            engaged=(L_TAU,),
            probes=(P_TAU,),
            sampling="t1.3",
            **sampled,
        ),
        _row("s_off_mixed", sampling="mixed", **sampled),
        _row(
            "s_cap_3",
            "--speculative-dspark-verify-cap",
            "3",
            engaged=(L_CAP,),
            **sampled,
        ),
        _row("s_cap_conf", *CAP_CONF, engaged=(L_CAP,), **sampled),
        _row("s_tau_0.7", *TAU, engaged=(L_TAU,), probes=(P_TAU,), **sampled),
        _row("s_block_verify", *BLOCK, probes=(P_BLOCK,), **sampled),
        _row(
            "s_block_verify_cap",
            *BLOCK,
            *CAP_CONF,
            engaged=(L_CAP,),
            probes=(P_BLOCK,),
            **sampled,
        ),
        _row(
            "s_head_fp8", *HEAD, engaged=(L_HEAD,), probes=(P_HEAD,), **small, **sampled
        ),
        _row(
            "s_wo_a_drop",  # drop serves every decode / verify call up to 192 rows
            *TWIN,
            "drop",
            engaged=(L_TWIN,),
            probes=(P_TWIN_SMALL, P_TWIN_MID),
            **sampled,
        ),
        _row(
            "s_all_on",
            *ALL_ON,
            engaged=(L_TWIN, L_CAP, L_TAU, L_HEAD),
            probes=(P_TWIN_SMALL, P_TWIN_MID, P_TAU, P_HEAD, P_BLOCK),
            **small,
            **sampled,
        ),
        # negative control: q read at T while the draft samples at 0.7 T must be refused
        _row(
            "s_tau_wrong_q",
            *TAU,
            engaged=(L_TAU,),
            probes=(P_TAU,),
            fault="tau_q_at_T",
            must_fail="sampled_agrees",
            may_fail=("sampled_fits_target",),
            **sampled,
        ),
        # the subtle control: q read at 1.03 x its temperature at every drafted position, which
        # the exact fit test must refuse (the two-sample test may not see it)
        _row(
            "s_tau_q_3pct",
            *TAU,
            engaged=(L_TAU,),
            probes=(P_TAU,),
            fault="tau_q_3pct",
            must_fail="sampled_fits_target",
            may_fail=("sampled_agrees",),
            **sampled,
        ),
        # ---- startup refusals
        Row(
            "refuse_wrong_build",
            DSPARK + ["--fork-expect-version", "0.5.23+fork.1.0000000"],
            greedy=False,
            refused_with="refusing to start another patch series",
        ),
        Row(
            "refuse_autotune_keep_tp1",
            DSPARK + ["--flashinfer-autotune-keep-cache"],
            greedy=False,
            refused_with="--tp-size 1 has no other rank to agree with",
        ),
        # The tiny checkpoints are DeepSeek-V4 (not V4.1) without Engram layers: these flags must
        # refuse them at startup (they serve V4.1 only; their GPU tests and benchmarks cover them).
        Row(
            "refuse_hc_fused_v4",
            DSPARK + ["--dsv4-hc-fused-stats", "auto"],
            greedy=False,
            refused_with="hc_pre_from_prev_sublayer is false",
        ),
        Row(
            "refuse_fence_v4",
            DSPARK + FENCE,
            greedy=False,
            refused_with="this server folds none",
        ),
        Row(
            "refuse_engram_prefetch",
            DSPARK + ["--engram-prefetch", "on"],
            greedy=False,
            refused_with="has no Engram layers",
        ),
        Row(
            "refuse_engram_fused_all_reduce",
            DSPARK + ["--engram-fused-all-reduce"],
            greedy=False,
            refused_with="--engram-fused-all-reduce does nothing at --tp-size 1",
        ),
        # The GB10 features refuse on this GPU and checkpoint, naming what they found.
        Row(
            "refuse_b12x_moe",
            DSPARK + ["--moe-runner-backend", "b12x"],
            greedy=False,
            refused_with="b12x kernels need SM120/SM121",
        ),
        Row(
            "refuse_b12x_mxfp8",
            DSPARK + ["--block-fp8-mxfp8-backend", "b12x"],
            greedy=False,
            refused_with="--block-fp8-mxfp8-backend b12x",
        ),
        Row(
            "refuse_b12x_roce",
            DSPARK + ["--enable-b12x-roce-all-gather"],
            greedy=False,
            refused_with="--enable-b12x-roce-all-gather does nothing with --tp 1",
        ),
        Row(
            "refuse_replicated_split_tp1",
            DSPARK + ["--replicated-linear-split", "wqkv_a,main_proj"],
            greedy=False,
            refused_with="--replicated-linear-split=wqkv_a,main_proj:96 does nothing with --tp 1",
        ),
        Row(
            "refuse_engram_store",
            DSPARK
            + ["--engram-row-store-dir", "/tmp", "--engram-row-store-cache-gib", "1"],
            greedy=False,
            refused_with="the model has no Engram tables",
        ),
        # ---- DeepSeek-V4.1-Flash per-rank shapes at TP4: decode timing (served alone)
        _row("real_off", model="real", greedy=False, timing=True),
        _row(
            "real_wo_a_small",
            *TWIN,
            "small",
            engaged=(L_TWIN,),
            probes=(P_TWIN_SMALL,),
            model="real",
            greedy=False,
            timing=True,
        ),
        _row(
            "real_head_fp8",
            *HEAD,
            engaged=(L_HEAD,),
            probes=(P_HEAD,),
            model="real",
            greedy=False,
            timing=True,
        ),
        _row(
            "real_cap_3",
            "--speculative-dspark-verify-cap",
            "3",
            engaged=(L_CAP,),
            model="real",
            greedy=False,
            timing=True,
        ),
        _row(
            "real_all_on",
            *ALL_ON,
            engaged=(L_TWIN, L_CAP, L_HEAD),
            probes=(P_TWIN_SMALL, P_HEAD),
            model="real",
            greedy=False,
            timing=True,
        ),
    ]


# ---------------------------------------------------------------------------- requests


def _greedy_batches(model: str) -> list[list[int]]:
    """Which prompts go together. Random weights (V4 and V4.1): one at a time (their logits have near ties and
    upstream's kernels are not batch invariant, so only a fixed composition compares bit for bit).
    Agree: four alone (6-row verify, 5-row draft calls), then three batches of four (24 and 20
    rows), so the small and the mid kernels both serve."""
    n = len(GREEDY_PROMPTS)
    if model in ("random",) + V41_MODELS:
        return [[i] for i in range(n)]
    return [[i] for i in range(4)] + [list(range(i, i + 4)) for i in range(4, n, 4)]


def greedy(server: Server, model: str) -> dict:
    """The greedy prompts, up to ``GREEDY_TOKENS`` each, with every emitted token's logprob.
    EOS is honoured (``ignore_eos`` requests are exempt from loop abort, which must run here).
    """
    if model == "long":
        return long_context(server)
    params = {"temperature": 0, "max_new_tokens": GREEDY_TOKENS}
    outs: list = [None] * len(GREEDY_PROMPTS)
    t0 = time.perf_counter()
    for batch in _greedy_batches(model):
        got = server.post(
            "/generate",
            {
                "text": [GREEDY_PROMPTS[i] for i in batch],
                "sampling_params": params,
                "return_logprob": True,
            },
        )
        for i, o in zip(batch, got):
            outs[i] = o
    seconds = time.perf_counter() - t0
    return greedy_record(server, outs, GREEDY_PROMPTS[0], GREEDY_TOKENS, seconds)


def greedy_record(
    server: Server, outs: list, prompt: str, tokens: int, seconds: float, **extra
) -> dict:
    """A greedy run's record from its /generate outputs: tokens, logprobs, finish reasons, the
    speculation counts, and whether /v1/completions gives the first prompt's text."""
    completion = server.post(
        "/v1/completions",
        {
            "model": "default",
            "prompt": prompt,
            "temperature": 0,
            "max_tokens": tokens,
            **extra,
        },
    )
    return {
        "tokens": [o["output_ids"] for o in outs],
        "logprobs": [
            [lp[0] for lp in o["meta_info"]["output_token_logprobs"]] for o in outs
        ],
        "finish": sorted({o["meta_info"]["finish_reason"]["type"] for o in outs}),
        "completion_matches_generate": completion["choices"][0]["text"]
        == outs[0]["text"],
        "tokens_per_s": len(outs) * tokens / seconds,
        "spec": spec_stats(outs),
        "accepts": [request_accepts(o, histogram=True) for o in outs],
    }


def long_text(index: int, n: int) -> str:
    """``n`` characters (``n`` tokens of the character-level tokenizer), the same on every run."""
    import random

    alphabet = string.ascii_letters + string.digits + string.punctuation + " "
    pick = random.Random(f"long-{index}")
    return "".join(pick.choice(alphabet) for _ in range(n))


def long_prompts() -> list[str]:
    """The long rows' complete requests in order: ``LONG_PROMPTS``, then the longest one's first
    ``LONG_SHARED`` tokens with another continuation, then the two aborted prompts in full.
    """
    prompts = [long_text(i, n) for i, n in enumerate(LONG_PROMPTS)]
    shared = prompts[0][:LONG_SHARED] + long_text(10, 300)
    aborted = [long_text(20 + i, n) for i, n in enumerate(LONG_ABORTED)]
    return prompts + [shared] + aborted


def long_context(server: Server) -> dict:
    """The long rows' requests, one at a time (the server runs one; a request sent while an
    aborted one still decodes waits, so no batch depends on when an abort lands), greedy with
    logprobs: the prompts of ``long_prompts`` of which the shared one and the two sent again find
    their prefixes in the radix cache; between them two streamed requests aborted after
    ``LONG_ABORT_AFTER`` chunks (``/abort_request`` by rid; the client closing the connection).
    The greedy record's fields (``greedy``), plus ``long``: each request's prompt and cached
    tokens, and what each aborted request streamed before it ended."""
    params = {"temperature": 0, "max_new_tokens": LONG_TOKENS, "ignore_eos": True}
    prompts = long_prompts()
    outs, aborts = [], {}
    t0 = time.perf_counter()

    def one(text: str) -> dict:
        got = server.post(
            "/generate",
            {"text": text, "sampling_params": params, "return_logprob": True},
        )
        outs.append(got)
        return got

    def streamed(text: str, how: str) -> dict:
        rid = f"e2e-long-{how}"
        body = {
            "text": text,
            "rid": rid,
            "sampling_params": {
                "temperature": 0,
                "max_new_tokens": LONG_ABORT_TOKENS,
                "ignore_eos": True,
            },
        }
        chunks, last = 0, {}
        events = server.stream("/generate", body)
        for event in events:
            chunks, last = chunks + 1, event
            if chunks == LONG_ABORT_AFTER:
                if how == "disconnect":
                    break
                server.post_text("/abort_request", {"rid": rid})
        events.close()  # a disconnect: the connection closes, and upstream aborts the request
        meta = last.get("meta_info", {})
        return {
            "chunks": chunks,
            "output_ids": last.get("output_ids", []),
            "finish": (meta.get("finish_reason") or {}).get("type"),
            "completion_tokens": meta.get("completion_tokens"),
        }

    for text in prompts[: len(LONG_PROMPTS) + 1]:
        one(text)
    for how, text in zip(("abort_request", "disconnect"), prompts[-2:]):
        aborts[how] = streamed(text, how)
        one(text)
    seconds = time.perf_counter() - t0
    record = greedy_record(
        server, outs, prompts[0], LONG_TOKENS, seconds, ignore_eos=True
    )
    return {
        **record,
        "long": {
            "prompt_tokens": [o["meta_info"]["prompt_tokens"] for o in outs],
            "cached_tokens": [o["meta_info"].get("cached_tokens", 0) for o in outs],
            "aborts": aborts,
        },
    }


def long_checks(row: Row, g: dict) -> dict[str, bool]:
    """The long rows' own checks (every row, fork and upstream): the prompts passed the window
    several times; the shared prefix and the prompts sent again after their aborts were found in
    the radix cache (all but at most one chunk of the shared tokens); each aborted request ended
    mid-decode (``/abort_request``: finish reason abort, fewer tokens than asked) and streamed a
    prefix of what the same prompt gives in full; a fixed verify cap K accepted at most K drafts
    in every step and K in some."""
    info, checks = g["long"], {}
    n = len(LONG_PROMPTS)
    checks["long_prompts_served"] = info["prompt_tokens"] == [
        *LONG_PROMPTS,
        LONG_SHARED + 300,
        *LONG_ABORTED,
    ]
    shared = [LONG_SHARED] + list(LONG_ABORTED)
    checks["long_radix_hits"] = all(
        info["cached_tokens"][i] > want - LONG_CHUNK
        for i, want in zip((n, n + 1, n + 2), shared)
    )
    for k, (how, a) in enumerate(info["aborts"].items()):
        full = g["tokens"][n + 1 + k]
        streamed = a["output_ids"][: len(full)]
        ended = how != "abort_request" or (
            a["finish"] == "abort"
            and 0 < (a["completion_tokens"] or 0) < LONG_ABORT_TOKENS
        )
        name = "mid_decode" if how == "abort_request" else "streamed_a_prefix"
        checks[f"long_{how}_{name}"] = (
            ended and len(streamed) > 0 and streamed == full[: len(streamed)]
        )
    cap = _flags(row.args).get("--speculative-dspark-verify-cap", "")
    if cap.isdigit():
        hists = [a[2] or [] for a in g["accepts"]]
        k = int(cap)
        checks[f"long_accepts_at_most_{k}"] = all(
            not any(h[k + 1 :]) for h in hists
        ) and any(len(h) > k and h[k] for h in hists)
    return checks


def row_seed(name: str) -> int:
    """Each server's own sampling seeds: two servers never draw the same random numbers."""
    return zlib.crc32(name.encode()) % 2**30


def sampling_set(sampling: str, i: int) -> str:
    """The parameter set of the ``i``-th request of a row serving ``sampling``."""
    return MIXED_SETS[i % len(MIXED_SETS)] if sampling == "mixed" else sampling


def sampled(
    server: Server,
    seed: int,
    sampling: str = "t1",
    requests: int = SAMPLED_REQUESTS,
    params: dict | None = None,
) -> dict:
    """``requests`` draws of ``SAMPLED_TOKENS`` tokens, 500 per batch, request ``i`` seeded
    ``seed + i`` with the parameters of ``sampling_set(sampling, i)`` (``params`` overrides).
    """
    tokens, metas = [], []
    for start in range(0, requests, 500):
        n = min(500, requests - start)
        outs = server.post(
            "/generate",
            {
                "text": [SAMPLED_PROMPT] * n,
                "sampling_params": [
                    {
                        **(params or SAMPLING_SETS[sampling_set(sampling, start + i)]),
                        "max_new_tokens": SAMPLED_TOKENS,
                        "ignore_eos": True,
                        "sampling_seed": seed + start + i,
                    }
                    for i in range(n)
                ],
            },
            timeout=900,
        )
        tokens += [o["output_ids"] for o in outs]
        metas += outs
    return {
        "tokens": tokens,
        "spec": spec_stats(metas),
        "accepts": [request_accepts(o) for o in metas],
    }


def target_distributions(server: Server, model: Path) -> list[list[float]]:
    """The served target's next-token logprobs after the sampled prompt with its last token
    replaced by each token of the vocabulary, over the whole vocabulary (``top_logprobs_num``),
    at T 1 with no filter (so they are the raw distribution, not a processed one). The sample
    checkpoint is a Markov chain to within its 1e-3 residual writes: row ``t`` is the target's
    distribution after token ``t`` at any position (``fit_test``)."""
    from transformers import AutoTokenizer

    vocab = TINY_DSV4["vocab_size"]
    prompt = AutoTokenizer.from_pretrained(model)(SAMPLED_PROMPT)["input_ids"]
    outs = server.post(
        "/generate",
        {
            "input_ids": [prompt[:-1] + [t] for t in range(vocab)],
            "sampling_params": {"temperature": 1.0, "max_new_tokens": 1},
            "return_logprob": True,
            "top_logprobs_num": vocab,
        },
    )
    dists = []
    for o in outs:
        row = [-math.inf] * vocab
        for logprob, token, *_ in o["meta_info"]["output_top_logprobs"][0]:
            row[token] = logprob
        dists.append(row)
    return dists


def seeded(server: Server) -> list[list[int]]:
    """``SEEDED_REQUESTS`` sampled requests one at a time, the same seeds on every server."""
    out = []
    for i in range(SEEDED_REQUESTS):
        params = SAMPLING_SETS["t1" if i % 2 == 0 else "t1.3"]
        got = server.post(
            "/generate",
            {
                "text": SAMPLED_PROMPT,
                "sampling_params": {
                    **params,
                    "max_new_tokens": SAMPLED_TOKENS,
                    "ignore_eos": True,
                    "sampling_seed": 1000 + i,
                },
            },
        )
        out.append(got["output_ids"])
    return out


def loop_requests(server: Server) -> dict:
    """A greedy request that cycles (period 100 on the agree checkpoint) must finish as a loop;
    a sampled one of the same length (no exact repeat) must not."""

    def finish(temperature: float) -> str:
        out = server.post(
            "/generate",
            {
                "text": "a",
                "sampling_params": {
                    "temperature": temperature,
                    "max_new_tokens": 600,  # not ignore_eos: such requests are exempt
                    "sampling_seed": 7,
                },
            },
        )
        return out["meta_info"]["finish_reason"]["type"]

    return {"greedy_finish": finish(0.0), "sampled_finish": finish(1.0)}


def thinking_request(server: Server) -> str:
    """Disagreeing thinking switches: the aliases answer 400 naming them (upstream serves it)."""
    try:
        server.post(
            "/v1/chat/completions",
            {
                "model": "default",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4,
                "chat_template_kwargs": {"enable_thinking": True},
                "thinking": {"type": "disabled"},
            },
        )
    except RuntimeError as e:
        return str(e)[:300]
    return "served"


METRICS_SETTLE_S = 15.0  # the counters are written when the scheduler goes idle
META_PROPOSED = "dspark_drafts_proposed_by_position"
META_ACCEPTED = "dspark_drafts_accepted_by_position"
_SAMPLE = re.compile(r"(sglang:dspark_\w+)\{(.*)\} (\S+)$")


def dspark_scrape(text: str) -> dict:
    """TP rank 0's DSpark acceptance series from a ``/metrics`` page (``--enable-metrics``):
    proposed and accepted drafts per position (position 1 first), the verify rows and tau.
    """
    per: dict = {"proposed": {}, "accepted": {}, "rows": {}}
    tau = None
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        if labels.get("tp_rank") != "0":
            continue
        name, value = m.group(1), float(m.group(3))
        if name == "sglang:dspark_drafts_proposed_total":
            per["proposed"][int(labels["position"])] = value
        elif name == "sglang:dspark_drafts_accepted_total":
            per["accepted"][int(labels["position"])] = value
        elif name == "sglang:dspark_verify_rows_total":
            per["rows"][labels["rows"]] = value
        elif name == "sglang:dspark_draft_temperature_scale":
            tau = value
    return {
        "proposed": [per["proposed"][p] for p in sorted(per["proposed"])],
        "accepted": [per["accepted"][p] for p in sorted(per["accepted"])],
        "rows_live": per["rows"].get("live", 0.0),
        "rows_kept_out_of_moe": per["rows"].get("kept_out_of_moe", 0.0),
        "tau": tau,
    }


def _scrape_delta(after: dict, before: dict) -> dict:
    out = {
        k: [a - b for a, b in zip(after[k], before[k])]
        for k in ("proposed", "accepted")
    }
    for k in ("rows_live", "rows_kept_out_of_moe"):
        out[k] = after[k] - before[k]
    return out


def metrics_requests(server: Server) -> dict:
    """``/metrics`` against the responses: greedy and sampled requests in batches, then the
    scrape's change over them (polled until it equals the responses' sum or
    ``METRICS_SETTLE_S`` passes) beside the sum of their ``meta_info`` counts."""

    def scrape() -> dict:
        return dspark_scrape(server.get("/metrics"))

    before = scrape()
    for _ in range(int(METRICS_SETTLE_S / 0.5)):  # settled: two scrapes alike
        time.sleep(0.5)
        again = scrape()
        if again == before:
            break
        before = again
    outs = server.post(
        "/generate",
        {
            "text": GREEDY_PROMPTS[:8],
            "sampling_params": {"temperature": 0, "max_new_tokens": GREEDY_TOKENS},
        },
    ) + server.post(
        "/generate",
        {
            "text": [SAMPLED_PROMPT] * 8,
            "sampling_params": {"temperature": 1.0, "max_new_tokens": GREEDY_TOKENS},
        },
    )
    metas = [o["meta_info"] for o in outs]
    gamma = len(before["proposed"])
    responses = {
        k: [float(sum(m.get(key, [0] * gamma)[p] for m in metas)) for p in range(gamma)]
        for k, key in (("proposed", META_PROPOSED), ("accepted", META_ACCEPTED))
    }
    deadline = time.monotonic() + METRICS_SETTLE_S
    while True:
        after = scrape()
        delta = _scrape_delta(after, before)
        if (
            delta["proposed"] == responses["proposed"]
            and delta["accepted"] == responses["accepted"]
        ) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    return {
        "responses": responses,
        "scrape": delta,
        "verify_steps": sum(m.get("spec_verify_ct", 0) for m in metas),
        "meta_info_counts": all(
            META_PROPOSED in m for m in metas if m.get("spec_verify_ct")
        ),
        "tau": after["tau"],
        "gamma": gamma,
    }


def request_accepts(out: dict, histogram: bool = False) -> list:
    """One request's speculation as its response reports it: [verify steps, accepted drafts]
    and, with ``histogram``, upstream's steps per accepted count (its meta_info)."""
    meta = out["meta_info"]
    got = [meta.get("spec_verify_ct", 0), meta.get("spec_num_correct_drafts", 0)]
    return got + [meta.get("spec_correct_drafts_histogram")] if histogram else got


def spec_stats(outs: list[dict]) -> dict | None:
    verify = sum(o["meta_info"].get("spec_verify_ct", 0) for o in outs)
    if not verify:
        return None
    correct = sum(o["meta_info"].get("spec_num_correct_drafts", 0) for o in outs)
    completion = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return {
        "verify_steps": verify,
        "accepted_drafts_per_step": correct / verify,
        "tokens_per_step": completion / verify,
    }


TIMING_REPEATS = 5


def timing(server: Server) -> dict:
    """Decode tokens/s and time per decode step at batch 1, 4 and 16 (128 greedy tokens each),
    the median of TIMING_REPEATS requests with every run's time kept (``ms_per_step_runs``): one
    request per batch size varied by up to 40 % between two runs of the same row on the H200.
    Each batch size is warmed up first with the same prompts: the first prefill and decode of a
    new batch shape compile kernels (Triton), which a timed request must not include."""
    out = {}
    for bs in (1, 4, 16):
        prompts = [f"{p} {bs}" for p in (GREEDY_PROMPTS * 2)[:bs]]
        server.post(
            "/generate",
            {
                "text": prompts,
                "sampling_params": {"temperature": 0, "max_new_tokens": 16},
            },
        )
        body = {
            "text": prompts,
            "sampling_params": {
                "temperature": 0,
                "max_new_tokens": 128,
                "ignore_eos": True,
            },
        }
        runs = []
        for _ in range(TIMING_REPEATS):
            t0 = time.perf_counter()
            outs = server.post("/generate", body)
            seconds = time.perf_counter() - t0
            stats = spec_stats(outs)
            steps = stats["verify_steps"] / bs if stats else 128
            runs.append((1e3 * seconds / steps, bs * 128 / seconds, stats))
        ms, tokens_per_s, stats = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
        out[f"bs{bs}"] = {
            "tokens_per_s": tokens_per_s,
            "ms_per_step": ms,
            "spec": stats,
            "ms_per_step_runs": [round(r[0], 3) for r in runs],
        }
    return out


PROFILE_TOKENS = 64
PROFILE_TOP = 25


def profile(
    server: Server,
    out_dir: Path,
    prompts: list[str] | None = None,
    tokens: int = PROFILE_TOKENS,
    all_kernels: bool = False,
    input_ids: list[list[int]] | None = None,
) -> dict:
    """The GPU kernels of one batch-1 request of PROFILE_TOKENS greedy tokens, through upstream's
    ``/start_profile`` (torch profiler, GPU activity only; CUDA-graph replays included): time per
    kernel name summed, the top PROFILE_TOP kept. The trace itself is deleted (megabytes).
    ``prompts`` (or ``input_ids``, token ids) sends that batch instead, ``tokens`` each;
    ``all_kernels`` keeps every kernel name's time and calls (``by_name``, ``kernel_times``);
    ``requests`` counts them.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    server.post_text(
        "/start_profile",
        {
            "output_dir": str(out_dir),
            "activities": ["GPU"],
            "with_stack": False,
            "record_shapes": False,
            "profile_id": "row",
        },
    )
    batch = (
        {"input_ids": input_ids}
        if input_ids is not None
        else {"text": GREEDY_PROMPTS[0] if prompts is None else prompts}
    )
    got = server.post(
        "/generate",
        {
            **batch,
            "sampling_params": {
                "temperature": 0,
                "max_new_tokens": tokens,
                "ignore_eos": True,
            },
        },
    )
    outs = got if isinstance(got, list) else [got]
    server.post_text("/stop_profile", {})
    traces = sorted(out_dir.glob("*.trace.json.gz"))
    if not traces:
        raise RuntimeError(f"/stop_profile wrote no trace under {out_dir}")
    summary = kernel_summary(traces[0])
    if all_kernels:
        summary["by_name"] = kernel_times(traces[0])
    summary["spec"] = spec_stats(outs)
    summary["requests"] = len(outs)
    for t in traces:
        t.unlink()
    return summary


def _kernel_events(trace: Path) -> list[dict]:
    with gzip.open(trace, "rt") as f:
        events = json.load(f).get("traceEvents", [])
    return [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"]


def kernel_times(trace: Path) -> dict[str, list[float]]:
    """A chrome trace's GPU kernels: {name: [total microseconds, calls]}."""
    by_name: dict[str, list[float]] = {}
    for e in _kernel_events(trace):
        t = by_name.setdefault(e.get("name", "?"), [0.0, 0])
        t[0] += float(e.get("dur", 0.0))
        t[1] += 1
    return by_name


def kernel_summary(trace: Path, top: int = PROFILE_TOP) -> dict:
    """Sum a chrome trace's GPU kernel events (``cat`` kernel) by name: total microseconds, the
    kernel count and the ``top`` names by time (share of the total). ``span_us`` runs from the
    first kernel's start to the last one's end; ``gpu_busy`` is the share of it covered by at
    least one kernel (overlapping streams counted once): a step that got slower while its
    kernels did not shows up as idle GPU time, i.e. time spent on the host."""
    events = _kernel_events(trace)
    by_name = kernel_times(trace)
    spans = [
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))
        for e in events
        if "ts" in e
    ]
    total = sum(t[0] for t in by_name.values())
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    busy, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        busy += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    span = (max(e for _, e in spans) - min(s for s, _ in spans)) if spans else 0.0
    return {
        "kernel_us": round(total, 1),
        "kernels": sum(t[1] for t in by_name.values()),
        "span_us": round(span, 1),
        "gpu_busy": round(busy / span, 4) if span else 0.0,
        "top": [
            {
                "name": n[:160],
                "us": round(t[0], 1),
                "calls": t[1],
                "share": round(t[0] / total, 4) if total else 0.0,
            }
            for n, t in ranked
        ],
    }


def _two_sample_p(ca: Counter, cb: Counter, na: int, nb: int) -> float:
    """Chi-square two-sample test of two categorical samples (counts ``ca`` of ``na`` draws, ``cb``
    of ``nb``); categories with fewer than 5 expected draws are pooled into one."""
    from scipy.stats import chi2_contingency

    total = na + nb
    big = [k for k in set(ca) | set(cb) if (ca[k] + cb[k]) * min(na, nb) / total >= 5]
    table = [
        [ca[k] for k in big] + [na - sum(ca[k] for k in big)],
        [cb[k] for k in big] + [nb - sum(cb[k] for k in big)],
    ]
    if table[0][-1] + table[1][-1] == 0:
        table = [r[:-1] for r in table]
    return 1.0 if len(table[0]) < 2 else float(chi2_contingency(table)[1])


def chi2_same(
    a: list[list[int]], b: list[list[int]], positions=SAMPLED_POSITIONS
) -> dict:
    """The token distributions at ``positions`` of two samples, one chi-square test each."""
    result = {
        f"p_pos{pos}": _two_sample_p(
            Counter(t[pos] for t in a), Counter(t[pos] for t in b), len(a), len(b)
        )
        for pos in positions
    }
    result["min_p"] = min(result.values())
    return result


def processed(logprobs: list[float], params: dict) -> list[float]:
    """The distribution upstream's torch sampler draws from (``--sampling-backend pytorch``):
    softmax at the temperature, then top-p, top-k and min-p each judged on the same sorted,
    unrenormalised probabilities (ties in token order), renormalised. Greedy: the argmax.
    """
    temperature = params.get("temperature", 1.0)
    if temperature == 0:
        top = max(range(len(logprobs)), key=lambda t: logprobs[t])
        return [float(t == top) for t in range(len(logprobs))]
    peak = max(logprobs)
    w = [math.exp((lp - peak) / temperature) for lp in logprobs]
    total = sum(w)
    probs = [x / total for x in w]
    order = sorted(range(len(probs)), key=lambda t: -probs[t])
    top_p, top_k = params.get("top_p", 1.0), params.get("top_k", -1)
    min_p = params.get("min_p", 0.0) * probs[order[0]]
    kept, cum = [0.0] * len(probs), 0.0
    for rank, t in enumerate(order):
        if cum <= top_p and (top_k < 0 or rank < top_k) and probs[t] >= min_p:
            kept[t] = probs[t]
        cum += probs[t]
    total = sum(kept)
    return [x / total for x in kept]


def fit_test(
    tokens: list[list[int]], dists: list[list[float]], params: dict, prev0: int
) -> dict:
    """Do the draws follow the target's own distribution, exactly? One-sample tests against
    ``processed(dists[previous token], params)``, which no reference sample's noise dilutes:
    - the draws that took the target's modal token over all positions after the first (the
      drafted ones; given the past each is a Bernoulli of known mean, so their sum has a known
      variance, dependence between positions notwithstanding), and per position;
    - per position, a chi-square goodness of fit of (previous token, token) pairs, cells with
      fewer than 5 expected draws pooled per previous token.
    ``min_p`` is the smallest p-value."""
    from scipy.stats import chi2

    probs, modals = {}, {}

    def p_of(prev):
        if prev not in probs:
            probs[prev] = processed(dists[prev], params)
            modals[prev] = max(range(len(probs[prev])), key=lambda t: probs[prev][t])
        return probs[prev]

    result, took, mean, var, impossible = {}, 0, 0.0, 0.0, 0
    for pos in range(SAMPLED_TOKENS):
        pairs = Counter()
        k, m, v = 0, 0.0, 0.0
        for seq in tokens:
            prev = seq[pos - 1] if pos else prev0
            dist = p_of(prev)
            modal = modals[prev]
            impossible += dist[seq[pos]] == 0
            k += seq[pos] == modal
            m += dist[modal]
            v += dist[modal] * (1 - dist[modal])
            pairs[prev, seq[pos]] += 1
        result[f"p_modal_pos{pos}"] = _z_p(k, m, v)
        if pos:
            took, mean, var = took + k, mean + m, var + v
        stat, dof = 0.0, 0
        for prev in {a for a, _ in pairs}:
            n = sum(c for (a, _), c in pairs.items() if a == prev)
            expected = [n * q for q in p_of(prev)]
            big = [t for t, e in enumerate(expected) if e >= 5]
            cells = [(pairs[prev, t], expected[t]) for t in big]
            rest = n - sum(o for o, _ in cells), n - sum(e for _, e in cells)
            if rest[1] >= 1e-9:
                cells.append(rest)
            stat += sum((o - e) ** 2 / e for o, e in cells if e > 0)
            dof += len(cells) - 1
        result[f"p_fit_pos{pos}"] = float(chi2.sf(stat, dof)) if dof else 1.0
    result["p_modal_drafted"] = _z_p(took, mean, var)
    result["modal_drafted_share"] = round(
        took / max(len(tokens), 1) / (SAMPLED_TOKENS - 1), 4
    )
    result["modal_drafted_expected"] = round(
        mean / max(len(tokens), 1) / (SAMPLED_TOKENS - 1), 4
    )
    # a draw of a token the filters give no mass is impossible for an exact sampler
    result["impossible_draws"] = impossible
    result["p_possible"] = 0.0 if impossible else 1.0
    result["min_p"] = min(v for k, v in result.items() if k.startswith("p_"))
    return result


def _z_p(observed: float, mean: float, var: float) -> float:
    """Two-sided p-value of ``observed`` against a normal of ``mean`` and ``var``."""
    from scipy.stats import norm

    if var <= 0:
        return 1.0 if observed == mean else 0.0
    return float(2 * norm.sf(abs(observed - mean) / math.sqrt(var)))


def sampled_reference(sampling: str) -> str:
    """The row serving the target's own distribution (upstream, no speculation) at ``sampling``."""
    return SAMPLED_REFERENCE if sampling == "t1" else f"{SAMPLED_REFERENCE}_{sampling}"


def _is_chain(tokens: list[int], succ: list[int] | None, prev0: int) -> bool:
    """Greedy on the sample checkpoint: each token the successor of the one before."""
    return succ is not None and all(
        t == succ[p] for p, t in zip([prev0] + tokens[:-1], tokens)
    )


def sample_test(
    a: list[list[int]], b: list[list[int]], succ: list[int], prev0: int
) -> dict:
    """Do samples ``a`` and ``b`` of the sample checkpoint come from one distribution?

    The target's modal next token is ``succ[previous token]`` (``prev0`` before the first). Per
    position, the share of draws that took it (a 2 x 2 test); the number of positions that took
    it (0..SAMPLED_TOKENS, one test over the joint); the token distributions at the first drafted
    positions. ``min_p`` is the smallest p-value; the shares are kept for the report.
    """

    def modal(seqs):
        return [[int(t == succ[p]) for p, t in zip([prev0] + s[:-1], s)] for s in seqs]

    ma, mb = modal(a), modal(b)
    na, nb = len(a), len(b)
    result = {}
    for i in range(SAMPLED_TOKENS):
        ka, kb = sum(m[i] for m in ma), sum(m[i] for m in mb)
        result[f"p_modal_pos{i}"] = _two_sample_p(
            Counter({1: ka, 0: na - ka}), Counter({1: kb, 0: nb - kb}), na, nb
        )
    result["p_modal_count"] = _two_sample_p(
        Counter(sum(m) for m in ma), Counter(sum(m) for m in mb), na, nb
    )
    result.update(chi2_same(a, b))
    result["min_p"] = min(v for k, v in result.items() if k.startswith("p_"))
    result["modal_share"] = [
        round(sum(m[i] for m in ma) / na, 4) for i in range(SAMPLED_TOKENS)
    ]
    result["modal_share_reference"] = [
        round(sum(m[i] for m in mb) / nb, 4) for i in range(SAMPLED_TOKENS)
    ]
    return result


# ---------------------------------------------------------------------------- driver


def fork_flags_line(log: str) -> str | None:
    return next((line for line in log.splitlines() if "fork flags:" in line), None)


def feature_lines(log: str, limit: int = 12) -> list[str]:
    """The startup lines in which a fork feature reports itself; not the command or the argument dump."""
    lines = [
        line.split("] ", 1)[-1]
        for line in log.splitlines()
        if FEATURE_LINE.search(line)
    ]
    return [
        line[:400] for line in lines if not line.startswith(("$ ", "server_args="))
    ][:limit]


def row_env(row: Row, env: dict, trees: dict[str, Path | None]) -> dict:
    """The row's server environment: its tree first on the path (the fork's, or the pinned
    release's for an upstream row), and the harness's probes and fault."""
    env = dict(env)
    tree = trees.get(row.tree)
    if tree is None:
        raise ServerDied(f"no {row.tree} tree to serve (--upstream PATH)")
    others = [
        p
        for p in env.get("PYTHONPATH", os.environ.get("PYTHONPATH", "")).split(
            os.pathsep
        )
        if p and Path(p).resolve() not in {t.resolve() for t in trees.values() if t}
    ]
    standins = [str(p) for p in STANDINS]
    env["PYTHONPATH"] = os.pathsep.join(
        standins + [str(tree)] + [p for p in others if p not in standins]
    )
    env.update(row.env)
    if row.probes:
        env["E2E_PROBES"] = ",".join(row.probes)
    if row.fault:
        env["E2E_FAULT"] = row.fault
    return env


def serve_row(
    row: Row,
    model: Path,
    env: dict,
    logs: Path,
    profiled: bool = False,
    sampled_requests: int = SAMPLED_REQUESTS,
) -> dict:
    """Start the row's server, send its requests, stop it: the raw record (tokens included).
    ``profiled``: a timing row also records its GPU kernels (``profile``) after timing.
    """
    rec: dict = {"args": row.args, "model": row.model, "tree": row.tree}
    if row.env:
        rec["env"] = row.env
    if row.refused_with:
        r = refusal(model, SERVE_ARGS + row.args, env=env)
        (logs / f"{row.name}.log").write_text(r.stdout)
        rec["refused"] = r.returncode != 0 and row.refused_with in r.stdout
        rec["exit_code"] = r.returncode
        return rec
    args = (
        SERVE_ARGS
        + MEM_ARGS[row.model]
        + GRAPH_ARGS[row.model]
        + MODEL_ARGS.get(row.model, [])
        + row.args
    )
    dump = logs / f"{row.name}.probe-dump"
    dump.unlink(missing_ok=True)
    if row.probes:
        env = {**env, "E2E_PROBE_DUMP": str(dump)}
    with Server(model, args, env=env, log_path=logs / f"{row.name}.log") as server:
        rec["startup_s"] = round(server.startup_seconds, 1)
        line = fork_flags_line(server.log())
        rec["fork_flags_line"] = (
            None if line is None else line.split("fork flags: ", 1)[-1]
        )
        if row.timing:
            rec["timing"] = timing(server)
            if profiled:
                rec["profile"] = profile(server, logs / f"{row.name}-profile")
        if row.greedy:
            rec["_greedy"] = greedy(server, row.model)
        if row.sampled:
            rec["_sampled"] = sampled(
                server, row_seed(row.name), row.sampling, sampled_requests
            )
            if row.name == SAMPLED_REFERENCE:
                rec["_target"] = target_distributions(server, model)
                # the first negative control: the target's distribution at 0.97 T
                rec["_control"] = sampled(
                    server,
                    row_seed(row.name + "-control"),
                    requests=sampled_requests,
                    params={"temperature": CONTROL_TEMPERATURE},
                )
            if row.seeded_same_as or any(r.seeded_same_as == row.name for r in rows()):
                rec["seeded"] = seeded(server)
        if row.requests == "loop":
            rec["loop"] = loop_requests(server)
        if row.requests == "thinking":
            rec["thinking_disagreeing_switches"] = thinking_request(server)
        if row.requests == "metrics":
            rec["metrics"] = metrics_requests(server)
        if row.probes:  # the device counters, after every request of the row
            dump.touch()
            deadline = time.monotonic() + 20
            while "e2e probe: device counts dumped" not in server.log():
                if time.monotonic() > deadline:
                    break
                time.sleep(0.5)
    rec["log_errors"] = server.errors()[:20]
    rec["upstream_fallbacks"] = server.fallbacks()[:5]
    rec["feature_lines"] = feature_lines(server.log())
    rec["_evidence"] = {e: bool(re.search(e, server.log())) for e in evidence(row)}
    rec["exit_code"] = server.proc.returncode
    return rec


def evidence(row: Row) -> list[str]:
    """The log lines that show the row's feature ran: its startup lines and its probes' lines;
    for a kernel served under CUDA graphs (``REPLAYED_PROBES``), its device counter at 100 or
    more (counted at every replay, not only at the capture)."""
    lines = list(row.engaged)
    for p in row.probes:
        name = p.split("?")[0]
        lines.append(re.escape(f"e2e probe: {name} call"))
        if p in REPLAYED_PROBES:
            lines.append(
                re.escape(f"e2e probe: {name} device count ") + "[1-9][0-9]{2,}"
            )
    return lines


def logprob_spread(got: dict, ref: dict) -> dict:
    """Two rows' greedy logprobs over the tokens both emit before their first differing token
    (per prompt; the logprob at a differing position is of another token): the largest
    |difference| overall and at the first decoded token (position 1: the first verify or decode
    forward after the prefill, before any differing KV feeds back), the share of tokens compared,
    and where each prompt first differs."""
    worst = first = 0.0
    compared, total, first_diff = 0, 0, {}
    for i, (ta, tb, la, lb) in enumerate(
        zip(got["tokens"], ref["tokens"], got["logprobs"], ref["logprobs"])
    ):
        n = next(
            (j for j, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb))
        )
        if n < max(len(ta), len(tb)):
            first_diff[i] = n
        for j, (x, y) in enumerate(zip(la[:n], lb[:n])):
            worst = max(worst, abs(x - y))
            if j == 1:
                first = max(first, abs(x - y))
        compared += n
        total += max(len(ta), len(tb))
    return {
        "max_abs": worst,
        "first_decode_max_abs": first,
        "share_compared": round(compared / max(total, 1), 4),
        "first_difference": first_diff,
    }


def within_bound(model: str, spread: dict) -> bool:
    """The rounding-level rule (``LOGPROB_BOUND``). Agree checkpoint: every logprob within the
    bound (its margins keep the tokens identical). Random weights, where one rounding step
    changes later tokens: the first decoded token's logprob within the bound, and the two rows
    emitting the same tokens over at least ``MIN_SHARED_PREFIX`` of them."""
    if model in ("agree", "long"):  # the long checkpoint is built as the agree one
        return spread["max_abs"] <= LOGPROB_BOUND["agree"]
    return (
        spread["first_decode_max_abs"] <= LOGPROB_BOUND["random"]
        and spread["share_compared"] >= MIN_SHARED_PREFIX
    )


def metrics_checks(row: Row, m: dict) -> dict[str, bool]:
    """``/metrics`` equals the sum of the responses' per-position counts; the verify rows add
    up to gamma + 1 per request step, some kept out of the MoE exactly when a cap is on; the
    tau gauge is the flag's value."""
    s = m["scrape"]
    cap = "--speculative-dspark-verify-cap" in row.args
    tau = float(row.flags.get("--speculative-dspark-draft-temperature-scale", 1.0))
    return {
        "metrics_equal_responses": m["meta_info_counts"]
        and sum(m["responses"]["proposed"]) > 0
        and s["proposed"] == m["responses"]["proposed"]
        and s["accepted"] == m["responses"]["accepted"],
        "metrics_rows_add_up": s["rows_live"] + s["rows_kept_out_of_moe"]
        == m["verify_steps"] * (m["gamma"] + 1)
        and (s["rows_kept_out_of_moe"] > 0) == cap,
        "metrics_tau": m["tau"] == tau,
    }


# A sampled row's accepted drafts per step is held to upstream's DSpark row on the same
# checkpoint at the sampled tests' significance (two-sided, P_MIN).
SAMPLED_SPEC_REFERENCE = "s_up_off"
SPEC_Z = statistics.NormalDist().inv_cdf(1 - P_MIN / 2)


def acceptance_rate(accepts: list) -> tuple[float, float]:
    """Accepted drafts per verify step over requests ``[[steps, accepted], ...]`` and the
    standard error of that ratio (requests independent; the ratio estimator's linearisation).
    """
    n = len(accepts)
    steps = sum(a[0] for a in accepts)
    rate = sum(a[1] for a in accepts) / steps
    spread = sum((a[1] - rate * a[0]) ** 2 for a in accepts) / max(n - 1, 1)
    return rate, math.sqrt(spread / n) / (steps / n)


def _identical(vs: dict | None) -> bool:
    return bool(vs and vs["tokens_identical"] and vs["logprobs_identical"])


def judge_speculation(row: Row, rec: dict, recs: dict) -> dict | None:
    """Whether the row speculated as it promises (``Row.accepts``); None where not judged.

    A server that silently stops speculating emits upstream's tokens (DSpark is lossless), so
    every token and logprob check passes it: only the responses' speculation counts see it.
    "none": no verify step. Otherwise verify steps must have run, and for "reference":
    - greedy: each request's [verify steps, accepted drafts, histogram] equal to the first
      reference (same_as, the matched same_as_one_of, tokens_as, bound_to) whose tokens equal
      this row's and which speculated; acceptance of greedy decoding is a function of the
      tokens, so only a row whose tokens differ (rounding-level rows on random weights) is held
      to running alone;
    - sampled: accepted drafts per step within ``SPEC_Z`` standard errors of
      ``SAMPLED_SPEC_REFERENCE``'s.
    Timing rows: every batch size speculated."""
    if row.accepts is None:
        return None
    if "timing" in rec and "_greedy" not in rec:
        ran = all(t.get("spec") for t in rec["timing"].values())
        return {"ok": ran == (row.accepts != "none"), "rule": "timing: speculated"}
    part = rec.get("_greedy") or rec.get("_sampled")
    if part is None:
        return None
    mine = part.get("accepts")
    if mine is None:
        return {"ok": False, "rule": "per-request counts not recorded"}
    steps = sum(a[0] for a in mine)
    out = {"verify_steps": steps, "accepted_drafts": sum(a[1] for a in mine)}
    if row.accepts == "none" or not steps:
        rule = "no speculation" if row.accepts == "none" else "speculation must run"
        return {**out, "ok": (steps == 0) == (row.accepts == "none"), "rule": rule}
    if row.accepts == "design":
        return {**out, "ok": True, "rule": "runs (the flag moves acceptance)"}
    if "_greedy" in rec:
        for name in (
            row.same_as
            + row.recorded_vs
            + tuple(r for r in row.same_as_one_of if _identical(rec.get(f"vs_{r}")))
            + row.tokens_as
            + ((row.bound_to,) if row.bound_to else ())
        ):
            ref = recs.get(name, {}).get("_greedy") or {}
            theirs = ref.get("accepts")
            if theirs and sum(a[0] for a in theirs) and ref["tokens"] == part["tokens"]:
                return {**out, "ok": mine == theirs, "rule": f"equal to {name}'s"}
        return {
            **out,
            "ok": True,
            "rule": "runs (no speculating reference, same tokens)",
        }
    if row.name == SAMPLED_SPEC_REFERENCE:
        return {**out, "ok": True, "rule": "runs (the reference)"}
    if row.sampling != "t1":
        return {
            **out,
            "ok": True,
            "rule": "runs (no upstream DSpark row at its parameters)",
        }
    ref = recs.get(SAMPLED_SPEC_REFERENCE, {}).get("_sampled") or {}
    if not ref.get("accepts") or not sum(a[0] for a in ref["accepts"]):
        return {
            **out,
            "ok": False,
            "rule": f"{SAMPLED_SPEC_REFERENCE} did not speculate",
        }
    (rate, se), (ref_rate, ref_se) = acceptance_rate(mine), acceptance_rate(
        ref["accepts"]
    )
    z = (rate - ref_rate) / math.hypot(se, ref_se)
    return {
        **out,
        "ok": abs(z) <= SPEC_Z,
        "rule": f"within {SPEC_Z:.2f} SE of {SAMPLED_SPEC_REFERENCE}'s",
        "accepted_per_step": round(rate, 4),
        "reference_per_step": round(ref_rate, 4),
        "z": round(z, 2),
    }


def upstream_defect_result(row: Row, rec: dict, recs: dict) -> str | None:
    """The defect's name when the row names one and misses its ``same_as`` reference only by
    giving the defect's result: a pinned digest, or the result of an upstream DSpark row of the
    same checkpoint in this run (an upstream row that misses the reference is upstream's own
    behaviour, so it is the defect's by definition)."""
    checks = rec.get("checks", {})
    missed = [f"identical_to_{r}" for r in row.same_as]
    if not row.upstream_defect or not any(checks.get(m) is False for m in missed):
        return None
    if any(not v for k, v in checks.items() if k not in missed):
        return None  # something else failed too: a plain failure
    if any("_greedy" not in recs.get(r, {}) for r in row.same_as):
        return None  # a reference that did not serve: a plain failure
    reference = {greedy_digest(recs[r]["_greedy"]) for r in row.same_as}
    known = set(UPSTREAM_DEFECTS[row.upstream_defect]["results"].get(row.model, ()))
    known |= {
        greedy_digest(other["_greedy"])
        for other in recs.values()
        if other.get("tree") == "upstream"
        and other.get("model") == row.model
        and DSPARK[0] in other.get("args", ())
        and "_greedy" in other
    } - reference
    return row.upstream_defect if greedy_digest(rec["_greedy"]) in known else None


def greedy_digest(g: dict) -> str:
    """A greedy result's tokens and logprobs, hashed: equal digests, equal bits."""
    digest = json.dumps([g["tokens"], g["logprobs"]])  # not a result: hashed
    return hashlib.sha256(digest.encode()).hexdigest()[:16]


def evaluate(row: Row, rec: dict, recs: dict, succ: list[int] | None = None) -> None:
    """Every check of a served row against its references, into ``rec["checks"]``; sets ``ok``.
    A negative control (``must_fail``) passes when that check fails and every other holds.
    """
    if "error" in rec:
        rec["ok"] = False
        return
    if "refused" in rec:
        rec["ok"] = rec["refused"]
        return
    checks: dict[str, bool] = {}
    if row.tree == "upstream":
        checks["is_upstream"] = rec["fork_flags_line"] is None
    else:
        from sglang.fork import (  # upstream flags of a row are not in the line
            fork_flags,
        )

        line = rec["fork_flags_line"] or ""
        checks["fork_flags_line"] = rec["fork_flags_line"] is not None and all(
            f"{flag}={value}" in line
            for flag, value in row.flags.items()
            if flag in fork_flags()
        )
    checks["no_log_errors"] = not rec["log_errors"]
    found = rec.get("_evidence", {})
    missing = [e for e in evidence(row) if not found.get(e)]
    if evidence(row):
        checks["engaged"] = not missing
        rec["engaged_missing"] = missing
    g = rec.get("_greedy")
    if g is not None:
        checks["completion_matches_generate"] = g["completion_matches_generate"]
        rec["greedy_digest"] = greedy_digest(g)
        for ref in (
            row.same_as
            + row.same_as_one_of
            + row.recorded_vs
            + row.tokens_as
            + ((row.bound_to,) if row.bound_to else ())
        ):
            other = recs.get(ref, {}).get("_greedy")
            if other is None:  # a reference that did not serve fails the comparison
                checks[f"reference_{ref}_served"] = False
                continue
            spread = logprob_spread(g, other)
            rec[f"vs_{ref}"] = {
                "tokens_identical": g["tokens"] == other["tokens"],
                "logprobs_identical": g["logprobs"] == other["logprobs"],
                **spread,
            }
            if ref in row.same_as:
                checks[f"identical_to_{ref}"] = (
                    g["tokens"] == other["tokens"]
                    and g["logprobs"] == other["logprobs"]
                )
            if ref in row.tokens_as:
                checks[f"tokens_identical_to_{ref}"] = g["tokens"] == other["tokens"]
            if ref == row.bound_to:
                checks[f"within_bound_of_{ref}"] = within_bound(row.model, spread)
        if row.same_as_one_of:  # a reference that did not serve already fails above
            compared = [rec[f"vs_{r}"] for r in row.same_as_one_of if f"vs_{r}" in rec]
            checks["identical_to_one_of_" + "_or_".join(row.same_as_one_of)] = any(
                v["tokens_identical"] and v["logprobs_identical"] for v in compared
            )
        if row.below_gamma:
            spec = g["spec"] or {}
            checks["accepts_below_gamma"] = (
                0 < spec.get("accepted_drafts_per_step", GAMMA) < GAMMA
            )
        if "--enable-loop-abort" in row.args:
            checks["greedy_prompts_not_looped"] = "loop" not in g["finish"]
        if "long" in g:
            checks.update(long_checks(row, g))
    if "loop" in rec:
        checks["looping_request_aborted"] = rec["loop"]["greedy_finish"] == "loop"
        # EOS may end the sampled one (it is honoured here); only a loop finish fails
        checks["sampled_request_not_aborted"] = rec["loop"]["sampled_finish"] != "loop"
    if "metrics" in rec:
        checks.update(metrics_checks(row, rec["metrics"]))
    if "thinking_disagreeing_switches" in rec:
        checks["disagreeing_switches_refused"] = rec[
            "thinking_disagreeing_switches"
        ].startswith("POST /v1/chat/completions -> 400")
    spec = judge_speculation(row, rec, recs)
    if spec is not None:
        rec["speculation"] = spec
        checks["speculation"] = spec["ok"]
    if "_sampled" in rec:
        s = rec["_sampled"]
        rec["sampled_spec"] = s["spec"]
        rec["sampled_requests"] = len(s["tokens"])  # a sitting's --sampled-requests
        prev0 = char_vocab()[SAMPLED_PROMPT[-1]]
        sets = MIXED_SETS if row.sampling == "mixed" else (row.sampling,)
        target = recs.get(SAMPLED_REFERENCE, {}).get("_target")
        for name in sets:
            mine = [
                t
                for i, t in enumerate(s["tokens"])
                if sampling_set(row.sampling, i) == name
            ]
            key = "" if row.sampling != "mixed" else f"_{name}"
            if target is None:
                checks[f"target_distribution_of_{SAMPLED_REFERENCE}_served"] = False
            elif name != "greedy":
                fit = fit_test(mine, target, SAMPLING_SETS[name], prev0)
                rec[f"sampled_fits_target{key}_result"] = fit
                checks[f"sampled_fits_target{key}"] = fit["min_p"] >= P_MIN
            if name == "greedy":  # the target's chain: every request the same tokens
                checks["greedy_among_sampled_is_one_result"] = len(
                    {tuple(t) for t in mine}
                ) == 1 and _is_chain(mine[0], succ, prev0)
                continue
            ref_name = sampled_reference(name)
            if row.name == ref_name:
                continue
            reference = recs.get(ref_name, {}).get("_sampled")
            if reference is None or succ is None:
                checks[f"reference_{ref_name}_served"] = False
                continue
            result = sample_test(mine, reference["tokens"], succ, prev0)
            rec[f"sampled_vs_upstream_nospec{key}"] = result
            checks[f"sampled_agrees{key}"] = result["min_p"] >= P_MIN
    if row.seeded_same_as:
        other = recs.get(row.seeded_same_as, {}).get("seeded")
        checks[f"seeded_identical_to_{row.seeded_same_as}"] = (
            other is not None and rec.get("seeded") == other
        )
        if "_control" in rec and succ is not None:
            rec["negative_control_0.97T"] = sample_test(
                rec["_control"]["tokens"], s["tokens"], succ, prev0
            )
            checks["control_0.97T_refused"] = (
                rec["negative_control_0.97T"]["min_p"] < P_MIN
            )
            if target is not None:
                fit = fit_test(
                    rec["_control"]["tokens"], target, SAMPLING_SETS["t1"], prev0
                )
                rec["negative_control_0.97T_fit"] = fit
                checks["control_0.97T_refused_by_fit"] = fit["min_p"] < P_MIN
    rec["checks"] = checks
    defect = upstream_defect_result(row, rec, recs)
    if defect:
        rec["expected_failure"] = defect
    if row.must_fail:
        rec["ok"] = checks.get(row.must_fail) is False and all(
            v for k, v in checks.items() if k != row.must_fail and k not in row.may_fail
        )
    else:
        rec["ok"] = all(checks.values())


def device_name() -> str:
    try:
        import torch

        return torch.cuda.get_device_name().replace(" ", "_")
    except Exception:
        return "cpu"


def _public(rec: dict) -> dict:
    """A row's record as the JSON keeps it: the raw tokens, logprobs and log left out (the
    greedy digest stands for them)."""
    g = rec.pop("_greedy", None)
    if g is not None:
        rec["greedy"] = {
            k: v for k, v in g.items() if k not in ("tokens", "logprobs", "accepts")
        }
    for key in ("_sampled", "_control", "_evidence", "seeded", "_target"):
        rec.pop(key, None)
    return rec


def serve_all(
    args,
    selected: list[Row],
    profiled: set,
    t_start: float,
    meta: dict,
    served_by: dict,
):
    """Serve the selected rows; returns their raw records and the sample checkpoint's successor map.

    The raw file (``e2e-raw-<device>.json.gz``) is rewritten after every row, so a run cut short
    (its machine's time limit) still leaves the tokens of every row that served: ``--evaluate``
    judges them, alone or together with another sitting's raw file.
    """
    logs = args.out / "e2e-logs"
    logs.mkdir(parents=True, exist_ok=True)
    env = harness_env(args.standins)
    import sglang

    trees = {
        "fork": Path(sglang.__file__).resolve().parents[1],
        "upstream": args.upstream,
    }
    models = {}
    for name, shape, seed, kw in (
        ("agree", TINY_DSV4, 0, dict(agree=True)),
        ("random", TINY_DSV4, 1, dict(agree=False)),
        ("v41", TINY_DSV4, 4, dict(agree=False, engram=TINY_ENGRAM)),
        ("v41_agree", TINY_DSV4, 5, dict(agree=True, engram=TINY_ENGRAM)),
        (
            "v41_partial",
            TINY_DSV4,
            6,
            dict(agree=True, engram=TINY_ENGRAM, draft_runs=(2, 3)),
        ),
        ("sample", TINY_DSV4, 3, dict(agree=True, target_margin=4.84, draft_bias=6.6)),
        ("long", LONG_DSV4, 7, dict(agree=True, draft_runs=LONG_DRAFT_RUNS)),
        ("real", REAL_SHAPE_DSV4, 2, dict(agree=False)),
    ):
        if any(r.model == name for r in selected):
            path = args.models / name
            if not (path / "model.safetensors").exists():
                t0 = time.monotonic()
                write_dsv4(path, shape=shape, seed=seed, device=_gen_device(), **kw)
                print(
                    f"==> wrote the {name} checkpoint in {time.monotonic() - t0:.0f} s",
                    flush=True,
                )
            models[name] = path
    if any(ROW_STORE_DIR in r.args for r in selected):
        Path(ROW_STORE_DIR).mkdir(parents=True, exist_ok=True)
    succ = (
        json.loads((models["sample"] / "succ.json").read_text())
        if "sample" in models
        else None
    )

    recs: dict = {}

    def one(row: Row) -> None:
        if time.monotonic() - t_start > args.budget:
            recs[row.name] = {"skipped": "over the time budget"}
            return
        print(f"==> {row.name} ({row.tree}): {' '.join(row.args)}", flush=True)
        t0 = time.monotonic()
        try:
            rec = serve_row(
                row,
                models[row.model],
                row_env(row, env, trees),
                logs,
                profiled=row.name in profiled,
                sampled_requests=args.sampled_requests,
            )
        except (ServerDied, RuntimeError, OSError, KeyError, ValueError) as e:
            rec = {
                "model": row.model,
                "tree": row.tree,
                "error": f"{type(e).__name__}: {str(e).splitlines()[0]}",
            }
        rec["seconds"] = round(time.monotonic() - t0, 1)
        recs[row.name] = rec
        with (
            PROGRESS_LOCK
        ):  # a progress file, so a run cut short still says what served
            write_raw(args.out, meta, succ, recs, served_by)
            (args.out / "e2e-progress.json").write_text(  # not a result: progress
                json.dumps(
                    {
                        k: {
                            "seconds": v.get("seconds"),
                            "error": v.get("error"),
                            "startup_s": v.get("startup_s"),
                            "log_errors": v.get("log_errors"),
                        }
                        for k, v in list(recs.items())
                    },
                    indent=1,
                )
            )
        print(
            f"<== {row.name} served in {rec['seconds']} s"
            + (f": {rec['error']}" if "error" in rec else ""),
            flush=True,
        )

    # Correctness rows share the GPU a few servers at a time, after the first one has run alone (it
    # fills the JIT and Triton caches the others read). Timing rows run alone, one after another: a
    # server sizes its KV pool from the memory it sees, which a neighbour's loading would skew.
    shared = [r for r in selected if not r.timing]
    first = shared[:1] if args.warm_first else []
    for row in first:
        one(row)
    with ThreadPoolExecutor(max(1, args.parallel)) as pool:
        list(pool.map(one, shared[len(first) :]))
    for row in selected:
        if row.timing:
            one(row)

    return recs, succ


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--rows", help="comma-separated row names (default: all)")
    p.add_argument(
        "--models", type=Path, default=Path("/tmp/e2e-models"), help="checkpoint cache"
    )
    p.add_argument(
        "--standins",
        action="store_true",
        help="the H200 harness: functional stand-ins + switches",
    )
    p.add_argument(
        "--upstream",
        type=Path,
        help="the pinned release's own python/ tree: served by the upstream rows "
        "(the GPU bundle's e2e.sh lays it out)",
    )
    p.add_argument(
        "--budget", type=float, default=1e9, help="start no row after this many seconds"
    )
    p.add_argument("--parallel", type=int, default=4, help="servers at a time")
    p.add_argument(
        "--no-warm-first",
        dest="warm_first",
        action="store_false",
        help="start every row at once instead of serving the first one alone "
        "(which fills the kernel caches the others then read)",
    )
    p.add_argument(
        "--sampled-requests",
        type=int,
        default=SAMPLED_REQUESTS,
        help="requests per sampled row (a smaller number is a smoke run: its tests are weaker)",
    )
    p.add_argument(
        "--profile",
        default="",
        help="comma-separated timing rows that also record their GPU "
        "kernels for one batch-1 request (torch profiler through /start_profile)",
    )
    p.add_argument(
        "--evaluate",
        type=Path,
        nargs="+",
        metavar="RAW",
        help="evaluate earlier runs' e2e-raw-<device>.json.gz again (no server is "
        "started): the checks recomputed from their tokens and logprobs; several "
        "sittings' files of one build are judged as one matrix",
    )
    p.add_argument(
        "--merge",
        type=Path,
        help="an earlier run's JSON (same build and device): its rows that "
        "this run does not serve are kept, so a matrix can be served in several sittings",
    )
    side_by_side.add_args(p)
    add_overwrite_arg(p)
    args = p.parse_args(argv)
    if args.side_by_side:
        return serve_side_by_side(args)

    t_start = time.monotonic()
    selected = [r for r in rows() if not args.rows or r.name in args.rows.split(",")]
    profiled = {name for name in args.profile.split(",") if name}
    unknown = sorted(profiled - {r.name for r in selected if r.timing})
    if unknown:
        p.error(
            f"--profile: {', '.join(unknown)} is not a timing row of this run "
            f"(timing rows: {', '.join(r.name for r in rows() if r.timing)})"
        )
    meta = {
        **build_provenance(device=device_name()),
        "standins": args.standins,
        "sampled_requests": args.sampled_requests,
    }
    # The machine that serves the rows: recorded with their tokens, kept by --evaluate elsewhere.
    served_by = build_provenance()
    if args.evaluate:
        meta, recs, succ, served_by = read_raws(args.evaluate)
        selected = [r for r in selected if r.name in recs]
    else:
        recs, succ = serve_all(args, selected, profiled, t_start, meta, served_by)
        write_raw(args.out, meta, succ, recs, served_by)
    report = {**meta, "rows": {}}
    out_json = args.out / f"e2e-{meta['device']}.json"
    for row in selected:
        rec = recs[row.name]
        if "skipped" in rec:
            report["rows"][row.name] = {"ok": None, **rec}
            continue
        evaluate(row, rec, recs, succ)
    for row in selected:
        rec = _public(recs[row.name])
        report["rows"][row.name] = rec
        if rec.get("ok") is False and not rec.get("expected_failure"):
            print(
                f"FAILED {row.name}: "
                + _failure_excerpt(rec, args.out / "e2e-logs" / f"{row.name}.log"),
                flush=True,
            )
    if args.merge:
        merge_rows(report, json.loads(args.merge.read_text()))
    done = [r for r in report["rows"].values() if r.get("ok") is not None]
    expected = [n for n, r in report["rows"].items() if r.get("expected_failure")]
    report["expected_failures"] = expected
    report["upstream_defects"] = defect_counts(selected, report["rows"])
    report["passed"] = sum(bool(r["ok"]) for r in done)
    report["failed"] = len(done) - report["passed"] - len(expected)
    out_json = write_result(
        out_json, report, overwrite=args.overwrite, produced_by=served_by
    )
    print(
        f"{report['passed']} passed, {report['failed']} failed, "
        f"{len(expected)} expected failures (upstream defects: {', '.join(expected)})"
    )
    return 0 if report["failed"] == 0 else 1


def defect_counts(selected: list[Row], rows_: dict) -> dict:
    """Per upstream defect: what it is, and over this run's upstream servers that could show it
    how many did (``flipped``), by checkpoint."""
    out = {}
    for name, defect in UPSTREAM_DEFECTS.items():
        by_model: dict = {}
        for row in selected:
            rec = rows_.get(row.name, {})
            if (
                row.upstream_defect != name
                or row.tree != "upstream"
                or "checks" not in rec
            ):
                continue
            seen = by_model.setdefault(row.model, {"servers": 0, "flipped": []})
            seen["servers"] += 1
            if rec.get("expected_failure"):
                seen["flipped"].append(row.name)
        out[name] = {"what": defect["what"], "by_checkpoint": by_model}
    return out


def harness_env(standins: bool) -> dict:
    env = {"PYTHONUNBUFFERED": "1"}
    if standins:
        env.update(HARNESS_ENV)
    return env


def serve_side_by_side(args) -> int:
    """``--side-by-side``: upstream and the fork timed side by side at full depth
    (``e2e.side_by_side``), with the matrix's harness, trees and provenance."""
    import sglang

    if args.upstream is None:
        raise SystemExit(
            "--side-by-side needs --upstream PATH (the pinned release's tree)"
        )
    trees = {
        "fork": Path(sglang.__file__).resolve().parents[1],
        "upstream": args.upstream,
    }
    meta = {
        **build_provenance(device=device_name()),
        "standins": args.standins,
        "upstream_tree": str(args.upstream),
    }
    return side_by_side.run(
        args, harness_env(args.standins), trees, meta["device"], meta
    )


def write_raw(
    out: Path, meta: dict, succ: list[int] | None, recs: dict, served_by: dict
) -> None:
    """The tokens and logprobs of every row served so far, for ``--evaluate``, with the
    provenance of the machine that served them (``served_by``)."""
    path = out / f"e2e-raw-{meta['device']}.json.gz"
    tmp = path.with_suffix(".tmp")
    with gzip.open(tmp, "wt") as f:
        json.dump(  # not a result: tokens, with the serving machine's provenance
            {"meta": meta, "provenance": served_by, "succ": succ, "rows": dict(recs)}, f
        )
    tmp.replace(path)


# What must agree between sittings judged or merged as one matrix.
SAME_RUN = ("fork_version", "device", "standins", "commit")


def served_by_of(raw: dict) -> dict:
    """The serving machine's provenance in a raw file; a file written before raw files carried
    it gives what its ``meta`` recorded (no harness commit: the result then fails the
    provenance check, it is not filled in with the evaluating machine's)."""
    block = raw.get("provenance")
    if isinstance(block, dict):
        return block
    return {k: raw["meta"][k] for k in FIELDS if k in raw["meta"]}


def read_raws(paths: list[Path]) -> tuple[dict, dict, list[int] | None, dict]:
    """One matrix from the raw files of several sittings of one build on one device (a row served
    in two of them: the later file's); refuses files of another build, device, harness commit or
    checkpoint. Returns the meta, the rows, the successor map and the serving machine's
    provenance (the first file's).
    """
    meta, recs, succ, served_by = None, {}, None, None
    for path in paths:
        with gzip.open(path, "rt") as f:
            raw = json.load(f)
        if meta is None:
            meta, succ, served_by = raw["meta"], raw["succ"], served_by_of(raw)
        for key in SAME_RUN:
            if raw["meta"].get(key) != meta.get(key):
                raise SystemExit(
                    f"--evaluate: {path} has {key} {raw['meta'].get(key)!r}, "
                    f"{paths[0]} has {meta.get(key)!r}"
                )
        if raw["succ"] is not None:
            if succ is not None and raw["succ"] != succ:
                raise SystemExit(f"--evaluate: {path} served another sample checkpoint")
            succ = raw["succ"]
        recs.update(raw["rows"])
    return meta, recs, succ, served_by


def merge_rows(report: dict, earlier: dict) -> None:
    """Keep ``earlier``'s rows that ``report`` did not serve; refuses another build or device (a
    row's comparisons are only meaningful within one build, device and harness commit).
    """
    for key in SAME_RUN:
        if earlier.get(key) != report.get(key):
            raise SystemExit(
                f"--merge: the earlier run's {key} is {earlier.get(key)!r}, this run's {report.get(key)!r}"
            )
    for name, rec in earlier["rows"].items():
        if name not in report["rows"] or report["rows"][name].get("ok") is None:
            report["rows"][name] = rec


def _failure_excerpt(rec: dict, log: Path, lines: int = 45) -> str:
    """What a failed row shows on the console: its checks and the end of its log, warnings left out."""
    summary = {k: v for k, v in rec.items() if k not in ("args", "fork_flags_line")}
    text = log.read_text(errors="replace").splitlines() if log.exists() else []
    text = [
        t for t in text if "warn" not in t.lower() and not t.lstrip().startswith("^")
    ]
    shown = json.dumps(summary)[:2000]  # not a result: console text
    return shown + "\n" + "\n".join(t[:300] for t in text[-lines:])


def _gen_device() -> str:
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


if __name__ == "__main__":
    sys.exit(main())
