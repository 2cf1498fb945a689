"""``tools/fork export <patch>``: one patch as a self-contained diff + PR text for upstream.

The diff is the patch's commit in the assembled tree against its parent, so it carries the
files of ours the patch owns as new files and nothing of any other patch, except the patches
it names in ``Depends:``, which it carries (in series order) so it works alone. It is proven
in a worktree of the bare upstream commit: each commit applies there (``git apply``, or, when
only context from an earlier patch differs, git's three-way merge), and every module the
exported patches own imports there. A replay that conflicts or a module that does not import
names the patch it really depends on or says to declare it.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from . import REPO_ROOT, ForkError
from .git import git, out, out_diff
from .importcheck import advice, module_name, run
from .pin import fetch_pinned, load_pin
from .series import Patch, check_series, load_series
from .tree import adjacent_lines, assemble, owned_files

PRIMARY_TAG = "cp311-cp311-manylinux_2_34_x86_64"


def find_patch(patches: list[Patch], ref: str) -> int:
    """Index of a patch given by name, file name or number (``1``, ``0001``)."""
    for i, p in enumerate(patches):
        if ref in (p.name, p.path.name) or (
            ref.isdigit() and p.name.startswith(f"{int(ref):04d}-")
        ):
            return i
    raise ForkError(
        f"no patch {ref!r} in patches/series; patches: {', '.join(p.name for p in patches)}"
    )


def with_dependencies(patches: list[Patch], i: int) -> list[int]:
    """Indices of patch ``i`` and every patch it depends on (transitively), in series order."""
    index = {p.name: j for j, p in enumerate(patches)}
    need, todo = {i}, [i]
    while todo:
        for dep in patches[todo.pop()].depends:
            j = index[dep]  # check_series guarantees an earlier patch of the series
            if j not in need:
                need.add(j)
                todo.append(j)
    return sorted(need)


def export(
    ref: str,
    root: Path = REPO_ROOT,
    out_dir: Path | None = None,
    python: str | None = None,
) -> tuple[Path, Path]:
    """Write ``<patch>.diff`` (the patch and what it depends on, on bare upstream) and its PR
    text; proven by applying to a clean upstream tree and importing its modules there.
    """
    out_dir = out_dir or root / "build" / "export"
    patches = load_series(root / "patches" / "series")
    check_series(patches, root)
    i = find_patch(patches, ref)
    patch = patches[i]
    chain = with_dependencies(patches, i)
    pin = load_pin(root / "upstream.toml")
    tree = out_dir / "tree"
    # Only the patches up to this one: later ones cannot matter to its commit.
    asm = assemble(
        tree,
        fetch_pinned(pin, PRIMARY_TAG),
        pin.version,
        patches[: i + 1],
        stamp=False,
        src=root,
    )
    expected: set[str] = set()
    new_files: list[str] = []
    for j in chain:
        commit = asm.applied[j].commit
        owns = owned_files(tree, commit)
        files = set(
            out(
                tree, "diff", "--name-only", "--no-renames", f"{commit}^", commit
            ).split()
        )
        mine = set(patches[j].files) | set(owns)
        if (
            files != mine
        ):  # the commit is built from exactly these; anything else is a tool bug
            raise ForkError(
                f"{patches[j].name}: commit touches {sorted(files ^ mine)} beyond its own files"
            )
        expected |= mine
        new_files += owns

    out_dir.mkdir(parents=True, exist_ok=True)
    diff_file = out_dir / f"{patch.name}.diff"
    replayed, moved = _standalone(
        tree,
        asm.base,
        [asm.applied[j].commit for j in chain],
        [patches[j] for j in chain],
        patches,
        pin.version,
        root,
        python,
        owners={
            asm.applied[k].commit: patches[k].name for k in range(i) if k not in chain
        },
    )
    if (
        set(
            out(tree, "diff", "--name-only", "--no-renames", asm.base, replayed).split()
        )
        != expected
    ):
        raise ForkError(
            f"{patch.name}: its replay onto upstream touches other files than its own"
        )
    tmp = diff_file.with_suffix(".diff.tmp")
    tmp.write_text(
        out_diff(tree, "diff", "--full-index", "--binary", asm.base, replayed) + "\n"
    )
    tmp.replace(diff_file)
    md_file = out_dir / f"{patch.name}.md"
    carried = [patches[j].name for j in chain if j != i]
    md_file.write_text(
        describe(
            patch,
            new_files,
            pin.package,
            pin.version,
            after=(
                [p.name for p in patches[:i] if p.name not in carried] if moved else []
            ),
            carried=carried,
        )
    )
    return diff_file, md_file


def _standalone(
    tree: Path,
    base: str,
    commits: list[str],
    chain: list[Patch],
    patches: list[Patch],
    version: str,
    root: Path,
    python: str | None,
    owners: dict[str, str] | None = None,
) -> tuple[str, bool]:
    """The commit holding ``chain`` (a patch after what it depends on) alone on bare upstream,
    each commit applied as it is or, when only context differs, by git's three-way merge; then
    every module the chain owns must import there. Returns (commit, whether a merge was needed).

    A replay that conflicts is told apart: a hunk whose context is another patch's lines
    (``owners``: commit -> patch of the patches not carried) only sits beside them, and the
    advice is to move the line; ``Depends:`` is for a patch that uses another one's code.
    """
    check = tree.parent / "check"
    git(tree, "worktree", "remove", "--force", str(check), check=False)
    shutil.rmtree(check, ignore_errors=True)
    git(tree, "worktree", "prune")
    git(tree, "worktree", "add", "-q", "--detach", str(check), base)
    moved = False
    try:
        for commit, patch in zip(commits, chain):
            diff = check.parent / "check.diff"
            diff.write_text(
                out_diff(tree, "diff", "--full-index", "--binary", f"{commit}^", commit)
                + "\n"
            )
            if (
                git(
                    check, "apply", "--check", str(diff.resolve()), check=False
                ).returncode
                == 0
            ):
                git(check, "apply", "--index", str(diff.resolve()))
                git(check, "commit", "-q", "-C", commit)
                continue
            moved = True
            if (
                git(
                    check, "cherry-pick", "--allow-empty", commit, check=False
                ).returncode
                != 0
            ):
                conflicts = out(check, "diff", "--name-only", "--diff-filter=U")
                git(check, "cherry-pick", "--abort", check=False)
                touching: dict[str, list[str]] = {}
                for path, line, text, owner in adjacent_lines(
                    tree, commit, owners or {}
                ):
                    touching.setdefault(owner, []).append(
                        f"{path}:{line} `{text.strip()}`"
                    )
                if touching:
                    raise ForkError(
                        f"{patch.name} does not apply alone to upstream {version}: "
                        + "; ".join(
                            f"its hunks have {owner}'s line(s) as context "
                            f"({', '.join(rows[:4])}{' ...' if len(rows) > 4 else ''})"
                            for owner, rows in touching.items()
                        )
                        + ". The lines touch: that is adjacency, not a dependence. Move our "
                        "line so that 3 lines of upstream's own code lie between it and theirs "
                        "(`make tree`, a fixup, `make refresh`). Only if "
                        f"{patch.name} uses {', '.join(touching)}'s code (a name it adds) "
                        "declare `Depends:` instead, and the export carries it"
                    )
                earlier = patches[: patches.index(patch)]
                touched = set(patch.files)
                deps = [
                    p.name
                    for p in earlier
                    if touched & (set(p.files) | set(p.owns)) and p not in chain
                ]
                raise ForkError(
                    f"{patch.name} does not apply alone to upstream {version}: replaying it there "
                    f"conflicts in {conflicts or '(no file named)'}\n"
                    + (
                        f"earlier patch(es) touch the same files: {', '.join(deps)}; if it uses "
                        "their code, declare it with `Depends:` and the export carries them; if "
                        "its lines only sit near theirs, move them apart"
                        if deps
                        else "no earlier patch touches these files"
                    )
                )
        _import_check(check, chain, version, root, python, patches)
        return out(check, "rev-parse", "HEAD"), moved
    finally:
        git(tree, "worktree", "remove", "--force", str(check), check=False)


def _import_check(
    tree: Path,
    chain: list[Patch],
    version: str,
    root: Path,
    python: str | None,
    patches: list[Patch] | None = None,
) -> None:
    """Every module the exported patches own imports on upstream with only the export applied
    (what ``git apply --check`` cannot see: a name an earlier patch adds). A failure says
    whose module is missing: one of ours (``Depends:``) or upstream's (port or drop)."""
    mods = [module_name(own) for p in chain for own in p.owns if own.endswith(".py")]
    if not mods:
        return
    venv = root / ".venv" / "bin" / "python"
    python = python or (str(venv) if venv.exists() else sys.executable)
    failures, _ = run(mods, python, tree=tree, root=root)
    if failures:
        f = failures[0]
        raise ForkError(
            f"{chain[-1].name}: with only this export applied to upstream {version}, "
            f"{f.module} does not import: {f.error}\n"
            + advice(f, patches or chain, version)
        )


def _body(patch: Patch) -> str:
    """The commit message body without its trailer paragraph (the header goes in its own fields)."""
    paragraphs = patch.body.split("\n\n")
    if paragraphs and all(":" in line for line in paragraphs[-1].splitlines()):
        paragraphs = paragraphs[:-1]
    return "\n\n".join(paragraphs).strip()


def describe(
    patch: Patch,
    new_files: list[str],
    package: str,
    version: str,
    after: list[str] | None = None,
    carried: list[str] | None = None,
) -> str:
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
    if carried:
        lines += [
            "This patch depends on "
            + ", ".join(carried)
            + " (its `Depends:` trailer); the diff "
            "carries them, in series order, so it applies and imports on clean upstream.",
            "",
        ]
    if after:
        lines += [
            "In the fork this patch comes after "
            + ", ".join(after)
            + "; this diff is its "
            "replay onto clean upstream by git's three-way merge (only context lines differed).",
            "",
        ]
    return "\n".join(lines)
