"""What our modules need from upstream: every upstream name they import or read, checked
against a release's source.

Our modules (the files the series ``Owns:``) reach into upstream's modules, private names
included (``mhc._block_m_for``, ``FusedMoE._weight_loader_impl``). A release that renames
one would break at serve time; this reads our syntax trees and the release's, so the build
fails first, naming the name, the line of ours that reads it and the release.

WHAT IS COLLECTED (``collect``), from each owned ``.py`` file's syntax tree, scope by scope
(an import inside a function binds there only; a parameter or assignment of the same name
shadows it):

- ``from sglang.X import n`` and ``import sglang.X`` where the module (or ``X.n``) is not
  one of ours: the module and the name;
- attribute chains on a name so imported (``mhc._HC_MIX_BLOCK_K``,
  ``FusedMoE._weight_loader_physical``, ``sglang.srt.utils.x``);
- ``getattr(<such a name or chain>, "literal"[, default])``: a default does not make the
  name optional here, since a renamed one would silently read the default.

``hasattr`` is a probe whose both answers the code handles, and is not a need; nor is an
import inside a ``try`` whose handler catches ``ImportError`` (or ``Exception``): the code
handles its absence (an optional plugin), and what it reads from the name is not followed. Attribute
reads on runtime objects (``engram.embed._reduce_owned_rows``, ``type(m)._x``) cannot be
resolved without running the code: private ones that no module of ours defines are listed
as *unchecked*, with the upstream file that defines such a name, never failed on.

HOW A NAME IS CHECKED (``check``), on the target's source, parsed, never imported (upstream
imports need GPU libraries): the module file exists; it binds the name at top level (a
definition, an assignment, an import, inside ``if``/``try`` too, a submodule, or through
``from M import *`` of another upstream module); a class defines the attribute in its body,
as ``self.<name>`` in a method, or in an upstream or standard-library base. Re-exports are
followed (``from .x import C`` then ``C._y``) a few levels. Once a name is a function or
a plain value, what the code reads from it is a runtime value and the chain stops there; a
module-level ``x = SomeClass(...)`` is read as an instance of that class (``envs.SGLANG_*``).

STATUS: *ok*; *missing* (the module is absent, or it or the class provably lacks the name:
every base resolved, no ``__getattr__``, no unknown star import or decorator); *unknown*
(something on the way is not resolvable statically: a third-party base class, an extension
module, a module ``__getattr__``). Only *missing* fails ``make`` and ``make check``.
"""

from __future__ import annotations

import abc
import ast
import builtins
import dataclasses
import enum
import os
import re
import tempfile
import types
import typing
import zipfile
from collections.abc import Iterator
from pathlib import Path

from . import REPO_ROOT, ForkError
from .git import git
from .series import Patch

STATUSES = ("ok", "missing", "unknown")
MAX_DEPTH = 6  # re-export hops followed before a name is taken as bound but opaque
# standard-library modules whose classes upstream subclasses: a base from these is checked
# on the real object (importing them is safe), any other non-sglang base is unknown
STDLIB_BASES = {"abc": abc, "enum": enum, "typing": typing, "builtins": builtins}


# ---------------------------------------------------------------------------- what we read


@dataclasses.dataclass(frozen=True)
class Site:
    """A line of ours: the repository-relative file and its line number."""

    path: str
    line: int

    def __str__(self) -> str:
        return f"{self.path}:{self.line}"


@dataclasses.dataclass(frozen=True)
class Need:
    """One read of an upstream name at one site: ``module`` as our code names it, then the
    attribute path read from it (empty: the module itself)."""

    module: str
    attrs: tuple[str, ...]
    site: Site


@dataclasses.dataclass(frozen=True)
class Unchecked:
    """A private attribute read on a runtime object (not resolvable statically)."""

    attr: str
    expr: str
    site: Site


def our_modules(patches: list[Patch]) -> dict[str, str]:
    """Dotted module name -> repository path, for every ``.py`` file the series owns."""
    mods = {}
    for p in patches:
        for own in p.owns:
            if own.startswith("python/") and own.endswith(".py"):
                name = own[len("python/") : -len(".py")].replace("/", ".")
                mods[name.removesuffix(".__init__")] = own
    return mods


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


EXTERNAL = "external"  # a name bound by an import of another package (torch, argparse)
_Ref = typing.Union[tuple[str, tuple[str, ...]], str, None]

_NESTED = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)
_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


def _scope_nodes(body: list[ast.AST]) -> Iterator[ast.AST]:
    """Every node of one scope: nested definitions are yielded (their name binds here) but
    not entered, comprehensions are not entered."""
    stack = list(reversed(body))
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, _NESTED) or isinstance(node, _COMPREHENSIONS):
            continue
        stack.extend(reversed(list(ast.iter_child_nodes(node))))


def _targets(node: ast.AST) -> Iterator[str]:
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            yield n.id
        elif isinstance(n, ast.Starred) and isinstance(n.value, ast.Name):
            yield n.value.id


