"""Assemble the patched tree: upstream release as the root commit, one commit per patch.

The tree mirrors upstream's repository layout (``python/sglang/...``), so a diff of it is a
diff against upstream's own sources and an exported patch applies there unchanged.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import shutil
import stat
import zipfile
from pathlib import Path

from . import REPO_ROOT, ForkError
from .git import git, out, out_diff, show
from .series import Patch

PKG = "python/sglang"
STAMP_FILES = (f"{PKG}/_version.py", f"{PKG}/_fork_manifest.json")


@dataclasses.dataclass(frozen=True)
class Applied:
    patch: Patch
    commit: str


@dataclasses.dataclass(frozen=True)
class Assembled:
    tree: Path
    upstream_version: str
    base: str  # the upstream commit
    applied: list[Applied]
    version: str  # PEP 440 version of the forked engine
    head: str


class PatchError(ForkError):
    """A patch that does not apply exactly (the message names the patch and the hunk)."""


def upstream_ref(version: str) -> str:
    return f"upstream/{version}"


def import_release(tree: Path, wheel: Path, version: str) -> str:
    """Commit the wheel's ``sglang/`` as ``python/sglang`` on branch ``upstream/<version>``.

    Reused when the branch already holds this exact wheel (its sha256 is in the message).
    """
    sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
    message = (
        f"upstream sglang {version}\n\nImported from {wheel.name}\nsha256: {sha}\n"
    )
    ref = upstream_ref(version)
    if not (tree / ".git").exists():
        tree.mkdir(parents=True, exist_ok=True)
        git(tree, "init", "-q")
        # A conflict (git am -3 in an editing tree, a rebase's replay) shows the base too, so
        # our lines stand apart from upstream's newer code.
        git(tree, "config", "merge.conflictStyle", "zdiff3")
    have = git(tree, "log", "-1", "--format=%B", ref, check=False)
    if have.returncode == 0 and f"sha256: {sha}" in have.stdout:
        return out(tree, "rev-parse", ref)
    git(tree, "checkout", "-q", "--orphan", f"import-{version}")
    git(tree, "rm", "-rqf", "--ignore-unmatch", ".")
    _clean_worktree(tree)
    extract_package(wheel, tree / "python")
    git(tree, "add", "-A")
    git(tree, "commit", "-q", "-m", message)
    git(tree, "branch", "-f", ref)
    commit = out(tree, "rev-parse", "HEAD")
    git(tree, "checkout", "-q", "--detach", commit)
    git(tree, "branch", "-D", f"import-{version}")
    return commit


def _clean_worktree(tree: Path) -> None:
    for child in tree.iterdir():
        if child.name != ".git":
            shutil.rmtree(child) if child.is_dir() else child.unlink()


def extract_package(wheel: Path, dest: Path) -> None:
    """Extract ``sglang/`` from a wheel, keeping file modes (the .so files stay executable)."""
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            if not info.filename.startswith("sglang/") or info.is_dir():
                continue
            path = dest / info.filename
            path.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, open(path, "wb") as dst:
                shutil.copyfileobj(src, dst)
            mode = (info.external_attr >> 16) & 0o777
            if mode & stat.S_IXUSR:
                path.chmod(0o755)


def apply_patch(
    tree: Path, patch: Patch, src: Path = REPO_ROOT, three_way: bool = False
) -> str:
    """Apply one patch exactly (no fuzz, no offset), add the files it owns (from ``src``), commit.

    ``three_way`` (editing trees only, never a build): a patch that no longer applies exactly
    is merged with ``git am -3`` instead, so ``refresh`` can write it back exactly.
    """
    problems = []
    if patch.files:
        check = git(tree, "apply", "--check", "-v", str(patch.path), check=False)
        problems = apply_problems(patch, check.stderr)
        if check.returncode != 0 and not problems:
            problems = [check.stderr.strip()]
    clash = [
        f"owns {own}, but upstream already ships a file there"
        for own in patch.owns
        if (tree / own).exists()
    ]
    if clash or (problems and not three_way):
        raise PatchError(
            f"patch {patch.path.name} does not apply exactly:\n  "
            + "\n  ".join(problems + clash)
        )
    if problems:
        print(
            f"  {patch.path.name}: merged with git am -3 (" + "; ".join(problems) + ")",
            flush=True,
        )
    before = out(tree, "rev-parse", "HEAD")
    if patch.files:
        merged = git(
            tree,
            "am",
            "-q",
            "-3" if problems else "--no-3way",
            str(patch.path),
            check=False,
        )
    else:  # no upstream file edited: nothing for git am to apply, only the message
        merged = _commit_message_only(tree, patch)
    copy_files(patch.owns, src, tree)
    if merged.returncode != 0:
        raise PatchError(
            f"patch {patch.path.name} conflicts with the patches before it; the merge is left in "
            f"{tree}: resolve the conflicts there, `git add -A` (the files it owns are already "
            "copied in), `git am --continue`, then `tools/fork tree --continue` merges the rest "
            f"of the series; `tools/fork refresh` writes it back.\n{merged.stdout.strip()}"
        )
    if out(tree, "rev-parse", "HEAD") == before:
        # git am made no commit (its change is in the tree already): amending now would fold
        # this patch into the one before it.
        raise PatchError(
            f"patch {patch.path.name} changes nothing on top of the patches before it (an earlier "
            "patch makes the same edit?): it made no commit; fix the series before going on"
        )
    if patch.owns:
        git(tree, "add", "--", *patch.owns)
        git(tree, "commit", "-q", "--amend", "--no-edit")
    return out(tree, "rev-parse", "HEAD")


def _commit_message_only(tree: Path, patch: Patch):
    """Commit a patch that edits no upstream file (its owned files are added next), with the
    author, date and message ``git am`` would take from it."""
    info = git(
        tree, "mailinfo", "/dev/null", "/dev/null", input=patch.path.read_text()
    ).stdout
    fields = dict(line.split(": ", 1) for line in info.splitlines() if ": " in line)
    env = {
        "GIT_AUTHOR_NAME": fields.get("Author", ""),
        "GIT_AUTHOR_EMAIL": fields.get("Email", ""),
        "GIT_AUTHOR_DATE": fields.get("Date", ""),
    }
    message = (
        f"{patch.subject}\n\n{patch.body}\n" if patch.body else patch.subject + "\n"
    )
    return git(
        tree,
        "commit",
        "-q",
        "--allow-empty",
        "-F",
        "-",
        input=message,
        env=env,
        check=False,
    )


def copy_files(paths: list[str], src: Path, dst: Path) -> None:
    """Copy repository-relative ``paths`` from one root to another (owned files: repo <-> tree)."""
    for path in paths:
        (dst / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src / path, dst / path)


def hunk_texts(
    patch: Patch,
) -> dict[str, list[tuple[str, list[str], list[str], list[str]]]]:
    """Each file's hunks, in order: (header, context lines, removed lines, added lines)."""
    hunks: dict[str, list[tuple[str, list[str], list[str], list[str]]]] = {}
    current = None
    for line in patch.path.read_text().splitlines():
        m = re.match(r"^diff --git a/(\S+) b/", line)
        if m:
            current = m.group(1)
            hunks[current] = []
        elif line.startswith("@@") and current is not None:
            hunks[current].append((line, [], [], []))
        elif current is not None and hunks[current] and line[:1] in (" ", "-", "+"):
            hunks[current][-1][" -+".index(line[0]) + 1].append(line[1:])
    return hunks


