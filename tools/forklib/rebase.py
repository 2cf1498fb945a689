"""``tools/fork rebase <release>``: move the series to another upstream release with git.

The scratch repository (``build/rebase/repo``) holds both releases as root commits. The
series is assembled exactly on the pinned release (branch ``old``, one commit per patch,
owned files inside), then each commit is cherry-picked onto the target release (branch
``rebased``): git's three-way merge with rename detection does the replay, never ``patch``.
Each patch is classified:

  clean           the commit's diff applies exactly (no offset, no 3-way) on the target
  merged          git merged it, but only with moved or changed context: review it
  conflict        the merge left conflicts in the scratch worktree: every region named as
                  file:line with the patch hunk it came from (zdiff3 markers show the base),
                  a modify/delete named as such with what each way out means
  upstream        the change is in the target already (reverse-applies, or the replay is empty)
  new-file clash  the target ships a file at a path one of our owned files uses

A real run first classifies every patch that way (what ``--dry-run`` prints, every note
shown) and then replays again, stopping at each stop in turn. At a conflict each region is
followed by the upstream names its hunk refers to, found or not in the target's source, and
a recommendation (port here; or the code is absent: drop, or port where its caller lives).

The last three stop the run (``--dry-run`` notes them and goes on). The person resolves in
the scratch worktree and runs ``--continue`` (staged or committed: the patch keeps its header;
a resolution that would make the patch own upstream's file, or more files of ours, is
refused), or drops the patch with ``--drop`` (refused while a patch that stays depends on it);
nothing is dropped or rewritten silently. The repository (``patches/``, ``python/sglang/``,
``upstream.toml``) is written only once every patch is clean, merged, resolved or dropped:
the new files are staged in the scratch dir, the new series is assembled exactly on the
target as a proof, and only then moved in; ``patches/series`` keeps a comment per dropped
patch naming its tests. ``--continue`` checks that a resolved patch still applies alone to
the target and names another patch's lines its hunks lean on; a patch whose every user was
dropped stops the run after the last patch (``--drop`` it, or ``--continue`` to keep it).
What our modules read from upstream (``needs``) is checked in the target before the replay:
its status follows the up-front table and is repeated at every stop (read from the replay).
``--continue`` also runs ``make export``'s import check on the target and the flags-off
check (``importcheck``), each warning saying whose module failed. After the write-back: a
closing summary and, unless ``--no-test``, ``make``, ``launch_server --help`` and the
``Tests:`` of every merged or resolved patch, reported per patch, each failure under its
cause (the environment, the test, or the patch owning the failing import). The docs' release and the
README's flag table are written with the series (``docs``).
``git range-diff`` of old against new is printed and kept in
``build/rebase/range-diff.txt``; ``finished.json`` lets ``--abort`` say that a finished
rebase wrote the repository. ``drift`` records dry runs as the tool prints them.
"""

from __future__ import annotations

import builtins
import dataclasses
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

from . import REPO_ROOT, ForkError, docs
from .git import git, out, out_diff, show
from .pin import Pin, fetch_pinned, fetch_wheel, file_sha256, load_pin, render_pin
from .series import DROPPED_RE, Patch, check_series, load_series, parse_patch, uses
from .tree import (
    adjacent_lines,
    apply_problems,
    assemble,
    commit_patch,
    hunk_texts,
    import_release,
    owned_files,
    upstream_ref,
)

