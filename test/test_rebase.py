"""`tools/fork rebase` on synthetic upstreams (every class, --continue, --drop, --abort,
interruptions, errors) and, marked slow, a dry run onto the real release before the pin."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
from fakefork import (
    BASE,
    TAG,
    TAG312,
    Spec,
    lines,
    make_fork,
    make_wheel,
    set_line,
    snapshot,
    status,
)
from forklib import REPO_ROOT, ForkError, rebase
from forklib.git import git
from forklib.pin import load_pin
from forklib.series import check_series, dropped_tests, load_series
from forklib.tree import assemble

# One patch per class, against the changes upstream 1.1.0 makes.
SPECS = [
    Spec("clean", {"python/sglang/a.py": lambda t: set_line(t, 5, "a5 = 'ours'")}),
    Spec("merged", {"python/sglang/b.py": lambda t: set_line(t, 20, "b20 = 'ours'")}),
    Spec("conflict", {"python/sglang/c.py": lambda t: set_line(t, 10, "c10 = 'ours'")}),
    Spec("upstream", {"python/sglang/d.py": lambda t: set_line(t, 3, "d3 = 'fixed'")}),
    Spec(
        "clash",
        {"python/sglang/e.py": lambda t: set_line(t, 5, "from sglang.extra import X")},
        owns={"python/sglang/extra.py": "X = 'ours'\n"},
    ),
]
TARGET = BASE | {
    "sglang/b.py": "# new header\n# of three\n# lines\n"
    + lines("b"),  # moves our hunk: merged
    "sglang/c.py": set_line(lines("c"), 10, "c10 = 'upstream'"),  # same line: conflict
    "sglang/d.py": set_line(
        lines("d"), 3, "d3 = 'fixed'"
    ),  # our change, merged upstream
    "sglang/extra.py": "X = 'upstream'\n",  # a file where ours lives: clash
}


@pytest.fixture
def fork(tmp_path, monkeypatch):
    monkeypatch.setenv("FORK_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # never reach PyPI from these tests
    root = tmp_path / "fork"
    make_fork(root, tmp_path / "cache", "1.0.0", BASE, SPECS)
    make_wheel(tmp_path / "cache", "1.1.0", TARGET)
    return rebase.Layout(root)


def statuses(lay: rebase.Layout) -> list[str]:
    return [p["status"] for p in json.loads(lay.state_file.read_text())["patches"]]


def test_every_class_then_continue_and_drop(fork, capsys):
    lay = fork
    before = snapshot(lay.root)
    assert rebase.start("1.1.0", lay) == 1
    assert statuses(lay) == ["clean", "merged", "conflict", "pending", "pending"]
    printed = capsys.readouterr().out
    assert (
        "python/sglang/c.py:10: conflict with hunk @@ -7,7 +7,7 @@" in printed
    )  # region and hunk
    assert (
        snapshot(lay.root) == before and status(lay.root) == ""
    )  # nothing written yet

    with pytest.raises(ForkError, match="unresolved conflicts"):
        rebase.resume(lay)
    (lay.repo / "python/sglang/c.py").write_text(
        set_line(lines("c"), 10, "c10 = 'both'")
    )
    git(lay.repo, "add", "python/sglang/c.py")
    assert rebase.resume(lay) == 1
    assert statuses(lay)[2:] == ["resolved", "upstream", "pending"]
    assert "reverse-applies cleanly on 1.1.0" in capsys.readouterr().out

    with pytest.raises(ForkError, match="nothing to continue"):
        rebase.resume(lay)  # an upstream patch is never dropped silently
    assert rebase.resume(lay, drop=["4"]) == 1
    assert statuses(lay)[3:] == ["dropped", "new-file clash"]
    assert "1.1.0 ships python/sglang/extra.py" in capsys.readouterr().out

    assert rebase.resume(lay, drop=["0005-clash"]) == 0
    assert not lay.state_file.exists()
    series = load_series(lay.series_file)
    assert [p.name for p in series] == ["0001-clean", "0002-merged", "0003-conflict"]
    assert not (lay.root / "patches/0004-upstream.patch").exists()
    assert not (lay.root / "python/sglang/extra.py").exists()  # its owner was dropped
    assert load_pin(lay.pin_file).version == "1.1.0"
    assert "c10 = 'both'" in series[2].path.read_text()
    assert series[1].trailers["Why"] == [
        "test merged"
    ]  # headers kept, only the base moved
    range_diff = (lay.dir / "range-diff.txt").read_text()
    assert (
        "! 3:" in range_diff and "c10 = 'both'" in range_diff
    )  # the resolution is visible
    assert "4:" in range_diff and "< -:  -------" in range_diff  # the dropped patch too
    check_series(series, lay.root)
    # The written series applies exactly (no offset) on the new release.
    wheel = lay.root.parent / "cache/wheels" / f"sglang-1.1.0-{TAG}.whl"
    assemble(
        lay.root.parent / "verify", wheel, "1.1.0", series, stamp=False, src=lay.root
    )


def test_abort_leaves_repository_as_it_was(fork):
    lay = fork
    before = snapshot(lay.root)
    assert rebase.start("1.1.0", lay) == 1
    rebase.abort(lay)
    assert not lay.dir.exists()
    assert snapshot(lay.root) == before and status(lay.root) == ""
    assert rebase.start("1.1.0", lay) == 1  # and a new rebase can start


def test_interrupted_replay_writes_nothing_and_resumes(fork, monkeypatch):
    lay = fork
    before = snapshot(lay.root)
    real_pick, calls = rebase._pick, []

    def pick(*args):
        calls.append(1)
        if len(calls) == 2:
            real_pick(*args)  # half done: the cherry-pick is in, the state not updated
            raise KeyboardInterrupt
        return real_pick(*args)

    monkeypatch.setattr(rebase, "_pick", pick)
    with pytest.raises(KeyboardInterrupt):
        rebase.start("1.1.0", lay)
    assert snapshot(lay.root) == before and status(lay.root) == ""
    monkeypatch.setattr(rebase, "_pick", real_pick)
    assert (
        rebase.resume(lay) == 1
    )  # the interrupted step is redone from its recorded HEAD
    assert statuses(lay)[:3] == ["clean", "merged", "conflict"]


def test_interrupted_write_back_restores_repository(tmp_path, monkeypatch):
    monkeypatch.setenv("FORK_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    lay = rebase.Layout(tmp_path / "fork")
    make_fork(lay.root, tmp_path / "cache", "1.0.0", BASE, SPECS[:2] + SPECS[4:])
    make_wheel(
        tmp_path / "cache",
        "1.1.0",
        {k: v for k, v in TARGET.items() if k != "sglang/extra.py"},
    )
    before = snapshot(lay.root)
    real_move, moved = rebase._move_in, []

    def move(src, dst):
        if moved:
            raise KeyboardInterrupt  # killed after the first file went in
        moved.append(dst)
        real_move(src, dst)

    monkeypatch.setattr(rebase, "_move_in", move)
    with pytest.raises(KeyboardInterrupt):
        rebase.start("1.1.0", lay)
    assert moved and snapshot(lay.root) == before and status(lay.root) == ""
    monkeypatch.setattr(rebase, "_move_in", real_move)
    assert rebase.resume(lay) == 0
    assert load_pin(lay.pin_file).version == "1.1.0"
    assert [p.name for p in load_series(lay.series_file)] == [
        "0001-clean",
        "0002-merged",
        "0003-clash",
    ]


def test_backward_all_clean_records_hashes(tmp_path, monkeypatch, capsys):
    cache = tmp_path / "cache"
    monkeypatch.setenv("FORK_CACHE", str(cache))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    lay = rebase.Layout(tmp_path / "fork")
    newer = BASE | {"sglang/b.py": lines("b", 40)}
    make_fork(lay.root, cache, "2.0.0", newer, SPECS[:1], extra_tags=(TAG312,))
    sha311 = make_wheel(cache, "1.0.0", BASE)
    sha312 = make_wheel(cache, "1.0.0", BASE, TAG312)
    assert rebase.start("1.0.0", lay) == 0
    assert "0001-clean  clean" in capsys.readouterr().out
    pin = load_pin(lay.pin_file)
    assert (pin.version, pin.wheels) == ("1.0.0", {TAG: sha311, TAG312: sha312})
    # Forward again, with no cp312 wheel to be had: said, not hidden.
    make_wheel(cache, "3.0.0", newer)
    git(lay.root, "commit", "-qam", "rebased to 1.0.0")
    assert rebase.start("3.0.0", lay) == 0
    assert f"warning: no hash recorded for {TAG312}" in capsys.readouterr().out
    assert load_pin(lay.pin_file).wheels.keys() == {TAG}


def test_the_dockerfile_follows_the_release(tmp_path, monkeypatch, capsys):
    """The serving image builds on upstream's image of the pinned release: a rebase rewrites it
    with upstream.toml (the drill onto an older release found it left behind)."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("FORK_CACHE", str(cache))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    lay = rebase.Layout(tmp_path / "fork")
    make_fork(lay.root, cache, "2.0.0", BASE, SPECS[:1])
    dockerfile = lay.root / "docker" / "Dockerfile"
    dockerfile.parent.mkdir()
    dockerfile.write_text(
        "# docker build -t sglang-dsv4:2.0.0 .\nARG SGLANG_IMAGE=lmsysorg/sglang:v2.0.0\n"
    )
    git(lay.root, "add", "-A")
    git(lay.root, "commit", "-qm", "docker")
    make_wheel(cache, "1.0.0", BASE)
    assert rebase.start("1.0.0", lay) == 0
    assert (
        dockerfile.read_text()
        == "# docker build -t sglang-dsv4:1.0.0 .\nARG SGLANG_IMAGE=lmsysorg/sglang:v1.0.0\n"
    )
    assert "docker/Dockerfile" in capsys.readouterr().out


