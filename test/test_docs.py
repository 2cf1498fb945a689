"""README.md and CONTRIBUTING.md follow the series and the pin: the flag table is written
from patches/series and docs/flags.toml (`tools/fork docs`), no flag of a patch outside the
series is quoted, and the only release quoted (outside CONTRIBUTING's rebase section) is
the pinned one."""

from __future__ import annotations

import shutil

import pytest
from forklib import REPO_ROOT, ForkError, docs
from forklib.pin import load_pin
from forklib.series import load_series


def test_the_docs_follow_the_series_and_the_pin():
    assert docs.problems(REPO_ROOT, load_series(), load_pin().version) == []
    assert (
        "upstream/" + load_pin().version
        not in (REPO_ROOT / "CONTRIBUTING.md").read_text()
    )


@pytest.fixture
def copy(tmp_path):
    for name in (*docs.DOCS, docs.FLAGS_FILE):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO_ROOT / name, tmp_path / name)
    return tmp_path


def test_a_stale_release_a_dropped_flag_and_a_stale_table_are_named(copy):
    pin = load_pin().version
    series = load_series()
    with_flag = next(p for p in series if p.flags)
    kept = [p for p in series if p is not with_flag]
    found = docs.problems(copy, kept, "9.9.9")
    assert any("flag table is not what patches/series" in f for f in found)
    assert any(
        f"names {with_flag.flags[0]}, a flag of no patch in the series" in f
        for f in found
    )
    assert any(
        f"README.md:" in f and f"quotes release {pin}, the pin is 9.9.9" in f
        for f in found
    )
    # what a rebase writes: the release followed, the table from the new series
    for name in docs.DOCS:
        path = copy / name
        path.write_text(docs.follow_release(name, path.read_text(), pin, "9.9.9"))
    docs.write(copy, kept)
    left = docs.problems(copy, kept, "9.9.9")
    assert not any("quotes release" in f or "flag table" in f for f in left)
    # only the hand-written mentions of the dropped flag remain, each named with its line
    assert all(with_flag.flags[0] in f or "a flag of no patch" in f for f in left)
    table = (copy / "README.md").read_text()
    assert f"[`{with_flag.flags[0]}" not in table
    # CONTRIBUTING's rebase section keeps the releases it speaks of
    rebase = (copy / "CONTRIBUTING.md").read_text().partition(docs.REBASE_SECTION)[2]
    assert "make rebase TO=0.5.24" in rebase


def test_a_flag_without_a_description_is_refused(copy):
    flags = copy / docs.FLAGS_FILE
    text = flags.read_text()
    first = load_series()[0]
    flags.write_text(text.replace(f'flag = "{first.flags[0]}"', 'flag = "--gone"', 1))
    with pytest.raises(
        ForkError, match=f"no entry for: {first.flags[0]} \\({first.name}\\)"
    ):
        docs.render(load_series(), copy)


# Words a reader outside the project cannot place: the out-of-tree speed-ups this fork replaced
# are "the GB10 line's earlier setup", never by the names the project used for them internally.
PRIVATE_WORDS = (
    r"\badapters?\b",
    r"\bthe seeds?\b",
    r"\bseeds'",
    r"\bseed's\b",
    r"\(seed:",
    r"\bseed (table|diff|adapter)",
)


def _prose_files():
    roots = ("docs", "benchmark", "tools", "test", "python/sglang")
    files = [REPO_ROOT / "README.md", REPO_ROOT / "CONTRIBUTING.md"]
    for root in roots:
        for path in (REPO_ROOT / root).rglob("*"):
            if path.suffix in (".md", ".py", ".toml", ".sh") and path.is_file():
                files.append(path)
    return files


def private_words(text: str) -> list[str]:
    import re

    return [
        m.group(0)
        for pattern in PRIVATE_WORDS
        for m in re.finditer(pattern, text, re.IGNORECASE)
    ]


def test_docs_code_and_patch_headers_use_no_private_project_words():
    found = {}
    for path in _prose_files():
        if path.name == "test_docs.py":
            continue
        hits = private_words(path.read_text(errors="replace"))
        if hits:
            found[str(path.relative_to(REPO_ROOT))] = hits
    for patch in sorted((REPO_ROOT / "patches").glob("*.patch")):
        header = patch.read_text().split("\n---\n", 1)[0]
        header = "\n".join(header.splitlines()[3:])  # past From / author lines
        hits = private_words(header)
        if hits:
            found[patch.name] = hits
    assert found == {}


def test_the_private_word_check_sees_them():
    assert private_words("as the seeds did; the production adapter measured")
    assert not private_words("independent seeds per server; seed=5; manual_seed(0)")
