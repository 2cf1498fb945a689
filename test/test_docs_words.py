"""The user docs agree with each other, with the image and with the measurement, in words a
reader can place.

- The launch command: README.md, docs/serving.md and docker/README.md each show it in a block
  after the ``LAUNCH_MARKER`` comment (as ``python -m sglang.launch_server ...`` or as ``docker run
  ... IMAGE ...``); the server's arguments are the same in every block, and its fork flags are a
  flag set of the full-depth end-to-end run that no measured cell shows slower than upstream.
- Docker: every documented ``docker run`` of the image hands its arguments to the entry point
  (the Dockerfile's exec-form ENTRYPOINT, launch_server), whose own parsing accepts them; the
  wheel cache the image's build stage reads is the folder docker/README.md tells a reader to fill.
- Words: no retired word in the user docs (generated tables, which come from result files,
  aside), no "issue N" reference anywhere in the code or docs, and "harness" / "stand-in"
  defined once (docs/gpu-testing.md) and kept off the README's first screen.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
from conftest import REPO

LAUNCH_MARKER = "<!-- launch command:"
LAUNCH_PAGES = ("README.md", "docs/serving.md", "docker/README.md")
ENTRYPOINT = ["python3", "-m", "sglang.launch_server"]
IMAGE_RE = re.compile(r"^sglang-dsv4:\S+$")
FULL_DEPTH = "e2e-full-depth-NVIDIA_H200.json"

# ------------------------------------------------------------------------------ launch command


def _blocks(text: str) -> list[tuple[str, str]]:
    """(the line before the fence, the fenced text) for every ``` block of a page."""
    found = []
    for m in re.finditer(r"^```[^\n]*\n(.*?)^```", text, re.M | re.S):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        found.append((before, m.group(1)))
    return found


def _commands(block: str) -> list[list[str]]:
    """The block's server commands (``docker run`` or ``sglang.launch_server``), continuation
    lines joined, comments dropped; other lines (a script's quoted multi-line program) are not
    split."""
    joined = re.sub(r"\\\n", " ", block)
    return [
        shlex.split(line, comments=True)
        for line in joined.splitlines()
        if line.lstrip().startswith("docker run") or "sglang.launch_server" in line
    ]


def server_args(command: list[str]) -> list[str] | None:
    """What launch_server receives from a command: the words after ``sglang.launch_server``,
    or, for ``docker run``, the words after the image (the entry point's arguments)."""
    if "sglang.launch_server" in command:
        return command[command.index("sglang.launch_server") + 1 :]
    if command[:2] == ["docker", "run"]:
        images = [i for i, w in enumerate(command) if IMAGE_RE.match(w)]
        if images:
            return command[images[0] + 1 :]
    return None


def launch_commands(text: str) -> list[list[str]]:
    """The server arguments of each block that follows the launch marker."""
    found = []
    for before, block in _blocks(text):
        if before.startswith(LAUNCH_MARKER):
            (command,) = _commands(block)
            args = server_args(command)
            assert args is not None, f"not a launch command: {command}"
            found.append(args)
    return found


def test_the_launch_command_is_the_same_on_every_page():
    per_page = {p: launch_commands((REPO / p).read_text()) for p in LAUNCH_PAGES}
    assert all(per_page.values()), per_page
    commands = [c for cs in per_page.values() for c in cs]
    assert all(c == commands[0] for c in commands), per_page
    # the serving page shows it both ways (pip and the image)
    assert len(per_page["docs/serving.md"]) == 2


def test_a_page_whose_launch_command_differs_is_found():
    ours = (REPO / "README.md").read_text()
    other = ours.replace("--dsv4-wo-a-fp8-twin mid", "--dsv4-wo-a-fp8-twin small", 1)
    assert launch_commands(ours) != launch_commands(other)
    docker = (
        f"{LAUNCH_MARKER} x -->\n```\ndocker run --gpus all -v /m:/m sglang-dsv4:9.8.7 \\\n"
        "    --model-path /m --tp-size 4\n```\n"
    )
    assert launch_commands(docker) == [["--model-path", "/m", "--tp-size", "4"]]


def _fork_flags() -> set[str]:
    import tomllib

    entries = tomllib.loads((REPO / "docs/flags.toml").read_text())["flag"]
    return {e["flag"] for e in entries if not e.get("upstream_flag")}