# The tag the replay runs on; the other pinned tags only get their hashes recorded.
PRIMARY_TAG = "cp311-cp311-manylinux_2_34_x86_64"
DOCKERFILE = (
    "docker/Dockerfile"  # its base image is upstream's image of the pinned release
)
WRITTEN = tuple(
    dict.fromkeys(
        (
            "patches",
            "python/sglang",
            "upstream.toml",
            DOCKERFILE,
            *docs.DOCS,  # the release they quote, the README's flag table
            *docs.EXAMPLE_PAGES,  # the example builds they quote
        )
    )
)  # what a rebase may change in the repo
STOPS = ("conflict", "upstream", "new-file clash")
DONE = ("clean", "merged", "resolved", "dropped")
VERSION_RE = re.compile(r"^\d+(\.\d+)*([a-z0-9.+-]*)$")


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a rebase reads and writes: the fork repository and its scratch dir."""

    root: Path = REPO_ROOT
    scratch: Path | None = None

    @property
    def dir(self) -> Path:
        return self.scratch or self.root / "build" / "rebase"

    @property
    def repo(self) -> Path:
        return self.dir / "repo"

    @property
    def state_file(self) -> Path:
        return self.dir / "state.json"

    @property
    def series_file(self) -> Path:
        return self.root / "patches" / "series"

    @property
    def pin_file(self) -> Path:
        return self.root / "upstream.toml"


def step(msg: str) -> None:
    print(f"==> {msg}", flush=True)


# ---------------------------------------------------------------------------- state


def _load_state(lay: Layout) -> dict | None:
    if not lay.state_file.exists():
        return None
    return json.loads(lay.state_file.read_text())


def _save_state(lay: Layout, state: dict) -> None:
    # Write-then-rename: a kill leaves the previous state, never half a JSON file.
    tmp = lay.state_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1) + "\n")
    os.replace(tmp, lay.state_file)


def _require_clean(lay: Layout) -> None:
    dirty = out(lay.root, "status", "--porcelain", "--", *WRITTEN)
    if dirty:
        raise ForkError(
            "the repository has uncommitted changes where a rebase writes (commit or stash them first):\n  "
            + "\n  ".join(dirty.splitlines())
        )


def _find(state: dict, ref: str) -> int:
    """Index of a patch by name, file name or number (``3``, ``0003``)."""
    for i, p in enumerate(state["patches"]):
        stem = p["name"]
        if ref in (stem, stem + ".patch") or (
            ref.isdigit() and stem.startswith(f"{int(ref):04d}-")
        ):
            return i
    raise ForkError(
        f"no patch {ref!r} in this rebase; patches: {', '.join(p['name'] for p in state['patches'])}"
    )


# ---------------------------------------------------------------------------- entry points


def start(
    target: str, lay: Layout = Layout(), dry_run: bool = False, tests: bool = False
) -> int:
    """Begin a rebase onto ``target``; 0 when written back (or, dry-run, fully classified).

    A real run first classifies every patch the way ``--dry-run`` does (each stop left out,
    the rest replayed after it) and prints that table, so the whole way is known before the
    first stop. ``tests``: once written back, build and run the ``Tests:`` of every patch
    that was merged or resolved (``tools/fork rebase`` does; ``--no-test`` skips it)."""
    if _load_state(lay) is not None:
        st = _load_state(lay)
        raise ForkError(
            f"a rebase onto {st['to']} is in progress in {lay.dir}: "
            "`tools/fork rebase --continue`, `--drop <patch>` or `--abort`"
        )
    if not VERSION_RE.match(target):
        raise ForkError(f"{target!r} is not a release version (like 0.5.22)")
    if not dry_run:
        _require_clean(lay)
    pin = load_pin(lay.pin_file)
    if target == pin.version:
        raise ForkError(f"the fork is already pinned to {pin.package} {target}")
    patches = load_series(lay.series_file)
    check_series(patches, lay.root)
    used = uses(patches, lay.root)
    t0 = time.monotonic()
    old_wheel = fetch_pinned(pin, PRIMARY_TAG)  # the pinned hash is checked here
    new_wheel = fetch_wheel(pin.package, target, PRIMARY_TAG, sha256=None)

    shutil.rmtree(lay.dir, ignore_errors=True)
    lay.dir.mkdir(parents=True)
    repo = lay.repo
    step(f"assembling the series on {pin.package} {pin.version} in {repo}")
    asm = assemble(repo, old_wheel, pin.version, patches, stamp=False, src=lay.root)
    git(repo, "branch", "-f", "old", asm.head)
    step(f"importing {pin.package} {target}")
    onto = import_release(repo, new_wheel, target)
    git(repo, "checkout", "-q", "-f", "-B", "rebased", onto)
    git(repo, "clean", "-qfdx")
    state = {
        "package": pin.package,
        "from": pin.version,
        "to": target,
        "dry_run": dry_run,
        "old_wheels": pin.wheels,
        "to_sha256": {PRIMARY_TAG: file_sha256(new_wheel)},
        "to_wheel": str(new_wheel),
        "phase": "replay",
        "next": 0,
        "head": onto,  # HEAD before the patch at "next": an interrupted step restarts from it
        "stopped": False,
        "onto": onto,
        "tests": tests,
        "orphans_kept": [],
        "seconds": time.monotonic() - t0,
        "patches": [
            {
                "name": a.patch.name,
                "commit": a.commit,
                "status": "pending",
                "detail": [],
                "new": None,
                "depends": a.patch.depends,
                "uses": used[a.patch.name],
                "tests": a.patch.trailers.get("Tests", []),
                "owns": a.patch.owns,
            }
            for a in asm.applied
        ],
    }
    state["needs"] = _needs(lay, state)
    _save_state(lay, state)  # a kill during the classification: --continue redoes it
    if not dry_run:
        _forecast(lay, state)
        _save_state(lay, state)
    return _replay(lay, state)


def _forecast(lay: Layout, state: dict) -> None:
    """Classify every patch as the dry run does, print the table with every note, and put
    the replay back on the target: the real run then stops where the table says."""
    t0 = time.monotonic()
    for entry in state["patches"]:
        status, detail = _pick(lay, state, entry)
        if status in STOPS:
            _reset(lay.repo, state["head"])
        else:
            state["head"] = out(lay.repo, "rev-parse", "HEAD")
        entry["forecast"] = {
            "status": status,
            "detail": detail + _needs_notes(state, entry["name"]),
        }
    state["head"] = state["onto"]
    _reset(lay.repo, state["head"])
    state["seconds"] += time.monotonic() - t0
    stops = [p["name"] for p in state["patches"] if p["forecast"]["status"] in STOPS]
    print(
        f"every patch classified onto {state['to']} first (what --dry-run prints; a stop is "
        "left out and the patches after it replayed without it):\n"
        + table(state, forecast=True)
        + f"\n\nthe replay now stops at each of these {len(stops)} patch(es) in turn: "
        + (", ".join(stops) or "none")
        + f".\nThe record of every patch (class, regions, notes) is {lay.state_file}.\n",
        flush=True,
    )
    print("\n".join(_needs_block(state)) + "\n", flush=True)


def resume(
    lay: Layout = Layout(), drop: list[str] | None = None, tests: bool | None = None
) -> int:
    """``--continue`` (after resolving in the scratch worktree) and ``--drop <patch>``.

    At the stop after the last patch (orphans: patches only dropped ones used), ``--drop``
    takes replayed patches out of the chain and ``--continue`` keeps the orphans named.
    ``tests``: False (``--no-test``) skips the test run after the write-back."""
    state = _load_state(lay)
    if state is None:
        raise ForkError(
            "no rebase in progress (start one with `tools/fork rebase <release>`)"
        )
    repo = lay.repo
    if state["phase"] == "writing":
        # Killed while moving files in: put the repository back, then write again.
        _restore_repo(lay)
        state["phase"] = "replay"
    if tests is not None:
        state["tests"] = tests
    if not state["dry_run"] and any("forecast" not in p for p in state["patches"]):
        state["head"] = state["onto"]  # killed while classifying: classify again
        _forecast(lay, state)
        _save_state(lay, state)
    i = state["next"]
    at_end = i >= len(state["patches"])
    idx = _drops(state, drop or [])
    if at_end and idx:
        _rechain(lay, state, idx)
    elif at_end and state["stopped"]:  # --continue at the orphan stop: keep them
        state["orphans_kept"] += [name for name, _ in _orphans(state)]
    for j in idx:
        state["patches"][j]["status"] = "dropped"
        state["patches"][j]["detail"] = ["dropped by --drop"]
        print(f"dropping {state['patches'][j]['name']} (by request)")
    for name, users in _orphans(state):
        if name not in state["orphans_kept"]:
            print(
                f"note: {name} is used only by {', '.join(users)}, dropped now: the end of "
                f"the replay offers to drop it too (`tools/fork rebase --drop {name}`)"
            )
    if i < len(state["patches"]) and state["patches"][i]["status"] == "dropped":
        _reset(repo, state["head"])
        state["next"] = i + 1
    elif i < len(state["patches"]) and state["stopped"]:
        state["patches"][i]["new"] = _take_resolution(repo, state, state["patches"][i])
        state["patches"][i]["status"] = "resolved"
        state["patches"][i]["detail"].insert(0, "resolved by hand: review it")
        state["head"] = state["patches"][i]["new"]
        state["next"] = i + 1
        alone = _alone(lay, state, i)
        state["patches"][i]["detail"] += alone
        print(
            "\n".join(f"warning: {a}" for a in alone)
            or f"{state['patches'][i]['name']}: resolved; it still applies alone to "
            f"{state['to']} (with what it Depends: on), as `make export` needs, its "
            "modules import there, and so do the upstream modules it edits with every "
            "flag off"
        )
    elif i < len(state["patches"]):
        _reset(repo, state["head"])  # an interrupted step: do it again
    state["stopped"] = False
    _save_state(lay, state)
    return _replay(lay, state)


def _drops(state: dict, refs: list[str]) -> list[int]:
    """The patches ``--drop`` names, refused when one is replayed already or when a patch
    that stays depends on one (its ``Depends:`` trailer): nothing is dropped silently.
    """
    idx = sorted({_find(state, ref) for ref in refs})
    at_end = state["next"] >= len(state["patches"])
    for j in idx:
        name, status = state["patches"][j]["name"], state["patches"][j]["status"]
        if status == "dropped":
            raise ForkError(f"{name} is dropped already")
        if not at_end and (j < state["next"] or status in DONE):
            raise ForkError(
                f"{name} is already replayed: it can be dropped at the stop after the last "
                "patch (which names the patches left without a user), or --abort and start again"
            )
    named = {state["patches"][j]["name"] for j in idx}
    gone = named | {p["name"] for p in state["patches"] if p["status"] == "dropped"}
    for p in state["patches"]:
        needs = sorted(set(p.get("depends", [])) & gone)
        if p["name"] not in gone and needs:
            # the command to run now: what was named plus everything that depends on it (not the
            # earlier drops, which --drop refuses to name again); the same set a stop offers
            with_dependents = named.union(*(_dependents(state, n) for n in named))
            both = " ".join(f"--drop {n}" for n in sorted(with_dependents))
            raise ForkError(
                f"{p['name']} depends on {', '.join(needs)} (its Depends: trailer): dropping "
                f"{', '.join(needs)} alone would leave it broken. Drop it too "
                f"(`tools/fork rebase {both}`), or resolve {', '.join(needs)} instead"
            )
    return idx


def abort(lay: Layout = Layout()) -> None:
    """Forget the rebase: the scratch dir goes; the repository is as it was before it.

    A rebase that finished has written the repository already: then nothing is removed,
    and the error says what was written and how to undo it.
    """
    state = _load_state(lay)
    finished = lay.dir / "finished.json"
    if state is None and finished.exists():
        done = json.loads(finished.read_text())
        changed = out(lay.root, "status", "--porcelain", "--", *WRITTEN).splitlines()
        raise ForkError(
            f"the rebase onto {done['package']} {done['to']} already finished: it wrote patches/, "
            f"python/sglang/, upstream.toml and {DOCKERFILE} ({len(changed)} path(s) differ from HEAD now; "
            "`git status` lists them). --abort does not undo a finished rebase and removed nothing. "
            f"To undo it before committing: `git checkout HEAD -- {' '.join(_tracked(lay.root, WRITTEN))} "
            "&& git clean -fd -- patches python/sglang`; once committed: `git revert <that commit>`. "
            f"{lay.dir} (range-diff.txt) is kept; `tools/fork rebase <release>` starts a new rebase."
        )
    if state is None and not lay.dir.exists():
        raise ForkError("no rebase in progress")
    if state is not None and state["phase"] == "writing":
        _restore_repo(lay)
    shutil.rmtree(lay.dir, ignore_errors=True)
    print(f"rebase aborted; {lay.dir} removed, the repository is unchanged")


# ---------------------------------------------------------------------------- replay


def _reset(repo: Path, head: str) -> None:
    git(repo, "cherry-pick", "--quit", check=False)
    git(repo, "reset", "-q", "--hard", head)
    git(repo, "clean", "-qfd")


def _replay(lay: Layout, state: dict) -> int:
    repo = lay.repo
    t0 = time.monotonic()
    while state["next"] < len(state["patches"]):
        i = state["next"]
        entry = state["patches"][i]
        if entry["status"] == "dropped":
            state["next"] = i + 1
            continue
        status, detail = _pick(lay, state, entry)
        if state["dry_run"]:  # the table is the whole record: the needs notes in it
            detail += _needs_notes(state, entry["name"])
        entry["status"], entry["detail"] = status, detail
        if status in STOPS and not state["dry_run"]:
            state["stopped"] = True
            state["seconds"] += time.monotonic() - t0
            _save_state(lay, state)
            print(table(state))
            _explain_stop(lay, state, entry)
            return 1
        if status in STOPS:  # dry run: note it, leave it out, go on
            _reset(repo, state["head"])
        else:
            entry["new"] = out(repo, "rev-parse", "HEAD")
            state["head"] = entry["new"]
        state["next"] = i + 1
        _save_state(lay, state)
    state["seconds"] += time.monotonic() - t0
    orphans = [o for o in _orphans(state) if o[0] not in state.get("orphans_kept", [])]
    if orphans and not state["dry_run"]:
        state["stopped"] = True
        _save_state(lay, state)
        print(table(state))
        _explain_orphans(lay, state, orphans)
        return 1
    state["stopped"] = False
    _save_state(lay, state)
    print(table(state))
    if state["dry_run"]:
        print("\n" + "\n".join(_needs_block(state)))
        os.replace(
            lay.state_file, lay.dir / "result.json"
        )  # nothing to continue: a dry run ends here
        print(
            f"\n(dry run: nothing written; the replay is in {repo}, branch 'rebased')"
        )
        return 0 if all(p["status"] in DONE for p in state["patches"]) else 1
    _finish(lay, state)
    return _after(lay, state)


def _orphans(state: dict) -> list[tuple[str, list[str]]]:
    """(patch, its users) for each patch kept whose every user (a patch that names it in
    ``Depends:`` or imports a module it owns) was dropped: code nothing uses any more.
    """
    gone = {p["name"] for p in state["patches"] if p["status"] == "dropped"}
    found = []
    for p in state["patches"]:
        users = [
            q["name"]
            for q in state["patches"]
            if p["name"] in q.get("uses", q.get("depends", []))
        ]
        if p["name"] not in gone and users and set(users) <= gone:
            found.append((p["name"], users))
    return found


def _explain_orphans(
    lay: Layout, state: dict, orphans: list[tuple[str, list[str]]]
) -> None:
    if "to_wheel" in state:
        state["needs"] = _needs(lay, state, lay.repo)
        _save_state(lay, state)
    print("\n".join(_needs_block(state)))
    print("\nstopped after the last patch: patches left without a user")
    for name, users in orphans:
        print(
            f"  - {name}: used only by {', '.join(users)} (Depends: or imports), dropped in this "
            f"rebase; nothing else in the series uses it. Drop it too: `tools/fork rebase --drop {name}`"
        )
    print(
        "or keep them: `tools/fork rebase --continue` (when a patch is useful on its own). "
        "Nothing has been written to the repository yet."
    )


def _rechain(lay: Layout, state: dict, idx: list[int]) -> None:
    """Take replayed patches ``idx`` out of the replay: the later ones are cherry-picked
    again onto what comes before the first; one that needs their lines stops it, loud.
    """
    repo, old_head = lay.repo, state["head"]
    first = min(idx)
    before = [
        p["new"]
        for p in state["patches"][:first]
        if p["status"] != "dropped" and p.get("new")
    ]
    _reset(repo, before[-1] if before else state["onto"])
    names = ", ".join(state["patches"][j]["name"] for j in idx)
    new = {}
    for k in range(first + 1, len(state["patches"])):
        p = state["patches"][k]
        if k in idx or p["status"] == "dropped" or not p.get("new"):
            continue
        r = git(repo, "cherry-pick", "--no-commit", p["new"], check=False)
        unmerged = out(repo, "diff", "--name-only", "--diff-filter=U").split()
        if r.returncode != 0 or unmerged:
            _reset(repo, old_head)
            raise ForkError(
                f"{p['name']} does not replay without {names}: its lines touch theirs in "
                f"{', '.join(unmerged) or r.stderr.strip()}. Keep {names} "
                "(`tools/fork rebase --continue`), or --abort and drop them at their own stop"
            )
        git(
            repo,
            "commit",
            "-q",
            "--allow-empty",
            "--allow-empty-message",
            "-C",
            p["new"],
        )
        new[k] = out(repo, "rev-parse", "HEAD")
    for k, c in new.items():
        state["patches"][k]["new"] = c
    state["head"] = out(repo, "rev-parse", "HEAD")


def _dep_chain(state: dict, i: int) -> list[int]:
    """The kept patches patch ``i`` depends on (``Depends:``, transitively), in order."""
    index = {p["name"]: j for j, p in enumerate(state["patches"])}
    need, todo = set(), [i]
    while todo:
        for dep in state["patches"][todo.pop()].get("depends", []):
            j = index.get(dep)
            if j is not None and j not in need:
                need.add(j)
                todo.append(j)
    return sorted(j for j in need if state["patches"][j]["status"] != "dropped")


def _alone(lay: Layout, state: dict, i: int) -> list[str]:
    """Why resolved patch ``i`` (with what it depends on) no longer applies alone to the
    target, as ``make export`` needs it to; empty when it does. A hunk that leans on another
    patch's lines is named with those lines: the two touch, so one of them must move."""
    repo, entry = lay.repo, state["patches"][i]
    chain = _dep_chain(state, i)
    index = lay.dir / "alone.index"
    index.unlink(missing_ok=True)
    env = {"GIT_INDEX_FILE": str(index)}
    git(repo, "read-tree", upstream_ref(state["to"]), env=env)
    diff = lay.dir / "alone.diff"
    for j in [*chain, i]:
        c = state["patches"][j]["new"]
        diff.write_text(
            out_diff(repo, "diff", "--full-index", "--binary", f"{c}^", c) + "\n"
        )
        r = git(repo, "apply", "--cached", str(diff), env=env, check=False)
        if r.returncode != 0:
            # as `make export` does: where only context from another patch differs,
            # git's three-way merge (the blobs are in this repository) still applies it
            r = git(
                repo, "apply", "--cached", "--3way", str(diff), env=env, check=False
            )
        if r.returncode != 0:
            break
    if r.returncode == 0:
        alone = lay.dir / "alone"
        shutil.rmtree(alone, ignore_errors=True)
        git(repo, "checkout-index", "-a", "-f", f"--prefix={alone}/", env=env)
        index.unlink(missing_ok=True)
        try:
            return _imports_alone(lay, state, [*chain, i], alone)
        finally:
            shutil.rmtree(alone, ignore_errors=True)
    index.unlink(missing_ok=True)
    who = state["patches"][j]["name"]
    if j != i:
        return [
            f"{entry['name']} does not apply alone to {state['to']}: {who}, which it "
            f"Depends: on, does not ({r.stderr.strip().splitlines()[0]})"
        ]
    owners = {
        p["new"]: p["name"]
        for k, p in enumerate(state["patches"][:i])
        if p.get("new") and p["status"] != "dropped" and k not in chain
    }
    touching: dict[str, list[str]] = {}
    for path, line, text, owner in adjacent_lines(repo, entry["new"], owners):
        touching.setdefault(owner, []).append(f"{path}:{line} `{text.strip()}`")
    if not touching:
        return [
            f"{entry['name']} does not apply alone to {state['to']} (`make export` will refuse "
            f"it): {r.stderr.strip().splitlines()[0]}"
        ]
    return [
        f"{entry['name']} does not apply alone to {state['to']}: its hunks have {owner}'s "
        f"line(s) as context ({'; '.join(rows[:4])}{' ...' if len(rows) > 4 else ''}): our "
        f"lines touch {owner}'s. If {entry['name']} uses {owner}'s code, declare "
        f"`Depends: {owner}`; if not, separate them: move our line so that 3 lines of "
        f"{state['to']}'s own code lie between it and {owner}'s (now in {lay.repo}, or after "
        "the rebase with `make tree`, a fixup and `make refresh`)"
        for owner, rows in touching.items()
    ]