class _Collector:
    """Walks one module of ours, scope by scope, into ``needs`` and ``unchecked``."""

    def __init__(self, rel: str, package: list[str], ours: set[str]) -> None:
        self.rel = rel
        self.package = package
        self.ours = ours
        self.needs: list[Need] = []
        self.unchecked: list[Unchecked] = []
        # each scope: (is a class body, name -> (module, attrs) of an upstream import,
        # EXTERNAL for an import of another package, None for any other binding)
        self.scopes: list[tuple[bool, dict[str, _Ref]]] = []
        self.optional: set[int] = set()  # ids of imports whose failure the code handles

    # -- bindings
    def _upstream(self, module: str) -> bool:
        return (
            module == "sglang" or module.startswith("sglang.")
        ) and module not in self.ours

    def _bindings(
        self, body: list[ast.AST], args: ast.arguments | None
    ) -> dict[str, _Ref]:
        """One scope's names; records a Need for each upstream import in it."""
        bound: dict[str, _Ref] = {}
        imported: set[str] = set()
        outer: set[str] = set()
        if args is not None:
            for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
                bound[a.arg] = None
            for a in (args.vararg, args.kwarg):
                if a is not None:
                    bound[a.arg] = None
        for node in _scope_nodes(body):
            site = Site(self.rel, getattr(node, "lineno", 0))
            if id(node) in self.optional:
                for a in node.names:
                    bound[a.asname or a.name.split(".")[0]] = None
            elif isinstance(node, ast.Import):
                for a in node.names:
                    ref: _Ref
                    if a.name.split(".")[0] != "sglang":
                        ref = EXTERNAL
                    elif not a.asname:  # `import sglang.x.y` binds `sglang`
                        ref = ("sglang", ())
                    elif a.name in self.ours:
                        ref = None
                    else:
                        ref = (a.name, ())
                    if self._upstream(a.name):
                        self.needs.append(Need(a.name, (), site))
                    name = a.asname or a.name.split(".")[0]
                    bound[name] = ref
                    if ref is not None:
                        imported.add(name)
            elif isinstance(node, ast.ImportFrom):
                mod = _absolute(node, self.package)
                for a in node.names:
                    if a.name == "*":
                        continue
                    name = a.asname or a.name
                    if (
                        mod
                        and self._upstream(mod)
                        and f"{mod}.{a.name}" not in self.ours
                    ):
                        self.needs.append(Need(mod, (a.name,), site))
                        bound[name] = (mod, (a.name,))
                        imported.add(name)
                    elif mod and mod.split(".")[0] != "sglang":
                        bound[name] = EXTERNAL
                    else:
                        bound[name] = None
            elif isinstance(node, (ast.Global, ast.Nonlocal)):
                outer.update(node.names)
            elif isinstance(node, _NESTED) and not isinstance(node, ast.Lambda):
                bound.setdefault(node.name, None)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                bound.setdefault(node.id, None)
            elif isinstance(node, ast.ExceptHandler) and node.name:
                bound.setdefault(node.name, None)
            elif isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name:
                bound.setdefault(node.name, None)
        for name in list(bound):
            # an import and a fallback assignment (`except ImportError: x = None`) of one
            # name: the import is what the code reads when it works
            if name in outer or (bound[name] is None and name in imported):
                del bound[name]
        return bound

    def _lookup(self, name: str) -> _Ref:
        for i, (is_class, scope) in enumerate(reversed(self.scopes)):
            if is_class and i > 0:
                continue  # a class body's names are not visible in its methods
            if name in scope:
                return scope[name]
        return None

    # -- walk
    def module(self, tree: ast.Module) -> None:
        self.optional = _optional_imports(tree)
        self.scopes.append((False, self._bindings(tree.body, None)))
        for stmt in tree.body:
            self.visit(stmt)
        self.scopes.pop()

    def visit(self, node: ast.AST) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for d in getattr(node, "decorator_list", []):
                self.visit(d)
            for d in [*node.args.defaults, *node.args.kw_defaults]:
                if d is not None:
                    self.visit(d)
            body = node.body if isinstance(node.body, list) else [node.body]
            self.scopes.append((False, self._bindings(body, node.args)))
            for stmt in body:
                self.visit(stmt)
            self.scopes.pop()
            return
        if isinstance(node, ast.ClassDef):
            for d in [*node.decorator_list, *node.bases, *node.keywords]:
                self.visit(d)
            self.scopes.append((True, self._bindings(node.body, None)))
            for stmt in node.body:
                self.visit(stmt)
            self.scopes.pop()
            return
        if isinstance(node, _COMPREHENSIONS):
            names = {t: None for g in node.generators for t in _targets(g.target)}
            self.scopes.append((False, names))
            for child in ast.iter_child_nodes(node):
                self.visit(child)
            self.scopes.pop()
            return
        if isinstance(node, ast.Attribute):
            self._attribute(node)
            return
        if isinstance(node, ast.Call):
            self._getattr(node)
        for child in ast.iter_child_nodes(node):
            self.visit(child)

    def _chain(self, node: ast.AST) -> tuple[ast.AST, list[str]]:
        attrs: list[str] = []
        while isinstance(node, ast.Attribute):
            attrs.append(node.attr)
            node = node.value
        return node, attrs[::-1]

    def _ref(self, node: ast.AST) -> tuple[str, tuple[str, ...]] | None:
        base, attrs = self._chain(node)
        if isinstance(base, ast.Name):
            ref = self._lookup(base.id)
            if isinstance(ref, tuple):
                return ref[0], ref[1] + tuple(attrs)
        return None

    def _runtime(self, base: ast.AST, first: int = 0) -> bool:
        """Whether a private name read ``first`` attributes after ``base`` may be one of
        upstream's: not on a name imported from another package (torch's privates are not
        upstream's), not directly on ``self`` / ``cls`` (ours)."""
        if isinstance(base, ast.Name):
            if self._lookup(base.id) == EXTERNAL:
                return False
            return first > 0 or base.id not in ("self", "cls")
        return True

    def _attribute(self, node: ast.Attribute) -> None:
        site = Site(self.rel, node.lineno)
        ref = self._ref(node)
        if ref is not None:
            self.needs.append(Need(*ref, site))
            return
        base, attrs = self._chain(node)
        # the first private name of the chain only: what follows is read on its value
        first = next((i for i, a in enumerate(attrs) if _is_private(a)), None)
        if first is not None and self._runtime(base, first):
            receiver = ast.unparse(base) + "".join(f".{a}" for a in attrs[:first])
            self.unchecked.append(Unchecked(attrs[first], receiver, site))
        self.visit(base)

    def _getattr(self, node: ast.Call) -> None:
        if not (
            isinstance(node.func, ast.Name)
            and node.func.id == "getattr"
            and self._lookup("getattr") is None
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            return
        name = node.args[1].value
        ref = self._ref(node.args[0])
        site = Site(self.rel, node.lineno)
        if ref is not None:
            self.needs.append(Need(ref[0], ref[1] + (name,), site))
        elif _is_private(name) and self._runtime(node.args[0]):
            self.unchecked.append(Unchecked(name, ast.unparse(node.args[0]), site))


_CATCHES_IMPORT = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}


