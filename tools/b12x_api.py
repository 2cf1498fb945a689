#!/usr/bin/env python3
"""Signatures of the b12x functions and types the fork calls, read from the pinned b12x wheel.

b12x's public API resolves lazily into modules that import cuda-python and the CuTe DSL, which a
CPU machine (CI) does not have, so the contract is read from the wheel's sources with ``ast``
instead of imported. ``test/data/b12x-api-<version>.json`` is this tool's output for the pinned
wheel (sha256 in ``sglang.srt.utils.b12x_pin``); ``test/test_b12x_contract.py`` checks every
b12x call of the fork against it, and (marked slow) fetches the wheel again and regenerates it.

  python3 tools/b12x_api.py [--wheel PATH] [--out test/data/b12x-api-1.5.1.json]
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VERSION = "1.5.1"
SHA256 = "8731e23571d8d45db26d78e7699ec0b23e7ba20b52487adf8c1063c8d8b53a3d"
WHEEL = f"b12x-{VERSION}-py3-none-any.whl"

# Name in the fork's calls -> (file in the wheel, qualified name there).
TARGETS = {
    # moe.fused_moe: the public functions dispatch to these with the same keywords
    "fused_moe.plan_weights": ("b12x/moe/fused_moe/api.py", "_canonical_plan_weights"),
    "fused_moe.prepare_weights": (
        "b12x/moe/fused_moe/api.py",
        "_canonical_prepare_weights",
    ),
    "fused_moe.plan_execution": (
        "b12x/moe/fused_moe/api.py",
        "_canonical_plan_execution",
    ),
    "fused_moe.bind": ("b12x/moe/fused_moe/api.py", "bind"),
    "fused_moe.run": ("b12x/moe/fused_moe/api.py", "run"),
    "fused_moe.PackedSource": ("b12x/moe/fused_moe/source.py", "PackedSource"),
    "fused_moe.PackedSourceFormat": (
        "b12x/moe/fused_moe/source.py",
        "PackedSourceFormat",
    ),
    "fused_moe.W13Layout": ("b12x/moe/fused_moe/source.py", "W13Layout"),
    "fused_moe.ActivationSpec": ("b12x/moe/fused_moe/planning.py", "ActivationSpec"),
    "fused_moe.ActivationMode": ("b12x/moe/fused_moe/planning.py", "ActivationMode"),
    "fused_moe.MoEGeometry": ("b12x/moe/fused_moe/planning.py", "MoEGeometry"),
    "fused_moe.PackedWeights": ("b12x/moe/fused_moe/weights.py", "PackedWeights"),
    "fused_moe.ExecutionCapacity": (
        "b12x/moe/fused_moe/execution.py",
        "ExecutionCapacity",
    ),
    "fused_moe.RoutingSpec": ("b12x/moe/fused_moe/execution.py", "RoutingSpec"),
    "fused_moe.MoeDecodeConfig": ("b12x/moe/fused_moe/_tuning.py", "MoeDecodeConfig"),
    # the prepared MoE state's bind (what fused_moe.bind forwards its keywords to)
    "fused_moe.state.bind": ("b12x/moe/fused_moe/_impl.py", "TPMoEScratchPlan.bind"),
    # preparation
    "preparation.PreparationSession": (
        "b12x/preparation/session.py",
        "PreparationSession.__init__",
    ),
    "preparation.PreparationSession.prepare": (
        "b12x/preparation/session.py",
        "PreparationSession.prepare",
    ),
    "preparation.PreparedCall": ("b12x/preparation/types.py", "PreparedCall"),
    "preparation.require_prepared": ("b12x/preparation/types.py", "require_prepared"),
    "preparation.Plan.request": ("b12x/preparation/types.py", "Plan.request"),
    "preparation.CompositePlan.request": (
        "b12x/preparation/types.py",
        "_CompositePlan.request",
    ),
    # gemm.block_fp8_linear
    "block_fp8_linear.Caps": (
        "b12x/gemm/_shared/block_fp8.py",
        "BlockFP8LinearScratchCaps",
    ),
    "block_fp8_linear.plan": ("b12x/gemm/block_fp8_linear/_preparation.py", "plan"),
    "block_fp8_linear.pack_weight": (
        "b12x/gemm/_shared/block_fp8.py",
        "pack_block_fp8_linear_weight_mxfp8",
    ),
    "block_fp8_linear.run": (
        "b12x/gemm/_shared/block_fp8.py",
        "block_fp8_linear_mxfp8",
    ),
    "block_fp8_linear.state.run": (
        "b12x/gemm/block_fp8_linear/_preparation.py",
        "_BlockFP8ExecutionState.run",
    ),
    # comm.roce
    "roce.AllReduce": (
        "b12x/comm/roce/roce_oneshot.py",
        "RoceOneshotAllReduce.__init__",
    ),
    "roce.AllReduce.from_exchange_group": (
        "b12x/comm/roce/roce_oneshot.py",
        "RoceOneshotAllReduce.from_exchange_group",
    ),
    "roce.AllReduce.should_all_gather": (
        "b12x/comm/roce/roce_oneshot.py",
        "RoceOneshotAllReduce.should_all_gather",
    ),
    "roce.AllReduce.all_gather": (
        "b12x/comm/roce/roce_oneshot.py",
        "RoceOneshotAllReduce.all_gather",
    ),
    "roce.AllReduce.capture": (
        "b12x/comm/roce/roce_oneshot.py",
        "RoceOneshotAllReduce.capture",
    ),
    "roce.state.all_gather": (
        "b12x/comm/roce/_preparation.py",
        "_PreparedRoce.all_gather",
    ),
    "roce.plan": ("b12x/comm/roce/_preparation.py", "plan"),
    "roce.query_from_runtime": ("b12x/comm/roce/_preparation.py", "query_from_runtime"),
}
# Lazy public surfaces: the names each package exports (its META.entry_points).
PACKAGES = {
    "fused_moe": "b12x/moe/fused_moe/__init__.py",
    "block_fp8_linear": "b12x/gemm/block_fp8_linear/__init__.py",
    "roce": "b12x/comm/roce/__init__.py",
}


def _find(tree: ast.Module, qualname: str):
    node = tree
    for part in qualname.split("."):
        for child in ast.iter_child_nodes(node):
            if (
                isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                and child.name == part
            ):
                node = child
                break
        else:
            return None
    return node


def _describe(node) -> dict:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        a = node.args
        return {
            "kind": "function",
            "positional": [p.arg for p in a.posonlyargs + a.args],
            "keyword_only": [p.arg for p in a.kwonlyargs],
            "var_positional": a.vararg is not None,
            "var_keyword": a.kwarg is not None,
        }
    bases = [ast.unparse(b) for b in node.bases]
    if any("Enum" in b for b in bases):
        members = [
            t.id
            for st in node.body
            if isinstance(st, ast.Assign)
            for t in st.targets
            if isinstance(t, ast.Name)
        ]
        return {"kind": "enum", "members": members}
    fields = [
        st.target.id
        for st in node.body
        if isinstance(st, ast.AnnAssign)
        and isinstance(st.target, ast.Name)
        and "ClassVar" not in ast.unparse(st.annotation)
    ]
    return {"kind": "dataclass", "fields": fields}


def _entry_points(tree: ast.Module) -> list[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "OpMeta":
            for kw in node.keywords:
                if kw.arg == "entry_points":
                    return [e.value for e in kw.value.elts]
    return []


def extract(wheel: Path) -> dict:
    sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
    out = {"wheel": wheel.name, "sha256": sha, "api": {}, "entry_points": {}}
    with zipfile.ZipFile(wheel) as z:
        for name, (path, qual) in TARGETS.items():
            node = _find(ast.parse(z.read(path).decode()), qual)
            out["api"][name] = (
                None if node is None else {"at": f"{path}:{qual}", **_describe(node)}
            )
        for pkg, path in PACKAGES.items():
            out["entry_points"][pkg] = _entry_points(ast.parse(z.read(path).decode()))
    return out


def fetch_wheel(dest: Path) -> Path:
    """The pinned wheel from PyPI (pip's cache), its sha256 checked."""
    path = dest / WHEEL
    if not path.exists() or hashlib.sha256(path.read_bytes()).hexdigest() != SHA256:
        dest.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                f"b12x=={VERSION}",
                "-d",
                str(dest),
            ],
            check=True,
        )
    got = hashlib.sha256(path.read_bytes()).hexdigest()
    if got != SHA256:
        raise SystemExit(f"{path}: sha256 {got}, pinned {SHA256}")
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--wheel",
        type=Path,
        help=f"a local {WHEEL} (default: fetched into build/b12x/)",
    )
    p.add_argument(
        "--out", type=Path, default=REPO / "test" / "data" / f"b12x-api-{VERSION}.json"
    )
    a = p.parse_args(argv)
    wheel = a.wheel or fetch_wheel(REPO / "build" / "b12x")
    snap = extract(wheel)
    missing = [k for k, v in snap["api"].items() if v is None]
    if missing:
        raise SystemExit(f"not found in {wheel.name}: {', '.join(missing)}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(snap, indent=1) + "\n")
    print(f"wrote {a.out} ({len(snap['api'])} signatures)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