def _imports_alone(lay: Layout, state: dict, idx: list[int], tree: Path) -> list[str]:
    """``make export``'s import check in ``tree`` (the target with patches ``idx`` alone):
    every module they own imports, and, with every flag off, the upstream modules the last
    one edits import (statically: no eager import of ours brings in an upstream module the
    file does not import itself; then by import). Third-party packages this venv lacks are
    stood in (``importcheck``). One warning per problem, saying whose module it is."""
    from . import importcheck

    to, entry = state["to"], state["patches"][idx[-1]]
    patches = load_series(lay.series_file)
    by_name = {p.name: p for p in patches}
    chain = [by_name[state["patches"][k]["name"]] for k in idx]
    owned = [
        importcheck.module_name(own)
        for k in idx
        for own in owned_files(lay.repo, state["patches"][k]["new"])
        if own.endswith(".py")
    ]
    edited = [
        importcheck.module_name(f)
        for f in out(
            lay.repo, "diff", "--name-only", f"{entry['new']}^", entry["new"]
        ).split()
        if f.endswith(".py") and f not in owned_files(lay.repo, entry["new"])
    ]
    warnings = [
        f"{entry['name']} on {to}: {p}"
        for p in importcheck.flags_off_problems(
            lambda f: (tree / f).read_text() if (tree / f).is_file() else None,
            chain[-1:],
        )
    ]
    venv = lay.root / ".venv" / "bin" / "python"
    failures, standins = importcheck.run(
        owned + edited,
        str(venv) if venv.exists() else None,
        tree=tree,
        standin=True,
        root=lay.root,
    )
    for f in failures:
        kind = "ours" if f.module in owned else "upstream's, with every flag off"
        warnings.append(
            f"{entry['name']} alone on {to} (as `make export` checks it): {f.module} "
            f"({kind}) does not import: {f.error}"
            + (f" (at {f.at})" if f.at else "")
            + ". "
            + importcheck.advice(f, patches, to)
        )
    if standins and failures:
        warnings.append(
            f"(this venv lacks {', '.join(standins)}: stood in for the import check)"
        )
    return warnings