def _optional_imports(tree: ast.Module) -> set[int]:
    """The imports inside a ``try`` body whose handler catches an ImportError (a bare
    ``except``, ``ImportError``, ``Exception``...): the code runs without them."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Try):
            continue
        caught = set()
        for h in node.handlers:
            types_ = h.type.elts if isinstance(h.type, ast.Tuple) else [h.type]
            caught |= {ast.unparse(t).rsplit(".", 1)[-1] if t else "" for t in types_}
        if caught & (_CATCHES_IMPORT | {""}):
            found |= {
                id(n)
                for stmt in node.body
                for n in ast.walk(stmt)
                if isinstance(n, (ast.Import, ast.ImportFrom))
            }
    return found


def _defined_by_ours(trees: list[ast.Module]) -> set[str]:
    """Names our modules define or store (functions, classes, assigned attributes,
    ``setattr`` literals): a private attribute read of such a name is taken as ours."""
    names: set[str] = set()
    for tree in trees:
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(n.name)
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                names.add(n.attr)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                names.add(n.id)
            elif (
                isinstance(n, ast.Call)
                and isinstance(n.func, ast.Name)
                and n.func.id == "setattr"
                and len(n.args) >= 2
                and isinstance(n.args[1], ast.Constant)
            ):
                names.add(str(n.args[1].value))
    return names


def collect(
    patches: list[Patch], root: Path = REPO_ROOT
) -> tuple[list[Need], list[Unchecked]]:
    """Every upstream read of every ``.py`` file the series owns (read from ``root``)."""
    ours = our_modules(patches)
    needs: list[Need] = []
    unchecked: list[Unchecked] = []
    trees = []
    for mod, rel in sorted(ours.items(), key=lambda kv: kv[1]):
        path = root / rel
        if not path.is_file():
            continue
        try:
            tree = ast.parse(path.read_text(errors="replace"), filename=rel)
        except SyntaxError:  # a conflict left in it mid-rebase: its import says so
            continue
        trees.append(tree)
        package = mod.split(".") if rel.endswith("__init__.py") else mod.split(".")[:-1]
        c = _Collector(rel, package, set(ours))
        c.module(tree)
        needs += c.needs
        unchecked += c.unchecked
    defined = _defined_by_ours(trees)
    return needs, [u for u in unchecked if u.attr not in defined]


# ---------------------------------------------------------------------------- the release


class UpstreamTree:
    """A release's ``sglang`` package as source text: a directory (an assembled tree's
    ``python/sglang`` or a site-packages ``sglang``) or a wheel, with ``overlay`` files
    (path under the package's parent -> text, None: deleted) laid over it."""

    def __init__(
        self,
        release: str,
        paths: set[str],
        read: typing.Callable[[str], str],
        where: str,
        overlay: dict[str, str | None] | None = None,
    ) -> None:
        self.overlay = overlay or {}
        self.paths = (paths | {p for p, t in self.overlay.items() if t is not None}) - {
            p for p, t in self.overlay.items() if t is None
        }
        self._read = read
        self.where = where
        self.release = release or _release_of(self) or "(unknown release)"
        self._dirs = {
            "/".join(p.split("/")[:i])
            for p in self.paths
            for i in range(1, p.count("/") + 1)
        }
        self._modules: dict[str, _Module | None] = {}
        self._kinds: dict[str, tuple[str, str | None]] = {}
        self._native = {
            p.rsplit("/", 1)[0] + "/" + p.rsplit("/", 1)[1].split(".", 1)[0]
            for p in self.paths
            if p.endswith((".so", ".pyd", ".pyi"))
        }

    @classmethod
    def from_dir(cls, path: Path, release: str = "") -> "UpstreamTree":
        """``path`` holds ``python/sglang`` (an assembled tree) or ``sglang``, or is ``sglang``."""
        path = Path(path)
        candidates = [path / "python", path] + (
            [path.parent] if path.name == "sglang" else []
        )
        parent = next((c for c in candidates if (c / "sglang").is_dir()), None)
        if parent is None:
            raise ForkError(
                f"{path}: no sglang package in it (python/sglang or sglang)"
            )
        paths = set()
        for dirpath, dirnames, filenames in os.walk(parent / "sglang"):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            rel = Path(dirpath).relative_to(parent).as_posix()
            paths.update(f"{rel}/{f}" for f in filenames)
        return cls(
            release,
            paths,
            lambda rel: (parent / rel).read_text(errors="replace"),
            str(path),
        )

    @classmethod
    def from_wheel(
        cls,
        wheel: Path,
        release: str = "",
        overlay: dict[str, str | None] | None = None,
    ) -> "UpstreamTree":
        zf = zipfile.ZipFile(wheel)
        paths = {
            n for n in zf.namelist() if n.startswith("sglang/") and not n.endswith("/")
        }
        return cls(
            release,
            paths,
            lambda rel: zf.read(rel).decode(errors="replace"),
            wheel.name,
            overlay,
        )

    def text(self, rel: str) -> str | None:
        if rel in self.overlay:
            return self.overlay[rel]
        return self._read(rel) if rel in self.paths else None

    def module_files(self, module: str) -> tuple[str, str | None]:
        """("source" | "package" | "extension" | "namespace" | "absent", the file)."""
        if module not in self._kinds:
            base = module.replace(".", "/")
            if f"{base}.py" in self.paths:
                kind = "source", f"{base}.py"
            elif f"{base}/__init__.py" in self.paths:
                kind = "package", f"{base}/__init__.py"
            elif base in self._native:
                kind = "extension", None
            elif base in self._dirs:
                kind = "namespace", None
            else:
                kind = "absent", None
            self._kinds[module] = kind
        return self._kinds[module]

    def looked_up(self) -> list[str]:
        """The source files of every module a check has looked up so far."""
        return sorted(rel for _, rel in self._kinds.values() if rel is not None)

    def module(self, name: str) -> "_Module | None":
        """The parsed module, or None where it has no Python source (absent, extension,
        namespace package)."""
        if name not in self._modules:
            kind, rel = self.module_files(name)
            text = self.text(rel) if rel else None
            try:
                self._modules[name] = (
                    _Module(name, kind == "package", ast.parse(text))
                    if text is not None
                    else None
                )
            except SyntaxError:
                self._modules[name] = None
        return self._modules[name]

    def search(self, names: set[str]) -> dict[str, str]:
        """name -> the first upstream file (sorted) that defines it as a function, a class
        attribute or a ``self.`` attribute (a text search, for the unchecked list)."""
        if not names:
            return {}
        found: dict[str, str] = {}
        for rel in sorted(p for p in self.paths if p.endswith(".py")):
            text = self.text(rel) or ""
            here = [n for n in names if n not in found and n in text]
            if not here:
                continue
            alt = "|".join(re.escape(n) for n in here)
            pattern = re.compile(
                rf"\bdef\s+({alt})\s*\(|(?:\.|^[ \t]+)({alt})\s*(?::|=(?!=))"
                rf"|setattr\([^,]+,\s*[\"']({alt})[\"']",
                re.M,
            )
            for m in pattern.finditer(text):
                found.setdefault(m.group(1) or m.group(2) or m.group(3), rel)
            if len(found) == len(names):
                break
        return found


def _release_of(tree: UpstreamTree) -> str:
    """The upstream release a tree is, from its ``sglang/_version.py`` (a fork stamp's
    local part dropped)."""
    text = tree.text("sglang/_version.py")
    if text is None:
        return ""
    m = re.search(r"__version__\s*=\s*(?:version\s*=\s*)?['\"]([^'\"]+)['\"]", text)
    return m.group(1).split("+", 1)[0] if m else ""


@dataclasses.dataclass
class _Module:
    """One upstream module's top-level bindings (inside ``if`` / ``try`` / ``with`` too)."""

    name: str
    is_package: bool
    tree: ast.Module
    bindings: dict[str, ast.AST] = dataclasses.field(default_factory=dict)
    stars: list[str | None] = dataclasses.field(default_factory=list)
    dynamic: bool = False  # a module __getattr__, or globals() written
    all_: list[str] | None = None

    def __post_init__(self) -> None:
        package = self.name.split(".") if self.is_package else self.name.split(".")[:-1]
        for node in _scope_nodes(self.tree.body):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.bindings[node.name] = node
                if node.name == "__getattr__":
                    self.dynamic = True
                if not isinstance(node, ast.ClassDef):
                    for g in ast.walk(node):
                        if isinstance(g, ast.Global):
                            for n in g.names:
                                self.bindings.setdefault(n, g)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                if isinstance(node, ast.ImportFrom):
                    mod = _absolute(node, package)
                    if any(a.name == "*" for a in node.names):
                        self.stars.append(mod)
                        continue
                for a in node.names:
                    name = a.asname or a.name.split(".")[0]
                    self.bindings[name] = node
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                self.bindings.setdefault(node.id, node)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = (
                    node.targets if isinstance(node, ast.Assign) else [node.target]
                )
                for t in targets:
                    for name in _targets(t):
                        self.bindings[name] = node
                        if name == "__all__" and isinstance(node.value, ast.List):
                            self.all_ = [
                                e.value
                                for e in node.value.elts
                                if isinstance(e, ast.Constant)
                            ]
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("globals", "vars")
            ):
                self.dynamic = True