def diff_hunks(diff: str) -> list[tuple[str, int, list[str]]]:
    """(file, first old line, old-side lines as " x" / "-x") of each hunk of a unified diff."""
    hunks: list[tuple[str, int, list[str]]] = []
    current = None
    for line in diff.splitlines():
        if m := re.match(r"^diff --git a/(\S+) b/", line):
            current = m.group(1)
        elif (m := re.match(r"^@@ -(\d+)(?:,\d+)? \+", line)) and current:
            hunks.append((current, int(m.group(1)), []))
        elif hunks and line[:1] in (" ", "-"):
            hunks[-1][2].append(line)
    return hunks


def adjacent_lines(
    tree: Path, commit: str, owners: dict[str, str]
) -> list[tuple[str, int, str, str]]:
    """The lines of another patch that ``commit``'s hunks lean on: (file, line in the
    parent, text, owning patch) for each context or removed line of its diff whose last
    change, by ``git blame`` of the parent, is a commit in ``owners`` (commit -> patch name).
    Such a hunk applies only where that patch went in first: it touches the other patch's
    lines (or uses them, when it names what they add)."""
    diff = out_diff(tree, "diff", "-U3", "--no-renames", f"{commit}^", commit)
    found = []
    for path, start, old in diff_hunks(diff):
        if not old:
            continue
        r = git(
            tree,
            "blame",
            "--porcelain",
            "-L",
            f"{start},+{len(old)}",
            f"{commit}^",
            "--",
            path,
            check=False,
        )
        if r.returncode != 0:
            continue
        sha, lineno = None, 0
        for row in r.stdout.splitlines():
            if m := re.match(r"^([0-9a-f]{40}) \d+ (\d+)", row):
                sha, lineno = m.group(1), int(m.group(2))
            elif row.startswith("\t") and sha in owners:
                found.append((path, lineno, row[1:], owners[sha]))
    return found