def _after(lay: Layout, state: dict) -> int:
    """The closing summary (every patch's class, regions and notes, kept in result.json)
    and, unless ``--no-test``, the tests of the merged and resolved patches, per patch.
    """
    result = lay.dir / "result.json"
    result.write_text(json.dumps(state, indent=1) + "\n")
    print(
        f"\nsummary: every patch's class, regions and notes (kept in {result}):\n{table(state)}"
    )
    check = [
        p
        for p in state["patches"]
        if p["status"] in ("merged", "resolved") and p["tests"]
    ]
    if not state.get("tests") or not check:
        if check:
            print(
                "not run (--no-test): the tests of the merged and resolved patches: "
                + ", ".join(sorted({t for p in check for t in p["tests"]}))
            )
        return 0
    step(
        "`make`: build the rebased series into .venv, then the tests of each merged or resolved patch"
    )
    r = _build(lay.root)
    if r.returncode != 0:
        print(r.stdout[-3000:] + r.stderr[-3000:])
        raise ForkError(
            f"`make` failed on the rebased series (exit {r.returncode}; output above): the "
            "repository is written; fix it with `make tree`, a fixup and `make refresh`"
        )
    help_cause = _launch_help(lay, state)
    runs: dict[tuple[str, ...], subprocess.CompletedProcess] = {}
    failed, blamed = [], {}
    print(
        "tests of the patches merged or resolved (a merge is textual: this is the check; "
        "each failure under its cause, blamed on the patch that owns the failing import):"
    )
    for p in check:
        key = tuple(p["tests"])
        if key not in runs:
            runs[key] = _pytest(lay.root, list(key))
        r = runs[key]
        tail = (r.stdout.strip().splitlines() or [r.stderr.strip()])[-1]
        # 5: pytest found no test to run (every one skipped or deselected); not a failure
        ok = r.returncode in (0, 5)
        causes = _triage(r.stdout, state, p["name"])
        skipped = _not_run(r.stdout, state["to"])
        if not ok:
            failed.append(p["name"])
            for who, _ in causes:
                blamed.setdefault(who, []).append(p["name"])
        verdict = "passed" if ok else "FAILED"
        if ok and skipped:
            verdict += f", {len(skipped)} check(s) not run on {state['to']}"
        print(f"  {p['name']} ({p['status']}): {verdict}: {tail} [{' '.join(key)}]")
        for who, line in causes:
            print(f"      {line}")
        for reason in dict.fromkeys(skipped):
            print(f"      not run: {reason}")
    if failed:
        real = sorted(w for w in blamed if w not in ("environment", "the test"))
        print(
            f"FAILED: {', '.join(failed)}: merged or resolved, tests failing on {state['to']}"
            + (f"; the broken code is in {', '.join(real)}" if real else "")
            + (
                f"; the environment: {help_cause}"
                if help_cause or "environment" in blamed
                else ""
            )
            + ". The repository is written, not committed: rerun a patch's tests with "
            "`.venv/bin/python -m pytest <its Tests:>`, port it (`make tree`, a fixup, "
            "`make refresh`) or revert the rebase (see `tools/fork rebase --abort`)"
        )
        return 1
    return 0


def _launch_help(lay: Layout, state: dict) -> str:
    """Run ``launch_server --help`` in the venv first: a target that imports a package
    the venv lacks fails every test that starts the engine, for one reason. Returns that
    reason ('' when it starts)."""
    py = lay.root / ".venv" / "bin" / "python"
    if not py.exists():
        print("`launch_server --help` not run: no .venv")
        return ""
    try:
        r = _run_help(py)
    except (OSError, subprocess.SubprocessError) as e:
        return f"launch_server --help did not run: {e}"
    if r.returncode == 0:
        print(f"`launch_server --help` on {state['to']}: it starts")
        return ""
    last = (r.stderr.strip().splitlines() or r.stdout.strip().splitlines() or ["?"])[-1]
    cause = _cause(last, state, "")[1]
    print(
        f"`launch_server --help` on {state['to']} fails: {last}\n  {cause}\n"
        "  every test that starts the engine fails for this reason"
    )
    return cause


def _run_help(py: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(py), "-W", "ignore", "-m", "sglang.launch_server", "--help"],
        capture_output=True,
        text=True,
        timeout=600,
    )


_SUMMARY_RE = re.compile(r"^(?:FAILED|ERROR) (\S+)(?: - (.*))?$", re.M)
_SKIP_RE = re.compile(r"^SKIPPED \[\d+\] [^:]+:\d+: (.*)$", re.M)
_NO_MODULE_RE = re.compile(r"No module named '([\w.]+)'")
_NO_NAME_RE = re.compile(r"cannot import name '(\w+)' from '([\w.]+)'")
_NO_ATTR_RE = re.compile(
    r"module '([\w.]+)'(?: from '[^']*'>)? has no attribute '(\w+)'"
)


def _triage(stdout: str, state: dict, patch: str) -> list[tuple[str, str]]:
    """(who, line) for each failure in pytest's short summary (``-rfEs``), by cause."""
    return [
        _cause(error or "", state, patch, test)
        for test, error in _SUMMARY_RE.findall(stdout)
    ]


def _not_run(stdout: str, to: str) -> list[str]:
    """The skip reasons that name the target release (what it lacks), one per skip."""
    return [r for r in _SKIP_RE.findall(stdout) if to in r]


def _cause(error: str, state: dict, patch: str, test: str = "") -> tuple[str, str]:
    """Who a failure is on, and the line that says so: the environment (a package the
    venv lacks), the patch that owns the module of ours that failed (a tool test of a
    dropped one needs ``require_patch``), the patch whose module reads what the target
    lacks, or the test (bound to the pinned release: it reaches an upstream name the
    target lacks); otherwise the tested patch."""
    from . import importcheck

    to = state["to"]
    dropped = {p["name"] for p in state["patches"] if p["status"] == "dropped"}
    owners = {
        importcheck.module_name(o): p["name"]
        for p in state["patches"]
        for o in p.get("owns", [])
    }
    where = f"{test}: " if test else ""
    missing, name = "", ""
    if m := _NO_NAME_RE.search(error):
        name, missing = m.group(1), m.group(2)
    elif m := _NO_MODULE_RE.search(error):
        missing = m.group(1)
    if missing and missing.split(".")[0] != "sglang":
        return "environment", (
            f"environment: {where}{missing} is a package this venv lacks ({error}); "
            "the CPU requirements or a stand-in in tools/standins, not a patch"
        )
    owner = next(
        (owners[m] for m in owners if missing == m or missing.startswith(m + ".")), None
    )
    if missing and owner in dropped:
        return "the test", (
            f"tool test needing require_patch: {where}it drives {missing} of {owner}, "
            "which this rebase dropped (guard it with upstream_api.require_patch)"
        )
    if missing and owner:
        return (
            owner,
            f"broken in {owner}: {where}its module {missing} does not import ({error})",
        )
    if missing:
        readers = sorted(
            {
                q
                for r in _needs_rows(state)
                if r["name"].replace(":", ".").startswith(missing)
                for q in r["patches"]
            }
        )
        who = readers[0] if readers else patch
        return who, (
            f"broken in {', '.join(readers) or patch}: {where}{to} lacks upstream's "
            f"{missing}{'.' + name if name else ''} ({error})"
        )
    if m := _NO_ATTR_RE.search(error):
        if m.group(1).startswith("sglang"):
            return "the test", (
                f"test bound to the pinned release: {where}it reaches "
                f"{m.group(1)}.{m.group(2)}, which {to} lacks (guard it with "
                "upstream_api.require)"
            )
    return patch, f"unclassified, on {patch}: {where}{error or 'see its output'}"


def _build(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["make"], cwd=root, capture_output=True, text=True)


def _pytest(root: Path, tests: list[str]) -> subprocess.CompletedProcess:
    py = root / ".venv" / "bin" / "python"
    return subprocess.run(
        [
            str(py),
            "-m",
            "pytest",
            "-q",
            "-rfEs",
            "-o",
            "tmp_path_retention_policy=failed",
            *tests,
        ],
        cwd=root,
        capture_output=True,
        text=True,
    )


def _pick(lay: Layout, state: dict, entry: dict) -> tuple[str, list[str]]:
    """Replay one commit on HEAD and classify it; leaves HEAD on the new commit when it went in."""
    repo, commit = lay.repo, entry["commit"]
    patch = parse_patch(lay.root / "patches" / f"{entry['name']}.patch")
    diff = lay.dir / "current.diff"
    diff.write_text(
        out_diff(repo, "diff", "--full-index", "--binary", f"{commit}^", commit) + "\n"
    )
    to = state["to"]

    # Already upstream: the whole change (owned files included) reverse-applies on the target.
    if git(repo, "apply", "--check", "-R", str(diff), check=False).returncode == 0:
        return "upstream", [
            f"its diff reverse-applies cleanly on {to}: upstream ships this change; drop it (--drop {entry['name']})"
        ]
    clash = [
        o
        for o in owned_files(repo, commit)
        if git(repo, "cat-file", "-e", f"HEAD:{o}", check=False).returncode == 0
    ]
    exact = git(repo, "apply", "--check", "-v", str(diff), check=False)
    problems = [
        p.removesuffix(": refresh the patch against this release")
        for p in apply_problems(patch, exact.stderr)
    ]
    if exact.returncode != 0 and not problems:
        problems = [exact.stderr.strip()]

    git(
        repo, "cherry-pick", "--no-commit", commit, check=False
    )  # ort: 3-way, renames followed
    unmerged = sorted(set(out(repo, "diff", "--name-only", "--diff-filter=U").split()))
    if clash:
        return "new-file clash", [
            f"{to} ships {o}, a path this patch owns: rename ours (and fix its imports), or drop the "
            f"patch if upstream's file is the same feature"
            for o in clash
        ] + [f"{u}: conflict left in {repo / u}" for u in unmerged]
    if unmerged:
        return "conflict", _conflict_detail(
            repo, patch, unmerged, to, state["from"], commit
        )
    if git(repo, "diff", "--cached", "--quiet", "HEAD", check=False).returncode == 0:
        _reset(repo, state["head"])
        return "upstream", [
            f"replaying it onto {to} changes nothing: upstream has the change; drop it (--drop {entry['name']})"
        ]
    git(repo, "commit", "-q", "--allow-empty-message", "-C", commit)
    if exact.returncode == 0 and not problems:
        return "clean", []
    touched = set(out(repo, "diff", "--name-only", "HEAD^", "HEAD").split())
    moved = sorted(touched - set(patch.files) - set(owned_files(repo, "HEAD")))
    notes = problems + [
        f"git followed a rename: the change now lands in {m}" for m in moved
    ]
    return "merged", notes or ["git needed its 3-way merge"]


