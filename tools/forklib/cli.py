"""``tools/fork <command>``: the front end ``make`` calls."""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import time
from pathlib import Path

from . import REPO_ROOT, ForkError
from .git import out
from .pin import fetch_pinned, load_pin, python_tag
from .series import SERIES_FILE, check_series, load_series, read_series
from .tree import Assembled, assemble, commit_patch, copy_files, numstat, owned_files, upstream_ref
from .wheel import build_wheel

VENV = REPO_ROOT / ".venv"
REQUIREMENTS = REPO_ROOT / "tools" / "requirements-cpu.txt"


def step(msg: str) -> None:
    print(f"==> {msg}", flush=True)


def venv_python(venv: Path = VENV) -> Path:
    return venv / "bin" / "python"


def target_python(args) -> str:
    return args.python or (str(venv_python()) if venv_python().exists() else sys.executable)


# ---------------------------------------------------------------------------- build


def assemble_series(args, stamp: bool = True, tag: str | None = None,
                    tree_name: str = "tree") -> tuple[Assembled, Path]:
    patches = load_series(args.series)
    check_series(patches)
    pin = load_pin()
    wheel = fetch_pinned(pin, tag or getattr(args, "tag", None) or python_tag(target_python(args)))
    tree = args.build / tree_name
    step(f"assembling {pin.package} {pin.version} + {len(patches)} patch(es) in {tree}")
    # An editing tree (no stamp) merges drifted patches with git am -3, so `refresh` can fix them.
    return assemble(tree, wheel, pin.version, patches, stamp=stamp, three_way=not stamp), wheel


def patch_table(asm: Assembled) -> str:
    rows = [("patch", "flag(s)", "upstream files", "upstream lines (+/-)", "our files")]
    parent = asm.base
    for a in asm.applied:
        upstream_files = list(a.patch.files)
        plus, minus = numstat(asm.tree, parent, a.commit, upstream_files) if upstream_files else (0, 0)
        rows.append((
            a.patch.name,
            " ".join(a.patch.flags) or "-",
            str(len(upstream_files)),
            f"+{plus}/-{minus}",
            str(len(a.patch.owns)),
        ))
        parent = a.commit
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def cmd_build(args) -> None:
    dist = args.build / "dist"
    for old in dist.glob("*.whl"):
        old.unlink()  # a failed build must leave no wheel that could be installed
    asm, wheel = assemble_series(args)
    step(f"packaging sglang {asm.version}")
    built = build_wheel(asm.tree, wheel, asm.upstream_version, asm.version, dist)
    if args.install:
        install_wheel(built, Path(args.install))
    print(f"\nsglang {asm.version}: {built}"
          + (f", installed in {args.install}" if args.install else "") + "\n")
    print(patch_table(asm))


def cmd_tree(args) -> None:
    """Assemble without the version stamp, for editing: one commit per patch on branch fork."""
    if args.cont:
        from .tree import continue_assembly

        tree = args.build / "tree"
        applied = continue_assembly(tree, load_pin().version, load_series(args.series))
        print(f"{tree}: merged the remaining {len(applied)} patch(es) of the series")
        print("review, then `tools/fork refresh`")
        return
    asm, _ = assemble_series(args, stamp=False)
    print(f"{asm.tree}: upstream at {asm.base[:10]}, branch 'fork' holds the series")
    print("edit, commit (or amend / fixup and rebase), then `tools/fork refresh`")


def cmd_gpu_bundle(args) -> None:
    from .bundle import GPU_WHEEL_TAG, make_bundle

    asm, _ = assemble_series(args, tag=GPU_WHEEL_TAG, tree_name="gpu-tree")
    dest = args.build / "gpu-bundle"
    step(f"writing {dest}")
    size = make_bundle(asm.tree, asm.version, dest)
    print(f"{dest}: sglang {asm.version}, {size / 2**20:.1f} MiB")
    print(f"run it on the GPU machine: bash {dest.relative_to(REPO_ROOT) if dest.is_relative_to(REPO_ROOT) else dest}/run.sh [RESULTS_DIR]")


def cmd_check(args) -> None:
    patches = load_series(args.series)
    check_series(patches)
    print(f"{len(patches)} patch(es): headers complete, every file under python/sglang owned once")


# ---------------------------------------------------------------------------- install


def _requirements_digest() -> str:
    return hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()


def install_wheel(wheel: Path, venv: Path) -> None:
    """Install the fork wheel (--no-deps) over the CPU dependency set into ``venv``."""
    py = venv_python(venv)
    if not py.exists():
        step(f"creating {venv} ({sys.executable})")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    marker = venv / ".fork-requirements"
    if not marker.exists() or marker.read_text() != _requirements_digest():
        step(f"installing the CPU dependency set ({REQUIREMENTS.relative_to(REPO_ROOT)})")
        subprocess.run([str(py), "-m", "pip", "install", "-q", "-r", str(REQUIREMENTS)], check=True)
        marker.write_text(_requirements_digest())
    step(f"installing {wheel.name} into {venv}")
    subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", str(wheel)],
        check=True,
    )


