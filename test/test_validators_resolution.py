"""Every validator of the series refuses through upstream's real argument resolution.

Each feature's ``validate_<feature>`` reads its own fields and upstream's by name. A table test
with a ``SimpleNamespace`` keeps passing when upstream renames a field the validator reads (the
stand-in still has the old name), so here each validator is reached the way a server reaches
it: a real ``ServerArgs`` resolved by ``resolve_once`` (``check_server_args`` after it, as
``Engine`` calls it, for the checks that live there), on a small Llama config where every
flag below must be refused, by that validator (its frame is on the traceback). A renamed
upstream field then raises ``AttributeError`` instead of the expected refusal, and fails.

The validators are found by reading our modules (every ``def validate_*`` in a file the series
owns): one that has no case here fails ``test_every_validator_has_a_resolution_case``.
"""

from __future__ import annotations

import ast
import inspect
import traceback

import pytest
from conftest import REPO

# validator -> (server arguments that it must refuse on a Llama target, message, stage)
CASES = {
    "validate_verify_cap": (
        {"speculative_dspark_verify_cap": "3"},
        "needs --speculative-algorithm DSPARK",
        "resolve",
    ),
    "validate_fence_accept_results": (
        {"speculative_dspark_fence_accept_results": True},
        "applies to --speculative-algorithm DSPARK only",
        "resolve",
    ),
    "validate_draft_temperature_scale": (
        {"speculative_dspark_draft_temperature_scale": 0.8},
        "DSPARK only",
        "resolve",
    ),
    "validate_draft_head_fp8": (
        {"speculative_dspark_draft_head_fp8": True},
        "applies to --speculative-algorithm DSPARK only",
        "resolve",
    ),
    "validate_loop_abort": (
        {"loop_abort_min_tokens": 600},
        "without --enable-loop-abort would do nothing",
        "resolve",
    ),
    "validate_thinking_aliases": (
        {"enable_thinking_aliases": True},
        "--reasoning-parser",
        "resolve",
    ),
    "validate_weight_loader_disable_async_load": (
        {"weight_loader_disable_async_load": True},
        "the LlamaForCausalLM loader does not copy weights",
        "resolve",
    ),
    "validate_flashinfer_autotune_keep": (
        {"flashinfer_autotune_keep_cache": True},
        "--flashinfer-autotune-keep-cache would do nothing",
        "check",
    ),
    "validate_fast_load": (
        {"weight_loader_fast_load_num_threads": 4},
        "does nothing without --weight-loader-fast-load",
        "resolve",
    ),
    "validate_hc_fused_stats": (
        {"dsv4_hc_fused_stats": "auto"},
        "this model is LlamaForCausalLM",
        "resolve",
    ),
    "validate_engram_prefetch": (
        {"engram_prefetch": "on"},
        r"this model \(LlamaForCausalLM\) has no Engram layers",
        "resolve",
    ),
    "validate_engram_row_store": (
        {"engram_row_store_cache_gib": 4.0},
        "does nothing without --engram-row-store-dir",
        "resolve",
    ),
    "validate_b12x_moe": (
        {"moe_runner_backend": "b12x"},
        "--moe-runner-backend b12x refused",
        "resolve",
    ),
    "validate_triton_mxfp4_moe": (
        {"moe_runner_backend": "triton_mxfp4"},
        "the target is LlamaForCausalLM; only DeepseekV4ForCausalLM",
        "resolve",
    ),
    "validate_block_fp8_mxfp8_backend": (
        {"block_fp8_mxfp8_backend": "b12x"},
        "not 32x32 ue8m0 block-fp8",
        "resolve",
    ),
    "validate_b12x_roce_all_gather": (
        {"enable_b12x_roce_all_gather": True},
        "does nothing with --tp 1",
        "resolve",
    ),
    "validate_engram_fused_all_reduce": (
        {"engram_fused_all_reduce": True},
        "does nothing at --tp-size 1",
        "resolve",
    ),
    "validate_replicated_linear_split": (
        {"replicated_linear_split": "wq_a"},
        "does nothing with --tp 1",
        "resolve",
    ),
    "validate_wo_a_fp8_twin": (
        {"dsv4_wo_a_fp8_twin": "small"},
        "the target is LlamaForCausalLM",
        "resolve",
    ),
}