def _conflict_detail(
    repo: Path, patch: Patch, unmerged: list[str], to: str, frm: str, commit: str
) -> list[str]:
    """One line per conflict: each region as file:line with the patch hunk it came from, and
    what a modify/delete or delete/modify conflict means and what each choice does."""
    stages: dict[str, set[str]] = {}
    for line in out(repo, "ls-files", "-u").splitlines():
        meta, path = line.split("\t", 1)
        stages.setdefault(path, set()).add(meta.split()[2])
    hunks = hunk_texts(patch)
    detail = []
    for u in unmerged:
        have = stages.get(u, set())
        if "2" not in have and _older(to, frm):
            detail.append(
                f"{u}: not in {to}, an older release than {frm} that predates this file "
                f"(modify/delete: it came later, nothing was deleted; the worktree holds "
                f"{frm}'s file with our edit). The code our edit needs does not exist in "
                f"{to} yet: `git rm {u}` drops the edit (then the patch, if that was its "
                f"point: --drop), or make it where {to} does this work, `git add` that "
                f"file and `git rm {u}`. Never `git add {u}`"
            )
            continue
        if (
            "2" not in have
        ):  # HEAD (the target) has no file there: deleted or renamed upstream
            detail.append(
                f"{u}: deleted (or renamed) in {to}, edited by this patch (modify/delete; the worktree "
                f"holds the patch's version, which is upstream's old file, not ours). Either `git rm {u}` "
                f"to drop our edit of a file that no longer exists, or re-home the edit: make it in the "
                f"file where {to} has that code now, `git add` that file and `git rm {u}`. Never `git add "
                f"{u}`: the patch would own upstream's old file"
            )
            continue
        if "3" not in have:
            detail.append(
                f"{u}: edited in {to}, deleted by this patch (delete/modify): `git rm {u}` keeps the "
                f"deletion, `git add {u}` keeps {to}'s file"
            )
            continue
        path = repo / u
        regions = (
            conflict_regions(path.read_text(errors="replace").splitlines())
            if path.exists()
            else []
        )
        if not regions:
            detail.append(
                f"{u}: conflict without markers (binary or mode change) in {path}: "
                f"pick a side with `git checkout --ours|--theirs {u}`, then `git add {u}`"
            )
        for start_line, base, theirs in regions:
            hunk = _which_hunk(hunks.get(u, []), base, theirs)
            header = (
                hunk[0]
                if hunk
                else "(no hunk of the patch matches this region: an earlier patch's lines?)"
            )
            detail.append(f"{u}:{start_line}: conflict with hunk {header}")
            if hunk:
                detail += _names_found(repo, u, hunk, frm, to, commit)
        detail += _header_notes(patch, u)
    return detail


def _older(a: str, b: str) -> bool:
    """Whether release ``a`` comes before ``b`` (numeric parts compared)."""

    def key(v: str) -> tuple[int, ...]:
        return tuple(int(x) for x in re.findall(r"\d+", v))

    return key(a) < key(b)


def _header_notes(patch: Patch, path: str) -> list[str]:
    """The sentences of the patch header that name the conflicting file (its exactness
    traps, what its lines must keep): a resolution must keep them true."""
    stem = Path(path).name
    prose = [r for r in patch.body.splitlines() if not re.match(r"^[A-Z][\w-]*: ", r)]
    text = " ".join(" ".join(prose).split())
    said = [
        s.strip()
        for s in re.split(r"(?<=\.)\s+", text)
        if stem in s or Path(path).stem + "." in s
    ]
    return [f"    the patch header says about {stem}: {s}" for s in said[:3]]


# a definition, an attribute, a call, or a snake_case name passed around (a handler, a flag)
_NAME_RE = re.compile(
    r"\b(?:def|class)\s+(\w+)|\.([A-Za-z_]\w*)|\b([A-Za-z_]\w*)\s*\(|\b([a-z]\w*_\w+)\b"
)
_DEF_RE = re.compile(r"\b(?:def|class)\s+(\w+)")
# words too common to tell anything: Python's builtins, self and the container methods
_COMMON = set(dir(builtins)) | {
    "self",
    "cls",
    "super",
    "__init__",
    "append",
    "items",
    "keys",
    "values",
    "get",
}


def _names_found(
    repo: Path,
    path: str,
    hunk: tuple[str, list[str], list[str], list[str]],
    frm: str,
    to: str,
    commit: str,
) -> list[str]:
    """Whether the upstream names a conflicting hunk edits exist in the target: the
    functions and classes that enclose the hunk in the patch's old side, and those its
    context and removed lines define, call or read as attributes. A function or class
    counts as found where the target defines it (``def``/``class``), another name where it
    occurs as a word; both by ``git grep`` of the releases' sources. Names the pinned
    release lacks are ours, not upstream's, and are left out. Then the recommendation:
    port here, or the code is absent (drop, or port to where its caller lives now)."""
    header, context, minus, plus = hunk
    if plus and all(_is_import_row(r) for r in plus if r.strip()):
        return [
            "    -> an import-only region: add our import line to the target's imports here "
            "(between upstream lines, where isort puts it); the code it edits is not here"
        ]
    anchors = _enclosing(repo, commit, path, header)
    anchors += [n for r in context + minus for n in _DEF_RE.findall(r)]
    names = set(anchors)
    for row in context + minus:
        # comments say nothing about the code; import lines name modules, not the code edited
        if row.lstrip().startswith(("#", "from ", "import ")):
            continue
        for groups in _NAME_RE.findall(row):
            names.update(g for g in groups if g)
    names = {n for n in names if len(n) >= 4 and n not in _COMMON}
    anchors = [a for a in dict.fromkeys(anchors) if a in names]
    ours = _row_names(plus)  # the names our own lines use
    if not names:
        return []
    upstream = _grep_names(repo, upstream_ref(frm), names | ours)
    ours &= upstream  # upstream's names our lines call (not the ones we add)
    upstream -= ours - names
    if not upstream:
        return []
    # a function or class the hunk sits in counts only where the target defines it in
    # this file: a method of the same name elsewhere is another one
    defined = _grep_defs(repo, upstream_ref(to), set(anchors), path)
    found = {
        n
        for n in _grep_names(repo, upstream_ref(to), upstream | ours)
        if n not in anchors or n in defined
    }
    missing = sorted(upstream - found)
    lost = [a for a in anchors if a in upstream and a not in found]
    ours_missing = sorted(ours - found)
    head = (
        f"    names its context refers to, in {to}'s source: found "
        f"{', '.join(sorted(found & upstream)) or 'none'}; not found "
        f"{', '.join(missing) or 'none'}"
        + (
            f" (a function or class counts where {to} defines it in {path})"
            if anchors
            else ""
        )
    )
    # python/sglang/<package> (srt, multimodal_gen, ...): no pointer into another package
    scope = "/".join(path.split("/")[:3]) if path.count("/") > 2 else "python/sglang"
    if lost:
        callers = _in_file_callers(repo, upstream_ref(frm), path, lost[0])
        elsewhere = [
            f
            for f in _grep_files(repo, upstream_ref(frm), lost[0], exclude=path)
            if f.startswith(scope)
        ]
        now = [
            f
            for f in _grep_def_files(repo, upstream_ref(to), lost[0])
            if f.startswith(scope)
        ]
        where = (
            f" (in {frm}, {path} calls {lost[0]} from {', '.join(callers[:3])}: look "
            f"for {'that' if len(callers) == 1 else 'those'} in {to})"
            if callers
            else (
                f" (in {frm}, {lost[0]} is used from {', '.join(elsewhere[:3])}: look "
                f"there in {to})"
                if elsewhere
                else ""
            )
        ) + (f"; {to} defines a {lost[0]} in {', '.join(now[:3])}" if now else "")
        advice = (
            f"    -> the code this hunk edits is absent in {to} ({', '.join(lost)} not found): "
            f"drop the patch (--drop), or port the hunk to where its caller lives now{where}"
        )
    elif anchors and ours_missing:
        advice = (
            f"    -> the function exists but its body differs: our lines call "
            f"{', '.join(ours_missing)}, which {to} lacks: a rewrite of our lines for "
            f"{to}'s design, not a port (or drop the patch)"
        )
    elif len(missing) * 2 > len(upstream):
        advice = (
            f"    -> most of what this hunk refers to is absent in {to}: the code moved or "
            f"changed shape; port it to where {to} does this work, or drop the patch"
        )
    else:
        advice = f"    -> port here: the code it edits exists in {to}" + (
            f"; adapt our lines that use {', '.join(ours_missing)}"
            if ours_missing
            else ""
        )
    return [head, advice]