def _absolute(node: ast.ImportFrom, package: list[str]) -> str | None:
    if not node.level:
        return node.module
    if node.level - 1 > len(package):
        return None
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


# ---------------------------------------------------------------------------- resolution


@dataclasses.dataclass(frozen=True)
class _Val:
    """What a name is, as far as the source says: a module, a class (``node`` in
    ``module``), an instance of one, a plain value (a function, a constant: what is read
    from it is a runtime value) or opaque (bound, but to something not resolvable here).
    """

    kind: str  # "module", "class", "instance", "stdlib", "value", "opaque"
    module: str = ""
    node: ast.ClassDef | None = None
    obj: object = None  # the real standard-library object, kind "stdlib"
    why: str = ""


@dataclasses.dataclass(frozen=True)
class _Res:
    status: str  # "ok", "missing", "unknown"
    val: _Val | None = None
    why: str = ""


def _ok(val: _Val) -> _Res:
    return _Res("ok", val)


class _Resolver:
    def __init__(self, tree: UpstreamTree) -> None:
        self.tree = tree

    def module_val(self, name: str) -> _Res:
        kind, _ = self.tree.module_files(name)
        if kind == "absent":
            return _Res("missing", why=f"no module {name}")
        if kind == "extension":
            return _ok(_Val("opaque", name, why=f"{name} is an extension module"))
        return _ok(_Val("module", name))

    def in_module(self, mod: str, name: str, depth: int) -> _Res:
        """``mod.name``: bound at top level, a submodule, or through a star import."""
        info = self.tree.module(mod)
        if info is not None and name in info.bindings:
            return _ok(self._binding(info, name, info.bindings[name], depth))
        sub = f"{mod}.{name}"
        if self.tree.module_files(sub)[0] != "absent":
            return self.module_val(sub)
        kind = self.tree.module_files(mod)[0]
        if kind == "extension":
            return _Res("unknown", why=f"{mod} is an extension module")
        if info is None:
            return _Res("missing", why=f"{mod} has no {name}")
        unknown = []
        for star in info.stars:
            if star is None or not (star == "sglang" or star.startswith("sglang.")):
                unknown.append(f"`from {star} import *`")
                continue
            if depth >= MAX_DEPTH:
                unknown.append(f"`from {star} import *` (too deep)")
                continue
            src = self.tree.module(star)
            listed = src.all_ if src is not None else None
            if (listed is not None and name not in listed) or (
                listed is None and name.startswith("_")
            ):
                continue
            res = self.in_module(star, name, depth + 1)
            if res.status != "missing":
                return res
        if info.dynamic:
            unknown.append("a module __getattr__ or a globals() write")
        if unknown:
            return _Res(
                "unknown", why=f"{mod} lacks {name} but has " + ", ".join(unknown)
            )
        return _Res("missing", why=f"{mod} does not define {name}")

    def _binding(self, info: _Module, name: str, node: ast.AST, depth: int) -> _Val:
        if isinstance(node, ast.ClassDef):
            return _Val("class", info.name, node)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return _Val("value", info.name)
        package = info.name.split(".") if info.is_package else info.name.split(".")[:-1]
        if isinstance(node, ast.Import):
            alias = next(
                a for a in node.names if (a.asname or a.name.split(".")[0]) == name
            )
            target = alias.name if alias.asname else alias.name.split(".")[0]
            if target == "sglang" or target.startswith("sglang."):
                res = self.module_val(target)
                return res.val if res.val else _Val("opaque", why=res.why)
            return self._stdlib(target) or _Val("opaque", why=f"module {target}")
        if isinstance(node, ast.ImportFrom):
            src = _absolute(node, package)
            alias = next(a for a in node.names if (a.asname or a.name) == name)
            if src and (src == "sglang" or src.startswith("sglang.")):
                if depth >= MAX_DEPTH:
                    return _Val("opaque", why=f"re-exported more than {MAX_DEPTH} deep")
                res = self.in_module(src, alias.name, depth + 1)
                return res.val if res.val else _Val("opaque", why=res.why)
            base = self._stdlib(src or "")
            if base is not None and hasattr(base.obj, alias.name):
                obj = getattr(base.obj, alias.name)
                if isinstance(obj, type):
                    return _Val("stdlib", obj=obj)
            return _Val("opaque", why=f"{alias.name} from {src}")
        value = getattr(node, "value", None)
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and value is not None:
            if isinstance(value, ast.Call):
                res = self.expr(info, value.func, depth + 1)
                if res.status == "ok" and res.val.kind == "class":
                    return _Val("instance", res.val.module, res.val.node)
            elif isinstance(value, (ast.Name, ast.Attribute)):
                res = self.expr(info, value, depth + 1)
                if res.status == "ok" and res.val.kind in ("module", "class"):
                    return res.val
        return _Val("value", info.name)

    def _stdlib(self, module: str) -> _Val | None:
        obj = STDLIB_BASES.get(module)
        return _Val("stdlib", obj=obj) if obj is not None else None

    def expr(self, info: _Module, node: ast.AST, depth: int) -> _Res:
        """A name or attribute chain as it reads in upstream module ``info``."""
        if depth > MAX_DEPTH:
            return _Res("unknown", why=f"more than {MAX_DEPTH} hops")
        if isinstance(node, ast.Subscript):  # Generic[T], Base[...]
            return self.expr(info, node.value, depth)
        if isinstance(node, ast.Name):
            res = self.in_module(info.name, node.id, depth)
            if res.status != "missing":
                return res
            obj = getattr(builtins, node.id, None)
            if isinstance(obj, type):
                return _ok(_Val("stdlib", obj=obj))
            return _Res("unknown", why=f"{node.id} is not bound in {info.name}")
        if isinstance(node, ast.Attribute):
            res = self.expr(info, node.value, depth)
            if res.status != "ok":
                return res
            return self.attr(res.val, node.attr, depth + 1)
        return _Res("unknown", why=f"{ast.unparse(node)} is not a name")

    def attr(self, val: _Val, name: str, depth: int) -> _Res:
        if val.kind == "module":
            return self.in_module(val.module, name, depth)
        if val.kind in ("class", "instance"):
            return self.class_attr(val.module, val.node, name, depth, set())
        if val.kind == "stdlib":
            if hasattr(val.obj, name):
                got = getattr(val.obj, name)
                return _ok(
                    _Val("stdlib", obj=got)
                    if isinstance(got, (type, types.ModuleType))
                    else _Val("value")
                )
            return _Res(
                "missing", why=f"{getattr(val.obj, '__name__', val)} has no {name}"
            )
        return _Res("unknown", why=val.why or "not resolvable statically")

    def class_attr(
        self, mod: str, cls: ast.ClassDef, name: str, depth: int, seen: set[int]
    ) -> _Res:
        seen.add(id(cls))
        own = _class_members(cls)
        if name in own:
            node = own[name]
            if isinstance(node, ast.ClassDef):
                return _ok(_Val("class", mod, node))
            return _ok(_Val("value", mod))
        unknown = []
        if "__getattr__" in own or "__getattribute__" in own:
            unknown.append("a __getattr__")
        if any(k.arg == "metaclass" for k in cls.keywords):
            unknown.append("a metaclass")
        for d in cls.decorator_list:
            d = d.func if isinstance(d, ast.Call) else d
            if ast.unparse(d) not in ("dataclass", "dataclasses.dataclass"):
                unknown.append(f"decorator @{ast.unparse(d)}")
        info = self.tree.module(mod)
        for base in cls.bases:
            res = self.expr(info, base, depth + 1) if info else _Res("unknown")
            if res.status != "ok" or res.val.kind not in ("class", "stdlib"):
                unknown.append(f"base {ast.unparse(base)}")
                continue
            if res.val.kind == "stdlib":
                if hasattr(res.val.obj, name):
                    return _ok(_Val("value"))
                continue
            if id(res.val.node) in seen or depth >= MAX_DEPTH:
                unknown.append(f"base {ast.unparse(base)}")
                continue
            got = self.class_attr(res.val.module, res.val.node, name, depth + 1, seen)
            if got.status == "ok":
                return got
            if got.status == "unknown":
                unknown.append(f"base {ast.unparse(base)}")
        if not cls.bases and hasattr(object, name):
            return _ok(_Val("value"))
        if unknown:
            return _Res(
                "unknown",
                why=f"class {cls.name} ({mod}) lacks {name} but has "
                + ", ".join(dict.fromkeys(unknown)),
            )
        return _Res("missing", why=f"class {cls.name} ({mod}) defines no {name}")