# validator -> (what its refusal above must advise, the arguments with that advice applied):
# a refusal names the flag and what it found, and says what works; applied, it resolves.
ADVICE = {
    "validate_verify_cap": ("drop the flag", {}),
    "validate_fence_accept_results": ("drop the flag", {}),
    "validate_draft_temperature_scale": ("drop the flag", {}),
    "validate_draft_head_fp8": ("drop the flag", {}),
    "validate_loop_abort": (
        "add --enable-loop-abort",
        {"loop_abort_min_tokens": 600, "enable_loop_abort": True},
    ),
    "validate_thinking_aliases": (
        "set --reasoning-parser to the served model's",
        {"enable_thinking_aliases": True, "reasoning_parser": "deepseek-v4"},
    ),
    "validate_weight_loader_disable_async_load": ("drop the flag", {}),
    "validate_flashinfer_autotune_keep": ("drop the flag", {}),
    "validate_fast_load": (
        "add --weight-loader-fast-load",
        {"weight_loader_fast_load_num_threads": 4, "weight_loader_fast_load": True},
    ),
    "validate_hc_fused_stats": (
        "use --dsv4-hc-fused-stats off",
        {"dsv4_hc_fused_stats": "off"},
    ),
    "validate_engram_prefetch": (
        "use --engram-prefetch off",
        {"engram_prefetch": "off"},
    ),
    "validate_engram_row_store": ("set both or neither", {}),
    "validate_b12x_moe": ("elsewhere drop --moe-runner-backend b12x", {}),
    "validate_triton_mxfp4_moe": (
        "use --moe-runner-backend auto",
        {"moe_runner_backend": "auto"},
    ),
    "validate_block_fp8_mxfp8_backend": ("drop the flag", {}),
    "validate_b12x_roce_all_gather": ("drop the flag", {}),
    "validate_engram_fused_all_reduce": ("drop the flag", {}),
    "validate_replicated_linear_split": (
        "use --replicated-linear-split off",
        {"replicated_linear_split": "off"},
    ),
    "validate_wo_a_fp8_twin": (
        "use --dsv4-wo-a-fp8-twin off",
        {"dsv4_wo_a_fp8_twin": "off"},
    ),
}

# More refusals whose advice is a value: (arguments, the advice, the arguments with it applied).
VALUE_ADVICE = [
    (
        {"enable_loop_abort": True, "loop_abort_min_tokens": 1},
        "use --loop-abort-min-tokens >= 384)",
        {"enable_loop_abort": True, "loop_abort_min_tokens": 384},
    ),
    (
        {"enable_loop_abort": True, "loop_abort_min_tokens": 30},
        "or --loop-abort-max-period <= 10)",
        {
            "enable_loop_abort": True,
            "loop_abort_min_tokens": 30,
            "loop_abort_max_period": 10,
        },
    ),
    (
        {"weight_loader_fast_load": True, "weight_loader_disable_mmap": True},
        "drop one of the two",
        {"weight_loader_fast_load": True},
    ),
    (
        {"weight_loader_fast_load": True, "load_format": "pt"},
        "use --load-format auto",
        {"weight_loader_fast_load": True, "load_format": "auto"},
    ),
]

# A refusal says what to do: each ValueError a validator raises holds one of these words.
ADVICE_WORDS = ("drop", "use ", "add ", "set ", "unset", "create", "install")


def _validators() -> dict[str, str]:
    """validator name -> the module of ours that defines it (every series patch's files)."""
    from forklib.series import load_series

    found = {}
    for patch in load_series():
        for own in patch.owns:
            if not own.endswith(".py"):
                continue
            tree = ast.parse((REPO / own).read_text())
            for node in tree.body:
                if isinstance(node, ast.FunctionDef) and node.name.startswith(
                    "validate_"
                ):
                    module = own[len("python/") : -len(".py")].replace("/", ".")
                    found[node.name] = module
    return found


def test_every_validator_has_a_resolution_case():
    assert sorted(set(_validators()) - set(CASES)) == []


def test_validators_take_the_server_arguments():
    """One shape: ``validate_<feature>(server_args)``, the fields read by name inside."""
    import importlib

    shapes = {}
    for name, module in _validators().items():
        params = list(
            inspect.signature(getattr(importlib.import_module(module), name)).parameters
        )
        shapes[name] = params
    assert {n: p for n, p in shapes.items() if p != ["server_args"]} == {}


@pytest.mark.parametrize("name", sorted(CASES))
def test_refused_through_real_resolution(name, llama_config):
    from conftest import resolve_server_args

    if name not in _validators():
        pytest.skip(f"{name}: its patch is not in the series")
    kwargs, message, stage = CASES[name]
    with pytest.raises(ValueError, match=message) as info:
        sa = resolve_server_args(llama_config, **kwargs)
        if stage == "check":
            sa.check_server_args()
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert name in frames, f"refused, but not by {name}: {frames}"