def test_clear_errors(fork):
    lay = fork
    with pytest.raises(ForkError, match="already pinned"):
        rebase.start("1.0.0", lay)
    with pytest.raises(ForkError, match="cannot fetch sglang==9.9.9"):
        rebase.start("9.9.9", lay)
    with pytest.raises(ForkError, match="not a release version"):
        rebase.start("main; rm -rf", lay)
    series = lay.series_file.read_text()
    lay.series_file.write_text(series + "# dirty\n")
    with pytest.raises(ForkError, match="uncommitted changes"):
        rebase.start("1.1.0", lay)
    lay.series_file.write_text(series)
    wheel = lay.root.parent / "cache/wheels" / f"sglang-1.0.0-{TAG}.whl"
    wheel.write_bytes(wheel.read_bytes() + b"tampered")
    with pytest.raises(ForkError, match="cannot fetch sglang==1.0.0"):
        rebase.start("1.1.0", lay)  # recorded when it entered the cache: fetched again
    wheel.with_name(
        wheel.name + ".sha256"
    ).unlink()  # no record: nothing says which is right
    with pytest.raises(ForkError, match="does not match the pinned"):
        rebase.start("1.1.0", lay)
    with pytest.raises(ForkError, match="no rebase in progress"):
        rebase.resume(lay)


