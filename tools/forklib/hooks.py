"""Upstream's Python pre-commit hooks on an exported diff, as upstream's CI would run them on a PR.

Upstream's own files are not all clean under its pinned black (many would be reformatted
unpatched), so a hunk of ours in an upstream file is held to the lines it adds: black with
``--line-ranges`` over the added lines, isort only where the upstream file was isort-clean
before the patch, codespell on the added lines. A file the diff creates is held whole. The
versions and settings are ``lint.py``'s (upstream's ``.pre-commit-config.yaml``).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from .git import run as git_run
from .lint import CODESPELL_ARGS, ISORT_ARGS, _tool

_HUNK = re.compile(r"^@@ -\d+(?:,\d+)? \+(\d+)(?:,(\d+))? @@")


def added_lines(diff_text: str) -> dict[str, tuple[bool, list[int]]]:
    """Per file the diff leaves in place: (created by the diff, line numbers of its added lines
    in the new file)."""
    files: dict[str, tuple[bool, list[int]]] = {}
    path, created, lineno = None, False, 0
    for line in diff_text.splitlines():
        if line.startswith("diff --git "):
            path, created = None, False
        elif line.startswith("--- "):
            created = line == "--- /dev/null"
        elif line.startswith("+++ "):
            path = None if line == "+++ /dev/null" else line[len("+++ b/") :]
            if path is not None:
                files[path] = (created, [])
        elif path is not None and (m := _HUNK.match(line)):
            lineno = int(m.group(1))
        elif path is not None and line.startswith("+"):
            files[path][1].append(lineno)
            lineno += 1
        elif path is not None and line.startswith(" "):
            lineno += 1
    return files


def line_ranges(lines: list[int]) -> list[tuple[int, int]]:
    """Consecutive line numbers merged into (first, last) ranges."""
    ranges: list[tuple[int, int]] = []
    for n in sorted(lines):
        if ranges and n == ranges[-1][1] + 1:
            ranges[-1] = (ranges[-1][0], n)
        else:
            ranges.append((n, n))
    return ranges


def _lines_changed(black_diff: str) -> set[int]:
    """Lines of the checked file that black's ``--diff`` rewrites: the lines it removes, and
    for a pure insertion the lines on either side of it."""
    changed: set[int] = set()
    old = 0
    for line in black_diff.splitlines():
        if m := re.match(r"^@@ -(\d+)", line):
            old = int(m.group(1))
        elif not old:
            continue  # the file header
        elif line.startswith("-"):
            changed.add(old)
            old += 1
        elif line.startswith("+"):
            changed |= {old - 1, old}
        elif line.startswith(" "):
            old += 1
    return changed


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)


def check_diff(diff: Path, upstream: Path, bindir: Path) -> list[str]:
    """Apply ``diff`` to a scratch copy of the files it touches in ``upstream`` (a clean tree
    of the pinned release) and run the hooks there; one problem per failing file and hook.
    """
    text = diff.read_text()
    files = {p: v for p, v in added_lines(text).items() if p.endswith(".py")}
    black, isort, codespell = (
        _tool(bindir, n) for n in ("black", "isort", "codespell")
    )
    problems: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        pre, post = Path(tmp) / "pre", Path(tmp) / "post"
        post.mkdir()
        for p in added_lines(text):
            if (upstream / p).is_file():
                for root in (pre, post):
                    (root / p).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(upstream / p, root / p)
        r = git_run(post, "apply", str(diff.resolve()))
        if r.returncode != 0:
            return [f"{diff.name}: does not apply to {upstream}: {r.stderr.strip()}"]
        for p, (created, lines) in sorted(files.items()):
            if not lines:
                continue
            ranges = [] if created else line_ranges(lines)
            cmd = [black, "--diff", "-q"]
            cmd += [f"--line-ranges={a}-{b}" for a, b in ranges]
            touched = _lines_changed(_run([*cmd, p], post).stdout)
            if not created:
                # black also rewrites some statements outside the ranges it is given (upstream's
                # own lines, which it would reformat unpatched): only our lines count
                touched &= set(lines)
            if touched:
                where = ", ".join(f"{a}-{b}" for a, b in line_ranges(list(touched)))
                problems.append(f"{p}: black 24.10.0 would reformat lines {where}")
            isort_check = [isort, *ISORT_ARGS, "--check-only", "-q"]
            if (created or _run([*isort_check, p], pre).returncode == 0) and _run(
                [*isort_check, p], post
            ).returncode != 0:
                why = "" if created else " (the upstream file was isort-clean)"
                problems.append(f"{p}: isort rejects its imports{why}")
            r = _run([codespell, *CODESPELL_ARGS, p], post)
            added = set(lines)
            for hit in r.stdout.splitlines():
                m = re.match(rf"{re.escape(p)}:(\d+):", hit)
                if m and (created or int(m.group(1)) in added):
                    problems.append(f"codespell: {hit}")
    return problems