def _hunks(patch: Patch) -> dict[str, list[str]]:
    """Hunk headers of a patch by file, in order."""
    return {f: [h[0] for h in hs] for f, hs in hunk_texts(patch).items()}


def apply_problems(patch: Patch, stderr: str) -> list[str]:
    """Name each hunk git had to move (offset) or could not place."""
    hunks = _hunks(patch)
    problems = []
    current = None
    for line in stderr.splitlines():
        if m := re.match(r"^Checking patch (\S+)\.\.\.$", line):
            current = m.group(1)
        elif m := re.match(
            r"^Hunk #(\d+) succeeded at (\d+) \((offset|with fuzz) ([^)]*)\)", line
        ):
            idx = int(m.group(1)) - 1
            header = hunks.get(current, [])[idx] if current in hunks else "?"
            problems.append(
                f"{current}: hunk #{idx + 1} {header} matches only at line {m.group(2)} "
                f"({m.group(3)} {m.group(4)}): refresh the patch against this release"
            )
        elif m := re.match(r"^error: patch failed: (\S+):(\d+)$", line):
            path, start = m.group(1), int(m.group(2))
            header = next(
                (
                    h
                    for h in hunks.get(path, [])
                    if int(re.match(r"@@ -(\d+)", h).group(1)) == start
                ),
                f"@@ -{start} @@",
            )
            problems.append(f"{path}: hunk {header} does not match the upstream text")
        elif m := re.match(r"^error: (\S+): No such file or directory$", line):
            problems.append(f"{m.group(1)}: the file does not exist upstream")
    return problems


def fork_version(
    upstream_version: str, patches: list[Patch], src: Path = REPO_ROOT
) -> str:
    """``<upstream>+fork.<number of patches>.<7 hex of the series' content>`` (PEP 440 local)."""
    h = hashlib.sha256(upstream_version.encode())
    for p in patches:
        h.update(p.path.name.encode() + b"\0" + p.path.read_bytes())
        for own in sorted(p.owns):
            h.update(own.encode() + b"\0" + (src / own).read_bytes())
    return f"{upstream_version}+fork.{len(patches)}.{h.hexdigest()[:7]}"


def manifest(upstream_version: str, version: str, patches: list[Patch]) -> dict:
    return {
        "version": version,
        "upstream": upstream_version,
        "series": [
            {
                "name": p.name,
                "subject": p.subject,
                "server_args": p.flags,
                "upstream_status": p.first("Upstream-Status"),
            }
            for p in patches
        ],
    }


def _stamp(
    tree: Path, upstream_version: str, version: str, patches: list[Patch]
) -> None:
    """Record the fork's version where ``sglang.version`` and the fork module read it."""
    local = version.split("+", 1)[1]
    parts = ", ".join(str(int(x)) for x in upstream_version.split(".") if x.isdigit())
    (tree / STAMP_FILES[0]).write_text(
        "# Written by tools/fork when the tree was assembled; do not edit.\n"
        f"__version__ = version = {version!r}\n"
        f"__version_tuple__ = version_tuple = ({parts}, {local!r})\n"
        "__commit_id__ = commit_id = None\n"
    )
    (tree / STAMP_FILES[1]).write_text(
        json.dumps(manifest(upstream_version, version, patches), indent=1) + "\n"
    )
    git(tree, "add", "--", *STAMP_FILES)
    git(tree, "commit", "-q", "-m", f"fork stamp: sglang {version}")


def assemble(
    tree: Path,
    wheel: Path,
    upstream_version: str,
    patches: list[Patch],
    stamp: bool = True,
    src: Path = REPO_ROOT,
    three_way: bool = False,
) -> Assembled:
    """Upstream root commit + one commit per patch; ``src`` is the fork repository holding
    the owned files (another one in tests); ``three_way`` only for editing trees."""
    if (
        tree / ".git" / "rebase-apply"
    ).exists():  # a stopped `git am` (editing tree): start afresh
        print(f"  {tree}: discarding the unfinished `git am` left there", flush=True)
        git(tree, "am", "--abort", check=False)
        shutil.rmtree(tree / ".git" / "rebase-apply", ignore_errors=True)
    base = import_release(tree, wheel, upstream_version)
    git(tree, "checkout", "-q", "-f", "-B", "fork", base)
    git(tree, "clean", "-qfdx")
    applied = []
    for p in patches:
        applied.append(Applied(p, apply_patch(tree, p, src, three_way)))
    version = fork_version(upstream_version, patches, src)
    if stamp:
        _stamp(tree, upstream_version, version, patches)
    return Assembled(
        tree, upstream_version, base, applied, version, out(tree, "rev-parse", "HEAD")
    )


