"""The docs' measured tables are their result files' (tools/docs_tables.py), and the build strings
a reader copies from the docs are valid for this series.

A figure lives once: a page's generated block must equal what ``tools/docs_tables.py`` renders
from its result file, every table the script knows has its block, and a block names a table of
its page. A launch example's ``--fork-expect-version`` value must be one the flag accepts, and an
example build carries the series' patch count.
"""

from __future__ import annotations

import json
import re
import shutil

import docs_tables  # noqa: E402
import pytest
from conftest import REPO  # also puts tools/ on sys.path

# The pages a reader copies launch lines and build strings from.
USER_PAGES = [
    "README.md",
    "docker/README.md",
    "docs/fork-identity.md",
    "docs/serving.md",
]


def test_every_generated_table_matches_its_result_file():
    assert docs_tables.update(write=False) == []


def test_every_table_of_the_script_is_on_its_page():
    for name, table in docs_tables.TABLES.items():
        assert f"<!-- docs_tables: {name} -->" in (REPO / table.page).read_text()
        for f in (table.result, *table.also):
            assert docs_tables.result_path(f).is_file()


@pytest.fixture
def copy(tmp_path):
    """docs/ and the result files the tables read, in a scratch repository."""
    shutil.copytree(REPO / "docs", tmp_path / "docs")
    for f in {f for t in docs_tables.TABLES.values() for f in (t.result, *t.also)}:
        src = docs_tables.result_path(f)
        dest = tmp_path / src.relative_to(REPO)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src, dest)
    assert docs_tables.update(tmp_path, write=False) == []
    return tmp_path


def test_a_figure_edited_in_a_page_is_found_and_rewritten(copy):
    page = copy / "docs/draft-temperature-scale.md"
    figure = re.search(r"refused at p = (\S+?)\.\n", page.read_text()).group(1)
    page.write_text(page.read_text().replace(figure, "4.5e-192"))
    (problem,) = docs_tables.update(copy, write=False)
    assert "e2e_tau_control" in problem and "e2e-NVIDIA_H200.json" in problem
    docs_tables.update(copy)  # the script rewrites it from the file
    assert f"refused at p = {figure}." in page.read_text()
    assert docs_tables.update(copy, write=False) == []


def test_a_result_file_changed_under_its_table_is_found(copy):
    path = docs_tables.result_path("hc_fused-NVIDIA_H200.json", copy)
    data = json.loads(path.read_text())
    data["rows"][-1]["ratio"] = 2.0
    path.write_text(json.dumps(data))
    (problem,) = docs_tables.update(copy, write=False)
    assert "docs/hc_fused.md" in problem and "'hc_fused'" in problem


def test_a_second_result_file_is_read_from_the_checked_tree(copy):
    # The attribution table takes its predictions from the cost model's report: a change
    # there must show in the scratch tree's check, not be read from this checkout.
    path = docs_tables.result_path("cost_model-cpu.json", copy)
    data = json.loads(path.read_text())
    for r in data["rows"]:
        r["cell"] = "999,999"
    path.write_text(json.dumps(data))
    problems = docs_tables.update(copy, write=False)
    assert any("'e2e_attribution'" in p for p in problems)


def test_a_missing_or_unknown_block_is_found(copy):
    page = copy / "docs/fast-load.md"
    text = page.read_text()
    start = text.index("<!-- docs_tables: fast_load_h200_repeat -->")
    end = text.index("<!-- /docs_tables -->", start) + len("<!-- /docs_tables -->")
    page.write_text(
        text[:start]
        + "<!-- docs_tables: no_such_table -->\n<!-- /docs_tables -->"
        + text[end:]
    )
    problems = docs_tables.update(copy, write=False)
    assert any("no_such_table" in p for p in problems)
    assert any(
        "no block '<!-- docs_tables: fast_load_h200_repeat -->'" in p for p in problems
    )


def _example_builds(text: str) -> list[int]:
    """Builds a reader is to type (``--fork-expect-version``, an image tag), not a measured one
    named as such (a result's "build X+fork.20.5b3f095" stays true when the series grows).
    """
    pattern = r"(build [\d.]+)?\+fork\.(\d+)\.[0-9a-fx]{7}\b"
    return [int(n) for measured, n in re.findall(pattern, text) if not measured]


def _expected_versions(text: str) -> list[str]:
    return re.findall(r"--fork-expect-version[ \t]+(\d[^\s`]*)", text)


def test_example_builds_and_expected_versions_are_valid_for_this_series(series):
    from sglang.fork import parse_expected_version

    for rel in USER_PAGES:
        text = (REPO / rel).read_text()
        assert set(_example_builds(text)) <= {len(series)}, rel
        for value in _expected_versions(text):
            assert parse_expected_version(value) == value, rel


def test_a_stale_or_invalid_example_build_is_found():
    import argparse

    from sglang.fork import parse_expected_version

    text = "--fork-expect-version 9.8.7+fork.7.xxxxxxx\n"
    assert _example_builds(text) == [7]
    assert _example_builds("measured on build 9.8.7+fork.6.abcdef0, " + text) == [7]
    (value,) = _expected_versions(text)
    with pytest.raises(argparse.ArgumentTypeError):
        parse_expected_version(value)