def _is_import_row(row: str) -> bool:
    """An import statement's line, or a continuation of a parenthesised one."""
    s = row.strip()
    return s.startswith(("from ", "import ", ")")) or bool(
        re.fullmatch(r"[\w.]+(\s+as\s+\w+)?,?", s)
    )


def _row_names(rows: list[str]) -> set[str]:
    """The names our own lines call or read (not comments, not imports)."""
    names: set[str] = set()
    for row in rows:
        if row.lstrip().startswith(("#", "from ", "import ")):
            continue
        for groups in _NAME_RE.findall(row):
            names.update(g for g in groups if g)
    return {n for n in names if len(n) >= 4 and n not in _COMMON}


def _in_file_callers(repo: Path, ref: str, path: str, name: str) -> list[str]:
    """The functions of ``path`` (at ``ref``) that call ``name``, as ``file:line (def)``."""
    r = git(repo, "show", f"{ref}:{path}", check=False)
    if r.returncode != 0:
        return []
    rows = r.stdout.splitlines()
    found = []
    for i, row in enumerate(rows):
        if re.search(rf"\b{re.escape(name)}\s*\(", row) and not _DEF_RE.search(row):
            outer = next(
                (m.group(2) for m in map(_ENCLOSING_RE.match, reversed(rows[:i])) if m),
                None,
            )
            found.append(f"{path}:{i + 1}" + (f" ({outer})" if outer else ""))
    return found


_ENCLOSING_RE = re.compile(r"^(\s*)(?:async\s+)?(?:def|class)\s+(\w+)")


def _enclosing(repo: Path, commit: str, path: str, header: str) -> list[str]:
    """The functions and classes around a hunk, innermost first, read from the file the
    patch was made against (its commit's parent): the nearest ``def``/``class`` above the
    hunk, then each one above it with less indentation."""
    m = re.match(r"^@@ -(\d+)", header)
    r = git(repo, "show", f"{commit}^:{path}", check=False)
    if not m or r.returncode != 0:
        return []
    rows = r.stdout.splitlines()[: int(m.group(1)) + 3]
    names, indent = [], None
    for row in reversed(rows):
        if (d := _ENCLOSING_RE.match(row)) and (
            indent is None or len(d.group(1)) < indent
        ):
            names.append(d.group(2))
            indent = len(d.group(1))
            if indent == 0:
                break
    return names


def _def_pattern(names) -> str:
    return r"(def|class)[[:space:]]+(" + "|".join(sorted(names)) + r")\b"


def _grep_def_files(repo: Path, ref: str, name: str) -> list[str]:
    """The files of ``ref``'s python/sglang that define ``name`` as a function or class."""
    r = git(
        repo,
        "grep",
        "-l",
        "-E",
        "-e",
        _def_pattern([name]),
        ref,
        "--",
        "python/sglang",
        check=False,
    )
    return [f.split(":", 1)[1] for f in r.stdout.split() if ":" in f]


def _grep_defs(
    repo: Path, ref: str, names: set[str], path: str = "python/sglang"
) -> set[str]:
    """The ``names`` that ``ref`` defines as a function or class under ``path``."""
    if not names:
        return set()
    pattern = _def_pattern(names)
    r = git(
        repo,
        "grep",
        "-h",
        "-o",
        "-E",
        "-I",
        "-e",
        pattern,
        ref,
        "--",
        path,
        check=False,
    )
    return {row.split()[-1] for row in r.stdout.splitlines()} & names


def _grep_names(repo: Path, ref: str, names: set[str]) -> set[str]:
    """The ``names`` that occur as words in ``ref``'s python/sglang."""
    args = [a for n in sorted(names) for a in ("-e", n)]
    r = git(
        repo,
        "grep",
        "-h",
        "-o",
        "-w",
        "-F",
        "-I",
        *args,
        ref,
        "--",
        "python/sglang",
        check=False,
    )
    return set(r.stdout.split()) & names


def _grep_files(repo: Path, ref: str, name: str, exclude: str) -> list[str]:
    r = git(
        repo,
        "grep",
        "-l",
        "-w",
        "-F",
        "-e",
        name,
        ref,
        "--",
        "python/sglang",
        check=False,
    )
    files = [f.split(":", 1)[1] for f in r.stdout.split() if ":" in f]
    return [f for f in files if f != exclude]


def conflict_regions(lines: list[str]) -> list[tuple[int, list[str], list[str]]]:
    """(line of ``<<<<<<<``, base lines, patch lines) of each conflict region (diff3 / zdiff3)."""
    regions, i = [], 0
    while i < len(lines):
        if not lines[i].startswith("<<<<<<< "):
            i += 1
            continue
        start, part, base, theirs = i + 1, "ours", [], []
        i += 1
        while i < len(lines) and not lines[i].startswith(">>>>>>> "):
            if lines[i].startswith("||||||| "):
                part = "base"
            elif lines[i] == "=======":
                part = "theirs"
            elif part == "base":
                base.append(lines[i])
            elif part == "theirs":
                theirs.append(lines[i])
            i += 1
        regions.append((start, base, theirs))
        i += 1
    return regions


def _which_hunk(
    hunks: list[tuple[str, list[str], list[str], list[str]]],
    base: list[str],
    theirs: list[str],
) -> tuple[str, list[str], list[str], list[str]] | None:
    """The hunk whose added lines are the region's patch side (or whose old lines are its base)."""

    def norm(rows):
        return {r.strip() for r in rows if r.strip()}

    base_set, theirs_set = norm(base), norm(theirs)
    best, score = None, 0
    for hunk in hunks:
        _, context, minus, plus = hunk
        s = (
            4 * len(norm(plus) & theirs_set)
            + 2 * len(norm(minus) & base_set)
            + len(norm(context) & base_set)
        )
        if s > score:
            best, score = hunk, s
    return best


def _take_resolution(repo: Path, state: dict, entry: dict) -> str:
    """The commit that replaces a stopped patch, from the person's resolution: what they
    staged, or what they committed on top of the stop (squashed). The tool owns the patch's
    message: the new commit keeps the old one's header whatever was committed."""
    head, base = out(repo, "rev-parse", "HEAD"), state["head"]
    committed = head != base
    if committed:
        if (
            git(repo, "merge-base", "--is-ancestor", base, head, check=False).returncode
            != 0
        ):
            raise ForkError(
                f"{repo}: HEAD moved off the replay; commit on top of {base[:10]} "
                f"(`git reset --soft {base[:10]}` keeps your changes staged), then --continue"
            )
        git(repo, "reset", "-q", "--soft", base)
    elif out(repo, "ls-files", "-u"):
        raise ForkError(
            f"{entry['name']}: unresolved conflicts in {repo}:\n  "
            + "\n  ".join(
                sorted(set(out(repo, "diff", "--name-only", "--diff-filter=U").split()))
            )
            + "\nresolve them and `git add` each file, then `tools/fork rebase --continue`"
        )
    unstaged = out(repo, "status", "--porcelain", "--untracked-files=all")
    loose = [
        line
        for line in unstaged.splitlines()
        if line[1] != " " or line.startswith("??")
    ]
    if loose:
        raise ForkError(
            f"{repo}: changes not added to the index (`git add` or remove them):\n  "
            + "\n  ".join(loose)
        )
    if git(repo, "diff", "--cached", "--quiet", "HEAD", check=False).returncode == 0:
        raise ForkError(
            f"{entry['name']} ({entry['status']}): nothing to continue with in {repo}; "
            f"resolve and `git add`, or drop it with `tools/fork rebase --drop {entry['name']}`"
        )
    _check_ownership(
        repo,
        state,
        entry,
        out(
            repo,
            "diff",
            "--cached",
            "--name-only",
            "--no-renames",
            "--diff-filter=A",
            "HEAD",
            "--",
            "python/sglang",
        ).split(),
    )
    git(repo, "cherry-pick", "--quit", check=False)
    git(repo, "commit", "-q", "--allow-empty-message", "-C", entry["commit"])
    if committed:
        print(
            f"kept the header of {entry['name']}: the tool owns patch headers, so your commit message "
            "is not used (change a header after the rebase: `make tree`, amend, `make refresh`)"
        )
    return out(repo, "rev-parse", "HEAD")


