"""benchmark/e2e/cost_model.py: the calls it counts per decode step, the fall-back to stock above
the kernels' row limits, interpolation only within measured shapes, and the check that a
prediction explains a measured step-time change (failing on a synthetic mismatch); the step by
kernel group: its groups add up, each figure's status, no figure past its measured rows, a MoE
runner result picked up when it lands (a synthetic file in a scratch folder), and a flag set's
saving the sum of its flags'."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "benchmark" / "e2e"))
import cost_model as cm  # noqa: E402

V41 = cm.V41_FLASH
ALL = cm.Flags("mid", True)


def _sites(tp=4, bs=4, gamma=5, flags=ALL, **kw):
    return {
        s.site: s for s in cm.count_sites(cm.Setup(V41, tp, gamma, bs, flags, **kw))
    }


def _predict(tp=4, bs=4, gamma=5, flags=ALL, **kw):
    p = cm.predict(cm.Setup(V41, tp, gamma, bs, flags, **kw))
    return p, {s["site"]: s for s in p["sites"]}


# ------------------------------------------------------------------ counting


def test_calls_and_rows_per_step_at_tp4():
    s = _sites(tp=4, bs=4, gamma=5)
    verify, draft, head = (
        s["wo_a, target verify"],
        s["wo_a, draft stages"],
        s["draft LM head"],
    )
    assert (verify.calls, verify.rows) == (
        43,
        4 * 6,
    )  # a call per layer, bs * (gamma + 1)
    assert (draft.calls, draft.rows) == (3, 4 * 5)  # a call per stage, bs * gamma
    assert (head.calls, head.rows) == (1, 4 * 5)  # one head call, bs * gamma rows
    assert verify.shape["G"] == 2 and (verify.shape["R"], verify.shape["D"]) == (
        1024,
        4096,
    )
    assert head.shape == {"N": 32320, "K": 5120}
    assert "routed experts, target verify" not in s  # no cap, no site


def test_shapes_per_rank_follow_tp():
    assert _sites(tp=1)["wo_a, target verify"].shape["G"] == 8
    assert _sites(tp=1)["draft LM head"].shape["N"] == 129280
    assert cm.groups_per_rank(V41, 3) == (4, cm.groups_per_rank(V41, 3)[1])
    assert "assumed" in cm.groups_per_rank(V41, 3)[1]
    assert cm.vocab_shard(129280, 3) == 43136  # 64 does not split over 3: padded to 192
    with pytest.raises(ValueError, match="do not split"):
        cm.groups_per_rank(V41, 5)


def test_an_odd_batch_above_8_runs_its_graphs_padded():
    assert [cm.graph_bs(b) for b in (1, 5, 8, 9, 11, 32, 33)] == [
        1,
        5,
        8,
        10,
        12,
        32,
        40,
    ]
    assert _sites(bs=9)["wo_a, target verify"].rows == 10 * 6
    assert _sites(bs=9, cuda_graph=False)["wo_a, target verify"].rows == 9 * 6


def test_draft_rows_without_sampling_from_the_anchor():
    s = _sites(bs=2, gamma=5, sample_from_anchor=False)
    assert s["wo_a, draft stages"].rows == 2 * 6 and s["draft LM head"].rows == 2 * 5


def test_counts_from_an_hf_config():
    cfg = {
        "hidden_size": 7168,
        "num_attention_heads": 128,
        "qk_nope_head_dim": 448,
        "qk_rope_head_dim": 64,
        "q_lora_rank": 1536,
        "o_groups": 16,
        "o_lora_rank": 1024,
        "moe_intermediate_size": 3072,
        "n_routed_experts": 384,
        "num_experts_per_tok": 6,
        "vocab_size": 129280,
        "num_hidden_layers": 61,
    }
    model = cm.Model.from_config(cfg, draft_stages=2, name="cfg.json")
    sites = {
        s.site: s
        for s in cm.count_sites(cm.Setup(model, 4, 3, 2, cm.Flags("mid", True, "2")))
    }
    assert (sites["wo_a, target verify"].calls, sites["wo_a, target verify"].rows) == (
        61,
        8,
    )
    assert sites["wo_a, target verify"].shape["G"] == 4
    assert (sites["wo_a, draft stages"].calls, sites["wo_a, draft stages"].rows) == (
        2,
        6,
    )
    assert sites["routed experts, target verify"].shape["inter_per_rank"] == 768


def test_row_limits_are_the_engines():
    assert cm.engine_constant(cm.HEAD_MODULE, "MAX_ROWS") == {
        "wgmma": 64,
        "mma.sync": 32,
    }
    assert cm.engine_constant(cm.TWIN_MODULE, "MID_FASTER_MAX") == {2: 32, 4: 32, 8: 32}
    assert cm.engine_constant(cm.TWIN_MODULE, "MID_MAX_ROWS") == 192


# ------------------------------------------------------------------ where each kernel's rows end


def test_small_batches_save_and_the_savings_are_the_measured_ones():
    p, s = _predict(bs=1)
    rows = {
        (r["G"], r["M"]): r
        for r in json.loads(
            cm.result_file(cm.RESULTS, "wo_a_fp8-NVIDIA_H200.json")[0].read_text()
        )["rows"]
    }
    verify = s["wo_a, target verify"]
    assert verify["status"] == cm.MEASURED
    want = (
        rows[2, 6]["einsum_us"] - rows[2, 6]["twin_us"]
    )  # Hopper's stock is the einsum
    assert verify["saved_us"] == pytest.approx(43 * want)
    assert p["complete"] and p["saved_us_per_step"] > 150


@pytest.mark.parametrize("bs", [16, 32])
def test_above_64_rows_everything_falls_back_to_stock(bs):
    p, s = _predict(bs=bs)
    assert p["complete"] and p["saved_us_per_step"] == 0
    assert all(x["status"] == cm.NOT_SERVED for x in s.values())


def test_the_twins_gain_ends_at_batch_5_to_6_and_the_heads_at_12_to_13():
    _, s6 = _predict(bs=6)  # 36 verify rows: stock; 30 draft rows: still served
    assert s6["wo_a, target verify"]["status"] == cm.NOT_SERVED
    assert s6["draft LM head"]["saved_us"] > 0
    p12, s12 = _predict(bs=12)  # 60 draft rows: the wgmma head serves up to 64
    assert s12["draft LM head"]["status"] == cm.INTERPOLATED  # between 48 and 64 rows
    assert p12["saved_us_per_step"] == s12["draft LM head"]["saved_us"] > 0
    p13, _ = _predict(bs=13)  # 78 verify, 65 draft rows: nothing of the fork runs
    assert p13["saved_us_per_step"] == 0


def test_small_serves_two_to_eight_rows_only():
    p1, _ = _predict(bs=1, flags=cm.Flags("small"))
    p2, _ = _predict(bs=2, flags=cm.Flags("small"))
    assert p1["saved_us_per_step"] > 0 and p2["saved_us_per_step"] == 0


def test_drop_serves_above_32_rows_at_the_measured_loss():
    _, s = _predict(bs=8, flags=cm.Flags("drop"))  # 48 verify rows: measured, slower
    assert s["wo_a, target verify"]["status"] == cm.MEASURED
    assert s["wo_a, target verify"]["saved_us"] < 0


# ------------------------------------------------------------------ interpolation


def test_interpolation_within_measured_points_only():
    pts = {2.0: (10.0, "a"), 8.0: (4.0, "a"), 16.0: (2.0, "b")}
    assert cm.interpolate(pts, 2)[:2] == (10.0, cm.MEASURED)
    assert cm.interpolate(pts, 5)[:2] == (7.0, cm.INTERPOLATED)
    assert cm.interpolate(pts, 1)[:2] == (None, cm.NOT_MEASURED)
    assert cm.interpolate(pts, 17)[:2] == (None, cm.NOT_MEASURED)
    value, status, note = cm.interpolate(pts, 12)  # the kernel changes between 8 and 16
    assert (value, status) == (None, cm.NOT_MEASURED) and "kernels differ" in note


def test_shapes_outside_the_benchmarks_are_not_measured():
    _, s = _predict(bs=1, gamma=1, flags=cm.Flags("drop"))
    # drop serves the draft's 1-row call; the wo_a benchmark has no 1-row point
    assert s["wo_a, draft stages"]["rows"] == 1
    assert s["wo_a, draft stages"]["status"] == cm.NOT_MEASURED
    assert s["wo_a, target verify"]["status"] == cm.MEASURED  # 2 rows
    p, s = _predict(tp=1, bs=4)  # G = 8: 24 rows on the mid kernel, 16 on the small one
    assert s["wo_a, draft stages"]["status"] == cm.NOT_MEASURED
    assert not p["complete"] and p["not_measured"]
    wide = cm.Model(**{**cm.asdict(V41), "hidden": 7168})
    p = cm.predict(cm.Setup(wide, 4, 5, 1, cm.Flags(draft_head_fp8=True)))
    assert (
        p["sites"][2]["status"] == cm.NOT_MEASURED and "K=5120" in p["sites"][2]["why"]
    )


def test_the_verify_cap_is_measured_only_at_the_benchmarks_expert_shape():
    p, s = _predict(bs=4, flags=cm.Flags(verify_cap="3"))
    assert s["routed experts, target verify"]["status"] == cm.NOT_MEASURED
    v4 = cm.Model(
        **{**cm.asdict(V41), "hidden": 7168, "expert_width": 3072, "layers": 43}
    )
    data = json.loads(
        cm.result_file(cm.RESULTS, "verify_cap_moe-NVIDIA_H200.json")[0].read_text()
    )
    row = next(r for r in data["rows"] if (r["bs"], r["k"]) == (4, 3))
    p = cm.predict(cm.Setup(v4, 4, 5, 4, cm.Flags(verify_cap="3")))
    cap = p["sites"][3]
    assert cap["status"] == cm.MEASURED
    assert cap["saved_us"] == pytest.approx(row["saved_us_per_step_43_layers"])
    p = cm.predict(
        cm.Setup(v4, 4, 5, 32, cm.Flags(verify_cap="3"))
    )  # bs 32: not measured
    assert p["sites"][3]["status"] == cm.NOT_MEASURED
    with pytest.raises(ValueError, match="--cap-mean-k"):
        cm.predict(cm.Setup(v4, 4, 5, 4, cm.Flags(verify_cap="conf:0.1")))
    p = cm.predict(
        cm.Setup(v4, 4, 5, 2, cm.Flags(verify_cap="conf:0.1", cap_mean_k=2.5))
    )
    assert p["sites"][3]["status"] == cm.INTERPOLATED
    assert "assumed" in p["inputs"]["cap_k"]["mark"]


def test_no_result_file_says_no_measurement_on_that_device():
    p, s = _predict(bs=1, device="NVIDIA_GB10")
    assert not p["complete"]
    assert "no measurement on NVIDIA GB10" in s["wo_a, target verify"]["why"]
    assert s["wo_a, target verify"]["saved_us"] == 0


# ------------------------------------------------------------------ against a measurement


def _synthetic(saved, complete=True):
    return {
        "saved_us_per_step": saved,
        "complete": complete,
        "not_measured": [] if complete else ["x: not measured"],
    }


def test_explains_within_a_third():
    assert cm.explains(_synthetic(200.0), 10_000.0, 9_780.0)[
        "explained"
    ]  # 220 measured
    miss = cm.explains(
        _synthetic(200.0), 10_000.0, 9_600.0
    )  # 400 measured: off by half
    assert not miss["explained"] and "outside" in miss["why"]
    assert not cm.explains(_synthetic(200.0), 10_000.0, 10_050.0)["explained"]  # slower
    assert not cm.explains(_synthetic(200.0, complete=False), 10_000.0, 9_800.0)[
        "explained"
    ]


def test_a_zero_prediction_against_noise_needs_the_interval():
    flat = cm.explains(_synthetic(0.0), 10_000.0, 9_990.0)  # 10 us of noise
    assert not flat["explained"]
    assert cm.explains(_synthetic(0.0), 10_000.0, 9_990.0, ci_us=40.0)["explained"]
    assert not cm.explains(_synthetic(0.0), 10_000.0, 9_800.0, ci_us=40.0)["explained"]


def test_the_command_line_check(capsys):
    args = [
        "--dsv4-wo-a-fp8-twin",
        "mid",
        "--speculative-dspark-draft-head-fp8",
        "--bs",
        "1",
    ]
    p = cm.predict(cm.Setup(V41, 4, 5, 1, ALL))["saved_us_per_step"]
    assert cm.main(args + ["--measured-step-us", "20000", str(20000 - p)]) == 0
    assert "EXPLAINED" in capsys.readouterr().out
    assert cm.main(args + ["--measured-step-us", "20000", str(20000 - 3 * p)]) == 1
    assert "NOT EXPLAINED" in capsys.readouterr().out


def test_report_writes_its_json_with_provenance(tmp_path, capsys):
    assert cm.main(["--report", "--out", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "cost_model-cpu.json").read_text())
    assert out["provenance"]["fork_version"] and out["rows"]
    assert [b["bs"] for b in out["step_share"]["batches"]] == list(cm.BATCHES)
    text = capsys.readouterr().out
    assert "No measurement on NVIDIA GB10" in text and "## H200, TP4" in text
    assert "## NVIDIA H200, TP4: the step by kernel group" in text


# ------------------------------------------------------------------ the step by kernel group

STOCK_FILES = ("wo_a_fp8", "draft_head_fp8", "verify_cap_moe", "wo_a_stock")


@pytest.fixture
def results(tmp_path):
    """The committed H200 result files the step reads, without any MoE runner result."""
    for name in STOCK_FILES:
        f = f"{name}-NVIDIA_H200.json"
        (tmp_path / f).write_text(cm.result_file(cm.RESULTS, f)[0].read_text())
    return tmp_path


def test_an_archived_result_is_read_and_named_until_its_rerun_lands(tmp_path):
    """A file moved to results/archive/ (an older build's) still feeds the model, cited as
    ``archive/<name>``; the re-run's file in results/ takes its place; with neither, the part
    is not measured instead of failing."""
    f = "wo_a_fp8-NVIDIA_H200.json"
    assert cm.result_file(tmp_path, f) == (None, f)
    (tmp_path / "archive").mkdir()
    (tmp_path / "archive" / f).write_text(json.dumps({"rows": []}))
    assert cm.result_file(tmp_path, f) == (tmp_path / "archive" / f, f"archive/{f}")
    assert cm._result(tmp_path, "wo_a_fp8", "NVIDIA_H200")[1] == f"archive/{f}"
    (tmp_path / f).write_text(json.dumps({"rows": [1]}))
    assert cm._result(tmp_path, "wo_a_fp8", "NVIDIA_H200") == ({"rows": [1]}, f)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cm._result(empty, "wo_a_fp8", "NVIDIA_H200") == (None, f"no {f}")
    s = cm.step_share(results=empty)
    assert s["batches"]  # the step is still split, its measured parts marked missing


def _moe_file(folder, device="NVIDIA_H200", rows=(4, 6, 8, 12, 24, 48), upstream_to=24):
    """A small synthetic MoE runner result: the fork at 20 + rows us, upstream's Triton route
    at 40 + 2 rows us up to ``upstream_to`` rows (none where 0), the floor at 10 + rows.
    """
    out = []
    for m in rows:
        for kind in ("random", "shared") if m % 6 == 0 else ("random",):
            r = {
                "shape": "v41_flash_tp4",
                "hidden": 5120,
                "inter": 576,
                "rows": m,
                "routing": kind,
                "floor_us": 10.0 + m,
                "fork_us": 20.0 + m,
            }
            if m <= upstream_to:
                r["upstream_triton_fp8_us"] = 40.0 + 2 * m
            out.append(r)
    data = {"benchmark": "moe_verify", "experts": 384, "topk": 6, "rows": out}
    (folder / f"moe_verify-{device}.json").write_text(json.dumps(data))


def _parts(batch, group):
    return {p["part"].split(":")[0]: p for p in batch["parts"] if p["group"] == group}


def test_the_groups_add_up_to_the_step(results):
    s = cm.step_share(results=results)
    assert [b["bs"] for b in s["batches"]] == [1, 2, 4, 8, 16, 32]
    for b in s["batches"]:
        assert sum(g["us"] for g in b["groups"].values()) == pytest.approx(b["step_us"])
        assert sum(g["share"] for g in b["groups"].values()) == pytest.approx(
            1, abs=1e-4
        )
        assert sum(p["us"] for p in b["parts"]) == pytest.approx(b["step_us"], abs=0.1)
        for g in b["groups"].values():
            assert g["measured_us"] + g["assumed_us"] == pytest.approx(g["us"])
        assert b["verify_rows"] == 6 * b["bs"] and b["draft_rows"] == 5 * b["bs"]
    assert set(s["assumptions"]) == set(cm.asdict(cm.StepAssumptions()))
    assert all(a["why"] for a in s["assumptions"].values())
    assert s["hbm_tbps"]["value"] == cm.engine_constant(cm.HARNESS, "HBM_TBPS")


def test_each_group_has_its_status_and_source(results):
    s = cm.step_share(results=results)
    by_bs = {b["bs"]: b for b in s["batches"]}
    for group in ("dense linears", "attention", "all-reduce", "other"):
        assert {b["groups"][group]["status"] for b in s["batches"]} == {cm.ASSUMED}
    # wo_a: 6 and 192 verify rows were measured, 12 lies between 9 and 16
    assert by_bs[1]["groups"]["wo_a"]["status"] == cm.MEASURED
    assert by_bs[2]["groups"]["wo_a"]["status"] == cm.INTERPOLATED
    rows = {
        (r["G"], r["M"]): r
        for r in json.loads((results / "wo_a_fp8-NVIDIA_H200.json").read_text())["rows"]
    }
    verify = _parts(by_bs[1], "wo_a")["target verify"]
    assert verify["calls"] == 43 and verify["rows"] == 6
    assert verify["us_per_call"] == pytest.approx(rows[2, 6]["einsum_us"], abs=1e-3)
    assert "wo_a_fp8-NVIDIA_H200.json einsum_us" in verify["source"]
    # every part of every group names its status and its source
    for b in s["batches"]:
        for p in b["parts"]:
            assert p["status"] in (cm.MEASURED, cm.INTERPOLATED, cm.ASSUMED)
            assert p["source"].startswith("assumed") == (p["status"] == cm.ASSUMED)


def test_no_figure_is_extrapolated_past_its_measured_rows(results):
    s = cm.step_share(results=results)
    by_bs = {b["bs"]: b for b in s["batches"]}
    heads = _parts(by_bs[16], "LM heads")  # 96 and 80 rows: measured
    assert {p["status"] for p in heads.values()} == {cm.MEASURED}
    heads = _parts(by_bs[32], "LM heads")  # 192 and 160 rows: past the 128 measured
    assert {p["status"] for p in heads.values()} == {cm.ASSUMED}
    assert "not extrapolated" in heads["target verify"]["source"]
    assert by_bs[32]["groups"]["LM heads"]["status"] == cm.ASSUMED
    _moe_file(results, rows=(4, 6, 8, 12, 24, 48))
    s = cm.step_share(results=results)
    experts = _parts(s["batches"][4], "routed experts")  # bs 16: 96 and 80 rows
    assert {p["status"] for p in experts.values()} == {cm.ASSUMED}
    assert "not extrapolated" in experts["target verify"]["source"]
    assert s["batches"][4]["flags"][cm.MOE_FLAG]["cell"] == "not measured"


def test_routed_experts_at_the_floor_without_the_moe_file(results):
    s = cm.step_share(results=results)
    assert (
        s["moe_file"] is None
        and "no moe_verify result file" in s["how"]["routed experts"]
    )
    b = s["batches"][0]
    verify = _parts(b, "routed experts")["target verify"]
    experts = 384 * (1 - (1 - 6 / 384) ** 6)
    floor = experts * 3 * 5120 * 576 * 0.53125 / (cm.hbm_tbps() * 1e6)
    assert verify["status"] == cm.ASSUMED and verify["us_per_call"] == pytest.approx(
        floor, abs=1e-3
    )
    assert cm.distinct_experts(V41, 6) == pytest.approx(experts)
    for b in s["batches"]:
        assert b["flags"][cm.MOE_FLAG]["cell"] == cm.NO_UPSTREAM
        assert b["flags"][cm.MOE_FLAG]["saved_us"] == 0


def test_the_moe_file_is_picked_up_when_it_lands(results):
    _moe_file(results)
    s = cm.step_share(results=results)
    assert s["moe_file"] == "moe_verify-NVIDIA_H200.json"
    bs1 = s["batches"][0]
    experts = _parts(bs1, "routed experts")
    # upstream measured at 6 rows: the step takes upstream's time there
    assert experts["target verify"]["status"] == cm.MEASURED
    assert experts["target verify"]["us_per_call"] == 40.0 + 2 * 6
    assert "upstream_triton_fp8_us" in experts["target verify"]["source"]
    # the draft's 5 rows lie between the measured 4 and 6
    assert experts["draft stages"]["status"] == cm.INTERPOLATED
    assert experts["draft stages"]["us_per_call"] == pytest.approx(40.0 + 2 * 5)
    saved = 43 * ((40 + 12) - (20 + 6)) + 3 * ((40 + 10) - (20 + 5))
    moe = bs1["flags"][cm.MOE_FLAG]
    assert moe["complete"] and moe["saved_us"] == pytest.approx(saved)
    assert moe["percent"] == pytest.approx(100 * saved / bs1["step_us"], abs=1e-3)
    assert moe["cell"].endswith(
        "us)*"
    )  # the draft's sites at an interpolated row count
    # bs 8: 48 verify rows, upstream measured only to 24: the step takes the fork's runner
    bs8 = s["batches"][3]
    verify = _parts(bs8, "routed experts")["target verify"]
    assert verify["us_per_call"] == 20.0 + 48 and "fork_us" in verify["source"]
    assert bs8["flags"][cm.MOE_FLAG]["cell"] == "not measured"
    # a file without an upstream route: the fork's runner times the step, no saving
    _moe_file(results, upstream_to=0)
    s = cm.step_share(results=results)
    verify = _parts(s["batches"][0], "routed experts")["target verify"]
    assert verify["us_per_call"] == 20.0 + 6 and verify["status"] == cm.MEASURED
    assert {b["flags"][cm.MOE_FLAG]["cell"] for b in s["batches"]} == {cm.NO_UPSTREAM}


def test_another_hoppers_moe_file_is_read_and_named(results):
    _moe_file(results, device="NVIDIA_H100_80GB_HBM3")
    s = cm.step_share(results=results)
    group = s["batches"][0]["groups"]["routed experts"]
    assert group["devices"] == ["NVIDIA H100 80GB HBM3"]
    assert "measured on NVIDIA H100 80GB HBM3" in s["how"]["routed experts"]
    _moe_file(results)  # the H200's own file comes first
    assert cm.step_share(results=results)["moe_file"] == "moe_verify-NVIDIA_H200.json"


def test_a_sets_saving_is_the_sum_of_its_flags(results):
    without = cm.step_share(results=results)
    _moe_file(results)
    for s in (without, cm.step_share(results=results), cm.step_share()):
        for b in s["batches"]:
            f = b["flags"]
            parts = ("wo_a mid", "head fp8", "cap 3", cm.MOE_FLAG)
            together = f["wo_a mid + head fp8 + cap 3 + " + cm.MOE_FLAG]
            assert together["saved_us"] == pytest.approx(
                sum(f[x]["saved_us"] for x in parts), abs=1e-2
            )
            assert together["percent"] == pytest.approx(
                sum(f[x]["percent"] for x in parts), abs=1e-3
            )
            for x in f.values():
                assert x["percent"] == pytest.approx(
                    100 * x["saved_us"] / b["step_us"], abs=1e-3
                )
    # the cap is not measured at V4.1-Flash's experts: every set with it says so
    for b in without["batches"]:
        assert b["flags"]["cap 3"]["cell"] == "not measured"
        together = b["flags"]["wo_a mid + head fp8 + cap 3 + " + cm.MOE_FLAG]["cell"]
        assert "not measured" in together and together.endswith("moe: not a saving")


def test_the_twin_and_the_head_save_the_cost_models_figures(results):
    s = cm.step_share(results=results)
    for b in s["batches"]:
        p = cm.predict(cm.Setup(V41, 4, 5, b["bs"], cm.Flags("mid", True)))
        assert b["flags"]["wo_a mid"]["saved_us"] + b["flags"]["head fp8"][
            "saved_us"
        ] == pytest.approx(p["saved_us_per_step"], abs=1e-2)
        # a saving never exceeds the group it comes from
        assert b["flags"]["wo_a mid"]["saved_us"] <= b["groups"]["wo_a"]["us"]
        assert b["flags"]["head fp8"]["saved_us"] <= b["groups"]["LM heads"]["us"]


def test_the_step_share_command_line(capsys):
    assert cm.main(["--step-share", "--bs", "1", "8"]) == 0
    text = capsys.readouterr().out
    assert "| kernel group | bs 1 | bs 8 |" in text and "| **step** |" in text
    assert "| routed experts |" in text and "How each group is timed:" in text
    assert cm.main(["--step-share", "--bs", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["batches"][0]["bs"] == 1 and out["tp"] == 4
    with pytest.raises(ValueError, match="routing"):
        cm.step_share(routing="trained")
