"""``tools/fork docs``: the README's flag table and the docs' release follow the series and pin.

The table between the README's markers is written from ``patches/series`` (which patches,
their order, their ``Server-Args:`` and ``Depends:``) and ``docs/flags.toml`` (each flag's
usage, page, default and one-line description; a patch without a flag gets a line below the
table). A rebase rewrites it with the new series, so a dropped patch's flags leave the
README. ``problems`` is what the test suite checks: the table is what the series gives, no
fork flag outside the series is quoted in README.md or CONTRIBUTING.md, and every release
they quote is the pinned one, except in CONTRIBUTING's rebase section, whose subject is
other releases.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from . import REPO_ROOT, ForkError
from .series import Patch

FLAGS_FILE = "docs/flags.toml"
DOCS = ("README.md", "CONTRIBUTING.md")  # what quotes the release and the flags
BEGIN = "<!-- begin: flag table written by `tools/fork docs` from patches/series and docs/flags.toml -->"
END = "<!-- end: flag table -->"
# a release, not part of a longer dotted number such as the address 0.0.0.0
RELEASE_RE = re.compile(r"(?<![\w.])0\.\d+\.\d+(?![\w]|\.\d)")
REBASE_SECTION = "## Rebasing onto a new upstream release"
FLAG_TOKEN_RE = re.compile(r"(?<![\w-])--[a-z0-9]+(?:-[a-z0-9]+)+")
# user pages quoting an example build (``<release>+fork.<patches>.<hash>``): a rebase rewrites
# its release and patch count, as test_docs_tables checks them against the series
EXAMPLE_PAGES = (
    "README.md",
    "docker/README.md",
    "docs/fork-identity.md",
    "docs/serving.md",
)


def load_entries(root: Path = REPO_ROOT) -> tuple[list[dict], list[dict]]:
    """The [[flag]] and [[patch]] entries of docs/flags.toml."""
    path = root / FLAGS_FILE
    if not path.exists():
        raise ForkError(
            f"{path} is missing: it describes each fork flag for the README"
        )
    data = tomllib.loads(path.read_text())
    return data.get("flag", []), data.get("patch", [])


def _num(name: str) -> str:
    return name.split("-", 1)[0]


def render(patches: list[Patch], root: Path = REPO_ROOT) -> str:
    """The block between the markers: one row per flag of the series, in series order, then
    the patches without a flag. A flag or flagless patch without an entry is an error.
    """
    flags, flagless = load_entries(root)
    by_flag = {f["flag"]: f for f in flags if "patch" not in f}
    extra: dict[str, list[dict]] = {}
    for f in flags:
        if "patch" in f:
            extra.setdefault(f["patch"], []).append(f)
    about = {p["patch"]: p["what"] for p in flagless}
    rows = [
        "| flag | default | what it does | patch |",
        "| --- | --- | --- | --- |",
    ]
    plain, missing = [], []
    for p in patches:
        entries = []
        for flag in p.flags:
            if flag not in by_flag:
                missing.append(f"{flag} ({p.name})")
            else:
                entries.append(by_flag[flag])
        entries += extra.get(p.name, [])
        if not entries:
            if p.name not in about:
                missing.append(
                    f"{p.name} (a patch without a flag: add a [[patch]] entry)"
                )
            else:
                plain.append(f"{_num(p.name)} ({about[p.name]})")
            continue
        deps = "".join(f" (+{_num(d)})" for d in p.depends)
        for k, e in enumerate(entries):
            usage = e["usage"].replace("|", "\\|")
            rows.append(
                f"| [`{usage}`]({e['page']}) | {e['default']} | {e['what']} | "
                f"{_num(p.name)}{deps if k == 0 else ''} |"
            )
    if missing:
        raise ForkError(f"{root / FLAGS_FILE} has no entry for: " + "; ".join(missing))
    text = "\n".join(rows)
    if plain:
        text += "\n\nPatches without a flag: " + ", ".join(plain) + "."
    return f"{BEGIN}\n{text}\n{END}"


def rewrite(text: str, block: str) -> str:
    """``text`` (the README) with its generated block replaced by ``block``."""
    if BEGIN not in text or END not in text:
        raise ForkError(f"README.md has no flag table markers ({BEGIN} ... {END})")
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return head + block + tail


def _release_lines(name: str, lines: list[str]) -> list[bool]:
    """For each line, whether it must quote only the pinned release: all of the README; in
    CONTRIBUTING every line outside the rebase section (its subject is other releases).
    """
    keep, inside = [], False
    for line in lines:
        if line.startswith("## "):
            inside = name == "CONTRIBUTING.md" and line.startswith(REBASE_SECTION)
        keep.append(not inside)
    return keep


def follow_release(name: str, text: str, old: str, new: str) -> str:
    """``text`` with the pinned release ``old`` quoted as ``new`` wherever only the pinned
    release may be quoted (``_release_lines``)."""
    pattern = re.compile(r"(?<![\w.])" + re.escape(old) + r"(?![\w])")
    lines = text.splitlines(keepends=True)
    return "".join(
        pattern.sub(new, line) if pinned else line
        for line, pinned in zip(lines, _release_lines(name, lines))
    )


def follow_builds(text: str, old: str, new: str, patches: int) -> str:
    """``text`` with each example build of release ``old`` or ``new``
    (``0.5.23+fork.20.3f9a1c2``) quoted as a build of ``new`` with ``patches`` patches (the
    hash part is kept): ``follow_release`` may have rewritten the release already."""
    releases = "|".join(re.escape(r) for r in (old, new))
    pattern = re.compile(
        r"(?<![\w.])(?:" + releases + r")\+fork\.\d+\.([0-9a-fx]{7})(?![0-9a-f])"
    )
    return pattern.sub(lambda m: f"{new}+fork.{patches}.{m.group(1)}", text)


def write(root: Path, patches: list[Patch], out: Path | None = None) -> list[str]:
    """Write the README's flag table from ``patches`` (into ``out``, a copy of the root, when
    given); the file names it changed."""
    readme = root / "README.md"
    if not readme.exists():
        return []
    new = rewrite(readme.read_text(), render(patches, root))
    dst = (out or root) / "README.md"
    if dst.exists() and dst.read_text() == new:
        return []
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text(new)
    return ["README.md"]


def problems(root: Path, patches: list[Patch], release: str) -> list[str]:
    """What the docs get wrong about the series and the pin (empty when they follow it)."""
    found = []
    readme = root / "README.md"
    try:
        want = render(patches, root)
    except ForkError as e:
        return [str(e)]
    if readme.exists():
        text = readme.read_text()
        if BEGIN not in text or END not in text:
            found.append("README.md: no flag table markers")
        elif rewrite(text, want) != text:
            found.append(
                "README.md: the flag table is not what patches/series and docs/flags.toml "
                "give: run `tools/fork docs`"
            )
    flags, _ = load_entries(root)
    ours = {f["flag"] for f in flags if not f.get("upstream_flag")}
    ours |= {flag for p in patches for flag in p.flags}
    series_flags = {flag for p in patches for flag in p.flags}
    for name in DOCS:
        path = root / name
        if not path.exists():
            continue
        text = path.read_text()
        lines = text.splitlines()
        for n, (line, pinned) in enumerate(zip(lines, _release_lines(name, lines)), 1):
            for v in RELEASE_RE.findall(line) if pinned else []:
                if v != release:
                    found.append(
                        f"{name}:{n}: quotes release {v}, the pin is {release}: {line.strip()[:100]}"
                    )
        for n, line in enumerate(text.splitlines(), 1):
            for flag in FLAG_TOKEN_RE.findall(line):
                if flag in ours and flag not in series_flags:
                    found.append(
                        f"{name}:{n}: names {flag}, a flag of no patch in the series: {line.strip()[:100]}"
                    )
    return found
