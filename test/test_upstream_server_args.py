"""Upstream sglang's own invariants for server arguments, run against the fork (every fork flag
at its default): flags off must mean upstream's tests pass too.

The wheel ships no tests. These are vendored from upstream's repository (Apache-2.0,
https://github.com/sgl-project/sglang), ``test/registered/unit/server_args/``:
``test_server_args_namespaces.py`` (every field in one known namespace, each namespace reachable
through its ``get_<group>()`` accessor and read there, no accessor shadowed) and
``test_resolution_hook_registry.py`` (the overridable-hook whitelist and the ``run_hook`` call
sites of ``pipeline.py`` are the same set, no whitelisted step called bare, registration),
adapted to pytest (and to the pinned release, whose ServerArgs is a msgspec record); the assertions are
upstream's. The namespace list is upstream's locked
taxonomy, which the pinned release's ``fields/*.py`` declare exactly.
"""

from __future__ import annotations

import ast
import collections
import glob
import os
from pathlib import Path

import pytest

import sglang
from sglang.srt.arg_groups import pipeline as pipeline_module
from sglang.srt.arg_groups import resolution_hooks as hooks_module
from sglang.srt.arg_groups.arg_utils import namespace_of, record_fields
from sglang.srt.arg_groups.resolution_hooks import (
    _OVERRIDABLE_HOOKS,
    register_resolution_hook,
)
from sglang.srt.server_args import ServerArgs

# Upstream's locked taxonomy (test_server_args_namespaces.VALID_NAMESPACES).
VALID_NAMESPACES = {
    "parallel",
    "device",
    "model",
    "schedule",
    "memory",
    "spec",
    "lora",
    "mm",
    "disagg",
    "serving",
    "observability",
    "exec.kernel",
    "exec.moe",
    "exec.graph",
    "exec.comm",
    "exec.mamba",
    "exec.overlap",
    "exec.offload",
    "exec.dllm",
    "exec.deterministic",
    "exec.features",
}
SRT = Path(sglang.__file__).resolve().parent / "srt"


def _field_names() -> set[str]:
    return {
        f.name for f in record_fields(ServerArgs)
    }  # a msgspec record, not a dataclass


# ---------------------------------------------------------------------------- namespaces


def test_every_field_has_a_namespace():
    assert sorted(_field_names() - set(namespace_of(ServerArgs))) == []


def test_all_namespaces_are_known():
    nsmap = namespace_of(ServerArgs)
    bad = {f: p for f, p in nsmap.items() if p not in VALID_NAMESPACES}
    assert bad == {}, f"unknown namespace paths (typo or new domain?): {bad}"


def test_namespace_map_covers_all_fields():
    nsmap = namespace_of(ServerArgs)
    assert set(nsmap) == _field_names()
    assert len(nsmap) >= 440


def _context_accessors() -> set[str]:
    tree = ast.parse((SRT / "runtime_context.py").read_text(encoding="utf-8-sig"))
    return {
        n.name
        for n in tree.body
        if isinstance(n, ast.FunctionDef)
        and (n.name.startswith("get_") or n.name.startswith("configured_"))
    }


def test_every_namespace_is_reachable_through_its_accessor():
    """Each published group ``g`` is read as ``get_g()...``: a group without that accessor
    in runtime_context publishes leaves nothing can read."""
    groups = {p.split(".")[0] for p in namespace_of(ServerArgs).values()}
    assert (
        sorted(f"get_{g}" for g in groups if f"get_{g}" not in _context_accessors())
        == []
    )


