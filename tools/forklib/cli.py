"""``tools/fork <command>``: the front end ``make`` calls."""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

from . import REPO_ROOT, ForkError
from .lint import VERSIONS, lint
from .pin import fetch_pinned, load_pin, python_tag
from .series import SERIES_FILE, check_series, load_series, series_problems
from .tree import Assembled, assemble, numstat
from .wheel import build_wheel

VENV = REPO_ROOT / ".venv"
REQUIREMENTS = REPO_ROOT / "tools" / "requirements-cpu.txt"


def step(msg: str) -> None:
    print(f"==> {msg}", flush=True)


def venv_python(venv: Path = VENV) -> Path:
    return venv / "bin" / "python"


def target_python(args) -> str:
    return args.python or (
        str(venv_python()) if venv_python().exists() else sys.executable
    )


# ---------------------------------------------------------------------------- build


def assemble_series(
    args, stamp: bool = True, tag: str | None = None, tree_name: str = "tree"
) -> tuple[Assembled, Path]:
    patches = load_series(args.series)
    if stamp:
        check_series(patches)
    else:  # an editing tree is where a header gets fixed: say what is wrong, do not refuse
        for problem in series_problems(patches):
            print(
                f"warning: {problem} (`make refresh` refuses until it is fixed)",
                flush=True,
            )
    pin = load_pin()
    wheel = fetch_pinned(
        pin, tag or getattr(args, "tag", None) or python_tag(target_python(args))
    )
    tree = args.build / tree_name
    step(f"assembling {pin.package} {pin.version} + {len(patches)} patch(es) in {tree}")
    # An editing tree (no stamp) merges drifted patches with git am -3, so `refresh` can fix them.
    return (
        assemble(tree, wheel, pin.version, patches, stamp=stamp, three_way=not stamp),
        wheel,
    )


def patch_table(asm: Assembled) -> str:
    rows = [("patch", "flag(s)", "upstream files", "upstream lines (+/-)", "our files")]
    parent = asm.base
    for a in asm.applied:
        upstream_files = list(a.patch.files)
        plus, minus = (
            numstat(asm.tree, parent, a.commit, upstream_files)
            if upstream_files
            else (0, 0)
        )
        rows.append(
            (
                a.patch.name,
                " ".join(a.patch.flags) or "-",
                str(len(upstream_files)),
                f"+{plus}/-{minus}",
                str(len(a.patch.owns)),
            )
        )
        parent = a.commit
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def build_inputs(args, tag: str) -> str:
    """Digest of everything a build reads: the pin and wheel tag, the series, our files and
    the tool itself. Equal digests give the same wheel."""
    h = hashlib.sha256(tag.encode() + b"\0")
    files = [
        REPO_ROOT / "upstream.toml",
        args.series,
        Path(__file__).parents[1] / "fork",
        *sorted(Path(__file__).parent.glob("*.py")),
    ]
    for patch in load_series(args.series):
        files.append(patch.path)
        files += [REPO_ROOT / own for own in sorted(patch.owns)]
    for f in files:
        h.update(
            str(f).encode()
            + b"\0"
            + (f.read_bytes() if f.exists() else b"(missing)")
            + b"\0"
        )
    return h.hexdigest()


def _installed_marker(venv: Path) -> Path:
    return venv / ".fork-wheel"


def cmd_build(args) -> None:
    dist = args.build / "dist"
    stamp_file = dist / ".build.json"
    tag = args.tag or python_tag(target_python(args))
    digest = build_inputs(args, tag)
    stamp = json.loads(stamp_file.read_text()) if stamp_file.exists() else {}
    wheel_path = dist / stamp.get("wheel", "-")
    venv = Path(args.install) if args.install else None
    installed = venv is None or (
        _installed_marker(venv).exists()
        and _installed_marker(venv).read_text() == f"{stamp.get('wheel')} {digest}"
        and _requirements_current(venv)
    )
    if stamp.get("digest") == digest and wheel_path.is_file() and installed:
        print(
            f"sglang {stamp['version']}: up to date (the pin, the series, our files and the tool are "
            f"unchanged since the last build): {wheel_path}"
            + (f", installed in {args.install}" if venv else "")
            + "\n"
        )
        print(stamp["table"])
        return
    for old in dist.glob("*.whl"):
        old.unlink()  # a failed build must leave no wheel that could be installed
    stamp_file.unlink(missing_ok=True)
    asm, wheel = assemble_series(args, tag=tag)
    step(_needs_line(asm.tree, [a.patch for a in asm.applied], asm.upstream_version))
    step(f"packaging sglang {asm.version}")
    built = build_wheel(asm.tree, wheel, asm.upstream_version, asm.version, dist)
    table = patch_table(asm)
    stamp_file.write_text(
        json.dumps(
            {
                "digest": digest,
                "wheel": built.name,
                "version": asm.version,
                "table": table,
            }
        )
        + "\n"
    )
    if venv is not None:
        install_wheel(built, venv)
        _installed_marker(venv).write_text(f"{built.name} {digest}")
    print(
        f"\nsglang {asm.version}: {built}"
        + (f", installed in {args.install}" if args.install else "")
        + "\n"
    )
    print(table)


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
    print(
        f"run it on the GPU machine: bash {dest.relative_to(REPO_ROOT) if dest.is_relative_to(REPO_ROOT) else dest}/run.sh [RESULTS_DIR]"
    )