def _check_ownership(repo: Path, state: dict, entry: dict, added: list[str]) -> None:
    """A patch never comes to own upstream's file, and its files of ours do not grow.

    ``added``: the files the resolution adds under python/sglang (they become its Owns:).
    """
    old = set(owned_files(repo, entry["commit"]))
    adopted = [
        f
        for f in added
        if f not in old
        and git(
            repo, "cat-file", "-e", f"{upstream_ref(state['from'])}:{f}", check=False
        ).returncode
        == 0
    ]
    if adopted:
        raise ForkError(
            f"{entry['name']} would own "
            + ", ".join(adopted)
            + f", upstream's file(s) ({state['from']} "
            f"ships them; {state['to']} deleted or renamed them). A patch owns only files of ours. "
            + " ".join(f"`git rm -f {f}`" for f in adopted)
            + " drops our edit of a file that no longer "
            f"exists; or re-home the edit into the file where {state['to']} has that code and `git rm` "
            "the old one. Then `tools/fork rebase --continue`"
        )
    if len(set(added)) > len(old):
        raise ForkError(
            f"{entry['name']} would own {len(set(added))} files of ours, it owned {len(old)} "
            f"({', '.join(sorted(old)) or 'none'}): a rebase may rename our files, not add new ones. "
            f"New: {', '.join(sorted(set(added) - old))}; `git rm` them, or add them after the rebase"
        )


def _explain_stop(lay: Layout, state: dict, entry: dict) -> None:
    print(
        f"\nstopped at {entry['name']} ({entry['status']}); the replay is in {lay.repo}"
    )
    for d in entry["detail"]:
        print(f"  {d}" if d.startswith(" ") else f"  - {d}")
    if "to_wheel" in state:
        state["needs"] = _needs(lay, state, lay.repo)
        _save_state(lay, state)
    for line in _needs_block(state, entry["name"]):
        print(f"  {line}")
    dependents = _dependents(state, entry["name"])
    drop = " ".join(f"--drop {n}" for n in [entry["name"], *dependents])
    what = (
        f"it and {', '.join(dependents)}, which depend on it (their Depends: trailer), will be removed"
        if dependents
        else "it will be removed"
    )
    print(
        "then either resolve there, `git add` the files and run `tools/fork rebase --continue`,\n"
        f"or drop the patch: `tools/fork rebase {drop}` ({what} from the series),\n"
        "or give up: `tools/fork rebase --abort`. Nothing has been written to the repository yet.\n"
        f"Every patch's class and notes so far, and the classification made first, are in {lay.state_file}."
    )


def _needs(lay: Layout, state: dict, root: Path | None = None) -> dict:
    """What our modules read from upstream (``tools/fork needs``), checked in the target's
    source: the summary line and each name not found, with the patches whose modules read
    it. A name one of our patches adds to an upstream file counts as found. ``root``: where
    our modules are read (the repository; at a stop, the replay, with its resolutions and
    without the patches dropped or not yet replayed)."""
    from . import needs

    patches = load_series(lay.series_file)
    report = needs.check(
        needs.UpstreamTree.from_wheel(Path(state["to_wheel"]), state["to"]),
        patches,
        root or lay.root,
        locate=False,
    )
    owner = {own: p.name for p in patches for own in p.owns}
    return {
        "summary": needs.summary(report),
        "rows": [
            {
                "name": e.name,
                "status": e.status,
                "why": e.why,
                "sites": [str(s) for s in e.sites],
                "patches": sorted({owner.get(s.path, s.path) for s in e.sites}),
            }
            for e in report.entries
            if e.status != "ok"
        ],
    }


def _needs_rows(state: dict, patch: str | None = None) -> list[dict]:
    rows = state.get("needs", {}).get("rows", [])
    return [r for r in rows if patch is None or patch in r["patches"]]


def _needs_notes(state: dict, patch: str) -> list[str]:
    """The table's note for a patch whose modules read names the target lacks."""
    missing = [r["name"] for r in _needs_rows(state, patch) if r["status"] == "missing"]
    if not missing:
        return []
    return [
        f"its modules read {len(missing)} upstream name(s) {state['to']} lacks: "
        + ", ".join(missing[:4])
        + (" ..." if len(missing) > 4 else "")
        + " (`make` fails on them: port or drop; listed under the table)"
    ]


def _needs_block(state: dict, patch: str | None = None) -> list[str]:
    """The needs list's status in the target: every name not found (``patch``: those its
    own modules read, then a count of the others'), each with its readers and what to do.
    """
    if "needs" not in state:
        return []
    to = state["to"]
    lines = [
        f"what our modules read from upstream, checked in {to}'s source "
        f"(`tools/fork needs --target-tree {state['to_wheel']}`): "
        + state["needs"]["summary"]
    ]
    rows = _needs_rows(state, patch)
    if patch is not None:
        lines.append(
            f"{patch}'s modules read {len(rows)} name(s) not found in {to}"
            + (":" if rows else ": its own code needs nothing more of upstream")
        )
    for r in rows:
        lines.append(f"  {r['status']:<8} {r['name']} ({r['why']})")
        lines.append(
            f"           read by {', '.join(r['patches'])} at {', '.join(r['sites'][:4])}"
            + (" ..." if len(r["sites"]) > 4 else "")
        )
    if any(r["status"] == "missing" for r in rows):
        lines.append(
            f"  -> {to} lacks upstream code our modules use (not a module of ours: no "
            "`Depends:` helps): port the reading lines to what "
            f"{to} has (resolve in the patch's own module), or drop the patch; `make` "
            "fails on a missing name"
        )
    others = sorted(
        {
            p
            for r in _needs_rows(state)
            if r["status"] == "missing"
            for p in r["patches"]
            if p != patch
        }
    )
    if patch is not None and others:
        lines.append(f"other patches reading names {to} lacks: {', '.join(others)}")
    return lines


def _dependents(state: dict, name: str) -> list[str]:
    """The patches not dropped that depend on ``name``, directly or through another one."""
    found: list[str] = []
    names = {name}
    changed = True
    while changed:
        changed = False
        for p in state["patches"]:
            if (
                p["status"] != "dropped"
                and p["name"] not in names
                and set(p.get("depends", [])) & names
            ):
                names.add(p["name"])
                found.append(p["name"])
                changed = True
    return found


def table(state: dict, forecast: bool = False) -> str:
    """One row per patch with every note (each region and what it found) on its own line;
    ``forecast``: the classification made before the replay instead of the replay's."""
    rows = [("patch", "result", "notes")]
    for p in state["patches"]:
        got = p["forecast"] if forecast else p
        notes = got["detail"] or [""]
        rows.append((p["name"], got["status"], notes[0]))
        rows += [("", "", note) for note in notes[1:]]
    widths = [max(len(r[i]) for r in rows) for i in range(2)]
    lines = [
        f"{r[0].ljust(widths[0])}  {r[1].ljust(widths[1])}  {r[2]}".rstrip()
        for r in rows
    ]
    lines.insert(1, f"{'-' * widths[0]}  {'-' * widths[1]}  -----")
    head = f"{state['package']} {state['from']} -> {state['to']} ({state['seconds']:.1f} s)"
    return head + "\n" + "\n".join(lines)


# ---------------------------------------------------------------------------- write back


def _new_pin(state: dict) -> tuple[Pin, list[str]]:
    """The target's hashes for every tag the old pin had; a tag that cannot be fetched is said."""
    wheels, warnings = dict(state["to_sha256"]), []
    for tag in sorted(state["old_wheels"]):
        if tag in wheels:
            continue
        try:
            wheels[tag] = file_sha256(
                fetch_wheel(state["package"], state["to"], tag, sha256=None)
            )
        except ForkError as e:
            warnings.append(f"no hash recorded for {tag}: {e}")
    return Pin(state["package"], state["to"], wheels), warnings


