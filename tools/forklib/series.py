"""``patches/series`` and the patch header a reviewer and the tools both read.

A patch is a ``git format-patch`` file. Its commit message carries the header as git
trailers (last paragraph)::

    Server-Args: --speculative-dspark-verify-cap     (one per flag it adds, or "none")
    Why: one line: the measured gain or the bug       (details go in the body above)
    Upstream-Status: not sent | PR <url> | merged in <release>
    Tests: test/test_verify_cap.py                   (one or more)
    Owns: python/sglang/srt/speculative/verify_cap.py (one per file of ours; none is fine)
    Depends: 0002-moe_fused_gate-optional-live-length (an earlier patch it needs; optional)

``Depends:`` names each earlier patch whose code this one uses (a module it imports, a
keyword it passes): ``check`` requires it wherever one patch imports another's module, a
rebase refuses to drop a patch another one depends on, and ``export`` carries it along.
The diff itself touches upstream files only; the files a patch owns live in this repository
under ``python/sglang/`` and join the patch's commit when the tree is assembled.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

from . import REPO_ROOT, ForkError
from .git import git

PATCH_DIR = REPO_ROOT / "patches"
SERIES_FILE = PATCH_DIR / "series"
OURS = REPO_ROOT / "python" / "sglang"

REQUIRED = ("Server-Args", "Why", "Upstream-Status", "Tests")
STATUS_RE = re.compile(r"^(not sent|PR https?://\S+|merged in \S+)$")
FLAG_RE = re.compile(r"^--[a-z0-9]+(-[a-z0-9]+)*$")


@dataclasses.dataclass(frozen=True)
class Patch:
    path: Path
    subject: str
    body: str
    trailers: dict[str, list[str]]
    files: tuple[str, ...]  # upstream files its diff touches

    @property
    def name(self) -> str:
        return self.path.stem

    @property
    def flags(self) -> list[str]:
        return [f for f in self.trailers.get("Server-Args", []) if f != "none"]

    @property
    def owns(self) -> list[str]:
        return self.trailers.get("Owns", [])

    @property
    def depends(self) -> list[str]:
        """The patches this one needs, by name (``0002-...``; a ``.patch`` suffix is dropped)."""
        return [d.removesuffix(".patch") for d in self.trailers.get("Depends", [])]

    def first(self, key: str) -> str:
        return (self.trailers.get(key) or [""])[0]


def read_series(series_file: Path = SERIES_FILE) -> list[Path]:
    names = []
    for line in series_file.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.append(line)
    return [series_file.parent / n for n in names]


DROPPED_RE = re.compile(
    r"^# dropped in the rebase from \S+ to \S+: (\S+) \(tests: ([^)]*)\)$"
)


def dropped_tests(series_file: Path = SERIES_FILE) -> dict[str, list[str]]:
    """Test file -> the patches a rebase dropped that named it (the series' comments say so);
    conftest skips those tests, so the suite passes unedited after a rebase drops a patch.
    """
    out: dict[str, list[str]] = {}
    for line in series_file.read_text().splitlines():
        if m := DROPPED_RE.match(line.strip()):
            for test in filter(None, (t.strip() for t in m.group(2).split(","))):
                out.setdefault(test, []).append(m.group(1))
    return out


def parse_patch(path: Path) -> Patch:
    text = path.read_text()
    head, sep, diff = text.partition("\n---\n")
    if not sep:
        raise ForkError(f"{path.name}: not a git format-patch file (no '---' line)")
    header_part, _, message = head.partition("\n\n")
    subject = _header(header_part, "Subject")
    if subject is None:
        raise ForkError(f"{path.name}: no Subject header")
    subject = re.sub(r"^\[PATCH[^\]]*\]\s*", "", subject)
    trailers = _trailers(message)
    files = tuple(dict.fromkeys(re.findall(r"^diff --git a/(\S+) b/", diff, re.M)))
    body = message.strip()
    return Patch(path, subject, body, trailers, files)


def _header(block: str, name: str) -> str | None:
    # RFC 2822 folding: continuation lines start with white space.
    m = re.search(rf"^{name}: (.*(?:\n[ \t].*)*)", block, re.M)
    return re.sub(r"\n[ \t]+", " ", m.group(1)).strip() if m else None


def _trailers(message: str) -> dict[str, list[str]]:
    # The subject is a mail header here: without a stand-in first paragraph, git takes a
    # message that is only the trailer block (no body) for the subject and finds none.
    out = git(
        REPO_ROOT,
        "interpret-trailers",
        "--parse",
        "--no-divider",
        input="subject\n\n" + message,
    ).stdout
    trailers: dict[str, list[str]] = {}
    for line in out.splitlines():
        key, _, value = line.partition(":")
        trailers.setdefault(key.strip(), []).append(value.strip())
    return trailers


def load_series(series_file: Path = SERIES_FILE) -> list[Patch]:
    return [parse_patch(p) for p in read_series(series_file)]


def header_problems(patch: Patch, root: Path = REPO_ROOT) -> list[str]:
    """What is missing or malformed in a patch's header (empty when it is complete).

    ``root`` is the fork repository whose files the header names (another one in tests).
    """
    problems = [f"no {key}: trailer" for key in REQUIRED if not patch.trailers.get(key)]
    if not patch.subject:
        problems.append("empty subject")
    for flag in patch.trailers.get("Server-Args", []):
        if flag != "none" and not FLAG_RE.match(flag):
            problems.append(f"Server-Args {flag!r} is not a --flag-name")
    if "none" in patch.trailers.get("Server-Args", []) and patch.flags:
        problems.append("Server-Args lists flags and 'none'")
    status = patch.first("Upstream-Status")
    if status and not STATUS_RE.match(status):
        problems.append(
            f"Upstream-Status {status!r} is not 'not sent', 'PR <url>' or 'merged in <release>'"
        )
    for test in patch.trailers.get("Tests", []):
        if not (root / test).exists():
            problems.append(f"Tests names {test}, which does not exist")
    for own in patch.owns:
        if not own.startswith("python/sglang/"):
            problems.append(f"Owns {own}: owned files live under python/sglang/")
        elif not (root / own).is_file():
            problems.append(f"Owns {own}, which does not exist in this repository")
        if own in patch.files:
            problems.append(
                f"Owns {own} but its diff also edits it (owned files are ours whole)"
            )
    return problems


def ownership_problems(patches: list[Patch], root: Path = REPO_ROOT) -> list[str]:
    """Every file under python/sglang/ must be owned by exactly one patch of the series."""
    owners: dict[str, list[str]] = {}
    for p in patches:
        for own in p.owns:
            owners.setdefault(own, []).append(p.name)
    ours = sorted(
        str(f.relative_to(root))
        for f in (root / "python" / "sglang").rglob("*")
        if f.is_file() and "__pycache__" not in f.parts
    )
    problems = [
        f"{f} is owned by no patch (add an Owns: trailer)"
        for f in ours
        if f not in owners
    ]
    problems += [
        f"{f} is owned by {len(names)} patches: {', '.join(names)}"
        for f, names in owners.items()
        if len(names) > 1
    ]
    return problems


def dependency_problems(patches: list[Patch], root: Path = REPO_ROOT) -> list[str]:
    """Each Depends: names an earlier patch, and every patch whose code (a file it owns or a
    line its diff adds) imports a module another patch owns depends on that patch."""
    problems = []
    owner = {own: p.name for p in patches for own in p.owns}
    seen: set[str] = set()
    for p in patches:
        for dep in p.depends:
            if dep not in seen:
                later = dep in {q.name for q in patches}
                problems.append(
                    f"{p.path.name}: Depends {dep}, "
                    + (
                        "which comes after it in the series"
                        if later
                        else "which is not in the series"
                    )
                )
        for mod in sorted(_imported_modules(p, root)):
            dep = next((owner[f] for f in _module_files(mod) if f in owner), None)
            if dep and dep != p.name and dep not in p.depends:
                problems.append(
                    f"{p.path.name}: imports {mod}, which {dep} owns: add `Depends: {dep}`"
                )
        seen.add(p.name)
    return problems


def uses(patches: list[Patch], root: Path = REPO_ROOT) -> dict[str, list[str]]:
    """Each patch's name -> the patches whose code it uses: its ``Depends:`` and the owners
    of the modules it imports (the two agree on a checked series; a rebase reads both, so
    an orphan is found even where a trailer is missing)."""
    owner = {own: p.name for p in patches for own in p.owns}
    used: dict[str, list[str]] = {}
    for p in patches:
        names = set(p.depends)
        for mod in _imported_modules(p, root):
            names.update(owner[f] for f in _module_files(mod) if f in owner)
        names.discard(p.name)
        used[p.name] = sorted(names)
    return used


def _imported_modules(patch: Patch, root: Path) -> set[str]:
    """Every ``sglang`` module a patch's code may import: from the files it owns (parsed
    whole, lazy imports inside functions included, relative imports resolved) and from the
    lines its diff adds. ``from pkg import name`` yields ``pkg`` and ``pkg.name``, since the
    name may be a module (``from sglang.srt import verify_cap``)."""
    mods: set[str] = set()
    for own in patch.owns:
        if own.endswith(".py") and (root / own).is_file():
            # x.py and x/__init__.py alike: the package is the path without its last part
            package = own[len("python/") : -len(".py")].split("/")[:-1]
            mods |= imports_in((root / own).read_text(errors="replace"), package)
    diff = patch.path.read_text().partition("\n---\n")[2]
    added = [
        line[1:]
        for line in diff.splitlines()
        if line.startswith("+") and not line.startswith("+++")
    ]
    mods |= imports_in("\n".join(added), None)
    return {m for m in mods if m == "sglang" or m.startswith("sglang.")}


def imports_in(text: str, package: list[str] | None) -> set[str]:
    """The modules ``text`` imports, read with ``ast``. ``package``: the importing module's
    package, to resolve relative imports (None: relative imports are skipped). Text that is
    not a whole module (a diff's added lines) is read statement by statement: each line
    that starts an import, with its continuation lines, is parsed on its own."""
    try:
        trees = [ast.parse(text)]
    except SyntaxError:
        trees = []
        rows = text.splitlines()
        i = 0
        while i < len(rows):
            head = rows[i].strip()
            i += 1
            if not head.startswith(("import ", "from ")):
                continue
            stmt = head
            while (
                stmt.count("(") > stmt.count(")") or stmt.endswith("\\")
            ) and i < len(rows):
                stmt += "\n" + rows[i].strip()
                i += 1
            try:
                trees.append(ast.parse(stmt.split(";", 1)[0]))
            except SyntaxError:
                continue
    mods: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                mods.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    if package is None or node.level - 1 > len(package):
                        continue
                    base = package[: len(package) - (node.level - 1)]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                if mod:
                    mods.add(mod)
                mods.update(f"{mod}.{a.name}" for a in node.names if a.name != "*")
    return mods


def _module_files(mod: str) -> list[str]:
    path = "python/" + mod.replace(".", "/")
    return [path + ".py", path + "/__init__.py"]


def series_problems(patches: list[Patch], root: Path = REPO_ROOT) -> list[str]:
    problems = [
        f"{p.path.name}: {msg}" for p in patches for msg in header_problems(p, root)
    ]
    problems += ownership_problems(patches, root)
    problems += dependency_problems(patches, root)
    return problems


def check_series(patches: list[Patch], root: Path = REPO_ROOT) -> None:
    problems = series_problems(patches, root)
    if problems:
        raise ForkError("the series is not well-formed:\n  " + "\n  ".join(problems))
