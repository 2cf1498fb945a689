"""Upstream's formatters (black, isort, codespell at its pinned versions) pass on every file we
own, and the check fails on a file they would change (a misformatted copy in a scratch repository)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from forklib.lint import lint

BIN = Path(sys.executable).parent


def test_the_repository_is_formatted_as_upstream_formats():
    assert lint(BIN) == []


def test_a_misformatted_file_and_a_typo_are_reported(tmp_path):
    repo = tmp_path / "r"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "ok.py").write_text('"""A module."""\n\nimport os\n\nX = os.sep\n')
    (repo / "bad.py").write_text("import sys, os\nx = {  'a':1 }\n")
    (repo / "notes.md").write_text("the re" + "cieved value\n")  # not a typo of ours
    subprocess.run(["git", "-C", str(repo), "add", "-A"], check=True)
    problems = "\n".join(lint(BIN, repo))
    assert "would reformat" in problems and "bad.py" in problems  # black
    assert "isort" in problems and "bad.py" in problems
    assert "re" + "cieved ==> received" in problems  # codespell
    assert "ok.py" not in problems
    assert (
        lint(BIN, repo, fix=True) is not None and lint(BIN, repo) == []
    )  # --fix mends all
    shutil.rmtree(repo)


def test_a_file_deleted_but_not_committed_is_not_read(tmp_path):
    """A rebase that drops a patch deletes its modules from the work tree; lint runs before
    that is committed and reads only the files that are there."""
    repo = tmp_path / "r"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "ok.py").write_text('"""A module."""\n\nimport os\n\nX = os.sep\n')
    (repo / "gone.py").write_text('"""Dropped."""\n')
    subprocess.run(["git", "-C", str(repo), "add", "-A"], check=True)
    (repo / "gone.py").unlink()
    assert lint(BIN, repo) == []
    shutil.rmtree(repo)


def test_an_unused_import_and_a_script_without_a_run_bit_are_reported(tmp_path):
    """ruff's F401 at upstream's pin over our Python files (an extensionless script named in
    PYTHON_SCRIPTS too), and upstream's check-shebang-scripts-are-executable over every tracked
    file: each is reported, and neither in a file that keeps the rule."""
    repo = tmp_path / "r"
    (repo / "tools").mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "used.py").write_text('"""Used."""\n\nimport os\n\nX = os.sep\n')
    (repo / "unused.py").write_text('"""Unused."""\n\nimport os\n\nX = 1\n')
    (repo / "tools/fork").write_text(
        '#!/usr/bin/env python3\n"""A script."""\n\nimport sys\n'
    )
    (repo / "run.sh").write_text("#!/bin/bash\necho ok\n")
    (repo / "ran.sh").write_text("#!/bin/bash\necho ok\n")
    subprocess.run(["git", "-C", str(repo), "add", "-A"], check=True)
    for script in ("ran.sh", "tools/fork"):
        subprocess.run(
            ["git", "-C", str(repo), "update-index", "--chmod=+x", script], check=True
        )
    problems = lint(BIN, repo)
    assert [p.split(":", 1)[0] for p in problems] == ["ruff", "run bits"]
    ruff, unset = problems[0].splitlines(), problems[1].splitlines()[1:]
    assert [line.split(" ", 2)[:2] for line in ruff if ": F401" in line] == [
        ["tools/fork:4:8:", "F401"],
        ["unused.py:3:8:", "F401"],
    ]
    assert unset == ["run.sh"]
    shutil.rmtree(repo)