def _class_members(cls: ast.ClassDef) -> dict[str, ast.AST]:
    """Names a class body binds, and the attributes its methods assign on ``self``/``cls``."""
    members: dict[str, ast.AST] = {}
    for node in _scope_nodes(cls.body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            members[node.name] = node
            if isinstance(node, ast.ClassDef):
                continue
            params = [a.arg for a in [*node.args.posonlyargs, *node.args.args]][:1]
            for n in ast.walk(node):
                if (
                    isinstance(n, ast.Attribute)
                    and isinstance(n.ctx, ast.Store)
                    and isinstance(n.value, ast.Name)
                    and n.value.id in params
                ):
                    members.setdefault(n.attr, n)
                elif (
                    isinstance(n, ast.Call)
                    and isinstance(n.func, ast.Name)
                    and n.func.id == "setattr"
                    and len(n.args) >= 2
                    and isinstance(n.args[0], ast.Name)
                    and n.args[0].id in params
                    and isinstance(n.args[1], ast.Constant)
                ):
                    members.setdefault(str(n.args[1].value), n)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            members.setdefault(node.id, node)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:
                members.setdefault(a.asname or a.name.split(".")[0], node)
    return members


# ---------------------------------------------------------------------------- the check


@dataclasses.dataclass
class Entry:
    """One upstream name as checked: ``module:attr.path`` (``module`` alone for a module),
    its status and why, and every site of ours that reads it."""

    module: str
    attrs: tuple[str, ...]
    status: str
    why: str
    sites: list[Site]

    @property
    def name(self) -> str:
        return self.module + (":" + ".".join(self.attrs) if self.attrs else "")

    @property
    def private(self) -> bool:
        return any(_is_private(a) for a in (*self.module.split("."), *self.attrs))


@dataclasses.dataclass
class Report:
    """A check's result: the release and where it was read, every name, the unchecked."""

    release: str
    where: str
    entries: list[Entry]
    # each unchecked read, with the upstream file that defines such a name (None: none)
    unchecked: list[tuple[Unchecked, str | None]]

    def count(self, status: str) -> int:
        return sum(e.status == status for e in self.entries)

    @property
    def missing(self) -> list[Entry]:
        return [e for e in self.entries if e.status == "missing"]


def check(
    tree: UpstreamTree,
    patches: list[Patch],
    root: Path = REPO_ROOT,
    locate: bool = True,
) -> Report:
    """Every upstream name the series' modules read, checked against ``tree``; ``locate``:
    also search the tree's text for where each unchecked name is defined (a second or so).
    """
    needs, unchecked = collect(patches, root)
    ours = our_modules(patches)
    r = _Resolver(tree)
    entries: dict[tuple[str, tuple[str, ...]], Entry] = {}
    for need in needs:
        module, attrs, res = _check_one(r, set(ours), need)
        if module is None:
            continue  # the chain led into a module of ours
        key = (module, attrs)
        if key not in entries:
            entries[key] = Entry(module, attrs, res.status, res.why, [])
        if need.site not in entries[key].sites:
            entries[key].sites.append(need.site)
    # a tree without the series (a target release as it ships, not replayed onto): a name
    # one of our patches adds to an upstream file is there once the series is
    bare = not any(own.removeprefix("python/") in tree.paths for own in ours.values())
    for e in entries.values() if bare else ():
        if e.status == "missing" and e.attrs:
            adder = added_by(patches, e.attrs[-1])
            if adder:
                e.status = "ok"
                e.why = f"not in this release: patch {adder} adds it"
    found = tree.search({u.attr for u in unchecked}) if locate else {}
    return Report(
        tree.release,
        tree.where,
        sorted(entries.values(), key=lambda e: (e.module, e.attrs)),
        [(u, found.get(u.attr)) for u in unchecked],
    )


def added_by(patches: list[Patch], name: str) -> str | None:
    """The first patch whose diff adds a definition of ``name`` to an upstream file (a
    function, a class, an assignment, a ``self.`` attribute)."""
    pattern = re.compile(
        rf"^\+(?:\s*(?:async\s+)?(?:def|class)\s+{re.escape(name)}\b"
        rf"|\s*{re.escape(name)}\s*(?::|=(?!=))|.*\bself\.{re.escape(name)}\s*=(?!=))",
        re.M,
    )
    for p in patches:
        if p.files and pattern.search(p.path.read_text().partition("\n---\n")[2]):
            return p.name
    return None


def _check_one(
    r: _Resolver, ours: set[str], need: Need
) -> tuple[str | None, tuple[str, ...], _Res]:
    """(the module, the attribute path checked, the result). The module grows while the
    chain names submodules; the path stops after a plain value (what is read from it is a
    runtime value)."""
    module = need.module
    if module in ours:
        return None, (), _Res("ok")
    res = r.module_val(module)
    if res.status != "ok":
        return module, (), res
    val = res.val
    checked: list[str] = []
    for attr in need.attrs:
        if val.kind == "value":
            break
        if val.kind == "module" and not checked and f"{module}.{attr}" in ours:
            return None, (), res
        res = r.attr(val, attr, 0)
        if res.status != "ok":
            return module, (*checked, attr), res
        if val.kind == "module" and res.val.kind == "module" and not checked:
            module = res.val.module  # a submodule: part of the module's name
        else:
            checked.append(attr)
        val = res.val
    return module, tuple(checked), res


# ---------------------------------------------------------------------------- trees, output


def series_tree(
    wheel: Path, patches: list[Patch], root: Path = REPO_ROOT, release: str = ""
) -> UpstreamTree:
    """The pinned wheel with the series laid over it, as ``make`` assembles it: the upstream
    files the patches edit, patched (``git apply`` of each patch in a scratch directory),
    and the files the series owns, from ``root``."""
    touched = sorted({f for p in patches for f in p.files})
    overlay: dict[str, str | None] = {}
    with zipfile.ZipFile(wheel) as zf, tempfile.TemporaryDirectory() as tmp:
        names = set(zf.namelist())
        scratch = Path(tmp)
        git(scratch, "init", "-q")
        for f in touched:
            inner = f.removeprefix("python/")
            if inner in names:
                (scratch / f).parent.mkdir(parents=True, exist_ok=True)
                (scratch / f).write_bytes(zf.read(inner))
        for p in patches:
            if p.files:
                r = git(scratch, "apply", str(p.path), check=False)
                if r.returncode != 0:
                    raise ForkError(
                        f"{p.path.name} does not apply to {wheel.name}:\n{r.stderr.strip()}"
                    )
        for f in touched:
            path = scratch / f
            overlay[f.removeprefix("python/")] = (
                path.read_text(errors="replace") if path.is_file() else None
            )
    for p in patches:
        for own in p.owns:
            if (root / own).is_file():
                overlay[own.removeprefix("python/")] = (root / own).read_text(
                    errors="replace"
                )
    return UpstreamTree.from_wheel(wheel, release, overlay)


def target_tree(
    target: Path | None, patches: list[Patch], tag: str, root: Path = REPO_ROOT
) -> UpstreamTree:
    """The tree to check: ``target`` as it is (a directory, or a ``.whl``), else the pinned
    release with the series (``series_tree``) as ``make`` assembles it."""
    if target is None:
        from .pin import fetch_pinned, load_pin

        pin = load_pin()
        return series_tree(fetch_pinned(pin, tag), patches, root, pin.version)
    if Path(target).is_file() and str(target).endswith(".whl"):
        return UpstreamTree.from_wheel(Path(target))
    return UpstreamTree.from_dir(Path(target))


def verify(tree: UpstreamTree, patches: list[Patch], root: Path = REPO_ROOT) -> str:
    """``make``'s and ``make check``'s check: raise on a missing name, else one line."""
    report = check(tree, patches, root, locate=False)
    require(report)
    return (
        f"{len(report.entries)} upstream names our modules read: found in sglang "
        f"{report.release} ({report.count('unknown')} not resolvable statically, "
        f"{len(report.unchecked)} private reads on runtime objects unchecked; "
        "`tools/fork needs` lists them)"
    )


def render(report: Report, unchecked: bool = True) -> str:
    """The list ``tools/fork needs`` prints: one line per name, its status and readers."""
    width = max((len(e.name) for e in report.entries), default=0)
    lines = [
        f"upstream names our modules read, checked against sglang {report.release} "
        f"({report.where}):"
    ]
    for e in report.entries:
        lines.append(f"  {e.status:<8} {e.name:<{width}}  {sites(e.sites)}")
        if e.why:
            lines.append(f"  {'':<8} {'':<{width}}  ({e.why})")
    lines.append(summary(report))
    if unchecked and report.unchecked:
        lines.append(
            "unchecked: private attributes read on runtime objects (not resolvable "
            "statically; where upstream defines such a name):"
        )
        for u, where in report.unchecked:
            lines.append(
                f"  {u.expr}.{u.attr}  {u.site}  "
                + (f"({where})" if where else "(no upstream file defines it)")
            )
    return "\n".join(lines)


def sites(of: list[Site]) -> str:
    """``a.py:3,9, b.py:4``: the sites, a file's lines together."""
    lines: dict[str, list[str]] = {}
    for s in of:
        lines.setdefault(s.path, []).append(str(s.line))
    return ", ".join(f"{path}:{','.join(n)}" for path, n in lines.items())


def summary(report: Report) -> str:
    """One line: how many names, sites and modules, each status's count."""
    read_at = {s for e in report.entries for s in e.sites}
    private = [e for e in report.entries if e.private]
    return (
        f"{len(report.entries)} upstream names ({len(private)} private) at {len(read_at)} "
        f"sites in {len({s.path for s in read_at})} modules of ours: "
        + ", ".join(f"{report.count(s)} {s}" for s in STATUSES)
        + f"; {len(report.unchecked)} unchecked private reads on runtime objects"
    )


DOC_BEGIN = (
    "<!-- begin: private upstream names our modules read (test/test_needs.py) -->"
)
DOC_END = "<!-- end: private upstream names -->"


def doc_list(report: Report) -> str:
    """CONTRIBUTING.md's list: the private names checked, one line per upstream module."""
    by_module: dict[str, list[str]] = {}
    for e in report.entries:
        if e.private:
            by_module.setdefault(e.module, []).append(".".join(e.attrs) or "(module)")
    return "\n".join(
        f"- `{m}`: " + ", ".join(f"`{a}`" for a in names)
        for m, names in sorted(by_module.items())
    )


def require(report: Report) -> None:
    """Raise naming each missing name, the lines of ours that read it and the release."""
    if not report.missing:
        return
    lines = [
        f"sglang {report.release} ({report.where}) lacks {len(report.missing)} upstream "
        "name(s) our modules read (`tools/fork needs` lists them all):"
    ]
    for e in report.missing:
        lines.append(f"  {e.name}: {e.why}")
        lines += [f"    read at {s}" for s in e.sites]
    raise ForkError("\n".join(lines))