def _full_depth() -> dict:
    results = REPO / "benchmark/results"
    (path,) = [
        p
        for p in (results / FULL_DEPTH, results / "archive" / FULL_DEPTH)
        if p.is_file()
    ]
    return json.loads(path.read_text())


def slower_cells(run: dict, name: str) -> list[str]:
    """A flag set's cells that the run shows slower than upstream: a step-time interval above
    1, an output tokens/s interval below 1, or the step test's verdict."""
    found = []
    for key, cell in run["flag_sets"][name]["batches"].items():
        if cell["step_ratio"]["t95"][0] > 1 or cell["throughput_ratio"]["t95"][1] < 1:
            found.append(f"{name} {key}")
    verdicts = run.get("step_verdicts", {})
    for label in verdicts.get("slower", []) + verdicts.get("slower_per_cell", []):
        if label.split()[0] == name:
            found.append(label)
    return found


def test_the_launch_command_runs_a_measured_flag_set_that_was_not_slower():
    (args,) = launch_commands((REPO / "README.md").read_text())
    fork = _fork_flags()
    ours = [w for w in args if w in fork]
    run = _full_depth()
    matching = [
        name
        for name, fs in run["flag_sets"].items()
        if sorted(w for w in fs["args"] if w.startswith("--")) == sorted(ours)
        and " ".join(fs["args"]) in " ".join(args)
    ]
    assert matching, f"{ours}: no flag set of {FULL_DEPTH} ({list(run['flag_sets'])})"
    (name,) = matching
    assert slower_cells(run, name) == []
    assert all(
        c["tokens_identical"] for c in run["flag_sets"][name]["batches"].values()
    )


def test_a_flag_set_measured_slower_is_found():
    run = _full_depth()
    # the fp8 head alone at batch 1: step 1.040 [1.009, 1.072], the step test's one slower cell
    assert "head_fp8 bs1" in slower_cells(run, "head_fp8")
    # the fixed cap alone at batch 1: output tokens/s 0.945 [0.891, 0.999]
    assert "cap_3 bs1" in slower_cells(run, "cap_3")


# ------------------------------------------------------------------------------ docker


def _dockerfile() -> str:
    return (REPO / "docker/Dockerfile").read_text()


def _exec_form(instruction: str) -> list[str]:
    (line,) = re.findall(rf"^{instruction} (.*)$", _dockerfile(), re.M)
    return json.loads(line)


def documented_docker_runs() -> list[tuple[str, list[str]]]:
    """(page, the arguments after the image) of every ``docker run`` of the image in the docs."""
    pages = [
        REPO / "README.md",
        REPO / "docker/README.md",
        *sorted((REPO / "docs").glob("*.md")),
    ]
    found = []
    for page in pages:
        for _, block in _blocks(page.read_text()):
            for command in _commands(block):
                if command[:2] == ["docker", "run"]:
                    args = server_args(command)
                    assert args is not None, f"{page}: no image in {command}"
                    found.append((str(page.relative_to(REPO)), args))
    return found


def run_entrypoint(args: list[str]):
    """What the image does with ``docker run IMAGE ARGS``: ENTRYPOINT + (ARGS or CMD), where the
    entry point is launch_server, whose main parses its arguments with prepare_server_args.
    """
    import sglang.launch_server as launch_server
    from sglang.srt.server_args import prepare_server_args

    command = _exec_form("ENTRYPOINT") + (args or _exec_form("CMD"))
    assert command[:3] == ENTRYPOINT
    assert (
        "prepare_server_args(sys.argv[1:])" in Path(launch_server.__file__).read_text()
    )
    return prepare_server_args(command[3:])


def test_documented_docker_runs_pass_the_entrypoints_parsing(capsys):
    runs = documented_docker_runs()
    assert len(runs) >= 4, runs  # docker/README.md's two, docs/serving.md's two
    for page, args in runs:
        if not args:
            with pytest.raises(SystemExit) as e:  # CMD ["--version"]: prints, exits 0
                run_entrypoint(args)
            assert e.value.code in (0, None), page
            assert "fork of sglang" in capsys.readouterr().out
            continue
        sa = run_entrypoint(args)
        assert sa.model_path, page