def test_the_matrix_table_counts_the_v41_rows_apart():
    """V4.1 rows get a line of their own (judged against upstream's V4.1 rows); a matrix served
    before they existed renders as it did."""
    data = json.loads(docs_tables.result_path("e2e-NVIDIA_H200.json").read_text())
    data["rows"] = {
        name: rec for name, rec in data["rows"].items() if not name.startswith("v41_")
    }
    before = docs_tables.e2e_last_run(data)
    assert "V4.1" not in before
    same = {"tokens_identical": True, "logprobs_identical": True}
    data["rows"]["v41_up_off"] = {"ok": True, "tree": "upstream", "checks": {}}
    data["rows"]["v41_off"] = {"ok": True, "tree": "fork", "vs_v41_up_off": same}
    data["rows"]["v41_row_store"] = {"ok": False, "tree": "fork", "vs_v41_up_off": {}}
    table = docs_tables.e2e_last_run(data)
    (line,) = [r for r in table.splitlines() if "V4.1" in r]
    assert line.startswith(
        "| greedy, DeepSeek-V4.1 (random weights) | 3 | 2 | 1 of 2 fork"
    )
    assert table.replace(line + "\n", "") == before


def _rendered(name: str) -> list[str]:
    """The table of a block rendered from the committed result file, one string per line."""
    return docs_tables.render(name).splitlines()


def test_the_twin_table_gives_each_cell_its_rows_min_to_max():
    lines = _rendered("wo_a_fp8")
    assert lines[0].startswith("| G | 2..8 rows (`small`) | 9..16 rows (`mid`) |")
    assert lines[2].startswith(
        "| 2 | 4.36-4.40 us: 2.01-2.03x the einsum, 1.82-1.84x the small-batch kernel "
        "(7.97-8.06 us); MXFP8 calls 1.30-1.32x |"
    )
    assert lines[4] == "| 8 | 1.73-1.83x | 1.57-1.66x | 1.23-1.24x | 0.65-1.05x |"


def test_the_verify_cap_table_leaves_out_the_cap_of_gamma():
    lines = _rendered("verify_cap_moe")
    assert lines[0] == "| bs | no cap | k = 1 | k = 2 | k = 3 | k = 4 |"
    assert "| 4 | 481 us, 121.5 experts | 218 us (2.20x), 45.6 |" in lines[3]


def test_the_router_table_has_one_column_per_batch():
    lines = _rendered("router_live")
    assert lines[0].endswith("| 32 (192) | 64 (384) |")
    assert lines[2].endswith("| 3.06 | 3.29 |")
    assert lines[3].endswith("| 0.99x | 0.98x |")


def test_the_fence_table_shows_stock_and_the_ring():
    assert "| 1 | 8.5 us | 4.6 us | 1.07 us |" in _rendered("folded_result_fence")


def test_the_row_store_table_has_a_line_per_workload():
    lines = _rendered("engram_row_store")
    assert (
        "| zipf | 5 % (25 MiB) | decode bs4 | 64 | 178 | 1535 | 1222 | 0.54 | 124 |"
        in lines
    )
    assert sum(line.startswith(("| zipf", "| uniform")) for line in lines) == 18


def test_the_loop_abort_table_gives_ns_per_token():
    assert "| 32, 128 | 8192 | 1110 | 1496 | 386 | 4743 |" in _rendered("loop_abort")


def test_the_serial_load_table_lists_every_process():
    assert (
        "| stock (pool) | 129.9, 209.6, 138.0 | 138.0 | 0.08, 0.071, 0.062 | 0.071 |"
        in _rendered("serial_weight_load")
    )


def test_the_full_depth_table_sorts_batches_and_marks_another_number_of_pairs():
    def batch(n: int) -> dict:
        r = {"mean": 1.0, "t95": [0.9, 1.1], "n": n}
        side = {"accepted_drafts_per_step": 2.5, "step_ms": 45.0}
        return {"step_ratio": r, "throughput_ratio": r, "tokens_identical": True}, side

    def rec(ns: dict[int, int]) -> dict:
        out = {}
        for bs, n in ns.items():
            b, side = batch(n)
            out[f"bs{bs}"] = {**b, "upstream": side, "fork": side}
        return {"batches": out}

    d = {  # a sitting that listed its batches last to first, one batch re-measured
        "method": {"batches": [32, 1]},
        "flag_sets": {"cap_3": rec({32: 10, 1: 30}), "wo_a_mid": rec({1: 10, 32: 10})},
    }
    lines = docs_tables.e2e_full_depth(d).splitlines()
    assert lines[0] == "| flags | bs 1 | bs 32 |"
    cap = next(line for line in lines if line.startswith("| cap 3: step time"))
    assert (
        cap
        == "| cap 3: step time | 1.000 [0.900, 1.100] (n = 30) | 1.000 [0.900, 1.100] |"
    )


def test_a_table_from_an_archived_file_says_so_and_links_nothing(copy):
    """An older build's file in the archive still renders its table, under a line that names
    it without a link and says it awaits a re-run; the re-run's file in results/ replaces it.
    """
    name = "loop_abort"
    table = docs_tables.TABLES[name]
    archived = copy / docs_tables.ARCHIVE / table.result
    current = copy / docs_tables.RESULTS / table.result
    if not archived.exists():
        shutil.move(
            current, archived.parent.mkdir(parents=True, exist_ok=True) or archived
        )
    assert docs_tables.result_path(table.result, copy) == archived
    body = docs_tables.render(name, copy)
    assert docs_tables.ARCHIVED in body and "](" not in body.splitlines()[-1]
    shutil.copy(archived, current)
    assert docs_tables.result_path(table.result, copy) == current
    body = docs_tables.render(name, copy)
    assert docs_tables.ARCHIVED not in body
    assert f"](../benchmark/results/{table.result})" in body
