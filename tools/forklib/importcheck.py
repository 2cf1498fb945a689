"""Import modules of a tree in a fresh interpreter, and say whose fault a failure is.

Two checks use it. ``make export`` and a rebase's ``--continue`` import every module the
exported (or resolved) patches own on upstream with only those patches applied. The
flags-off check imports every upstream module the series' hunks edit with one or more of
our modules made unimportable (``block``): with every fork flag off, upstream's modules must
import even where a module of ours cannot (a target release that lacks what it reads), so an
upstream file may import our module only inside the branch its flag turns on.

A third-party package that this environment lacks (the CPU venv has no
``compressed_tensors``, a GPU package upstream imports eagerly) is not the patches' fault:
with ``standin``, each one whose absence stops an import is replaced by an import-only
stand-in (every attribute exists, calling one returns another) and named in the result, so
the check reads sglang's own import graph. A failure is then one of: a module of ours
(a ``Depends:`` trailer is the fix), upstream's (the release lacks it: port or drop), a
module the check made unimportable, or the environment (without ``standin``).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from .needs import added_by
from .series import Patch

_SCRIPT = r"""
import importlib, importlib.abc, importlib.machinery, json, sys, traceback

args = json.loads(sys.argv[1])
block, tree = tuple(args["block"]), args["tree"]
standins = []


class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname in block or fullname.startswith(tuple(b + "." for b in block)):
            raise ImportError(
                f"{fullname} made unimportable by the check", name=fullname
            )


class Anything:
    def __init__(self, *a, **k):
        pass

    def __call__(self, *a, **k):
        return Anything()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return Anything()

    def __getitem__(self, key):
        return Anything()

    def __iter__(self):
        return iter(())

    def __or__(self, other):
        return Anything()

    __ror__ = __or__

    def __mro_entries__(self, bases):
        return (object,)