# ---------------------------------------------------------------------------- drift record


def test_drift_record_is_the_tools_own_output(fork, capsys):
    """`tools/fork drift` writes the dry runs' printed output verbatim, with where and how
    long they ran; a hand-written part of the record outside the generated block is kept.
    """
    lay = fork
    record = lay.root / "drift.md"
    record.write_text(
        "# Drift\n\nkept by hand\n\n"
        + rebase.DRIFT_BEGIN
        + "\nold\n"
        + rebase.DRIFT_END
        + "\n\ntail by hand\n"
    )
    rebase.drift(["1.1.0"], lay.root, record=record)
    printed = capsys.readouterr().out.replace(
        str(lay.root / "build/drift/1.1.0"), "build/drift/1.1.0"
    )
    text = record.read_text()
    assert (
        text.startswith("# Drift\n\nkept by hand\n")
        and text.endswith("tail by hand\n")
        and "\nold\n" not in text
    )
    table = printed[printed.index("sglang 1.0.0 -> 1.1.0") : printed.index("(dry run")]
    assert table.strip() and table.strip() in text  # the tool's table, verbatim
    assert (
        "python/sglang/c.py:10: conflict with hunk @@ -7,7 +7,7 @@" in text
    )  # every detail, not the first
    assert "CPU" in text and "Python" in text and "git" in text  # where it was measured
    assert str(lay.root) not in text  # no machine paths
    assert (
        not (lay.root / "build" / "rebase").exists()
        and status(lay.root) == "?? drift.md"
    )


@pytest.mark.slow
def test_real_drift_onto_an_older_release(tmp_path):
    """The current series, dry-run onto the release before the pin (real wheels from PyPI)."""
    pin = load_pin()
    *head, last = pin.version.split(".")
    if not last.isdigit() or int(last) == 0:
        pytest.skip(f"no previous patch release of {pin.version} to replay onto")
    older = ".".join([*head, str(int(last) - 1)])
    record = tmp_path / "drift.md"
    rebase.drift([older], REPO_ROOT, record=record, scratch=tmp_path / "scratch")
    text = record.read_text()
    assert f"{pin.package} {pin.version} -> {older}" in text
    for p in load_series():
        assert p.name in text


# ---------------------------------------------------------------------------- hardening


