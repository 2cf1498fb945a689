"""Upstream's Python pre-commit hooks on an exported diff (``forklib.hooks.check_diff``): black on
the lines a hunk adds to an upstream file, isort on the whole file where it was isort-clean and
on the order of the imports we add in every file, codespell on the added lines, the whole of a
file the diff creates. ``test_export.py`` runs it on every real patch's ``make export`` output;
here it must fail on each kind of problem and only on ours."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from forklib.hooks import added_lines, check_diff, import_neighbours, line_ranges
from forklib.lint import ISORT_ARGS

BIN = Path(sys.executable).parent
TYPO = "recie" + "ved"  # split, so codespell over this file does not flag it

# upstream's own lines: black would reformat the dict, isort would reorder nothing
UPSTREAM_MESSY = (
    "import os\nimport sys\n\nx = {  'a':1 }\n\n\ndef f():\n    return os.sep\n"
)
UPSTREAM_CLEAN = "import os\nimport sys\n\n\ndef f():\n    return os.sep\n"


def _diff(tmp_path: Path, files: dict[str, tuple[str, str]]) -> tuple[Path, Path]:
    """(the diff from each file's old to new text, the upstream tree holding the old texts)."""
    repo = tmp_path / "repo"
    repo.mkdir()
    run = lambda *a: subprocess.run(
        ["git", "-C", str(repo), *a], check=True, capture_output=True, text=True
    )
    run("init", "-q")
    for name, (old, _) in files.items():
        if old is not None:
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            (repo / name).write_text(old)
    run("add", "-A")
    run("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "upstream")
    for name, (_, new) in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(new)
    run("add", "-A")
    diff = tmp_path / "feature.diff"
    diff.write_text(run("diff", "--cached").stdout)
    run("reset", "-q", "--hard")  # the tree goes back to upstream's texts
    run("clean", "-qfd")
    return diff, repo


def test_added_line_ranges():
    text = (
        "diff --git a/p.py b/p.py\n--- a/p.py\n+++ b/p.py\n"
        "@@ -1,3 +1,5 @@\n a\n+b\n+c\n d\n-e\n+f\n"
    )
    assert added_lines(text) == {"p.py": (False, [2, 3, 5])}
    assert line_ranges([5, 2, 3]) == [(2, 3), (5, 5)]


def test_clean_hunks_pass_even_in_a_file_upstream_left_unformatted(tmp_path):
    new = UPSTREAM_MESSY.replace("x = {", "y = 1  # added\nx = {")
    diff, up = _diff(
        tmp_path,
        {
            "python/a.py": (UPSTREAM_MESSY, new),
            "python/ours.py": (None, '"""Ours."""\n\nimport os\n\nZ = os.sep\n'),
        },
    )
    assert check_diff(diff, up, BIN) == []


def test_each_hook_fails_on_our_lines_only(tmp_path):
    messy = UPSTREAM_MESSY.replace(
        "x = {", f"y = {{  'b':2 }}  # the {TYPO} value\nx = {{"
    )
    unsorted = UPSTREAM_CLEAN.replace("import sys\n", "import sys\nimport abc\n")
    diff, up = _diff(
        tmp_path,
        {
            "python/a.py": (UPSTREAM_MESSY, messy),
            "python/b.py": (UPSTREAM_CLEAN, unsorted),
            "python/ours.py": (None, "import sys, os\n\nx = {  'a':1 }\n"),
        },
    )
    problems = "\n".join(check_diff(diff, up, BIN))
    assert "python/a.py: black 24.10.0 would reformat lines 4-4" in problems
    assert f"{TYPO} ==> received" in problems and "a.py:4:" in problems
    assert "python/b.py: isort rejects" in problems
    assert "python/ours.py: black" in problems and "python/ours.py: isort" in problems
    # upstream's own dict on line 5 of a.py is not ours, and a.py was never isort-checked
    assert "lines 5" not in problems and "python/a.py: isort" not in problems


# upstream's imports out of isort's order (sys before os) and in a style isort rewrites (the
# parenthesized typing import): isort over the whole file fails before any patch
UPSTREAM_UNSORTED = (
    "import sys\nimport os\nfrom typing import (\n    Any,\n)\n\nimport torch\n\n"
    "from sglang.srt.b import B\n\n\ndef f():\n    import re\n    import zlib\n"
    "    return re, zlib\n"
)


def _isort_fails(bindir: Path, text: str, tmp_path: Path) -> bool:
    f = tmp_path / "probe.py"
    f.write_text(text)
    cmd = [str(bindir / "isort"), *ISORT_ARGS, "--check-only", "-q", str(f)]
    return subprocess.run(cmd, capture_output=True).returncode != 0


def test_our_imports_are_held_to_isort_order_where_upstream_was_not_clean(tmp_path):
    """In a file upstream left isort-unclean the whole-file isort check is skipped (it would
    fail on upstream's own lines), so before the per-statement check an import we add out of
    order passed; now each misplaced one is refused, and well-placed ones still pass."""
    assert _isort_fails(BIN, UPSTREAM_UNSORTED, tmp_path)
    well_placed = (
        UPSTREAM_UNSORTED.replace("import sys\n", "import abc\nimport sys\n")
        .replace("import torch\n", "import numpy\nimport torch\n")
        .replace(
            "from sglang.srt.b import B\n",
            "from sglang.srt.a import A\nfrom sglang.srt.b import B\n",
        )
        .replace("    import re\n", "    import json\n    import re\n")
    )
    misplaced = (  # our lines: 3 after os, 9 after torch, 12 after B, 17 after re
        "import sys\nimport os\nimport abc\nfrom typing import (\n    Any,\n)\n\n"
        "import torch\nimport numpy\n\nfrom sglang.srt.b import B\nimport json\n\n\n"
        "def f():\n    import re\n    import json\n    import zlib\n    return re, zlib\n"
    )
    names = UPSTREAM_UNSORTED.replace(
        "from sglang.srt.b import B\n",
        "from sglang.srt.b import B\nfrom sglang.srt.c import Z, Y\n",
    )
    diff, up = _diff(
        tmp_path,
        {
            "python/good.py": (UPSTREAM_UNSORTED, well_placed),
            "python/bad.py": (UPSTREAM_UNSORTED, misplaced),
            "python/names.py": (UPSTREAM_UNSORTED, names),
        },
    )
    problems = check_diff(diff, up, BIN)
    assert problems == [
        "python/bad.py: isort would reorder the imports we add at line(s) 3, 9, 12, 17",
        "python/names.py: isort would reorder the imports we add at line(s) 10",
    ]


def test_the_neighbours_of_an_added_import():
    source = "import os\n\n# ours\nimport abc\nx = 1\nif x:\n    import re\n    import json\n"
    found = import_neighbours(source, {3, 4, 8})
    assert found == {
        4: ("import os\n", "\n# ours\n", "import abc\n", "", None),
        8: ("import re\n", "", "import json\n", "", None),
    }
    assert import_neighbours("import os  # isort: skip_file\nimport abc\n", {2}) == {}
    off = "# isort: off\nimport os\nimport abc\n# isort: on\nimport re\n"
    assert list(import_neighbours(off, {3, 5})) == [5]
