"""--replicated-linear-split: the flag, and the split over real gloo ranks on CPU.

Two and three spawned gloo ranks (one process group each, all scenarios in one run) split real
ReplicatedLinear layers (bf16, with bias, 14 tiles and a partial tile) and a block-fp8 layout
(e4m3 weight, one scale per 128x128 block, a 128-row-tile-major flat scale buffer): the split
output is bit for bit the stock layer's, tiles uneven where they must be; a self-check failing
on one rank, or a slice failing on one rank, keeps the layer stock on every rank; the cost
choice follows injected timings (slowest rank's split against the fastest rank's stock). GPU:
the same on two GPUs over NCCL with the real kernels, whatever the timing decides.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import traceback
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def load_by_path(path: str):
    """The module from its file, without importing the engine package (~10 s per spawned rank)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("replicated_split_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _module_path() -> str:
    import importlib.util

    return str(
        Path(importlib.util.find_spec("sglang").origin).parent
        / "srt"
        / "layers"
        / "replicated_split.py"
    )


rs = load_by_path(_module_path())

FLAG = "--replicated-linear-split"


# ----------------------------------------------------------------------------- the flag


@pytest.mark.parametrize(
    "value, parsed",
    [
        ("off", None),
        ("", None),
        (None, None),
        ("OFF", None),
        ("wqkv_a", (("wqkv_a",), rs.DEFAULT_MAX_ROWS)),
        ("wqkv_a,main_proj", (("wqkv_a", "main_proj"), rs.DEFAULT_MAX_ROWS)),
        ("main_proj:16", (("main_proj",), 16)),
        ("self_attn.wqkv_a, main_proj:4096", (("self_attn.wqkv_a", "main_proj"), 4096)),
    ],
)
def test_accepted_forms(value, parsed):
    assert rs.replicated_linear_split_rule(value) == parsed


@pytest.mark.parametrize(
    "value",
    [
        "on",
        "wqkv_a:0",
        "wqkv_a:4097",
        "wqkv_a:x",
        ",",
        "a,,b",
        "a,a",
        ".a",
        "wqkv-a",
        "a:1:2",
    ],
)
def test_refused_forms_list_the_accepted_ones(value):
    if (
        value == "on"
    ):  # a valid suffix name: accepted by the parser, refused later for matching nothing
        assert rs.replicated_linear_split_rule(value) == (("on",), rs.DEFAULT_MAX_ROWS)
        return
    for parse in (rs.parse_replicated_linear_split, rs.replicated_linear_split_rule):
        with pytest.raises(argparse.ArgumentTypeError, match="expected off, or SUFFIX"):
            parse(value)


def test_canonical_value():
    assert (
        str(rs.parse_replicated_linear_split(" main_proj , wqkv_a "))
        == "main_proj,wqkv_a:96"
    )
    assert rs.parse_replicated_linear_split("off") == "off"


def test_flag_on_command_line():
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    assert parser.parse_args(["--model-path", "x"]).replicated_linear_split == "off"
    args = parser.parse_args(["--model-path", "x", FLAG, "wqkv_a, main_proj:32"])
    assert str(args.replicated_linear_split) == "wqkv_a,main_proj:32"
    with pytest.raises(argparse.ArgumentError, match="expected off, or SUFFIX"):
        parser.parse_args(["--model-path", "x", FLAG, "wqkv_a:0"])


def test_the_flag_is_parsed_once(monkeypatch):
    """The command line's text is parsed once, by the field's type parser, into the value every
    reader uses: the validator, a child process (pickled) and each layer that reads the rule
    parse nothing again. An ``Engine(...)`` text is parsed once, by the validator, which
    declares the parsed value; an unparsed text at a reader raises."""
    import pickle

    import sglang.srt.layers.replicated_split as engine_rs
    from sglang.srt.server_args import ServerArgs

    calls = []
    rule = engine_rs.replicated_linear_split_rule
    monkeypatch.setattr(
        engine_rs, "replicated_linear_split_rule", lambda v: calls.append(v) or rule(v)
    )
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    value = parser.parse_args(["--model-path", "x", FLAG, "wqkv_a:32"])
    value = value.replicated_linear_split
    assert calls == ["wqkv_a:32"] and str(value) == "wqkv_a:32"
    engine_rs.validate_replicated_linear_split(_cfg(replicated_linear_split=value))
    value = pickle.loads(pickle.dumps(value))
    for _layer in range(3):
        assert engine_rs.split_rule(value) == (("wqkv_a",), 32)
    assert calls == ["wqkv_a:32"]
    calls.clear()
    cfg = _cfg(replicated_linear_split="wqkv_a")
    engine_rs.validate_replicated_linear_split(cfg)
    assert calls == ["wqkv_a"]
    declared = cfg._resolved_overrides[-1][1]["replicated_linear_split"]
    assert engine_rs.split_rule(declared) == (("wqkv_a",), rs.DEFAULT_MAX_ROWS)
    assert engine_rs.split_rule("off") is None
    with pytest.raises(TypeError, match="not parsed"):
        engine_rs.split_rule("wqkv_a")


def _cfg(**kw):
    base = dict(
        replicated_linear_split="wqkv_a",
        tp_size=2,
        attn_dp_size=1,
        enable_dp_attention=False,
        device="cuda",
    )
    base.update(kw)
    return SimpleNamespace(**base)


def test_hook_accepts_tp2_and_off():
    rs.validate_replicated_linear_split(_cfg())
    rs.validate_replicated_linear_split(_cfg(replicated_linear_split="off", tp_size=1))


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(tp_size=1), "does nothing with --tp 1"),
        (dict(attn_dp_size=2), "attention data parallelism"),
        (dict(enable_dp_attention=True), "attention data parallelism"),
        (dict(device="cpu"), "needs --device cuda"),
        (
            dict(replicated_linear_split="wqkv_a:0"),
            "expected off, or SUFFIX",
        ),  # Engine(...) skips argparse
    ],
)
def test_hook_refusals_name_the_flag(kw, message):
    error = argparse.ArgumentTypeError if "SUFFIX" in message else ValueError
    with pytest.raises(error, match=message) as e:
        rs.validate_replicated_linear_split(_cfg(**kw))
    assert FLAG in str(e.value)