def _fork(tmp_path, monkeypatch, specs, target, version="1.1.0"):
    monkeypatch.setenv("FORK_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    lay = rebase.Layout(tmp_path / "fork")
    make_fork(lay.root, tmp_path / "cache", "1.0.0", BASE, specs)
    make_wheel(tmp_path / "cache", version, target)
    return lay


def test_modify_delete_is_named_and_never_adopts_upstreams_file(
    tmp_path, monkeypatch, capsys
):
    """A file the patch edits is gone in the target: say so, say what each choice means,
    and refuse to write back a patch that would own upstream's old file."""
    specs = [
        Spec(
            "gone",
            {
                "python/sglang/a.py": lambda t: set_line(t, 5, "a5 = 'ours'"),
                "python/sglang/d.py": lambda t: set_line(t, 3, "d3 = 'ours'"),
            },
        )
    ]
    target = {k: v for k, v in BASE.items() if k != "sglang/d.py"}
    lay = _fork(tmp_path, monkeypatch, specs, target)
    assert rebase.start("1.1.0", lay) == 1
    printed = capsys.readouterr().out
    assert "no markers" not in printed
    assert (
        "python/sglang/d.py: deleted (or renamed) in 1.1.0, edited by this patch"
        in printed
    )
    assert (
        "git rm python/sglang/d.py" in printed
    )  # drop our edit of a file that no longer exists
    assert "re-home" in printed
    git(
        lay.repo, "add", "python/sglang/d.py"
    )  # the wrong move: adopt upstream's old file
    with pytest.raises(
        ForkError,
        match=r"python/sglang/d\.py.*upstream's file.*git rm -f python/sglang/d\.py",
    ):
        rebase.resume(lay)
    git(lay.repo, "rm", "-qf", "python/sglang/d.py")
    assert rebase.resume(lay) == 0
    (patch,) = load_series(lay.series_file)
    assert patch.owns == [] and patch.files == ("python/sglang/a.py",)


def test_a_resolution_committed_by_hand_keeps_the_header(tmp_path, monkeypatch, capsys):
    lay = _fork(tmp_path, monkeypatch, SPECS[2:3], TARGET)
    assert rebase.start("1.1.0", lay) == 1
    (lay.repo / "python/sglang/c.py").write_text(
        set_line(lines("c"), 10, "c10 = 'both'")
    )
    git(lay.repo, "add", "python/sglang/c.py")
    git(lay.repo, "commit", "-qm", "fix the conflict")  # a message of the person's own
    assert rebase.resume(lay) == 0
    assert "kept the header of 0001-conflict" in capsys.readouterr().out
    (patch,) = load_series(lay.series_file)
    assert patch.subject == "conflict: change things" and patch.trailers["Why"] == [
        "test conflict"
    ]
    assert "c10 = 'both'" in patch.path.read_text()
    check_series([patch], lay.root)


def test_abort_after_a_finished_rebase_says_what_is_true(fork):
    lay = fork
    assert rebase.start("1.1.0", lay) == 1
    (lay.repo / "python/sglang/c.py").write_text(
        set_line(lines("c"), 10, "c10 = 'both'")
    )
    git(lay.repo, "add", "python/sglang/c.py")
    assert rebase.resume(lay, drop=["4", "5"]) == 0
    changed = status(lay.root)
    assert changed
    with pytest.raises(ForkError) as e:
        rebase.abort(lay)
    msg = str(e.value)
    assert "already finished" in msg and "unchanged" not in msg
    assert "git checkout HEAD -- patches python/sglang upstream.toml" in msg
    assert (lay.dir / "range-diff.txt").exists() and status(
        lay.root
    ) == changed  # nothing lost


def test_every_conflict_region_is_named_with_its_hunk(tmp_path, monkeypatch, capsys):
    """Two hunks of one file conflict: both regions are listed as file:line with the patch
    hunk each came from; the scratch repository shows the base (zdiff3)."""
    specs = [
        Spec(
            "two",
            {
                "python/sglang/c.py": lambda t: set_line(
                    set_line(t, 5, "c5 = 'ours'"), 25, "c25 = 'ours'"
                )
            },
        )
    ]
    target = BASE | {
        "sglang/c.py": set_line(set_line(lines("c"), 5, "c5 = 'up'"), 25, "c25 = 'up'")
    }
    lay = _fork(tmp_path, monkeypatch, specs, target)
    assert rebase.start("1.1.0", lay) == 1
    printed = capsys.readouterr().out
    text = (lay.repo / "python/sglang/c.py").read_text().splitlines()
    starts = [n + 1 for n, line in enumerate(text) if line.startswith("<<<<<<< ")]
    assert len(starts) == 2 and any(line.startswith("||||||| ") for line in text)
    assert (
        f"python/sglang/c.py:{starts[0]}: conflict with hunk @@ -2,7 +2,7 @@" in printed
    )
    assert (
        f"python/sglang/c.py:{starts[1]}: conflict with hunk @@ -22,7 +22,7 @@"
        in printed
    )


DEP_SPECS = [
    Spec(
        "helper",
        {"python/sglang/a.py": lambda t: set_line(t, 5, "a5 = 'ours'")},
        owns={"python/sglang/helper.py": "H = 1\n"},
    ),
    Spec(
        "user",
        {"python/sglang/b.py": lambda t: set_line(t, 5, "from sglang.helper import H")},
        owns={"python/sglang/user.py": "from sglang.helper import H\n"},
    ),
]


def test_drop_refuses_while_another_patch_depends_on_it(tmp_path, monkeypatch, capsys):
    lay = _fork(
        tmp_path,
        monkeypatch,
        DEP_SPECS,
        BASE | {"sglang/a.py": set_line(lines("a"), 5, "a5 = 'up'")},
    )
    depends_on(lay.root, "0002-user", "0001-helper")
    assert rebase.start("1.1.0", lay) == 1
    # the stop offers the drop that the tool accepts: the patch with what depends on it
    assert (
        "`tools/fork rebase --drop 0001-helper --drop 0002-user` (it and 0002-user, which depend on it "
        "(their Depends: trailer), will be removed from the series)"
    ) in capsys.readouterr().out
    with pytest.raises(
        ForkError,
        match=r"0002-user depends on 0001-helper.*--drop 0001-helper --drop 0002-user",
    ):
        rebase.resume(lay, drop=["1"])
    assert rebase.resume(lay, drop=["1", "2"]) == 0
    assert load_series(lay.series_file) == []
    # The series says what was dropped and whose tests no longer run (conftest skips them).
    assert dropped_tests(lay.series_file) == {
        "test/test_x.py": ["0001-helper", "0002-user"]
    }
    assert (
        "# dropped in the rebase from 1.0.0 to 1.1.0: 0001-helper (tests: test/test_x.py)"
        in lay.series_file.read_text()
    )


def test_the_refusal_offers_a_drop_the_tool_accepts_after_earlier_drops():
    """A refused --drop names the command to run now: the patches named plus their dependent,
    not the ones dropped earlier in the rebase (naming those again is refused)."""
    state = {
        "next": 1,
        "patches": [
            {"name": "0001-old", "status": "dropped", "depends": []},
            {"name": "0002-helper", "status": "conflict", "depends": []},
            {"name": "0003-user", "status": "pending", "depends": ["0002-helper"]},
        ],
    }
    with pytest.raises(ForkError) as refused:
        rebase._drops(state, ["2"])
    assert "(`tools/fork rebase --drop 0002-helper --drop 0003-user`)" in str(
        refused.value
    )
    assert rebase._drops(state, ["2", "3"]) == [1, 2]
    # a chain: what depends on the dependent goes in the offer too (else it is refused again)
    state["patches"].append(
        {"name": "0004-user-of-user", "status": "pending", "depends": ["0003-user"]}
    )
    with pytest.raises(ForkError) as refused:
        rebase._drops(state, ["2"])
    assert (
        "(`tools/fork rebase --drop 0002-helper --drop 0003-user --drop 0004-user-of-user`)"
        in str(refused.value)
    )
    assert rebase._drops(state, ["2", "3", "4"]) == [1, 2, 3]


def depends_on(root, name, dep):
    """Add a Depends: trailer to a patch of a fake fork and commit it."""
    path = root / "patches" / f"{name}.patch"
    path.write_text(
        path.read_text().replace(
            "Tests: test/test_x.py\n", f"Tests: test/test_x.py\nDepends: {dep}\n", 1
        )
    )
    git(root, "commit", "-qam", f"{name} depends on {dep}")


# ---------------------------------------------------------------------------- explained end to end


def test_the_real_run_classifies_every_patch_first_and_tests_at_the_end(
    fork, monkeypatch, capsys
):
    """Before the first stop the whole table (what --dry-run prints, every note); after the
    last, a closing summary and the Tests: of each merged or resolved patch, per patch.
    """
    lay = fork
    assert rebase.start("1.1.0", lay, tests=True) == 1
    printed = capsys.readouterr().out
    first = printed[: printed.index("stopped at 0003-conflict")]
    assert "every patch classified onto 1.1.0 first" in first
    for name, cls in [
        ("0001-clean", "clean"),
        ("0002-merged", "merged"),
        ("0003-conflict", "conflict"),
        ("0004-upstream", "upstream"),
        ("0005-clash", "new-file clash"),
    ]:
        assert re.search(rf"^{name} +{cls}( |$)", first, re.M), name
    assert "1.1.0 ships python/sglang/extra.py" in first  # later stops' notes, up front
    assert "(+" not in printed  # no note folded away
    assert str(lay.state_file) in printed
    (lay.repo / "python/sglang/c.py").write_text(
        set_line(lines("c"), 10, "c10 = 'both'")
    )
    git(lay.repo, "add", "python/sglang/c.py")
    runs = []

    def pytest_(root, tests):
        runs.append(tests)
        return subprocess.CompletedProcess([], 1, "F\n1 failed in 0.1s\n", "")

    monkeypatch.setattr(
        rebase, "_build", lambda root: subprocess.CompletedProcess([], 0, "", "")
    )
    monkeypatch.setattr(rebase, "_pytest", pytest_)
    assert rebase.resume(lay) == 1
    assert rebase.resume(lay, drop=["4"]) == 1
    assert rebase.resume(lay, drop=["5"]) == 1  # written, but the tests failed
    printed = capsys.readouterr().out
    assert runs == [["test/test_x.py"]]  # one run per set of test files
    summary = printed[printed.index("summary: every patch's class") :]
    assert re.search(r"^0004-upstream +dropped +dropped by --drop", summary, re.M)
    assert str(lay.dir / "result.json") in summary
    assert "0002-merged (merged): FAILED: 1 failed in 0.1s" in summary
    assert "0003-conflict (resolved): FAILED" in summary
    assert "0001-clean" not in summary[summary.index("tests of the patches") :]
    assert "FAILED: 0002-merged, 0003-conflict" in summary
    assert json.loads((lay.dir / "result.json").read_text())["to"] == "1.1.0"


def test_no_test_says_which_tests_were_not_run(tmp_path, monkeypatch, capsys):
    lay = _fork(tmp_path, monkeypatch, SPECS[1:2], TARGET)
    monkeypatch.setattr(rebase, "_build", lambda root: pytest.fail("built"))
    assert rebase.start("1.1.0", lay, tests=False) == 0
    assert "not run (--no-test)" in capsys.readouterr().out


FUNCS = (
    "def helper_one(x):\n    return x\n\n\ndef helper_two(x):\n    return x\n\n\n"
    + "".join(f"pad{i} = {i}\n" for i in range(8))
    + "\n\ndef keep_me(x):\n    a = helper_one(x)\n    b = 2\n    return a\n\n\n"
    + "".join(f"pad{i} = {i}\n" for i in range(8, 16))
    + "\n\ndef gone_away(x):\n    c = helper_two(x)\n    d = 4\n    return c\n"
)


def test_a_stop_says_which_names_the_target_lacks_and_recommends(
    tmp_path, monkeypatch, capsys
):
    """Each conflicting region: the upstream names its hunk refers to, found or not in the
    target's source, and port here (all there) or drop / port where the caller lives now.
    """
    specs = [
        Spec(
            "edits",
            {
                "python/sglang/f.py": lambda t: t.replace(
                    "b = 2", "b = 'ours'"
                ).replace("d = 4", "d = 'ours'")
            },
        )
    ]
    base = BASE | {
        "sglang/f.py": FUNCS,
        "sglang/g.py": "from sglang.f import gone_away\n",
    }
    target = base | {
        "sglang/f.py": FUNCS.replace("b = 2", "b = 'up'")
        .replace("d = 4", "d = 'up'")
        .replace("gone_away", "moved_here"),
        # a function of that name elsewhere is not the code the hunk edits
        "sglang/h.py": "def gone_away(x):\n    return x\n",
    }
    monkeypatch.setenv("FORK_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    lay = rebase.Layout(tmp_path / "fork")
    make_fork(lay.root, tmp_path / "cache", "1.0.0", base, specs)
    make_wheel(tmp_path / "cache", "1.1.0", target)
    assert rebase.start("1.1.0", lay) == 1
    printed = capsys.readouterr().out
    stop = printed[printed.index("stopped at") :]
    regions = stop.split("conflict with hunk")
    assert len(regions) == 3
    here, absent = regions[1], regions[2]
    assert "found helper_one, keep_me; not found none" in here
    assert "-> port here: the code it edits exists in 1.1.0" in here
    assert "not found gone_away" in absent and "found helper_two" in absent
    assert (
        "-> the code this hunk edits is absent in 1.1.0 (gone_away not found)" in absent
    )
    assert "drop the patch" in absent and "python/sglang/g.py" in absent
    assert "1.1.0 defines a gone_away in python/sglang/h.py" in absent


def test_an_orphan_is_named_at_the_end_and_dropped_or_kept(
    tmp_path, monkeypatch, capsys
):
    """Dropping the only user of a patch leaves it without one: the stop after the last
    patch names it with the command to drop it too; --continue keeps it."""
    target = BASE | {"sglang/b.py": set_line(lines("b"), 5, "b5 = 'up'")}
    for keep in (False, True):
        lay = _fork(tmp_path / str(keep), monkeypatch, DEP_SPECS, target)
        depends_on(lay.root, "0002-user", "0001-helper")
        assert rebase.start("1.1.0", lay) == 1  # 0002-user conflicts
        capsys.readouterr()
        assert rebase.resume(lay, drop=["2"]) == 1
        printed = capsys.readouterr().out
        assert "note: 0001-helper is used only by 0002-user" in printed
        assert (
            "0001-helper: used only by 0002-user (Depends: or imports), dropped in this "
            "rebase" in printed
        )
        assert "`tools/fork rebase --drop 0001-helper`" in printed
        if keep:
            assert rebase.resume(lay) == 0
            assert [p.name for p in load_series(lay.series_file)] == ["0001-helper"]
        else:
            assert rebase.resume(lay, drop=["1"]) == 0
            assert load_series(lay.series_file) == []
            assert not (lay.root / "python/sglang/helper.py").exists()


def _first_and_second():
    """Two patches on lines 5 and 12 of a.py, and a.py's lines with upstream's line 12 changed
    in the target (the target then drops lines between them)."""
    specs = [
        Spec("first", {"python/sglang/a.py": lambda t: set_line(t, 5, "a5 = 'first'")}),
        Spec(
            "second",
            {"python/sglang/a.py": lambda t: set_line(t, 12, "a12 = 'second'")},
        ),
    ]
    return specs, set_line(lines("a"), 12, "a12 = 'up'").splitlines(keepends=True)


def test_continue_names_another_patchs_lines_a_resolution_leans_on(
    tmp_path, monkeypatch, capsys
):
    """The target lacks the upstream lines that kept two patches apart: after the
    resolution the second one's hunk has the first one's line as context, so it no longer
    applies alone; --continue says which lines touch and how to separate them."""
    specs, rows = _first_and_second()
    # a6..a11 gone: the two patches' lines touch, so not even a three-way apply holds
    target = BASE | {"sglang/a.py": "".join(rows[:5] + rows[11:])}
    lay = _fork(tmp_path, monkeypatch, specs, target)
    assert rebase.start("1.1.0", lay) == 1
    assert "stopped at 0001-first" in capsys.readouterr().out
    rows = set_line(lines("a"), 5, "a5 = 'first'").splitlines(keepends=True)
    (lay.repo / "python/sglang/a.py").write_text("".join(rows[:5] + rows[11:]))
    git(lay.repo, "add", "python/sglang/a.py")
    assert rebase.resume(lay) == 1
    assert "stopped at 0002-second" in capsys.readouterr().out
    rows = (
        set_line(set_line(lines("a"), 5, "a5 = 'first'"), 12, "a12 = 'second'")
    ).splitlines(keepends=True)
    (lay.repo / "python/sglang/a.py").write_text("".join(rows[:5] + rows[11:]))
    git(lay.repo, "add", "python/sglang/a.py")
    assert rebase.resume(lay) == 0
    printed = capsys.readouterr().out
    assert (
        "warning: 0002-second does not apply alone to 1.1.0: its hunks have 0001-first's "
        "line(s) as context (python/sglang/a.py:5 `a5 = 'first'`" in printed
    )
    assert (
        "declare `Depends: 0001-first`; if not, separate them: move our line" in printed
    )


def test_continue_applies_alone_three_way_where_only_context_moved(
    tmp_path, monkeypatch, capsys
):
    """The target lacks upstream lines near another patch's line, but the two do not touch:
    a strict apply of the resolved patch fails on that context, git's three-way apply (what
    `make export` falls back to) holds, so --continue reports no warning."""
    specs, rows = _first_and_second()
    target = BASE | {"sglang/a.py": "".join(rows[:6] + rows[10:])}  # a7..a10 gone
    lay = _fork(tmp_path, monkeypatch, specs, target)
    assert rebase.start("1.1.0", lay) == 1
    assert "stopped at 0002-second" in capsys.readouterr().out
    rows = (
        set_line(set_line(lines("a"), 5, "a5 = 'first'"), 12, "a12 = 'second'")
    ).splitlines(keepends=True)
    (lay.repo / "python/sglang/a.py").write_text("".join(rows[:6] + rows[10:]))
    git(lay.repo, "add", "python/sglang/a.py")
    assert rebase.resume(lay) == 0
    printed = capsys.readouterr().out
    assert "0002-second: resolved; it still applies alone to 1.1.0" in printed
    assert "does not apply alone" not in printed


def test_continue_says_a_resolution_still_applies_alone(tmp_path, monkeypatch, capsys):
    lay = _fork(tmp_path, monkeypatch, SPECS[2:3], TARGET)
    assert rebase.start("1.1.0", lay) == 1
    (lay.repo / "python/sglang/c.py").write_text(
        set_line(lines("c"), 10, "c10 = 'both'")
    )
    git(lay.repo, "add", "python/sglang/c.py")
    assert rebase.resume(lay) == 0
    printed = capsys.readouterr().out
    assert "0001-conflict: resolved; it still applies alone to 1.1.0" in printed
    assert "warning:" not in printed


def test_a_test_on_a_private_upstream_name_skips_naming_it_and_the_release():
    from upstream_api import release, require

    require(True, "anything")  # present: the test goes on
    with pytest.raises(pytest.skip.Exception) as skipped:
        require(False, "runtime_context.use_context")
    assert str(skipped.value) == (
        f"needs upstream's runtime_context.use_context, which sglang {release()} does not have"
    )
    assert release() == load_pin().version  # the installed engine is the pinned release


def test_the_rebase_writes_the_release_and_flag_table_into_the_docs(fork, capsys):
    """A dropped patch's flag leaves the README's table, the docs quote the new release; a
    hand-written mention of the dropped flag is named as a warning."""
    from forklib import docs

    lay = fork
    root = lay.root
    patch = root / "patches/0004-upstream.patch"
    patch.write_text(
        patch.read_text().replace("Server-Args: none", "Server-Args: --fake-up")
    )
    (root / "docs").mkdir()
    (root / docs.FLAGS_FILE).write_text(
        '[[flag]]\nflag = "--fake-up"\nusage = "--fake-up"\npage = "docs/x.md"\n'
        'default = "off"\nwhat = "a fake flag"\n'
        + "".join(
            f'\n[[patch]]\npatch = "{n}"\nwhat = "about {n}"\n'
            for n in ("0001-clean", "0002-merged", "0003-conflict", "0005-clash")
        )
    )
    (root / "README.md").write_text(
        f"Over sglang 1.0.0.\n\n{docs.BEGIN}\n{docs.END}\n\nlaunch with --fake-up\n"
        "--version prints 1.0.0+fork.5.3f9a1c2\n"
    )
    (root / "docker").mkdir()
    (root / "docker/README.md").write_text(
        "for example `1.0.0+fork.5.xxxxxxx`; the image of 1.0.0\n"
    )
    (root / "CONTRIBUTING.md").write_text(
        f"Pinned: 1.0.0.\n\n{docs.REBASE_SECTION}\n\n`make rebase TO=1.0.1`, from 1.0.0\n"
    )
    docs.write(root, load_series(lay.series_file))
    assert (
        "| [`--fake-up`](docs/x.md) | off | a fake flag | 0004 |"
        in (root / "README.md").read_text()
    )
    git(root, "add", "-A")
    git(root, "commit", "-qm", "docs")
    assert rebase.start("1.1.0", lay) == 1
    (lay.repo / "python/sglang/c.py").write_text(
        set_line(lines("c"), 10, "c10 = 'both'")
    )
    git(lay.repo, "add", "python/sglang/c.py")
    assert rebase.resume(lay, drop=["4", "5"]) == 0
    readme = (root / "README.md").read_text()
    assert readme.startswith("Over sglang 1.1.0.") and "[`--fake-up`]" not in readme
    assert "about 0001-clean" in readme and "about 0005-clash" not in readme
    # an example build names the new release and the kept series' length
    assert "--version prints 1.1.0+fork.3.3f9a1c2\n" in readme
    assert (root / "docker/README.md").read_text() == (
        "for example `1.1.0+fork.3.xxxxxxx`; the image of 1.0.0\n"
    )
    contributing = (root / "CONTRIBUTING.md").read_text()
    assert contributing.startswith("Pinned: 1.1.0.")
    assert (
        "`make rebase TO=1.0.1`, from 1.0.0" in contributing
    )  # the rebase section's own
    assert re.search(
        r"warning: README.md:\d+: names --fake-up, a flag of no patch in the series",
        capsys.readouterr().out,
    )


def test_a_tool_test_of_a_dropped_patch_skips_naming_it_and_the_release(tmp_path):
    from upstream_api import require_patch

    series = tmp_path / "series"
    series.write_text(
        "0001-kept.patch\n# dropped in the rebase from 1.1.0 to 1.0.0: 0002-gone "
        "(tests: test/test_gone.py)\n"
    )
    require_patch("0001-kept", "kept_module", series)  # carried: the test goes on
    with pytest.raises(pytest.skip.Exception) as skipped:
        require_patch("0002-gone", "gone_module", series)
    assert str(skipped.value) == (
        "needs gone_module of patch 0002-gone, which the rebase onto sglang 1.0.0 dropped: "
        "1.0.0 lacks the code it edits (patches/series says so)"
    )
