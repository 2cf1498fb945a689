"""The b12x functions and types the fork calls exist in the pinned release with the keywords we
pass. b12x's public API loads cuda-python and the CuTe DSL on first use, which CI's CPU machine
does not have, so its signatures are read from the pinned wheel's sources with ``ast``
(tools/b12x_api.py) into test/data/b12x-api-1.5.1.json, with the wheel's sha256. The fast tests
check every b12x call in our modules against that file; the slow ones fetch the wheel (2.4 MB,
pip's cache), check its sha256, regenerate the file and compare, and run b12x's own validator on
the MoE plans we pin (its _tuning module imports without a GPU)."""

from __future__ import annotations

import ast
import json
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SNAP = json.loads((REPO / "test" / "data" / "b12x-api-1.5.1.json").read_text())
sys.path.insert(0, str(REPO / "tools"))
import b12x_api  # noqa: E402

# Our modules that call b12x, and how a receiver name in them maps to the snapshot.
MODULES = [
    "python/sglang/srt/layers/quantization/mxfp4_b12x_moe.py",
    "python/sglang/srt/layers/quantization/b12x_block_fp8.py",
    "python/sglang/srt/distributed/device_communicators/b12x_roce_gather.py",
]
RECEIVERS = {
    "fused_moe": "fused_moe",
    "block_fp8_linear": "block_fp8_linear",
    "roce": "roce",
}
METHOD_CALLS = {  # receiver.attr in our code -> snapshot key
    "state.bind": "fused_moe.state.bind",
    "state.run": "block_fp8_linear.state.run",
    "session.prepare": "preparation.PreparationSession.prepare",
    "PreparationSession": "preparation.PreparationSession",
    "PreparedCall": "preparation.PreparedCall",
    "require_prepared": "preparation.require_prepared",
    "self.runtime.should_all_gather": "roce.AllReduce.should_all_gather",
    "self.runtime.all_gather": "roce.AllReduce.all_gather",
    "self.runtime.capture": "roce.AllReduce.capture",
    "self.session.prepare": "preparation.PreparationSession.prepare",
    "self.plan.request": "preparation.Plan.request",
    "state.all_gather": "roce.state.all_gather",
}


def module_source(rel: str) -> str:
    """Our module as the series builds it (build/tree when assembled, else the checkout)."""
    for root in (REPO / "build" / "tree", REPO):
        p = root / rel
        if p.exists():
            return p.read_text()
    pytest.skip(f"{rel} not present")


def b12x_calls(src: str):
    """(dotted callee, keywords, has **kwargs, line) of each call whose receiver is b12x's."""
    for node in ast.walk(ast.parse(src)):
        if not isinstance(node, ast.Call):
            continue
        name = ast.unparse(node.func)
        kws = [k.arg for k in node.keywords if k.arg is not None]
        star = any(k.arg is None for k in node.keywords)
        head = name.split(".")[0]
        if (
            head in RECEIVERS
            or name in METHOD_CALLS
            or name.endswith(".request")
            and head in ("decl", "plan")
        ):
            yield name, kws, star, node.lineno


def accepted(entry) -> set[str]:
    if entry["kind"] == "function":
        return set(entry["positional"]) | set(entry["keyword_only"])
    if entry["kind"] == "dataclass":
        return set(entry["fields"])
    return set()


def test_snapshot_is_of_the_pinned_wheel():
    from sglang.srt.utils import b12x_pin

    assert SNAP["sha256"] == b12x_pin.B12X_WHEEL_SHA256 == b12x_api.SHA256
    assert SNAP["wheel"] == b12x_pin.B12X_WHEEL == b12x_api.WHEEL
    assert b12x_pin.B12X_VERSION == b12x_api.VERSION
    assert all(v is not None for v in SNAP["api"].values())