def test_no_matching_layer_is_refused_once_the_last_model_is_loaded():
    parsed = (("wqkv_a", "main_proj"), 96)
    # The target of a DSpark server: the draft, loaded next, may hold main_proj.
    rs.check_matched(parsed, "DSPARK", is_draft_worker=False, matched={"wqkv_a": 4})
    with pytest.raises(
        ValueError, match=r"prefix ending in main_proj \(matched: wqkv_a x4\)"
    ):
        rs.check_matched(parsed, "DSPARK", is_draft_worker=True, matched={"wqkv_a": 4})
    with pytest.raises(ValueError, match="ending in wqkv_a, main_proj"):
        rs.check_matched(parsed, None, is_draft_worker=False, matched={})
    rs.check_matched(
        parsed, None, is_draft_worker=False, matched={"wqkv_a": 1, "main_proj": 1}
    )


def test_prefix_matches_on_a_dot_boundary():
    assert (
        rs.prefix_matches("model.layers.3.self_attn.wqkv_a", ["main_proj", "wqkv_a"])
        == "wqkv_a"
    )
    assert rs.prefix_matches("model.layers.3.self_attn.xwqkv_a", ["wqkv_a"]) is None
    assert rs.prefix_matches("main_proj", ["main_proj"]) == "main_proj"