def test_a_command_after_the_image_is_refused_by_the_entrypoint(capsys):
    """The example docs/serving.md once gave: a command where the server's arguments go."""
    (args,) = launch_commands((REPO / "docker/README.md").read_text())
    with pytest.raises(SystemExit) as e:
        run_entrypoint(["python3", "-m", "sglang.launch_server", *args])
    assert e.value.code == 2
    assert (
        "unrecognized arguments: python3 -m sglang.launch_server"
        in capsys.readouterr().err
    )


def test_the_build_stage_reads_the_wheel_cache_the_docs_name(tmp_path, monkeypatch):
    """docker/README.md: a pinned wheel put in docker/cache/wheels/ is used, PyPI not asked."""
    from forklib import pin

    text = _dockerfile()
    stage = text.split("\nFROM ", 2)[1]  # the first stage, where the wheel is built
    (workdir,) = re.findall(r"^WORKDIR (\S+)$", stage, re.M)
    (cache,) = re.findall(r"^ENV FORK_CACHE=(\S+)$", stage, re.M)
    rel = Path(cache).relative_to(workdir)
    assert stage.index("ENV FORK_CACHE") < stage.index("RUN bash docker/build-wheel.sh")
    ignored = (REPO / ".dockerignore").read_text().split()
    assert not any(str(rel).startswith(p.rstrip("/")) for p in ignored)
    for page in ("docker/README.md", "docs/serving.md"):
        assert f"`{rel}/wheels/`" in (REPO / page).read_text(), page
    assert f"{rel}/" in (REPO / ".gitignore").read_text().split()

    monkeypatch.setenv("FORK_CACHE", str(tmp_path / rel))
    assert pin.cache_dir() == tmp_path / rel / "wheels"
    wheel = pin.cache_dir() / pin.wheel_name("sglang", "9.8.7", "cp312-cp312-x")
    wheel.write_bytes(b"a wheel fetched elsewhere")

    def no_pypi(*a, **k):
        raise AssertionError("asked PyPI although the wheel was in the cache")

    monkeypatch.setattr(pin, "_download", no_pypi)
    sha = pin.file_sha256(wheel)
    assert pin.fetch_wheel("sglang", "9.8.7", "cp312-cp312-x", sha) == wheel
    with pytest.raises(pin.ForkError, match="does not match the pinned"):
        pin.fetch_wheel("sglang", "9.8.7", "cp312-cp312-x", "0" * 64)


# ------------------------------------------------------------------------------ words

# Words a reader outside the project cannot place, or that describe where the project ran
# rather than what was run: a measurement names its device and build instead.
RETIRED = (
    (r"\bsittings?\b", 'a measurement "run", not a "sitting"'),
    (
        r"\bproject's [\w -]{0,30}machines?\b",
        "name the device and build, not the project's machines",
    ),
    (r"\bthis (\d+-core |CPU |GPU )?machine\b", "name the device, not this machine"),
    (r"\b\d+-core (CPU )?machine\b", "name the device (e.g. a CPU host with 2 cores)"),
    (r"\bGB10 line\b", "GB10 nodes, or a GB10 deployment"),
    (r"\bissues? #?\d+\b", "no issue references: the tracker is not in the repository"),
)
ISSUE_RE = RETIRED[-1][0]
GENERATED = re.compile(r"<!-- docs_tables: .*?<!-- /docs_tables -->", re.S)


def retired_words(text: str, patterns=RETIRED) -> list[str]:
    """Each retired word of ``text`` with its line and what to write instead; the generated
    tables (written from result files by tools/docs_tables.py) are left out."""
    text = GENERATED.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    found = []
    for pattern, instead in patterns:
        for m in re.finditer(pattern, text, re.I):
            line = text.count("\n", 0, m.start()) + 1
            found.append(f"{line}: {m.group(0)!r} ({instead})")
    return found


def user_docs() -> list[Path]:
    return [
        REPO / "README.md",
        REPO / "CONTRIBUTING.md",
        *sorted((REPO / "docs").rglob("*.md")),
        *sorted(p for p in (REPO / "docker").rglob("*") if p.is_file()),
    ]


def test_the_user_docs_use_no_retired_words():
    found = {}
    for path in user_docs():
        hits = retired_words(path.read_text())
        if hits:
            found[str(path.relative_to(REPO))] = hits
    assert found == {}


