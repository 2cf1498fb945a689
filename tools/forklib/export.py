"""``tools/fork export <patch>``: one patch as a self-contained diff + PR text for upstream.

The diff is the patch's commit in the assembled tree against its parent, so it carries the
files of ours the patch owns as new files and nothing of any other patch. It is proven by
``git apply --check`` in a worktree of the bare upstream commit. When an earlier patch only
sits in its context (neighbouring lines of the same file), the commit is cherry-picked onto
bare upstream (git's three-way merge) and that replay is exported instead; when the replay
conflicts, the patch really depends on an earlier one, which the error names.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from . import REPO_ROOT, ForkError
from .git import git, out, out_diff
from .pin import fetch_pinned, load_pin
from .series import Patch, check_series, load_series
from .tree import assemble, owned_files

PRIMARY_TAG = "cp311-cp311-manylinux_2_34_x86_64"


def find_patch(patches: list[Patch], ref: str) -> int:
    """Index of a patch given by name, file name or number (``1``, ``0001``)."""
    for i, p in enumerate(patches):
        if ref in (p.name, p.path.name) or (ref.isdigit() and p.name.startswith(f"{int(ref):04d}-")):
            return i
    raise ForkError(f"no patch {ref!r} in patches/series; patches: {', '.join(p.name for p in patches)}")


def export(ref: str, root: Path = REPO_ROOT, out_dir: Path | None = None) -> tuple[Path, Path]:
    out_dir = out_dir or root / "build" / "export"
    patches = load_series(root / "patches" / "series")
    check_series(patches, root)
    i = find_patch(patches, ref)
    patch = patches[i]
    pin = load_pin(root / "upstream.toml")
    tree = out_dir / "tree"
    # Only the patches up to this one: later ones cannot matter to its commit.
    asm = assemble(tree, fetch_pinned(pin, PRIMARY_TAG), pin.version, patches[: i + 1], stamp=False, src=root)
    commit = asm.applied[i].commit
    diff = out_diff(tree, "diff", "--full-index", "--binary", f"{commit}^", commit) + "\n"
    new_files = owned_files(tree, commit)

    files = set(out(tree, "diff", "--name-only", "--no-renames", f"{commit}^", commit).split())
    expected = set(patch.files) | set(new_files)
    if files != expected:  # the commit is built from exactly these; anything else is a tool bug
        raise ForkError(f"{patch.name}: commit touches {sorted(files ^ expected)} beyond its own files")

    out_dir.mkdir(parents=True, exist_ok=True)
    diff_file = out_dir / f"{patch.name}.diff"
    tmp = diff_file.with_suffix(".diff.tmp")
    tmp.write_text(diff)
    replayed = _standalone(tree, asm.base, commit, tmp, patch, patches[:i], pin.version)
    if set(out(tree, "diff", "--name-only", "--no-renames", asm.base, replayed).split()) != expected:
        raise ForkError(f"{patch.name}: its replay onto upstream touches other files than its own")
    tmp.write_text(out_diff(tree, "diff", "--full-index", "--binary", asm.base, replayed) + "\n")
    tmp.replace(diff_file)
    md_file = out_dir / f"{patch.name}.md"
    md_file.write_text(describe(patch, new_files, pin.package, pin.version,
                                after=[p.name for p in patches[:i]] if replayed != commit else []))
    return diff_file, md_file


def _standalone(tree: Path, base: str, commit: str, diff: Path, patch: Patch,
                earlier: list[Patch], version: str) -> str:
    """The commit that holds the patch alone on bare upstream: ``commit`` itself when its diff
    applies there, else its three-way replay onto ``base``; raises when that conflicts."""
    check = tree.parent / "check"
    git(tree, "worktree", "remove", "--force", str(check), check=False)
    shutil.rmtree(check, ignore_errors=True)
    git(tree, "worktree", "prune")
    git(tree, "worktree", "add", "-q", "--detach", str(check), base)
    try:
        if git(check, "apply", "--check", str(diff.resolve()), check=False).returncode == 0:
            git(check, "apply", "--index", str(diff.resolve()))
            git(check, "commit", "-q", "-C", commit)
            return out(check, "rev-parse", "HEAD")
        picked = git(check, "cherry-pick", "--allow-empty", commit, check=False)
        if picked.returncode == 0:
            return out(check, "rev-parse", "HEAD")
        conflicts = out(check, "diff", "--name-only", "--diff-filter=U")
        git(check, "cherry-pick", "--abort", check=False)
    finally:
        git(tree, "worktree", "remove", "--force", str(check), check=False)
    touched = set(patch.files)
    deps = [p.name for p in earlier if touched & (set(p.files) | set(p.owns))]
    raise ForkError(
        f"{patch.name} does not apply alone to upstream {version}: replaying it there conflicts in "
        f"{conflicts or '(no file named)'}\n"
        + (f"it depends on earlier patch(es) touching the same files: {', '.join(deps)}" if deps
           else "no earlier patch touches these files")
    )


def _body(patch: Patch) -> str:
    """The commit message body without its trailer paragraph (the header goes in its own fields)."""
    paragraphs = patch.body.split("\n\n")
    if paragraphs and all(":" in line for line in paragraphs[-1].splitlines()):
        paragraphs = paragraphs[:-1]
    return "\n\n".join(paragraphs).strip()


def describe(patch: Patch, new_files: list[str], package: str, version: str,
             after: list[str] | None = None) -> str:
    flags = ", ".join(f"`{f}`" for f in patch.flags) or "none"
    lines = [
        f"# {patch.subject}",
        "",
        "## What",
        "",
        _body(patch) or patch.subject,
        "",
        "## Why",
        "",
        "\n".join(patch.trailers.get("Why", [])),
        "",
        f"**Server arguments:** {flags}",
        "",
        f"**Upstream status (in the fork):** {patch.first('Upstream-Status')}",
        "",
        "## Tests",
        "",
        *[f"- `{t}` (in the fork)" for t in patch.trailers.get("Tests", [])],
        "",
        "## Files",
        "",
        *[f"- `{f}` (changed)" for f in patch.files],
        *[f"- `{f}` (new)" for f in new_files],
        "",
        f"Against {package} {version}: `git apply {patch.name}.diff` at the repository root "
        "(paths are `python/sglang/...`).",
        "",
    ]
    if after:
        lines += [
            "In the fork this patch comes after " + ", ".join(after) + "; this diff is its "
            "replay onto clean upstream by git's three-way merge (only context lines differed).",
            "",
        ]
    return "\n".join(lines)