def continue_assembly(
    tree: Path, upstream_version: str, patches: list[Patch], src: Path = REPO_ROOT
) -> list[Applied]:
    """After a conflict stopped an editing tree and the person finished ``git am --continue``:
    merge the rest of the series (git am -3), each with the files it owns."""
    if (tree / ".git" / "rebase-apply").exists():
        raise PatchError(
            f"a `git am` is still in progress in {tree}: resolve, `git add -A`, "
            "`git am --continue`, then continue the tree again"
        )
    base = out(tree, "merge-base", "HEAD", upstream_ref(upstream_version))
    done = len(out(tree, "rev-list", f"{base}..HEAD").split())
    if done > len(patches):
        raise PatchError(
            f"{tree} holds {done} commits above upstream, the series only {len(patches)}"
        )
    return [
        Applied(p, apply_patch(tree, p, src, three_way=True)) for p in patches[done:]
    ]


def numstat(
    tree: Path, parent: str, commit: str, paths: list[str] | None = None
) -> tuple[int, int]:
    """Lines added and removed between two commits (optionally only in ``paths``)."""
    text = out(tree, "diff", "--numstat", parent, commit, "--", *(paths or []))
    added = removed = 0
    for line in text.splitlines():
        a, r, _ = line.split("\t", 2)
        if a != "-":
            added, removed = added + int(a), removed + int(r)
    return added, removed


# ---------------------------------------------------------------------------- write-back
# Shared by `refresh` and `rebase`: a commit of the tree becomes a patch file + owned files.


def owned_files(tree: Path, commit: str) -> list[str]:
    """The files of ours a commit owns: the ones it adds under python/sglang (not the stamp)."""
    added = out(
        tree,
        "diff",
        "--name-only",
        "--diff-filter=A",
        "--no-renames",
        f"{commit}^",
        commit,
        "--",
        PKG,
    ).split()
    return [f for f in added if f not in STAMP_FILES]


def commit_patch(tree: Path, commit: str, owns: list[str]) -> str:
    """The commit as a patch of upstream files only, its header listing the files it owns.

    Owns: trailers are rewritten from ``owns`` (the files the commit really adds), so a
    header cannot keep naming a file the commit no longer carries.
    """
    excludes = [f":(exclude){o}" for o in owns]
    fmt = (
        "format-patch",
        "-1",
        commit,
        "--stdout",
        "--zero-commit",
        "--no-signature",
        "--full-index",
    )
    if out(tree, "diff", "--name-only", f"{commit}^", commit, "--", ".", *excludes):
        text = out_diff(tree, *fmt, "--", ".", *excludes) + "\n"
        head, sep, diff = text.partition("\n---\n")
    else:  # only files of ours: a pathspec would make format-patch walk back to an older commit
        head, sep, _ = (out_diff(tree, *fmt) + "\n").partition("\n---\n")
        diff = "\n"
    head = "\n".join(line for line in head.split("\n") if not line.startswith("Owns: "))
    trailers = [arg for own in owns for arg in ("--trailer", f"Owns: {own}")]
    return git(
        tree,
        "interpret-trailers",
        "--if-exists",
        "addIfDifferent",
        *trailers,
        input=head + sep + diff,
    ).stdout


