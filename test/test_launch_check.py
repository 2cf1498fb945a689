"""``tools/fork check -- ARGS``: a launch command's arguments checked on a CPU machine.

Each case runs the command as a user would (the tool, then ``.venv``'s engine), on the small
Llama config of the resolution tests: an accepted command lists the fork flags it turns on,
a bad value is refused by the argument parser, a useless combination by its validator, and a
model whose config cannot be read is reported as not checked (never as accepted).
"""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO


def fork_check(*launch_args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "tools" / "fork"), "check", "--", *launch_args],
        capture_output=True,
        text=True,
    )


def test_an_accepted_command_lists_the_flags_it_turns_on(llama_config):
    r = fork_check(
        "--model-path", str(llama_config), "--enable-loop-abort",
        "--loop-abort-max-period", "64",
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "accepted:" in r.stdout
    on = r.stdout.split("fork flags on:")[1].split("fork flags off:")[0]
    assert on.split() == [
        "--enable-loop-abort",
        "True",
        "--loop-abort-max-period",
        "64",
    ]
    assert "refused" not in r.stdout


def test_upstream_s_command_turns_nothing_on(llama_config):
    r = fork_check("--model-path", str(llama_config))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "fork flags on: none" in r.stdout


def test_a_bad_value_is_refused_by_its_type_parser(llama_config):
    r = fork_check("--model-path", str(llama_config), "--loop-abort-min-tokens", "x")
    assert r.returncode == 1
    assert "refused" in r.stdout and "accepted:" not in r.stdout
    assert "--loop-abort-min-tokens 'x' is not an accepted value" in r.stderr


def test_a_useless_combination_is_refused_by_its_validator(llama_config):
    r = fork_check("--model-path", str(llama_config), "--loop-abort-min-tokens", "600")
    assert r.returncode == 1
    assert (
        "refused: --loop-abort-min-tokens without --enable-loop-abort would do nothing; "
        "add --enable-loop-abort" in r.stdout
    )


def test_a_model_config_it_cannot_read_is_not_checked(tmp_path):
    r = fork_check("--model-path", str(tmp_path / "absent"), "--enable-loop-abort")
    assert r.returncode == 2
    assert "not checked" in r.stdout and "accepted:" not in r.stdout
