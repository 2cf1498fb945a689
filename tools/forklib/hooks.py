"""Upstream's Python pre-commit hooks on an exported diff, as upstream's CI would run them on a PR.

Upstream's own files are not all clean under its pinned black and isort (many would be
rewritten unpatched), so a hunk of ours in an upstream file is held to the lines it adds: black
with ``--line-ranges`` over the added lines, isort on the whole file where the upstream file was
isort-clean before the patch and on each import statement we add or edit in every file (see
``misplaced_imports``), codespell on the added lines. A file the diff creates is held whole. The
versions and settings are ``lint.py``'s (upstream's ``.pre-commit-config.yaml``).
"""

from __future__ import annotations

import ast
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


Neighbours = tuple[str | None, str, str, str, str | None]


def import_neighbours(source: str, added: set[int]) -> dict[int, Neighbours]:
    """Per import statement of ``source`` with a line in ``added``, keyed by its first line:
    (the import statement just before it in the same block or None, the text between the two,
    the statement, the text between it and the next, the next import statement or None), each
    dedented to the statement's indentation.

    A block is one statement list (a module's, a function's, an ``if``'s ...), as isort sorts
    indented imports too; two import statements are neighbours when nothing but comments and
    blank lines lies between them. An upstream statement we edit (a name added to its list)
    counts as ours. A statement inside an ``isort: off`` region, or in a file that says
    ``isort: skip_file``, is left out, as isort does not touch it.
    """
    if "isort: skip_file" in source:
        return {}
    lines = source.splitlines(keepends=True)
    off = [False] * (len(lines) + 2)  # off[n]: line n lies in an `isort: off` region
    for n, line in enumerate(lines, 1):
        if re.search(r"#\s*isort:\s*off\b", line):
            off[n] = True
        elif re.search(r"#\s*isort:\s*on\b", line):
            off[n] = False
        else:
            off[n] = off[n - 1]

    def text(first: int, last: int, indent: int) -> str:
        out = []
        for line in lines[first - 1 : last]:
            if not line.strip():
                out.append("\n")
            else:
                out.append(
                    line[indent:] if not line[:indent].strip() else line.lstrip()
                )
        return "".join(out)

    def span(stmt: ast.stmt) -> tuple[int, int]:
        return stmt.lineno, stmt.end_lineno or stmt.lineno

    found: dict[int, Neighbours] = {}
    for node in ast.walk(ast.parse(source)):
        for field in ("body", "orelse", "finalbody"):
            body = getattr(node, field, None)
            if not isinstance(body, list):
                continue
            is_import = [isinstance(s, (ast.Import, ast.ImportFrom)) for s in body]
            for i, stmt in enumerate(body):
                first, last = span(stmt)
                if (
                    not is_import[i]
                    or off[first]
                    or not added & set(range(first, last + 1))
                ):
                    continue
                ind = stmt.col_offset
                prev_text, before, after, next_text = None, "", "", None
                if i > 0 and is_import[i - 1]:
                    a, b = span(body[i - 1])
                    prev_text, before = text(a, b, ind), text(b + 1, first - 1, ind)
                if i + 1 < len(body) and is_import[i + 1]:
                    a, b = span(body[i + 1])
                    after, next_text = text(last + 1, a - 1, ind), text(a, b, ind)
                found[first] = (
                    prev_text,
                    before,
                    text(first, last, ind),
                    after,
                    next_text,
                )
    return found


def _isort_texts(texts: list[str], isort: str, tmp: Path) -> list[str]:
    """Each text as isort writes it, by one isort run over scratch files in ``tmp``."""
    tmp.mkdir(parents=True, exist_ok=True)
    files = []
    for k, t in enumerate(texts):
        files.append(tmp / f"w{k}.py")
        files[-1].write_text(t)
    if files:
        _run([isort, *ISORT_ARGS, "-q", *map(str, files)], tmp)
    return [f.read_text() for f in files]


def _order(text: str) -> list[str]:
    """What isort's order decides in ``text``: its words (names, keywords, comments) in order,
    and a gap where blank lines separate statements (isort's section break). The wrapping,
    parentheses and commas are formatting, held by black on our lines, and not compared.
    """
    seq: list[str] = []
    for line in text.splitlines():
        if not line.strip():
            if seq and seq[-1] != "":
                seq.append("")
        else:
            seq.extend(re.findall(r"[^\s(),\\]+", line))
    while seq and seq[-1] == "":
        seq.pop()
    return seq


def misplaced_imports(source: str, added: set[int], isort: str, tmp: Path) -> list[int]:
    """First lines of the import statements with a line in ``added`` that isort would move or
    reorder: where upstream's pre-commit isort over the file would put our imports elsewhere,
    even in a file whose upstream imports isort would already reorder (where isort over the
    whole file says nothing about our lines).

    Judged statement by statement, with isort itself as the oracle (two runs in ``tmp``), on
    the order only (``_order``): first each statement and its neighbours (``import_neighbours``)
    alone, where isort must keep the names of ours in order (and not split it); then ours after
    its previous neighbour and before its next, each as isort writes it alone and the text
    between as it is, where isort must keep the order and the section break: ours is in
    isort's order with each neighbour, a blank line between them exactly where a new section
    starts. The neighbours are rewritten alone first because upstream's order inside them is
    not ours to judge. Pairs are held, not the whole block: a block upstream left unsorted may
    have no place in order with all of it, but a place in order with both neighbours is one
    isort leaves alone locally, and in an isort-clean block it is the place isort gives, its
    order being total.
    """
    found = import_neighbours(source, added)
    alone = [t for nb in found.values() for t in (nb[0] or "", nb[2], nb[4] or "")]
    written = iter(_isort_texts(alone, isort, tmp / "alone"))
    moved: set[int] = set()
    pairs: list[tuple[int, str]] = []
    for first, (prev, before, ours, after, nxt) in found.items():
        prev_w, ours_w, nxt_w = next(written), next(written), next(written)
        if _order(ours_w) != _order(ours):
            moved.add(first)
        if prev is not None:
            pairs.append((first, prev_w + before + ours_w))
        if nxt is not None:
            pairs.append((first, ours_w + after + nxt_w))
    written_pairs = _isort_texts([t for _, t in pairs], isort, tmp / "pairs")
    moved |= {
        first for (first, t), w in zip(pairs, written_pairs) if _order(w) != _order(t)
    }
    return sorted(moved)


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
            if not created:
                scratch = Path(tmp) / "isort" / p
                scratch.mkdir(parents=True)
                source = (post / p).read_text()
                moved = misplaced_imports(source, set(lines), isort, scratch)
                if moved:
                    where = ", ".join(map(str, moved))
                    problems.append(
                        f"{p}: isort would reorder the imports we add at "
                        f"line(s) {where}"
                    )
            r = _run([codespell, *CODESPELL_ARGS, p], post)
            added = set(lines)
            for hit in r.stdout.splitlines():
                m = re.match(rf"{re.escape(p)}:(\d+):", hit)
                if m and (created or int(m.group(1)) in added):
                    problems.append(f"codespell: {hit}")
    return problems