def _finish(lay: Layout, state: dict) -> None:
    repo, root = lay.repo, lay.root
    _require_clean(lay)
    pin, warnings = _new_pin(state)
    kept = [p for p in state["patches"] if p["status"] != "dropped"]

    # 1. Stage every file a rebase writes, under the scratch dir.
    staged = lay.dir / "staged"
    shutil.rmtree(staged, ignore_errors=True)
    (staged / "patches").mkdir(parents=True)
    owned: set[str] = set()
    for p in kept:
        owns = owned_files(repo, p["new"])
        if _header(repo, p["new"]) != _header(repo, p["commit"]):
            raise ForkError(
                f"{p['name']}: its replayed commit's message differs from the patch's header; "
                "--abort and start again (the tool keeps headers; this is a bug)"
            )
        for own in owns:
            (staged / own).parent.mkdir(parents=True, exist_ok=True)
            (staged / own).write_bytes(git_show(repo, p["new"], own))
        owned.update(owns)
        (staged / "patches" / f"{p['name']}.patch").write_text(
            commit_patch(repo, p["new"], owns)
        )
    dropped = [p for p in state["patches"] if p["status"] == "dropped"]
    old_series = [
        line
        for line in lay.series_file.read_text().splitlines()
        if DROPPED_RE.match(line.strip())
    ]
    (staged / "patches" / "series").write_text(
        "".join(f"{p['name']}.patch\n" for p in kept)
        + "".join(
            line + "\n"
            for line in old_series
            + [
                f"# dropped in the rebase from {state['from']} to {state['to']}: {p['name']} (tests: "
                + ", ".join(
                    parse_patch(root / "patches" / f"{p['name']}.patch").trailers.get(
                        "Tests", []
                    )
                )
                + ")"
                for p in dropped
            ]
        )
    )
    (staged / "upstream.toml").write_text(render_pin(pin))
    if (
        root / DOCKERFILE
    ).exists():  # the serving image builds on upstream's image of the release
        (staged / DOCKERFILE).parent.mkdir(parents=True, exist_ok=True)
        (staged / DOCKERFILE).write_text(
            (root / DOCKERFILE).read_text().replace(state["from"], pin.version)
        )

    # 2. Proof: the written series applies exactly on the target (the same check as `make`).
    new_patches = load_series(staged / "patches" / "series")
    # The docs quote the new release and list the new series' flags.
    for name in docs.DOCS:
        if (root / name).exists():
            (staged / name).parent.mkdir(parents=True, exist_ok=True)
            (staged / name).write_text(
                docs.follow_release(
                    name, (root / name).read_text(), state["from"], pin.version
                )
            )
    for name in docs.EXAMPLE_PAGES:  # an example build names the release and the count
        src = staged / name if (staged / name).exists() else root / name
        if src.exists():
            text = src.read_text()
            new = docs.follow_builds(text, state["from"], pin.version, len(new_patches))
            if new != text:
                (staged / name).parent.mkdir(parents=True, exist_ok=True)
                (staged / name).write_text(new)
    if (root / docs.FLAGS_FILE).exists() and (staged / "README.md").exists():
        readme = staged / "README.md"
        readme.write_text(
            docs.rewrite(readme.read_text(), docs.render(new_patches, root))
        )
    wheel = fetch_wheel(pin.package, pin.version, PRIMARY_TAG, pin.wheels[PRIMARY_TAG])
    step("checking that the refreshed series applies exactly on the target")
    assemble(repo, wheel, pin.version, new_patches, stamp=False, src=staged)

    # 3. range-diff of the old series against the new one, for the reviewer.
    if kept:
        rd = out(
            repo,
            "range-diff",
            "--no-color",
            f"{upstream_ref(state['from'])}..old",
            f"{upstream_ref(state['to'])}..fork",
        )
    else:  # git range-diff takes no empty range
        rd = "every patch was dropped:\n" + out(
            repo,
            "log",
            "--reverse",
            "--format=  %h %s",
            f"{upstream_ref(state['from'])}..old",
        )
    (lay.dir / "range-diff.txt").write_text(rd + "\n")

    # 4. Move in. A failure or a kill midway restores the paths from git (they were clean).
    state["phase"] = "writing"
    _save_state(lay, state)
    try:
        gone = [
            f
            for f in (root / "patches").glob("*.patch")
            if f.name not in {f"{p['name']}.patch" for p in kept}
        ]
        gone += [
            f
            for f in (root / "python" / "sglang").rglob("*")
            if f.is_file()
            and "__pycache__" not in f.parts
            and str(f.relative_to(root)) not in owned
        ]
        for f in gone:
            f.unlink()
        for f in sorted(staged.rglob("*")):
            if f.is_file():
                dst = root / f.relative_to(staged)
                dst.parent.mkdir(parents=True, exist_ok=True)
                _move_in(f, dst)
    except BaseException:
        _restore_repo(lay)
        state["phase"] = "replay"
        _save_state(lay, state)
        raise
    (lay.dir / "finished.json").write_text(
        json.dumps(
            {"package": state["package"], "from": state["from"], "to": state["to"]}
        )
        + "\n"
    )
    lay.state_file.unlink()
    print(
        f"\ngit range-diff {state['from']}..old {state['to']}..new (kept in {lay.dir / 'range-diff.txt'}):\n{rd}\n"
    )
    for w in warnings:
        print(f"warning: {w}")
    if (root / docs.FLAGS_FILE).exists():
        for w in docs.problems(root, load_series(lay.series_file), pin.version):
            print(f"warning: {w} (fix it by hand before committing)")
        for w in docs.dropped_prose(root, load_series(lay.series_file)):
            print(f"review: {w} (prose about a dropped feature)")
    for name in dict.fromkeys((*docs.DOCS, *docs.EXAMPLE_PAGES)):
        if (root / name).exists():
            for w in docs.for_review(name, (root / name).read_text(), state["from"]):
                print(f"review: {w}")
    dropped = [p["name"] for p in dropped]
    review = [p["name"] for p in kept if p["status"] != "clean"]
    print(
        f"rebased {len(kept)} patch(es) onto {pin.package} {pin.version}; wrote patches/, python/sglang/, upstream.toml, "
        f"{DOCKERFILE}, the release README.md and CONTRIBUTING.md quote, the example builds the user pages quote and the README's flag table"
        + (
            f"; dropped: {', '.join(dropped)} (patches/series says so; their tests are skipped)"
            if dropped
            else ""
        )
        + (f"; review: {', '.join(review)}" if review else "")
        + ". Check `git diff`, run `make test`, then commit."
    )


def _header(repo: Path, commit: str) -> str:
    """A commit's message without its Owns: trailers (those follow the files it adds)."""
    msg = out(repo, "log", "-1", "--format=%B", commit)
    return "\n".join(
        line for line in msg.splitlines() if not line.startswith("Owns: ")
    ).strip()


def git_show(repo: Path, commit: str, path: str) -> bytes:
    return show(repo, commit, path)


def _move_in(src: Path, dst: Path) -> None:
    os.replace(src, dst)  # same filesystem: each file appears whole


def _tracked(root: Path, paths: tuple[str, ...]) -> list[str]:
    """The paths git tracks (a fork may have no Dockerfile; git checkout refuses unknown paths)."""
    return [p for p in paths if out(root, "ls-files", "--", p)]


def _restore_repo(lay: Layout) -> None:
    """Put the written paths back as committed (a rebase starts only when they are clean)."""
    written = _tracked(lay.root, WRITTEN)
    git(lay.root, "checkout", "-q", "HEAD", "--", *written)
    git(lay.root, "clean", "-qfd", "--", *written)


# ---------------------------------------------------------------------------- drift record

DRIFT_BEGIN = "<!-- begin: written by `tools/fork drift`; do not edit by hand -->"
DRIFT_END = "<!-- end: written by `tools/fork drift` -->"


def drift(
    targets: list[str],
    root: Path = REPO_ROOT,
    record: Path | None = None,
    scratch: Path | None = None,
) -> str:
    """Dry-run the series onto each release and return (and, with ``record``, write between
    the DRIFT markers of that file) the tool's own output for each, with where it ran.
    """
    import contextlib
    import io
    import platform
    import sys

    from .pin import cache_dir, wheel_name

    pin = load_pin(root / "upstream.toml")
    base = scratch or root / "build" / "drift"
    parts = []
    for target in targets:
        cached = (cache_dir() / wheel_name(pin.package, target, PRIMARY_TAG)).exists()
        lay = Layout(root, base / target)
        shutil.rmtree(lay.dir, ignore_errors=True)
        buf = io.StringIO()
        t0 = time.monotonic()
        with contextlib.redirect_stdout(_Tee(sys.stdout, buf)):
            rc = start(target, lay, dry_run=True)
        seconds = time.monotonic() - t0
        text = (
            buf.getvalue()
            .replace(str(lay.dir), f"build/drift/{target}")
            .replace(str(root), ".")
        )
        parts += [
            f"### {pin.package} {pin.version} -> {target}: "
            + ("every patch applies" if rc == 0 else "stops where shown")
            + f" ({seconds:.1f} s, target wheel "
            + ("cached" if cached else "downloaded")
            + ")",
            "",
            "```text",
            text.rstrip(),
            "```",
            "",
        ]
        shutil.rmtree(lay.dir, ignore_errors=True)
    git_version = out(root, "--version").removeprefix("git version ")
    body = "\n".join(
        [
            DRIFT_BEGIN,
            f"`tools/fork drift {' '.join(targets)}`: `tools/fork rebase <release> --dry-run` from "
            f"{pin.package} {pin.version} with the series of that commit, printed as the tool prints it. "
            f"Measured on {os.cpu_count()} CPU(s), {platform.machine()} {platform.system()}, Python "
            f"{platform.python_version()}, git {git_version}; the time includes assembling the series on "
            f"{pin.version} and importing the target wheel.",
            "",
            *parts,
            DRIFT_END,
        ]
    )
    if record is not None:
        old = record.read_text() if record.exists() else ""
        if DRIFT_BEGIN in old and DRIFT_END in old:
            head, _, rest = old.partition(DRIFT_BEGIN)
            _, _, tail = rest.partition(DRIFT_END)
            new = head + body + tail
        else:
            new = (old.rstrip() + "\n\n" if old.strip() else "") + body + "\n"
        record.write_text(new)
    return body


class _Tee:
    def __init__(self, *streams):
        self.streams = streams

    def write(self, text):
        for s in self.streams:
            s.write(text)
        return len(text)

    def flush(self):
        for s in self.streams:
            s.flush()