def _getattr(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return Anything()


class StandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in standins:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.__path__ = []
        module.__getattr__ = _getattr


sys.meta_path.insert(0, Blocked())
sys.meta_path.append(StandIn())


def where(exc):
    # the deepest line of the tree that was running: the import statement that failed
    frames = [
        f for f in traceback.extract_tb(exc.__traceback__)
        if tree and f.filename.startswith(tree)
    ]
    return f"{frames[-1].filename[len(tree):].lstrip('/')}:{frames[-1].lineno}" if frames else ""


for name in args["modules"]:
    for _ in range(20):
        try:
            importlib.import_module(name)
            row = {"module": name, "ok": True}
        except BaseException as e:
            missing = getattr(e, "name", None) or ""
            top = missing.split(".")[0]
            if (
                args["standin"]
                and isinstance(e, ModuleNotFoundError)
                and top
                and top != "sglang"
                and top not in sys.stdlib_module_names
                and top not in standins
            ):
                standins.append(top)  # the modules that failed are gone: retry
                continue
            last = traceback.format_exception_only(type(e), e)[-1].strip()
            row = {"module": name, "ok": False, "error": last, "missing": missing,
                   "at": where(e)}
        break
    print(json.dumps(row), flush=True)
print(json.dumps({"standins": standins}), flush=True)
"""


@dataclasses.dataclass(frozen=True)
class Failure:
    """A module that did not import: the exception's last line, the module it could not
    import (``missing``, when the exception names one) and where the tree's import failed.
    """

    module: str
    error: str
    missing: str
    at: str


def run(
    modules: list[str],
    python: str | None = None,
    tree: Path | None = None,
    block: tuple[str, ...] = (),
    standin: bool = False,
    root: Path | None = None,
) -> tuple[list[Failure], list[str]]:
    """Import ``modules`` (in order, one interpreter) from ``tree``'s ``python/`` (None: the
    interpreter's installed sglang), ``block`` made unimportable; returns the failures and
    the third-party packages stood in."""
    paths = [str(tree / "python")] if tree is not None else []
    if root is not None and (root / "tools" / "standins").is_dir():
        paths.append(str(root / "tools" / "standins"))
    env = dict(os.environ)
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    else:
        env.pop("PYTHONPATH", None)
    arg = {
        "modules": modules,
        "block": list(block),
        "standin": standin,
        "tree": str((tree / "python").resolve()) if tree is not None else "",
    }
    r = subprocess.run(
        [python or sys.executable, "-W", "ignore", "-c", _SCRIPT, json.dumps(arg)],
        cwd=tree or root or Path.cwd(),
        capture_output=True,
        text=True,
        env=env,
    )
    rows = []
    for line in r.stdout.splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue  # a module printed something while importing
    if not rows or "standins" not in rows[-1]:
        tail = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
        return [Failure(modules[0] if modules else "", tail, "", "")], []
    failures = [
        Failure(row["module"], row["error"], row["missing"], row["at"])
        for row in rows[:-1]
        if not row["ok"]
    ]
    return failures, rows[-1]["standins"]


def module_name(path: str) -> str:
    """``python/sglang/a/b.py`` -> ``sglang.a.b`` (a package's ``__init__`` -> the package)."""
    return (
        path.removeprefix("python/")
        .removesuffix(".py")
        .replace("/", ".")
        .removesuffix(".__init__")
    )


def owner(module: str, patches: list[Patch]) -> Patch | None:
    """The patch that owns ``module`` (or the package it is in), if it is one of ours."""
    for p in patches:
        for own in p.owns:
            if own.endswith(".py") and (
                module == module_name(own) or module.startswith(module_name(own) + ".")
            ):
                return p
    return None


_FROM_RE = re.compile(r"cannot import name '(\w+)' from '([\w.]+)'")


def advice(f: Failure, patches: list[Patch], version: str) -> str:
    """What the failure means and what to do: our module (``Depends:``), upstream's (the
    release lacks it: port or drop), one the check blocked, or the environment."""
    m = _FROM_RE.search(f.error)
    missing = m.group(2) if m else f.missing
    name = f"{missing}.{m.group(1)}" if m else missing
    if "made unimportable by the check" in f.error:
        return (
            f"{f.module} imports {missing}, a module of ours, when it is imported"
            + (f" ({f.at})" if f.at else "")
            + ": with every flag off upstream's module must import even where ours "
            "cannot (a release that lacks what it reads). Import it inside the branch its "
            "flag turns on (a function-level import), not at module level"
        )
    if not missing:
        return "fix the error above (it names no module)"
    ours = owner(missing, patches)
    if ours is not None:
        return (
            f"{missing} is a module of ours ({ours.name}): name it in a `Depends:` trailer "
            "(make tree, amend the commit, make refresh) and the export carries it"
        )
    adder = added_by(patches, m.group(1)) if m else None
    if adder is not None:
        return (
            f"{name} is not in upstream's {missing}: patch {adder} adds it. Name {adder} "
            "in a `Depends:` trailer (make tree, amend the commit, make refresh) and the "
            "export carries it"
        )
    if missing.split(".")[0] == "sglang":
        return (
            f"{name} is upstream's, and sglang {version} lacks it (no `Depends:` helps): port "
            "the lines of ours that read it to what this release has, or drop the patch "
            "(`tools/fork needs` lists every upstream name our modules read)"
        )
    return (
        f"{missing} is a third-party package this environment lacks (not the patch's "
        "fault): install it, or add an import-only stand-in under tools/standins"
    )


# ---------------------------------------------------------------------------- flags off, statically


def module_level_imports(text: str, module: str) -> list[tuple[str, int]]:
    """(module, line) of each ``sglang`` import that runs when ``module`` is imported: at
    module level or in a class body, inside ``if``/``try``/``with`` too, not in a function.
    ``from X import n`` gives ``X`` and ``X.n`` (``n`` may be a submodule)."""
    package = module.split(".")[:-1]
    found: list[tuple[str, int]] = []
    stack = list(ast.parse(text).body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = (
                node.module
                if not node.level
                else ".".join(
                    package[: len(package) - node.level + 1]
                    + ([node.module] if node.module else [])
                )
            )
            found.append((base, node.lineno))
            found += [(f"{base}.{a.name}", node.lineno) for a in node.names]
        stack.extend(ast.iter_child_nodes(node))
    return sorted(m for m in found if m[0].split(".")[0] == "sglang")


def flags_off_problems(text_of, patches: list[Patch]) -> list[str]:
    """Each module-level import of a module of ours in an upstream file our hunks edit
    whose own module-level imports (through other modules of ours, transitively) reach an
    upstream module the upstream file does not import itself: on a release that lacks it,
    upstream's module would stop importing with every flag off. ``text_of(path)``: the
    file's text in the tree with the series (``python/sglang/...``), None if absent."""
    ours = {module_name(o): o for p in patches for o in p.owns if o.endswith(".py")}

    def ours_of(name: str) -> str | None:
        while name:
            if name in ours:
                return name
            name = name.rpartition(".")[0]
        return None

    def reaches(mod: str, seen: set[str]) -> dict[str, str]:
        """upstream module -> the line of ours that imports it, at import time of ``mod``."""
        seen.add(mod)
        text = text_of(ours[mod])
        got: dict[str, str] = {}
        for name, line in module_level_imports(text or "", mod):
            inner = ours_of(name)
            if inner is None:
                got.setdefault(name, f"{ours[mod]}:{line}")
            elif inner not in seen:
                for k, v in reaches(inner, seen).items():
                    got.setdefault(k, v)
        return got

    problems = []
    for f in sorted({f for p in patches for f in p.files if f.endswith(".py")}):
        text = text_of(f)
        if text is None or ours_of(module_name(f)):
            continue
        imports = module_level_imports(text, module_name(f))
        own = {name for name, _ in imports}
        for name, line in imports:
            mod = ours_of(name)
            if mod is None or name != mod:
                continue
            got = reaches(mod, set())
            # `from X import n` lists X and X.n: n is a name in X (the needs check reads
            # it), or a submodule; X decides
            extra = {
                k: v
                for k, v in got.items()
                if k not in own and k.rpartition(".")[0] not in own | set(got)
            }
            if extra:
                owner_ = owner(mod, patches)
                first = sorted(extra.items())[0]
                problems.append(
                    f"{f}:{line} imports {mod} ({owner_.name if owner_ else 'ours'}) when "
                    f"it is imported, and {mod} then imports {first[0]} ({first[1]})"
                    + (f" and {len(extra) - 1} more" if len(extra) > 1 else "")
                    + f", which {f} does not import itself: a release without it would "
                    "stop upstream's module from importing with every flag off. Import "
                    f"{mod} inside the branch its flag turns on (a function-level import)"
                )
    return problems


def verify_flags_off(tree, patches: list[Patch]) -> str:
    """``make``'s and ``make check``'s flags-off check on ``tree`` (a ``needs.UpstreamTree``
    with the series): raise naming each problem, else one line."""
    from . import ForkError

    problems = flags_off_problems(
        lambda path: tree.text(path.removeprefix("python/")), patches
    )
    if problems:
        raise ForkError(
            f"with every flag off, upstream's modules must import on any release "
            f"({len(problems)} import(s) of ours could stop them):\n  "
            + "\n  ".join(problems)
        )
    files = {f for p in patches for f in p.files if f.endswith(".py")}
    return (
        f"flags off: the {len(files)} upstream files our hunks edit import, when they are "
        "imported, no module of ours that brings in an upstream module they do not import "
        "themselves"
    )