def test_tiles_are_whole_and_counts_differ_by_at_most_one():
    assert [(hi - lo) // 128 for lo, hi in rs.tile_ranges(14 * 128, 4)] == [4, 4, 3, 3]
    assert rs.tile_ranges(704, 2) == [(0, 384), (384, 704)]
    assert rs.tile_ranges(704, 4) == [(0, 256), (256, 512), (512, 640), (640, 704)]
    ranges = rs.tile_ranges(704, 4)
    assert ranges[0][0] == 0 and ranges[-1][1] == 704
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


def test_too_few_tiles_is_refused_naming_the_layer():
    layer = SimpleNamespace(output_size=128)
    group = SimpleNamespace(world_size=2, rank_in_group=0)
    with pytest.raises(ValueError, match="x.wqkv_a has 128 output rows, 1 tile"):
        rs.ReplicatedSplit(layer, "x.wqkv_a", 96, group)


def test_flag_off_leaves_the_upstream_layer():
    from sglang.srt.layers.linear import ReplicatedLinear

    layer = ReplicatedLinear(
        256,
        704,
        bias=False,
        params_dtype=torch.bfloat16,
        prefix="model.layers.0.self_attn.wqkv_a",
    )
    assert layer.replicated_split is None
    with torch.no_grad():
        layer.weight.normal_()
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    out, _ = layer(x)
    assert torch.equal(out, torch.nn.functional.linear(x, layer.weight))


def test_the_real_layer_calls_its_split(tmp_path, monkeypatch):
    """ReplicatedLinear.forward as patched, with a split attached (one gloo rank, in process)."""
    import torch.distributed as dist

    from sglang.srt.layers import replicated_split as pkg
    from sglang.srt.layers.linear import ReplicatedLinear

    layer = ReplicatedLinear(
        256, 704, bias=True, params_dtype=torch.bfloat16, prefix="x.main_proj"
    )
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.normal_()
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        layer.replicated_split = pkg.ReplicatedSplit(
            layer,
            "x.main_proj",
            16,
            GlooGroup(),
            timer=fixed_timer({"stock": 2.0, "split": 1.0}),
        )
        x = torch.randn(5, 256).to(torch.bfloat16)
        monkeypatch.setattr(
            pkg, "flashinfer_tuning", lambda: True
        )  # FlashInfer's autotune pass
        out, _ = layer(x)
        assert (
            layer.replicated_split.decisions == {}
        )  # stock, nothing decided with tactics unsettled
        assert same_bits(out, torch.nn.functional.linear(x, layer.weight, layer.bias))
        monkeypatch.setattr(pkg, "flashinfer_tuning", lambda: False)
        out, _ = layer(x)
        assert layer.replicated_split.decisions == {5: True}
        assert same_bits(out, torch.nn.functional.linear(x, layer.weight, layer.bias))
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- gloo ranks


class GlooGroup:
    """The three things the split uses of a GroupCoordinator, over the default gloo group."""

    def __init__(self):
        import torch.distributed as dist

        self.world_size, self.rank_in_group, self.cpu_group = (
            dist.get_world_size(),
            dist.get_rank(),
            None,
        )

    def all_gather_into_tensor(self, output, input):
        import torch.distributed as dist

        dist.all_gather(list(output.chunk(self.world_size)), input)


class BlockFp8Method:
    """A CPU stand-in of a block-fp8 linear with upstream's layouts: weight e4m3 [N, K],
    weight_scale_inv [ceil(N/128), K/128], and a flat per-row factor stored 128-row-tile-major
    (as the swizzled MXFP8 scales are), padded to whole tiles."""

    def apply(self, layer, x, bias=None):
        n = layer.weight.shape[0]
        s = layer.weight_scale_inv.repeat_interleave(128, 0)[:n].repeat_interleave(
            128, 1
        )
        w = layer.weight.float() * s[:, : layer.weight.shape[1]]
        out = (x.float() @ w.t()) * layer.weight_scale_inv_swizzled[:n]
        return out.to(x.dtype)


class SplitKByNMethod:
    """A kernel whose split-K depends on N (as a library heuristic may): the full layer sums K in
    two halves, a narrower slice in one pass. Exact in neither case the same: the self-check's target.
    """

    def apply(self, layer, x, bias=None):
        w = layer.weight.float()
        if layer.weight.shape[0] >= 512:
            h = w.shape[1] // 2
            return x.float()[..., :h] @ w[:, :h].t() + x.float()[..., h:] @ w[:, h:].t()
        return x.float() @ w.t()


class PlainLinearMethod:
    """UnquantizedLinearMethod.apply's CPU path."""

    def apply(self, layer, x, bias=None):
        return torch.nn.functional.linear(x, layer.weight, bias)


class Replicated(torch.nn.Module):
    """ReplicatedLinear's state and forward as the patch leaves them (the spawned ranks skip
    importing the engine, ~10 s each; the real layer's wiring is tested in one process above).
    """

    def __init__(self, k: int, n: int, bias: bool):
        super().__init__()
        self.input_size, self.output_size, self.skip_bias_add = k, n, False
        self.quant_method = PlainLinearMethod()
        self.weight = torch.nn.Parameter(
            torch.empty(n, k, dtype=torch.bfloat16), requires_grad=False
        )
        self.bias = (
            torch.nn.Parameter(
                torch.empty(n, dtype=torch.bfloat16), requires_grad=False
            )
            if bias
            else None
        )
        self.replicated_split = None

    def forward(self, x):
        bias = self.bias if not self.skip_bias_add else None
        if self.replicated_split is not None:
            output = self.replicated_split.apply(x, bias)
        else:
            output = self.quant_method.apply(self, x, bias)
        return output, (self.bias if self.skip_bias_add else None)


def block_fp8_layer(n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    layer = Replicated(k, n, bias=False)
    w = (torch.randn(n, k, generator=g) * 4).to(torch.float8_e4m3fn)
    layer.weight = torch.nn.Parameter(w, requires_grad=False)
    tiles = -(-n // 128)
    layer.weight_scale_inv = torch.nn.Parameter(
        torch.rand(tiles, k // 128, generator=g) + 0.5, requires_grad=False
    )
    layer.weight_scale_inv_swizzled = torch.rand(tiles * 128, generator=g) + 0.5
    layer.quant_method = BlockFp8Method()
    return layer


def bf16_layer(n: int, k: int, seed: int, bias: bool):
    torch.manual_seed(seed)
    layer = Replicated(k, n, bias=bias)
    with torch.no_grad():
        layer.weight.normal_()
        if bias:
            layer.bias.normal_()
    return layer


def same_bits(a, b):
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    )


def fixed_timer(times):
    """Injected timing: runs the call once (the collectives stay matched) and returns times[which]."""

    def timer(which, fn, device):
        fn()
        return times[which]

    return timer


def scenario(layer, timer, rows, max_rows=16):
    """Attach a split, call the layer at each row count, compare with stock bit for bit."""
    group = GlooGroup()
    split = rs.ReplicatedSplit(layer, layer_name(layer), max_rows, group, timer=timer)
    layer.replicated_split = split
    same = {}
    for m in rows:
        x = torch.randn(
            m, layer.input_size, generator=torch.Generator().manual_seed(100 + m)
        ).to(torch.bfloat16)
        out, _ = layer(x)
        bias = layer.bias if not layer.skip_bias_add else None
        ref = layer.quant_method.apply(layer, x, bias)
        same[m] = same_bits(out, ref)
    return {
        "decisions": {str(k): v for k, v in split.decisions.items()},
        "same": same,
        "widths": split.widths,
    }


def layer_name(layer):
    return "test.layer"


def rank_main(rank: int, world: int, store: str, out: str) -> None:
    try:
        import torch.distributed as dist

        torch.set_num_threads(1)

        dist.init_process_group(
            "gloo", init_method=f"file://{store}", rank=rank, world_size=world
        )
        fast = fixed_timer({"stock": 10.0, "split": 1.0})
        res = {}
        res["bf16_partial_tile"] = scenario(
            bf16_layer(704, 256, 1, bias=True), fast, [1, 3, 8, 16, 17]
        )
        res["bf16_14_tiles"] = scenario(
            bf16_layer(14 * 128, 128, 2, bias=False), fast, [2, 5]
        )
        res["block_fp8"] = scenario(
            block_fp8_layer(14 * 128 + 64, 256, 3), fast, [1, 4]
        )

        n_dep = bf16_layer(704, 256, 11, bias=False)
        n_dep.quant_method = SplitKByNMethod()
        res["split_k_by_n"] = scenario(n_dep, fast, [2])

        real = rs._same_bits
        rs._same_bits = (
            (lambda a, b: False) if rank == world - 1 else real
        )  # one rank's check fails
        res["check_fails_on_one_rank"] = scenario(
            bf16_layer(704, 256, 4, bias=False), fast, [2]
        )
        rs._same_bits = real

        real_slice = rs.slice_layer

        def failing_slice(*a, **k):
            raise RuntimeError("injected: this rank's kernel refuses the slice")

        rs.slice_layer = failing_slice if rank == 0 else real_slice
        res["slice_fails_on_one_rank"] = scenario(
            bf16_layer(704, 256, 5, bias=False), fast, [2]
        )
        rs.slice_layer = real_slice

        slow_on_last = fixed_timer(
            {"stock": 20.0, "split": 50.0 if rank == world - 1 else 5.0}
        )
        res["slower_on_one_rank"] = scenario(
            bf16_layer(704, 256, 6, bias=False), slow_on_last, [2]
        )
        stock_fast_on_one = fixed_timer(
            {"stock": 4.0 if rank == 0 else 20.0, "split": 5.0}
        )
        res["stock_faster_on_one_rank"] = scenario(
            bf16_layer(704, 256, 7, bias=False), stock_fast_on_one, [2]
        )
        res["within_margin"] = scenario(
            bf16_layer(704, 256, 8, bias=False),
            fixed_timer({"stock": 20.0, "split": 19.8}),
            [2],
        )
        res["past_margin"] = scenario(
            bf16_layer(704, 256, 9, bias=False),
            fixed_timer({"stock": 20.0, "split": 19.0}),
            [2],
        )

        layer = bf16_layer(704, 256, 10, bias=False)
        scenario(layer, fast, [2])
        q = (torch.randn(2, 256).to(torch.bfloat16), torch.ones(1))
        try:
            layer(q)
            res["tuple_input"] = "called the stock path"
        except (
            Exception
        ) as e:  # F.linear refuses a tuple: the point is the split did not touch it
            res["tuple_input"] = f"stock: {type(e).__name__}"
        Path(out).write_text(json.dumps(res))
        dist.destroy_process_group()
    except BaseException:
        Path(out).write_text(json.dumps({"error": traceback.format_exc()}))
        raise


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Results of the 2-rank and the 3-rank groups, run at the same time."""
    root = tmp_path_factory.mktemp("repsplit")
    ctx = mp.get_context("spawn")
    procs, outs = [], {}
    for world in (2, 3):
        for r in range(world):
            outs[(world, r)] = root / f"out{world}_{r}.json"
            procs.append(
                ctx.Process(
                    target=rank_main,
                    args=(r, world, str(root / f"store{world}"), str(outs[(world, r)])),
                )
            )
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    results = {}
    for key, path in outs.items():
        data = json.loads(path.read_text())
        assert "error" not in data, data.get("error")
        results[key] = data
    assert all(p.exitcode == 0 for p in procs)
    return results


WORLDS = [(2, 0), (2, 1), (3, 0), (3, 1), (3, 2)]


@pytest.mark.parametrize("key", WORLDS)
def test_split_is_bitwise_the_stock_layer(ranks, key):
    res = ranks[key]
    for name in ("bf16_partial_tile", "bf16_14_tiles", "block_fp8"):
        assert all(res[name]["same"].values()), (name, res[name])
    # Split at every row count up to the bound; 17 rows is past it and never decided.
    assert res["bf16_partial_tile"]["decisions"] == {
        "1": True,
        "3": True,
        "8": True,
        "16": True,
    }
    assert res["bf16_14_tiles"]["decisions"] == {"2": True, "5": True}
    assert res["block_fp8"]["decisions"] == {"1": True, "4": True}


@pytest.mark.parametrize(
    "world, widths",
    [
        (
            2,
            {
                "bf16_partial_tile": [384, 320],
                "bf16_14_tiles": [896, 896],
                "block_fp8": [1024, 832],
            },
        ),
        (
            3,
            {
                "bf16_partial_tile": [256, 256, 192],
                "bf16_14_tiles": [640, 640, 512],
                "block_fp8": [640, 640, 576],
            },
        ),
    ],
)
def test_widths(ranks, world, widths):
    for name, w in widths.items():
        assert ranks[(world, 0)][name]["widths"] == w


@pytest.mark.parametrize("key", WORLDS)
@pytest.mark.parametrize(
    "name",
    [
        "split_k_by_n",
        "check_fails_on_one_rank",
        "slice_fails_on_one_rank",
        "slower_on_one_rank",
        "stock_faster_on_one_rank",
        "within_margin",
    ],
)
def test_every_rank_stays_stock(ranks, key, name):
    res = ranks[key][name]
    assert res["decisions"] == {"2": False}
    assert all(res["same"].values())


@pytest.mark.parametrize("key", WORLDS)
def test_split_kept_when_faster_on_every_rank_past_the_margin(ranks, key):
    assert ranks[key]["past_margin"]["decisions"] == {"2": True}


@pytest.mark.parametrize("key", WORLDS)
def test_pre_quantized_input_goes_to_the_stock_path(ranks, key):
    assert ranks[key]["tuple_input"].startswith("stock")


# ----------------------------------------------------------------------------- GPU


def gpu_rank_main(rank: int, world: int, store: str, out: str) -> None:
    sys.path.insert(0, str(REPO / "tools" / "standins"))
    try:
        import torch.distributed as dist

        torch.cuda.set_device(rank)
        dist.init_process_group(
            "nccl", init_method=f"file://{store}", rank=rank, world_size=world
        )
        cpu = dist.new_group(backend="gloo")

        class NcclGroup:
            world_size, rank_in_group, cpu_group = world, rank, cpu

            def all_gather_into_tensor(self, output, input):
                dist.all_gather_into_tensor(output, input)

        from sglang.srt.layers.linear import ReplicatedLinear

        res = {}
        for n, k in ((1792, 5120), (5120, 2048)):
            torch.manual_seed(n)
            layer = ReplicatedLinear(
                k,
                n,
                bias=False,
                params_dtype=torch.bfloat16,
                prefix="model.layers.0.wqkv_a",
            ).cuda()
            with torch.no_grad():
                layer.weight.normal_()
            layer.replicated_split = split = rs.ReplicatedSplit(
                layer, f"{n}x{k}", 96, NcclGroup()
            )
            same = []
            for m in (1, 4, 16, 96):
                x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
                same.append(
                    rs._same_bits(layer(x)[0], layer.quant_method.apply(layer, x, None))
                )
            res[f"{n}x{k}"] = {
                "same": same,
                "decisions": {str(a): b for a, b in split.decisions.items()},
            }
        Path(out).write_text(json.dumps(res))
        dist.destroy_process_group()
    except BaseException:
        Path(out).write_text(json.dumps({"error": traceback.format_exc()}))
        raise


@pytest.mark.gpu
def test_gpu_two_ranks_serve_stock_bits_whatever_is_decided(tmp_path):
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(
            target=gpu_rank_main,
            args=(r, 2, str(tmp_path / "store"), str(tmp_path / f"o{r}")),
        )
        for r in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)
    res = [json.loads((tmp_path / f"o{r}").read_text()) for r in range(2)]
    for r in res:
        assert "error" not in r, r.get("error")
        for layer in r.values():
            assert all(layer["same"]), r
    assert res[0] == res[1]  # the ranks decided alike