# ---------------------------------------------------------------------------- refresh


def cmd_refresh(args) -> None:
    """Write the commits of build/tree's branch 'fork' back to patches/ and python/sglang/."""
    tree = args.build / "tree"
    base = out(tree, "merge-base", "fork", upstream_ref(load_pin().version))
    commits = out(tree, "rev-list", "--reverse", f"{base}..fork").split()
    if any(out(tree, "log", "-1", "--format=%s", c).startswith("fork stamp:") for c in commits):
        raise ForkError(
            "build/tree holds a stamped build (from `make`), not an editing tree: run "
            "`make tree`, edit and commit there, then `make refresh`"
        )
    names = [p.name for p in read_series(args.series)]
    for i, commit in enumerate(commits):
        if i < len(names):
            name = names[i]
        else:
            slug = "-".join(out(tree, "log", "-1", "--format=%f", commit).split("-")[:6])
            name = f"{i + 1:04d}-{slug}.patch"
            names.append(name)
        owns = owned_files(tree, commit)
        copy_files(owns, tree, REPO_ROOT)
        (args.series.parent / name).write_text(commit_patch(tree, commit, owns))
        print(f"wrote {args.series.parent / name} ({len(owns)} owned file(s))")
    args.series.write_text("\n".join(names[: len(commits)]) + "\n")
    check_series(load_series(args.series))


# ---------------------------------------------------------------------------- rebase, export


def cmd_rebase(args) -> int:
    from . import rebase

    if args.abort:
        rebase.abort()
        return 0
    if args.cont or args.drop:
        return rebase.resume(drop=args.drop)
    if not args.release:
        raise ForkError("name the release to rebase onto (or --continue, --drop <patch>, --abort)")
    return rebase.start(args.release, dry_run=args.dry_run)


def cmd_export(args) -> None:
    from .export import export

    diff, md = export(args.patch)
    print(f"wrote {diff.relative_to(REPO_ROOT)} and {md.relative_to(REPO_ROOT)} "
          "(checked with `git apply --check` on a clean upstream tree)")


# ---------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/fork", description=__doc__)
    parser.add_argument("--python", help="interpreter whose wheel tag to build for (default: .venv's, else this one)")
    parser.add_argument("--series", type=Path, default=SERIES_FILE, help="series file (default: patches/series)")
    parser.add_argument("--build", type=Path, default=REPO_ROOT / "build", help="build directory (default: build/)")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("check", help="headers complete, ownership of python/sglang files").set_defaults(fn=cmd_check)
    p = sub.add_parser("build", help="fetch, assemble build/tree, package build/dist, print the patch table")
    p.add_argument("--install", metavar="VENV", help="then install the wheel into this venv")
    p.add_argument("--tag", help="build for this pinned wheel tag instead, e.g. cp312-cp312-manylinux_2_34_x86_64")
    p.set_defaults(fn=cmd_build)
    p = sub.add_parser("tree", help="assemble build/tree without the stamp, for editing (drifted patches merged with git am -3)")
    p.add_argument("--continue", dest="cont", action="store_true",
                   help="after resolving a conflict there (git am --continue): merge the rest of the series")
    p.set_defaults(fn=cmd_tree)
    sub.add_parser("gpu-bundle", help="write build/gpu-bundle: GPU tests + benchmarks for a torch-only machine").set_defaults(fn=cmd_gpu_bundle)
    sub.add_parser("refresh", help="write build/tree's commits back to patches/ and python/sglang/").set_defaults(fn=cmd_refresh)
    p = sub.add_parser("rebase", help="replay the series onto another upstream release (build/rebase)")
    p.add_argument("release", nargs="?", help="the target release, e.g. 0.5.24 (or an older one)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--continue", dest="cont", action="store_true", help="resume after resolving in build/rebase/repo")
    g.add_argument("--abort", action="store_true", help="forget the rebase; the repository stays as it was")
    p.add_argument("--drop", action="append", metavar="PATCH", help="drop this patch from the series, then resume")
    p.add_argument("--dry-run", action="store_true", help="classify every patch, write nothing")
    p.set_defaults(fn=cmd_rebase)
    p = sub.add_parser("export", help="one patch as a diff against upstream + PR text (build/export)")
    p.add_argument("patch", help="patch name or number")
    p.set_defaults(fn=cmd_export)
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    try:
        rc = args.fn(args)
    except ForkError as e:
        print(f"fork: error: {e}", file=sys.stderr)
        return 1
    if args.cmd == "build":
        print(f"\n({time.monotonic() - t0:.1f} s)")
    return rc or 0