def test_no_code_or_doc_refers_to_an_issue_number():
    found = {}
    for root in ("python", "tools", "test", "benchmark"):
        for path in sorted((REPO / root).rglob("*")):
            if (
                path.suffix not in (".py", ".sh", ".md", ".toml")
                or "results" in path.parts
            ):
                continue
            if path.name == "test_docs_words.py":
                continue
            hits = retired_words(path.read_text(errors="replace"), [RETIRED[-1]])
            if hits:
                found[str(path.relative_to(REPO))] = hits
    assert found == {}


def test_the_retired_word_check_sees_them():
    text = (
        "Measured in three sittings on the project's H200 test machine.\n"
        "CPU (this 2-core machine); the GB10 line over RoCE.\n"
        "# ---- hardening (issue 19, item 6)\n"
    )
    hits = retired_words(text)
    assert len(hits) == 6, hits
    assert hits[0].startswith("1: 'sittings'")
    assert any(h.startswith("3: 'issue 19'") for h in hits)
    # a generated table is its result file's: skipped, and the lines after it still counted
    table = "<!-- docs_tables: t -->\n| GB10 line, TP4 |\n<!-- /docs_tables -->\none sitting\n"
    assert retired_words(table) == [
        '4: \'sitting\' (a measurement "run", not a "sitting")'
    ]
    # the words the docs use instead pass
    plain = "Measured in three runs on one H200 (build X); a CPU host with 2 cores; four GB10 nodes.\n"
    assert retired_words(plain + "upstream's sglang#40320\n") == []


def test_harness_and_stand_in_are_defined_once_and_off_the_first_screen():
    definitions = {
        str(p.relative_to(REPO))
        for p in user_docs()
        if re.search(r"The \*test harness\* is|A \*stand-in\*\s+is", p.read_text())
    }
    assert definitions == {"docs/gpu-testing.md"}
    text = (REPO / "docs/gpu-testing.md").read_text()
    assert "The *test harness* is" in text and re.search(r"A \*stand-in\*\s+is", text)
    first_screen = (REPO / "README.md").read_text().split("\n## ", 1)[0]
    assert not re.search(r"harness|stand-in", first_screen, re.I)
    assert launch_commands(first_screen), "the launch command is on the first screen"


def test_the_release_check_reads_an_address_as_no_release():
    """The launch command binds 0.0.0.0; the docs' release check must not read it as a release."""
    from forklib.docs import RELEASE_RE

    assert RELEASE_RE.findall("--host 0.0.0.0 --port 30000") == []
    assert RELEASE_RE.findall("sglang 0.9.23. Then 0.9.22, (0.9.21)") == [
        "0.9.23",
        "0.9.22",
        "0.9.21",
    ]


def test_the_patches_that_add_a_value_are_named_where_version_shows_no_flags():
    """A flags.toml row for a value of an upstream flag (``upstream_flag``) belongs to a patch
    whose ``--version`` line says ``(no flags)``; README.md and docs/fork-identity.md say which
    patches those are, so the flag table's patch column and ``--version`` do not disagree.
    """
    import tomllib

    from forklib.docs import BEGIN, END
    from forklib.series import load_series

    rows = tomllib.loads((REPO / "docs/flags.toml").read_text())["flag"]
    by_name = {p.name: p for p in load_series()}
    values = sorted({r["patch"] for r in rows if r.get("upstream_flag")})
    assert values
    readme = (REPO / "README.md").read_text()
    pages = {
        "README.md": readme.split(BEGIN)[0] + readme.split(END)[1],
        "docs/fork-identity.md": (REPO / "docs/fork-identity.md").read_text(),
    }
    for page, text in pages.items():
        said = " ".join(
            p for p in text.split("\n\n") if "(no flags)" in p and "add" in p
        )
        for name in values:
            assert by_name[name].flags == [], name
            assert re.search(rf"\b{name[:4]}\b", said), (page, name)


def test_contributings_new_patch_takes_a_free_number_past_the_series():
    """The worked example's `make refresh` writes a new patch numbered past the series' last
    (tools/forklib/tree.py), never a number that is taken."""
    from forklib.series import load_series

    text = (REPO / "CONTRIBUTING.md").read_text()
    (number,) = set(re.findall(r"writes `patches/(\d{4})-[\w-]+\.patch`", text))
    last = max(int(p.name[:4]) for p in load_series())
    assert int(number) > last, (number, last)
