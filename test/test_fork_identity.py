"""Patch 0001: the installed engine says which fork build it is, and its flags follow the convention."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import subprocess
import sys

import pytest
from conftest import REPO, UPSTREAM, run_engine

import sglang.fork as fork
from sglang.version import __version__


def test_version_is_the_fork_version(series):
    assert re.fullmatch(re.escape(UPSTREAM) + r"\+fork\.\d+\.[0-9a-f]{7}", __version__)
    assert fork.fork_version() == __version__
    assert [p["name"] for p in fork.manifest()["series"]] == [p.name for p in series]


def test_launch_server_version_lists_the_series(series):
    r = run_engine("-m", "sglang.launch_server", "--version", check=True)
    lines = r.stdout.splitlines()
    assert lines[0].startswith(
        f"sglang {__version__} (fork of sglang {UPSTREAM}; {len(series)} patch(es))"
    )
    for patch in series:
        assert f"  {patch.name}: {' '.join(patch.flags) or '(no flags)'}" in lines


def _help_entries() -> dict[str, str]:
    """``--flag`` -> its help text, from the installed engine's --help."""
    text = run_engine("-m", "sglang.launch_server", "--help", check=True).stdout
    entries: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        m = re.match(r"^  (--[a-z0-9-]+)", line)
        if m:
            current = m.group(1)
            entries[current] = line[m.end() :]
        elif current and line.startswith("    "):
            entries[current] += " " + line.strip()
    return {k: re.sub(r"\s+", " ", v) for k, v in entries.items()}


def test_help_lists_every_fork_flag_with_its_default(series):
    entries = _help_entries()
    flags = [f for p in series for f in p.flags]
    assert flags and set(flags) <= set(entries)
    for flag in flags:
        assert (
            "(default: " in entries[flag]
        ), f"{flag}: help text does not state its default"


def test_bad_fork_flag_value_is_a_clear_error():
    r = run_engine(
        "-m",
        "sglang.launch_server",
        "--model-path",
        "m",
        "--fork-expect-version",
        "1.2",
    )
    assert r.returncode == 2
    assert "argument --fork-expect-version" in r.stderr and "accepted form" in r.stderr


def _view(**kwargs):
    from sglang.srt.server_args import ServerArgs

    return ServerArgs(model_path="m", **kwargs)


def test_wrong_fork_build_refuses_to_start():
    from sglang.srt.arg_groups.fork_hook import handle_fork

    with pytest.raises(ValueError, match="refusing to start"):
        handle_fork(_view(fork_expect_version=f"{UPSTREAM}+fork.1.0000000"))
    with pytest.raises(
        argparse.ArgumentTypeError, match="accepted form"
    ):  # Engine(...) skips argparse
        handle_fork(_view(fork_expect_version="latest"))


def test_startup_line_names_every_fork_flag_and_its_value(caplog, series):
    from sglang.srt.arg_groups.fork_hook import handle_fork

    with caplog.at_level(logging.INFO, logger="sglang.srt.arg_groups.fork_hook"):
        handle_fork(_view(fork_expect_version=__version__))
    (line,) = [r.getMessage() for r in caplog.records if "fork flags" in r.getMessage()]
    assert line.startswith(f"sglang {__version__} fork flags: ")
    for flag in (f for p in series for f in p.flags):
        assert f"{flag}=" in line
    assert f"--fork-expect-version={__version__}" in line


def test_launch_refuses_a_wrong_build_before_touching_the_model():
    """End to end through `launch_server`: resolution runs the fork hook first."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "tools" / "standins")}
    r = subprocess.run(
        [
            sys.executable,
            "-W",
            "ignore",
            "-m",
            "sglang.launch_server",
            "--model-path",
            "/nonexistent",
            "--fork-expect-version",
            f"{UPSTREAM}+fork.1.0000000",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode != 0
    assert f"but this engine is sglang {__version__}" in r.stderr
    assert "HFValidationError" not in r.stderr  # the model path was never looked at


def _parser_defaults(pythonpath: str | None) -> dict[str, str]:
    code = (
        "import argparse, json; from sglang.srt.server_args import ServerArgs; "
        "p = argparse.ArgumentParser(); ServerArgs.add_cli_args(p); "
        "print(json.dumps({a.option_strings[0]: repr(a.default) for a in p._actions if a.option_strings}))"
    )
    env = {**os.environ, "PYTHONPATH": pythonpath} if pythonpath else None
    r = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return json.loads(r.stdout)


def test_flags_off_every_upstream_argument_is_unchanged(assembled, series, tmp_path):
    """Fork = upstream's arguments and defaults + the fork flags, nothing else."""
    from forklib.git import git

    upstream = tmp_path / "upstream"
    git(
        assembled.tree,
        "worktree",
        "add",
        "-q",
        "--detach",
        str(upstream),
        assembled.base,
    )
    theirs = _parser_defaults(str(upstream / "python"))
    ours = _parser_defaults(None)
    flags = {f for p in series for f in p.flags}
    assert {k: v for k, v in ours.items() if k not in flags} == theirs
    assert all(ours[f] == "None" or ours[f] in ("False", "'off'", "1.0") for f in flags)


def test_help_shows_each_fork_flag_beside_its_areas_flags(series):
    """In --help a fork flag sits in its upstream namespace's run of flags (the DSpark flags
    together), and a flag with choices shows them as upstream's choice flags do."""
    from sglang.srt.arg_groups.arg_utils import namespace_of
    from sglang.srt.server_args import ServerArgs

    text = run_engine("-m", "sglang.launch_server", "--help", check=True).stdout
    order = list(_help_entries())
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    fields = namespace_of(ServerArgs)
    # flag -> namespace through each flag's dest (--fp8-gemm-backend stores fp8_gemm_runner_backend)
    ns = {
        o: fields[a.dest]
        for a in parser._actions
        for o in a.option_strings
        if a.dest in fields
    }
    ours = {f for p in series for f in p.flags}
    for flag in ours:
        i = order.index(flag)
        before = next(f for f in reversed(order[:i]) if f not in ours and f in ns)
        assert (
            ns.get(before) == ns[flag]
        ), f"{flag} ({ns[flag]}) follows {before} ({ns.get(before)})"
    dspark = [i for i, f in enumerate(order) if f.startswith("--speculative-dspark-")]
    assert dspark == list(range(dspark[0], dspark[0] + len(dspark)))
    assert "--dsv4-wo-a-fp8-twin {off,small,mid,drop}" in text


def test_sglang_serve_version_and_sglang_version_name_the_series(series):
    code = "import sys; from sglang.cli.main import main; sys.argv = ['sglang', *sys.argv[1:]]; main()"
    for argv in (["serve", "--version"], ["version"]):
        r = run_engine("-c", code, *argv)
        assert r.returncode == 0, r.stderr[-3000:]
        assert (
            f"sglang {__version__} (fork of sglang {UPSTREAM}; {len(series)} patch(es))"
            in r.stdout
        )
        assert all(f"  {p.name}: " in r.stdout for p in series)
