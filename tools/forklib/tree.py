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
from .git import git, out
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
    message = f"upstream sglang {version}\n\nImported from {wheel.name}\nsha256: {sha}\n"
    ref = upstream_ref(version)
    if not (tree / ".git").exists():
        tree.mkdir(parents=True, exist_ok=True)
        git(tree, "init", "-q")
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


def apply_patch(tree: Path, patch: Patch, src: Path = REPO_ROOT, three_way: bool = False) -> str:
    """Apply one patch exactly (no fuzz, no offset), add the files it owns (from ``src``), commit.

    ``three_way`` (editing trees only, never a build): a patch that no longer applies exactly
    is merged with ``git am -3`` instead, so ``refresh`` can write it back exactly.
    """
    if not patch.files:
        return _commit_owned_only(tree, patch, src)
    check = git(tree, "apply", "--check", "-v", str(patch.path), check=False)
    problems = apply_problems(patch, check.stderr)
    if check.returncode != 0 and not problems:
        problems = [check.stderr.strip()]
    clash = [f"owns {own}, but upstream already ships a file there"
             for own in patch.owns if (tree / own).exists()]
    if clash or (problems and not three_way):
        raise PatchError(
            f"patch {patch.path.name} does not apply exactly:\n  " + "\n  ".join(problems + clash)
        )
    if problems:
        print(f"  {patch.path.name}: merged with git am -3 (" + "; ".join(problems) + ")", flush=True)
    merged = git(tree, "am", "-q", "-3" if problems else "--no-3way", str(patch.path), check=False)
    copy_files(patch.owns, src, tree)
    if merged.returncode != 0:
        raise PatchError(
            f"patch {patch.path.name} conflicts with the patches before it; the merge is left in "
            f"{tree}: resolve the conflicts there, `git add -A` (the files it owns are already "
            "copied in), `git am --continue`, then `tools/fork tree --continue` merges the rest "
            f"of the series; `tools/fork refresh` writes it back.\n{merged.stdout.strip()}"
        )
    if patch.owns:
        git(tree, "add", "--", *patch.owns)
        git(tree, "commit", "-q", "--amend", "--no-edit")
    return out(tree, "rev-parse", "HEAD")


def _commit_owned_only(tree: Path, patch: Patch, src: Path) -> str:
    """A patch that edits no upstream file (a module of ours only, e.g. a utility that a later
    patch calls): ``git am`` refuses its empty diff, so commit its files with its message,
    author and date as ``git am`` would."""
    if not patch.owns:
        raise PatchError(f"patch {patch.path.name} neither edits an upstream file nor owns one")
    head = patch.path.read_text().partition("\n---\n")[0]
    mail = git(tree, "mailinfo", "-b", "/dev/null", "/dev/null", input=head + "\n---\n").stdout
    info = dict(line.split(": ", 1) for line in mail.splitlines() if ": " in line)
    message = patch.subject + "\n\n" + head.partition("\n\n")[2].strip() + "\n"
    copy_files(patch.owns, src, tree)
    git(tree, "add", "--", *patch.owns)
    env = {"GIT_AUTHOR_NAME": info["Author"], "GIT_AUTHOR_EMAIL": info["Email"],
           "GIT_AUTHOR_DATE": info["Date"]}
    git(tree, "commit", "-q", "-F", "-", input=message, env=env)
    return out(tree, "rev-parse", "HEAD")


def copy_files(paths: list[str], src: Path, dst: Path) -> None:
    """Copy repository-relative ``paths`` from one root to another (owned files: repo <-> tree)."""
    for path in paths:
        (dst / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src / path, dst / path)


def _hunks(patch: Patch) -> dict[str, list[str]]:
    """Hunk headers of a patch by file, in order."""
    hunks: dict[str, list[str]] = {}
    current = None
    for line in patch.path.read_text().splitlines():
        m = re.match(r"^diff --git a/(\S+) b/", line)
        if m:
            current = m.group(1)
            hunks[current] = []
        elif line.startswith("@@") and current is not None:
            hunks[current].append(line)
    return hunks