def cmd_check(args) -> None:
    from .docs import problems

    patches = load_series(args.series)
    check_series(patches)
    print(
        f"{len(patches)} patch(es): headers complete, every file under python/sglang owned once"
    )
    stale = problems(REPO_ROOT, patches, load_pin().version)
    if stale:
        raise ForkError(
            "README.md / CONTRIBUTING.md do not follow the series and the pin:\n  "
            + "\n  ".join(stale)
        )
    print("README.md and CONTRIBUTING.md: the series' flags and the pinned release")
    print(_needs_line(None, patches, tag=python_tag(target_python(args))))
    cmd_lint(args)


def _needs_line(
    tree: Path | None, patches: list, release: str = "", tag: str = ""
) -> str:
    """Every upstream name our modules read exists in ``tree`` (an assembled tree), or in
    the pinned release with the series: else ForkError naming it, its reader, the release.
    """
    from . import needs

    if tree is None:
        return needs.verify(needs.target_tree(None, patches, tag), patches)
    return needs.verify(needs.UpstreamTree.from_dir(tree, release), patches, tree)


def cmd_needs(args) -> int:
    """List every upstream name our modules read, with its status in the target."""
    from .needs import check, render, target_tree

    patches = load_series(args.series)
    tag = python_tag(target_python(args)) if args.target_tree is None else ""
    report = check(target_tree(args.target_tree, patches, tag), patches)
    print(render(report))
    return 1 if report.missing else 0


def cmd_docs(args) -> None:
    """Write the README's flag table from the series and docs/flags.toml."""
    from .docs import write

    wrote = write(REPO_ROOT, load_series(args.series))
    print(
        f"wrote {', '.join(wrote)}" if wrote else "README.md: the flag table is current"
    )


def cmd_lint(args) -> None:
    bindir = venv_python(args.venv).parent
    problems = lint(bindir, fix=getattr(args, "fix", False))
    if problems:
        raise ForkError(
            "upstream's formatters disagree with these files "
            "(`tools/fork lint --fix` rewrites them):\n" + "\n".join(problems)
        )
    print(
        ", ".join(f"{tool} {version}" for tool, version in VERSIONS.items())
        + ", run bits: clean"
    )


# ---------------------------------------------------------------------------- install


def _requirements_digest() -> str:
    return hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()


def _requirements_current(venv: Path) -> bool:
    marker = venv / ".fork-requirements"
    return (
        venv_python(venv).exists()
        and marker.exists()
        and marker.read_text() == _requirements_digest()
    )


def install_wheel(wheel: Path, venv: Path) -> None:
    """Install the fork wheel (--no-deps) over the CPU dependency set into ``venv``."""
    py = venv_python(venv)
    if not py.exists():
        step(f"creating {venv} ({sys.executable})")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    _installed_marker(venv).unlink(missing_ok=True)
    marker = venv / ".fork-requirements"
    if not _requirements_current(venv):
        step(
            f"installing the CPU dependency set ({REQUIREMENTS.relative_to(REPO_ROOT)})"
        )
        subprocess.run(
            [str(py), "-m", "pip", "install", "-q", "-r", str(REQUIREMENTS)], check=True
        )
        marker.write_text(_requirements_digest())
    step(f"installing {wheel.name} into {venv}")
    subprocess.run(
        [
            str(py),
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--force-reinstall",
            str(wheel),
        ],
        check=True,
    )


# ---------------------------------------------------------------------------- refresh


def cmd_refresh(args) -> None:
    """Write the commits of build/tree's branch 'fork' back to patches/ and python/sglang/."""
    from .tree import refresh

    wrote = refresh(args.build / "tree", REPO_ROOT)
    for path in wrote:
        print(f"wrote {path}")
    print(
        f"{len(load_series(args.series))} patch(es) refreshed ({len(wrote)} file(s) changed); "
        "`make check`, then `make` and the tests"
    )


# ---------------------------------------------------------------------------- rebase, export


def cmd_rebase(args) -> int:
    from . import rebase

    if args.abort:
        rebase.abort()
        return 0
    if args.cont or args.drop:
        return rebase.resume(drop=args.drop, tests=False if args.no_test else None)
    if not args.release:
        raise ForkError(
            "name the release to rebase onto (or --continue, --drop <patch>, --abort)"
        )
    return rebase.start(args.release, dry_run=args.dry_run, tests=not args.no_test)