@pytest.mark.parametrize("rel", MODULES)
def test_every_b12x_call_matches_the_pinned_signatures(rel):
    seen = 0
    for name, kws, star, line in b12x_calls(module_source(rel)):
        where = f"{rel}:{line} {name}"
        parts = name.split(".")
        if name in METHOD_CALLS:
            key = METHOD_CALLS[name]
        elif parts[0] in ("decl", "plan"):
            key = (
                "preparation.CompositePlan.request"
                if "prepare_calls" in kws
                else "preparation.Plan.request"
            )
        else:
            pkg = RECEIVERS[parts[0]]
            assert (
                parts[1] in SNAP["entry_points"][pkg]
            ), f"{where}: b12x.{pkg} does not export {parts[1]}"
            key = (
                f"{pkg}.{parts[1]}" if len(parts) == 2 else ".".join([pkg, *parts[1:]])
            )
        assert (
            key in SNAP["api"]
        ), f"{where}: no pinned signature for {key} (add it to tools/b12x_api.py)"
        entry = SNAP["api"][key]
        if (
            name == "fused_moe.bind"
        ):  # bind(plan, **kw) forwards kw to the prepared state's bind
            entry = SNAP["api"]["fused_moe.state.bind"]
        unknown = set(kws) - accepted(entry)
        assert not unknown and not (
            star and name != "fused_moe.MoeDecodeConfig"
        ), f"{where}: keywords {sorted(unknown)} not in b12x {b12x_api.VERSION} ({entry['at']})"
        seen += 1
    assert seen


def test_enum_members_we_use_exist():
    api = SNAP["api"]
    assert "MXFP4_E8M0_K32" in api["fused_moe.PackedSourceFormat"]["members"]
    assert "W13" in api["fused_moe.W13Layout"]["members"]
    assert "A8" in api["fused_moe.ActivationMode"]["members"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    try:
        return b12x_api.fetch_wheel(REPO / "build" / "b12x")
    except Exception as e:  # noqa: BLE001 - the failure names what went wrong
        pytest.fail(f"fetching the pinned b12x wheel failed: {e}")


@pytest.mark.slow
def test_snapshot_regenerates_from_the_wheel(wheel):
    assert b12x_api.extract(wheel) == SNAP


@pytest.mark.slow
def test_b12x_validator_accepts_our_pins_and_refuses_64_row_tiles(wheel, tmp_path):
    """b12x 1.5.1's own validate_moe_decode_config on the 576-wide V4.1-Flash experts (TP4):
    our <= 8-row pin is valid; 64-row tiles from 2048 rows (what the GB10 line ran before this
    fork) are not expressible.
    """
    with zipfile.ZipFile(wheel) as z:
        z.extractall(tmp_path)
    sys.path.insert(0, str(tmp_path))
    try:
        from b12x.moe.fused_moe import _tuning as t
        from b12x.preparation import FrozenMapping

        from sglang.srt.layers.quantization.mxfp4_b12x_moe import pinned_config

        def query(rows):
            return t.MoeDecodeQuery(
                quant_mode="w4a8_mx",
                quant_modes=("w4a8_mx",),
                source_format="fp4_e8m0_k32",
                activation="silu",
                io_dtype="bfloat16",
                num_experts=384,
                hidden_size=5120,
                intermediate_size=576,
                top_k=6,
                num_tokens=rows,
                routed_rows=rows * 6,
                route_num_experts=0,
                route_logits_dtype=None,
                apply_router_weight_on_input=False,
                collect_activation_amax=False,
                deterministic_output=None,
                swiglu_limit=10.0,
                swiglu_alpha=None,
                swiglu_beta=None,
                w13_layout="w13",
                weight_layouts=("mma_packed",),
                w4a16_weight_layout=None,
                w4a16_scale_format=None,
                w4a16_block_size_m=None,
                fast_math=False,
                numerical_recipe=None,
                controls=FrozenMapping(),
            )

        for rows in (1, 2, 4, 8):
            t.validate_moe_decode_config(
                query(rows), t.MoeDecodeConfig(**pinned_config(rows, 576)), None
            )
        tile64 = dict(pinned_config(1, 576), dynamic_tile_m=64)
        with pytest.raises(
            ValueError,
            match="compact N64 W4A8 dynamic execution requires grouped M16 routing",
        ):
            t.validate_moe_decode_config(query(2048), t.MoeDecodeConfig(**tile64), None)
    finally:
        sys.path.remove(str(tmp_path))
        for m in [m for m in sys.modules if m == "b12x" or m.startswith("b12x.")]:
            del sys.modules[m]