def _flags(kwargs: dict) -> list[str]:
    return ["--" + name.replace("_", "-") for name in kwargs]


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_advised_change_is_accepted(name, llama_config):
    """The refusal names a flag it was given and says what works; done, resolution passes."""
    from conftest import resolve_server_args

    if name not in _validators():
        pytest.skip(f"{name}: its patch is not in the series")
    kwargs, _, stage = CASES[name]
    advice, fixed = ADVICE[name]
    with pytest.raises(ValueError) as info:
        sa = resolve_server_args(llama_config, **kwargs)
        if stage == "check":
            sa.check_server_args()
    message = str(info.value)
    assert any(flag in message for flag in _flags(kwargs)), message
    assert advice in message
    sa = resolve_server_args(llama_config, **fixed)
    if stage == "check":
        sa.check_server_args()


@pytest.mark.parametrize("kwargs, advice, fixed", VALUE_ADVICE)
def test_an_advised_value_is_accepted(kwargs, advice, fixed, llama_config):
    from conftest import resolve_server_args

    with pytest.raises(ValueError) as info:
        resolve_server_args(llama_config, **kwargs)
    assert advice in str(info.value)
    resolve_server_args(llama_config, **fixed)


def test_every_refusal_says_what_to_do():
    """Read from the source: every ``raise ValueError(...)`` in a ``validate_*`` names a
    change (the cases above run one per validator; this covers the branches Llama skips).
    """
    silent = []
    for name, module in _validators().items():
        path = REPO / "python" / (module.replace(".", "/") + ".py")
        fn = next(
            n
            for n in ast.parse(path.read_text()).body
            if isinstance(n, ast.FunctionDef) and n.name == name
        )
        for node in ast.walk(fn):
            if not (
                isinstance(node, ast.Raise)
                and isinstance(node.exc, ast.Call)
                and getattr(node.exc.func, "id", "") == "ValueError"
            ):
                continue
            text = "".join(
                c.value
                for c in ast.walk(node.exc)
                if isinstance(c, ast.Constant) and isinstance(c.value, str)
            )
            if not any(word in text for word in ADVICE_WORDS):
                silent.append(f"{path.name}:{node.lineno}: {text[:80]}")
    assert silent == []


def test_the_advice_check_can_fail():
    """Negative control for the word check: a bare refusal holds none of the words."""
    assert not any(
        w in "--x 3 does nothing without --speculative-algorithm DSPARK"
        for w in ADVICE_WORDS
    )


def _parser_calls_outside_resolution(sources: dict[str, str]) -> list[str]:
    """``file:function:parser`` for each call of a type parser (a ``parse_*`` of our modules)
    from a function that is neither a parser nor a validator (``validate_*``, ``handle_*``).
    """
    trees = {path: ast.parse(text) for path, text in sources.items()}
    parsers = {
        n.name
        for tree in trees.values()
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef) and n.name.startswith("parse_")
    }
    found = []
    for path, tree in trees.items():
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef) or fn.name.startswith(
                ("parse_", "validate_", "handle_")
            ):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Call):
                    name = getattr(node.func, "id", None) or getattr(
                        node.func, "attr", None
                    )
                    if name in parsers:
                        found.append(f"{path}:{fn.name}:{name}")
    return found


def test_each_flag_is_parsed_once_by_its_type_parser():
    """A flag's text is parsed by its type parser (argparse), or for an ``Engine(...)`` keyword
    by its validator, which declares the parsed value (``sglang.fork.parsed_flag``); what is
    built from the published value (a layer, the scheduler's detector, a model's feature)
    never parses it again. Read from every module the series owns."""
    from forklib.series import load_series

    sources = {
        own: (REPO / own).read_text()
        for patch in load_series()
        for own in patch.owns
        if own.endswith(".py")
    }
    assert _parser_calls_outside_resolution(sources) == []


def test_the_parse_once_check_can_fail():
    """Negative control: a builder that parses the flag again is found."""
    source = (
        "def parse_mode(v):\n    return v\n\n"
        "def build_feature(value):\n    return parse_mode(value)\n"
    )
    assert _parser_calls_outside_resolution({"m.py": source}) == [
        "m.py:build_feature:parse_mode"
    ]


@pytest.mark.parametrize(
    "field, given, parsed",
    [
        ("dsv4_hc_fused_stats", " OFF ", "off"),
        ("engram_prefetch", "Off", "off"),
    ],
)
def test_an_engine_keyword_is_published_parsed(field, given, parsed, llama_config):
    """``Engine(...)`` skips argparse: the validator declares the parsed value, which every
    later reader sees."""
    from conftest import resolve_server_args

    from sglang.srt.arg_groups.overrides import resolving_view

    if field not in _fields():
        pytest.skip(f"{field}: its patch is not in the series")
    sa = resolve_server_args(llama_config, **{field: given})
    assert getattr(resolving_view(sa), field) == parsed
    assert ("parsed_flag", {field: parsed}) in sa._resolved_overrides


def _fields() -> set[str]:
    from sglang.srt.server_args import ServerArgs

    return set(ServerArgs.__struct_fields__)