def cmd_drift(args) -> None:
    from .rebase import drift

    drift(args.releases, REPO_ROOT, record=args.write)
    if args.write:
        print(f"wrote {args.write}")
        if args.write.resolve().is_relative_to(REPO_ROOT / "benchmark" / "results"):
            # a committed result: its provenance beside it (tools/e2e/provenance.py)
            from e2e.provenance import write_sidecar

            print(f"wrote {write_sidecar(args.write)}")


def cmd_export(args) -> None:
    from .export import export

    diff, md = export(args.patch)
    print(
        f"wrote {diff.relative_to(REPO_ROOT)} and {md.relative_to(REPO_ROOT)} "
        "(applied to a clean upstream tree, its modules imported there)"
    )


# ---------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/fork", description=__doc__)
    parser.add_argument(
        "--python",
        help="interpreter whose wheel tag to build for (default: .venv's, else this one)",
    )
    parser.add_argument(
        "--series",
        type=Path,
        default=SERIES_FILE,
        help="series file (default: patches/series)",
    )
    parser.add_argument(
        "--build",
        type=Path,
        default=REPO_ROOT / "build",
        help="build directory (default: build/)",
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser(
        "check",
        help="headers complete, ownership of python/sglang files, upstream's formatters",
    )
    p.add_argument("--venv", type=Path, default=VENV, help="where the formatters are")
    p.set_defaults(fn=cmd_check)
    p = sub.add_parser(
        "lint",
        help="black, isort, codespell and ruff F401 at upstream's versions and settings; "
        "scripts with a shebang executable",
    )
    p.add_argument("--venv", type=Path, default=VENV, help="where the formatters are")
    p.add_argument("--fix", action="store_true", help="rewrite the files instead")
    p.set_defaults(fn=cmd_lint)
    p = sub.add_parser(
        "build",
        help="fetch, assemble build/tree, package build/dist, print the patch table",
    )
    p.add_argument(
        "--install", metavar="VENV", help="then install the wheel into this venv"
    )
    p.add_argument(
        "--tag",
        help="build for this pinned wheel tag instead, e.g. cp312-cp312-manylinux_2_34_x86_64",
    )
    p.set_defaults(fn=cmd_build)
    p = sub.add_parser(
        "tree",
        help="assemble build/tree without the stamp, for editing (drifted patches merged with git am -3)",
    )
    p.add_argument(
        "--continue",
        dest="cont",
        action="store_true",
        help="after resolving a conflict there (git am --continue): merge the rest of the series",
    )
    p.set_defaults(fn=cmd_tree)
    sub.add_parser(
        "gpu-bundle",
        help="write build/gpu-bundle: GPU tests + benchmarks for a torch-only machine",
    ).set_defaults(fn=cmd_gpu_bundle)
    sub.add_parser(
        "refresh", help="write build/tree's commits back to patches/ and python/sglang/"
    ).set_defaults(fn=cmd_refresh)
    p = sub.add_parser(
        "needs",
        help="every upstream name our modules read, ok / missing / unknown in a release",
    )
    p.add_argument(
        "--target-tree",
        type=Path,
        metavar="DIR",
        help="an assembled tree, a site-packages or a .whl (default: the pinned release "
        "with the series)",
    )
    p.set_defaults(fn=cmd_needs)
    sub.add_parser(
        "docs",
        help="write README.md's flag table from patches/series and docs/flags.toml",
    ).set_defaults(fn=cmd_docs)
    p = sub.add_parser(
        "rebase", help="replay the series onto another upstream release (build/rebase)"
    )
    p.add_argument(
        "release", nargs="?", help="the target release, e.g. 0.5.24 (or an older one)"
    )
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--continue",
        dest="cont",
        action="store_true",
        help="resume after resolving in build/rebase/repo",
    )
    g.add_argument(
        "--abort",
        action="store_true",
        help="forget the rebase; the repository stays as it was",
    )
    p.add_argument(
        "--drop",
        action="append",
        metavar="PATCH",
        help="drop this patch from the series, then resume",
    )
    p.add_argument(
        "--dry-run", action="store_true", help="classify every patch, write nothing"
    )
    p.add_argument(
        "--no-test",
        action="store_true",
        help="after the write-back, do not build and run the merged and resolved patches' tests",
    )
    p.set_defaults(fn=cmd_rebase)
    p = sub.add_parser(
        "drift",
        help="dry-run the series onto releases; record the tool's output (build/drift)",
    )
    p.add_argument(
        "releases", nargs="+", help="releases to replay onto, e.g. 0.5.22 0.5.21"
    )
    p.add_argument(
        "--write",
        type=Path,
        metavar="FILE",
        help="write the output into FILE's generated block, e.g. benchmark/results/rebase-drift.md",
    )
    p.set_defaults(fn=cmd_drift)
    p = sub.add_parser(
        "export",
        help="one patch (and what it depends on) as a diff against upstream + PR text (build/export)",
    )
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