def test_the_readers_agree_with_the_namespace_metadata():
    mapping = namespace_of(ServerArgs)
    accessors = {
        f"get_{group}" for group in {p.split(".")[0] for p in mapping.values()}
    }
    sites, disagreements = 0, []
    for path in sorted(SRT.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8-sig"))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            chain, cursor = [], node
            while isinstance(cursor, ast.Attribute):
                chain.append(cursor.attr)
                cursor = cursor.value
            if not (
                isinstance(cursor, ast.Call)
                and isinstance(cursor.func, ast.Name)
                and cursor.func.id in accessors
            ):
                continue
            chain.reverse()
            field = chain[-1]
            if field not in mapping:
                continue
            sites += 1
            read = [cursor.func.id[len("get_") :]] + chain[:-1]
            if mapping[field].split(".") != read:
                disagreements.append(
                    f"{path.relative_to(SRT)}:{node.lineno} reads {'.'.join(read)}.{field}, "
                    f"metadata says {mapping[field]}.{field}"
                )
    assert disagreements == []
    assert sites > 1500, f"only {sites} bag reads were matched; the scan broke"


def test_no_module_shadows_a_bag_accessor():
    accessors = _context_accessors()
    assert len(accessors) > 20, "the accessor derivation broke"
    shadowed = []
    for path in sorted(SRT.rglob("*.py")):
        if path.name == "runtime_context.py":
            continue
        bindings = collections.defaultdict(set)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8-sig"))):
            if isinstance(node, ast.ImportFrom):
                origin = node.module or ""
                kind = (
                    "context"
                    if origin.endswith("runtime_context")
                    else f"{origin or '.'}"
                )
                for alias in node.names:
                    bindings[alias.asname or alias.name].add((kind, node.lineno))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    bindings[(alias.asname or alias.name).split(".")[0]].add(
                        ("import", node.lineno)
                    )
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                bindings[node.name].add(("def", node.lineno))
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        bindings[target.id].add(("assign", node.lineno))
        for name, where in bindings.items():
            kinds = {kind for kind, _ in where}
            if name in accessors and "context" in kinds and kinds - {"context"}:
                shadowed.append(f"{path.relative_to(SRT)}: {name}")
    assert shadowed == []


# ---------------------------------------------------------------------------- resolution hooks


def _run_hook_call_targets() -> set[str]:
    tree = ast.parse(Path(pipeline_module.__file__).read_text())
    return {
        node.args[0].id
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "run_hook"
        and node.args
        and isinstance(node.args[0], ast.Name)
    }


def test_every_whitelisted_hook_has_a_call_site():
    called = _run_hook_call_targets()
    assert (
        sorted(_OVERRIDABLE_HOOKS - called),
        sorted(called - _OVERRIDABLE_HOOKS),
    ) == ([], [])


def test_no_bare_calls_to_a_whitelisted_hook_anywhere_in_arg_groups():
    hook_dir = os.path.dirname(pipeline_module.__file__)
    bypasses = []
    for path in sorted(glob.glob(os.path.join(hook_dir, "**", "*.py"), recursive=True)):
        if os.path.basename(path) in ("pipeline.py", "resolution_hooks.py"):
            continue
        for node in ast.walk(ast.parse(Path(path).read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in _OVERRIDABLE_HOOKS
            ):
                bypasses.append(
                    f"{os.path.relpath(path, hook_dir)}:{node.lineno} calls {node.func.id}(...)"
                )
    assert bypasses == []


@pytest.fixture
def empty_registry(monkeypatch):
    monkeypatch.setattr(hooks_module, "_HOOKS", {})


def test_every_pipeline_step_can_be_registered(empty_registry):
    for name in sorted(_run_hook_call_targets()):
        register_resolution_hook(name)(
            lambda server_args, previous: previous(server_args)
        )


def test_an_unlisted_name_is_refused_at_registration(empty_registry):
    with pytest.raises(ValueError, match="not an overridable resolution hook"):
        register_resolution_hook("handle_something_nobody_whitelisted")(
            lambda sa, prev: None
        )


def test_an_override_reaches_a_real_resolution(empty_registry, llama_config):
    """Upstream's end-to-end proof, on a config-only model directory."""
    from conftest import resolve_server_args

    from sglang.srt.arg_groups.overrides import declare_resolution, resolution_result

    @register_resolution_hook("handle_cuda_graph_config")
    def _mark_it(server_args, previous):
        previous(server_args)
        declare_resolution(server_args, "test_plugin", random_seed=999)

    sa = resolve_server_args(llama_config)
    assert resolution_result(sa, "random_seed") == 999
    assert resolution_result(sa, "chunked_prefill_size") is not None