def refresh(
    tree: Path, root: Path = REPO_ROOT, upstream_version: str | None = None
) -> list[str]:
    """Write the commits of ``tree``'s branch ``fork`` back to ``root``'s patches/ and
    python/sglang/; returns what it wrote.

    Refused, with nothing written: an uncommitted change in the tree, a commit that edits a
    file another patch owns (it would land in two places), and a series that does not pass
    ``check``. Everything is staged first and checked there; then moved in.
    """
    from .pin import load_pin
    from .series import DROPPED_RE, check_series, load_series, parse_patch, read_series

    series_file = root / "patches" / "series"
    version = upstream_version or load_pin(root / "upstream.toml").version
    base = out(tree, "merge-base", "fork", upstream_ref(version))
    commits = out(tree, "rev-list", "--reverse", f"{base}..fork").split()
    subjects = [out(tree, "log", "-1", "--format=%s", c) for c in commits]
    if any(s.startswith("fork stamp:") for s in subjects):
        raise ForkError(
            "build/tree holds a stamped build (from `make`), not an editing tree: run "
            "`make tree`, edit and commit there, then `make refresh`"
        )
    if out(tree, "rev-parse", "--abbrev-ref", "HEAD") != "fork":
        raise ForkError(
            f"{tree}: HEAD is not on branch 'fork' (a rebase or am in progress?); finish it first"
        )
    dirty = out(tree, "status", "--porcelain", "--untracked-files=no")
    if dirty:
        raise ForkError(
            f"{tree} has uncommitted changes (commit them, or `git checkout` them away):\n  "
            + "\n  ".join(dirty.splitlines())
        )

    # Each commit keeps its patch's name: matched by subject, else by position, else new.
    old_paths = read_series(series_file) if series_file.exists() else []
    old = {}
    for path in old_paths:
        if path.exists():
            old.setdefault(parse_patch(path).subject, path.name)
    old_names = [p.name for p in old_paths]
    # A new patch is numbered past the series' last number, never one that is taken or freed.
    last = max((int(n[:4]) for n in old_names if n[:4].isdigit()), default=0)
    names: list[str] = []
    for i, (commit, subject) in enumerate(zip(commits, subjects)):
        name = old.get(subject)
        if name is None or name in names:
            name = (
                old_names[i]
                if i < len(old_names) and old_names[i] not in old.values()
                else None
            )
        if name is None or name in names:
            slug = "-".join(
                out(tree, "log", "-1", "--format=%f", commit).split("-")[:6]
            )
            last = max(last, i) + 1
            name = f"{last:04d}-{slug}.patch"
        names.append(name)

    owner: dict[str, tuple[str, str]] = {}
    owns_of, problems = [], []
    for commit, name in zip(commits, names):
        owns = owned_files(tree, commit)
        edited = out(
            tree, "diff", "--name-only", "--no-renames", f"{commit}^", commit, "--", PKG
        ).split()
        for f in sorted(set(edited) - set(owns)):
            if f in owner:
                problems.append(
                    f"commit {commit[:10]} ({name.removesuffix('.patch')}) edits {f}, which "
                    f"{owner[f][0].removesuffix('.patch')} owns (files of ours belong to one patch "
                    "whole): move the edit into that patch's commit: `git reset HEAD^` (or an "
                    f"interactive rebase to that commit), then `git commit --fixup={owner[f][1][:10]} "
                    f"-- {f}` and `git rebase -i --autosquash {base[:10]}` in {tree}"
                )
        owner.update({f: (name, commit) for f in owns})
        owns_of.append(owns)
    if problems:
        raise ForkError("refresh wrote nothing:\n  " + "\n  ".join(problems))

    staged = tree.parent / "refresh"
    shutil.rmtree(staged, ignore_errors=True)
    (staged / "patches").mkdir(parents=True)
    for commit, name, owns in zip(commits, names, owns_of):
        for own in owns:
            (staged / own).parent.mkdir(parents=True, exist_ok=True)
            (staged / own).write_bytes(_show(tree, commit, own))
        (staged / "patches" / name).write_text(commit_patch(tree, commit, owns))
    # A rebase's comments on the patches it dropped stay (conftest skips their tests by them).
    dropped = (
        [
            line
            for line in series_file.read_text().splitlines()
            if DROPPED_RE.match(line.strip())
        ]
        if series_file.exists()
        else []
    )
    (staged / "patches" / "series").write_text(
        "".join(n + "\n" for n in names + dropped)
    )
    for extra in ("test",):  # what a header names besides our files
        if (root / extra).exists():
            (staged / extra).symlink_to(root / extra)
    try:
        check_series(load_series(staged / "patches" / "series"), staged)
    except ForkError as e:
        raise ForkError(f"refresh wrote nothing: {e}") from None

    owned = {f for owns in owns_of for f in owns}
    for f in (root / PKG).rglob("*") if (root / PKG).exists() else []:
        if (
            f.is_file()
            and "__pycache__" not in f.parts
            and str(f.relative_to(root)) not in owned
        ):
            f.unlink()
    for f in (root / "patches").glob("*.patch"):
        if f.name not in names:
            f.unlink()
    wrote = []
    for f in sorted(staged.rglob("*")):
        if (
            f.is_file()
            and not f.is_symlink()
            and "test" not in f.relative_to(staged).parts[:1]
        ):
            dst = root / f.relative_to(staged)
            dst.parent.mkdir(parents=True, exist_ok=True)
            if not dst.exists() or dst.read_bytes() != f.read_bytes():
                shutil.copyfile(f, dst)
                wrote.append(str(f.relative_to(staged)))
    shutil.rmtree(staged)
    return wrote


def _show(tree: Path, commit: str, path: str) -> bytes:
    return show(tree, commit, path)