def apply_problems(patch: Patch, stderr: str) -> list[str]:
    """Name each hunk git had to move (offset) or could not place."""
    hunks = _hunks(patch)
    problems = []
    current = None
    for line in stderr.splitlines():
        if m := re.match(r"^Checking patch (\S+)\.\.\.$", line):
            current = m.group(1)
        elif m := re.match(r"^Hunk #(\d+) succeeded at (\d+) \((offset|with fuzz) ([^)]*)\)", line):
            idx = int(m.group(1)) - 1
            header = hunks.get(current, [])[idx] if current in hunks else "?"
            problems.append(
                f"{current}: hunk #{idx + 1} {header} matches only at line {m.group(2)} "
                f"({m.group(3)} {m.group(4)}): refresh the patch against this release"
            )
        elif m := re.match(r"^error: patch failed: (\S+):(\d+)$", line):
            path, start = m.group(1), int(m.group(2))
            header = next(
                (h for h in hunks.get(path, []) if int(re.match(r"@@ -(\d+)", h).group(1)) == start),
                f"@@ -{start} @@",
            )
            problems.append(f"{path}: hunk {header} does not match the upstream text")
        elif m := re.match(r"^error: (\S+): No such file or directory$", line):
            problems.append(f"{m.group(1)}: the file does not exist upstream")
    return problems


def fork_version(upstream_version: str, patches: list[Patch], src: Path = REPO_ROOT) -> str:
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
            {"name": p.name, "subject": p.subject, "server_args": p.flags,
             "upstream_status": p.first("Upstream-Status")}
            for p in patches
        ],
    }


def _stamp(tree: Path, upstream_version: str, version: str, patches: list[Patch]) -> None:
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


def assemble(tree: Path, wheel: Path, upstream_version: str, patches: list[Patch],
             stamp: bool = True, src: Path = REPO_ROOT, three_way: bool = False) -> Assembled:
    """Upstream root commit + one commit per patch; ``src`` is the fork repository holding
    the owned files (another one in tests); ``three_way`` only for editing trees."""
    base = import_release(tree, wheel, upstream_version)
    git(tree, "checkout", "-q", "-f", "-B", "fork", base)
    git(tree, "clean", "-qfdx")
    applied = []
    for p in patches:
        applied.append(Applied(p, apply_patch(tree, p, src, three_way)))
    version = fork_version(upstream_version, patches, src)
    if stamp:
        _stamp(tree, upstream_version, version, patches)
    return Assembled(tree, upstream_version, base, applied, version, out(tree, "rev-parse", "HEAD"))


def continue_assembly(tree: Path, upstream_version: str, patches: list[Patch],
                      src: Path = REPO_ROOT) -> list[Applied]:
    """After a conflict stopped an editing tree and the person finished ``git am --continue``:
    merge the rest of the series (git am -3), each with the files it owns."""
    if (tree / ".git" / "rebase-apply").exists():
        raise PatchError(f"a `git am` is still in progress in {tree}: resolve, `git add -A`, "
                         "`git am --continue`, then continue the tree again")
    base = out(tree, "merge-base", "HEAD", upstream_ref(upstream_version))
    done = len(out(tree, "rev-list", f"{base}..HEAD").split())
    if done > len(patches):
        raise PatchError(f"{tree} holds {done} commits above upstream, the series only {len(patches)}")
    return [Applied(p, apply_patch(tree, p, src, three_way=True)) for p in patches[done:]]


def numstat(tree: Path, parent: str, commit: str, paths: list[str] | None = None) -> tuple[int, int]:
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
    added = out(tree, "diff", "--name-only", "--diff-filter=A", "--no-renames",
                f"{commit}^", commit, "--", PKG).split()
    return [f for f in added if f not in STAMP_FILES]


def commit_patch(tree: Path, commit: str, owns: list[str]) -> str:
    """The commit as a patch of upstream files only, its header listing the files it owns.

    Owns: trailers are rewritten from ``owns`` (the files the commit really adds), so a
    header cannot keep naming a file the commit no longer carries.
    """
    excludes = [f":(exclude){o}" for o in owns]
    edits = out(tree, "diff", "--name-only", "--no-renames", f"{commit}^", commit, "--", ".", *excludes)
    if edits:
        text = out(
            tree, "format-patch", "-1", commit, "--stdout", "--zero-commit", "--no-signature",
            "--full-index", "--", ".", *excludes,
        ) + "\n"
    else:
        # A commit that adds only files of ours: path-limited format-patch would walk back to
        # the last commit that edits upstream files, so keep the header and an empty diff.
        full = out(tree, "format-patch", "-1", commit, "--stdout", "--zero-commit", "--no-signature")
        text = full.partition("\n---\n")[0] + "\n---\n"
    head, sep, diff = text.partition("\n---\n")
    head = "\n".join(line for line in head.split("\n") if not line.startswith("Owns: "))
    trailers = [arg for own in owns for arg in ("--trailer", f"Owns: {own}")]
    return git(
        tree, "interpret-trailers", "--if-exists", "addIfDifferent", *trailers,
        input=head + sep + diff,
    ).stdout
