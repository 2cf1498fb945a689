"""Every result JSON the benchmarks and the e2e harness write carries its provenance (fork build,
device, torch, triton, python, harness commit) through ``tools/e2e/provenance.py``'s
``write_result``, and a rerun by another build never silently replaces a result that docs cite.
Every file committed under ``benchmark/results/`` (its ``archive/`` aside) has that provenance:
a JSON (or gzipped JSON) in its own ``provenance`` block, any other file in a sidecar
``<name>.provenance.json``; docs cite no archived file.

The scan reads every writer's source: a ``json.dump``/``json.dumps`` outside ``print`` is a JSON
written by hand, allowed only on a statement marked ``# not a result: <what it is>`` (checkpoint
files, a tuning input). Every check here has its negative case.
"""

from __future__ import annotations

import ast
import gzip
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO
from e2e import provenance as prov

import sglang.fork as fork

MARK = "# not a result:"
# tools/e2e modules whose JSON is never a result, and why.
NOT_WRITERS = {
    "checkpoints.py": "the tiny checkpoints' config and tokenizer files the server loads",
    "server.py": "HTTP request bodies",
    "provenance.py": "the helper itself",
}
# Writers that still write their JSON themselves. Strict: once one calls write_result its entry
# fails the run until it is removed here.
PENDING: dict[str, str] = {}
WRITERS = sorted((REPO / "benchmark").rglob("*.py")) + sorted(
    p for p in (REPO / "tools" / "e2e").glob("*.py") if p.name not in NOT_WRITERS
)


def hand_written_json(source: str) -> list[int]:
    """Lines of ``json.dump``/``json.dumps`` calls outside ``print`` (to the terminal) whose
    statement is not marked ``MARK``."""
    tree = ast.parse(source)
    lines = source.splitlines()
    printed, bad = set(), []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "print"
            and not any(k.arg == "file" for k in node.keywords)
        ):
            printed |= {id(n) for n in ast.walk(node)}
    for stmt in ast.walk(tree):
        if not isinstance(stmt, ast.stmt):
            continue
        for node in _own_nodes(stmt):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("dump", "dumps")
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "json"
                and id(node) not in printed
            ):
                body = getattr(
                    stmt, "body", None
                )  # a compound statement: its header only
                end = body[0].lineno - 1 if body else stmt.end_lineno
                span = lines[stmt.lineno - 1 : end]
                if not any(MARK in line for line in span):
                    bad.append(node.lineno)
    return sorted(set(bad))


def _own_nodes(stmt: ast.stmt):
    """The expressions of ``stmt`` itself, not of the statements nested in it."""
    for field, value in ast.iter_fields(stmt):
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, ast.expr) or isinstance(v, ast.keyword):
                yield from ast.walk(v)
            elif isinstance(v, ast.withitem):
                yield from ast.walk(v.context_expr)


@pytest.mark.parametrize(
    "script",
    [
        pytest.param(
            p,
            marks=(
                [pytest.mark.xfail(strict=True, reason=PENDING[p.name])]
                if p.name in PENDING and p.parent.name == "e2e"
                else []
            ),
        )
        for p in WRITERS
    ],
    ids=lambda p: p.relative_to(REPO).as_posix(),
)
def test_every_writer_goes_through_write_result(script):
    bad = hand_written_json(script.read_text())
    assert (
        not bad
    ), f"{script.relative_to(REPO)}: JSON written without write_result at {bad}"


def test_the_scan_finds_a_hand_written_result():
    bare = "import json\nfrom pathlib import Path\nPath('r.json').write_text(json.dumps({}))\n"
    indirect = "import json\ndef f(p, r):\n    s = json.dumps(r)\n    p.write_text(s)\n"
    dump = "import json\nwith open('r.json', 'w') as f:\n    json.dump({}, f)\n"
    assert hand_written_json(bare) == [3]
    assert hand_written_json(indirect) == [3]
    assert hand_written_json(dump) == [3]
    routed = "from e2e.provenance import write_result\nwrite_result('r.json', {})\n"
    shown = "import json\nprint(json.dumps({'a': 1}, indent=1))\n"
    to_file = "import json, sys\nprint(json.dumps({}), file=open('r.json', 'w'))\n"
    assert hand_written_json(to_file) == [2]
    marked = (
        "import json\nfrom pathlib import Path\n"
        f"Path('config.json').write_text(  {MARK} a checkpoint's config\n"
        "    json.dumps({})\n)\n"
    )
    assert hand_written_json(routed) == hand_written_json(shown) == []
    assert hand_written_json(marked) == []
    # a mark inside a loop's body does not cover the loop's own header
    header = f"import json\nfor x in json.dumps([1]):\n    pass  {MARK} nothing\n"
    assert hand_written_json(header) == [2]


def test_every_exemption_says_what_the_file_is():
    for script in WRITERS:
        for line in script.read_text().splitlines():
            if MARK in line:
                assert line.split(MARK, 1)[1].strip(), f"{script}: {line}"


# ---------------------------------------------------------------- the block


def test_write_result_adds_the_provenance_block(tmp_path):
    path = prov.write_result(tmp_path / "r.json", {"rows": [1]}, root=tmp_path)
    payload = json.loads(path.read_text())
    assert prov.check(payload) == [] and payload["rows"] == [1]
    block = payload["provenance"]
    assert set(block) == set(prov.FIELDS)
    assert block["fork_version"] == fork.fork_version()
    assert block["python"] == ".".join(map(str, sys.version_info[:3]))
    import torch

    assert block["torch"] == torch.__version__
    assert block["triton"] == prov._package_version("triton")
    assert block["device"] == prov.device_name()
    assert block["commit"] == prov.harness_commit()


def test_check_refuses_a_result_without_provenance():
    assert prov.check({"rows": []}) == ["no 'provenance' block"]
    block = prov.provenance()
    assert prov.check({"provenance": block}) == []
    assert set(prov.FIELDS) >= {"fork_version", "device", "torch", "triton", "commit"}
    for field in prov.FIELDS:
        assert prov.check({"provenance": {**block, field: ""}}) == [
            f"provenance.{field} missing or empty"
        ]
        assert prov.check({"provenance": {**block, field: "unknown (no git)"}}) == [
            f"provenance.{field} missing or empty"
        ]
        partial = {k: v for k, v in block.items() if k != field}
        assert prov.check({"provenance": partial}) == [
            f"provenance.{field} missing or empty"
        ]
    assert prov.check([1]) and prov.check_files([]) == {}


def test_harness_report_writes_provenance_on_cpu(tmp_path, capsys):
    """The benchmarks' common writer, run as a benchmark runs it (its own process)."""
    code = (
        "import sys; sys.path.insert(0, 'benchmark'); import harness; from pathlib import Path; "
        f"harness.report('sample', ['a'], [{{'a': 1.5}}], Path({str(tmp_path)!r}), {{'k': 2}})"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    (written,) = tmp_path.glob("sample-*.json")
    payload = json.loads(written.read_text())
    assert prov.check(payload) == [] and payload["k"] == 2
    assert payload["provenance"]["fork_version"] == fork.fork_version()
    # the check that guards the writers refuses what they wrote before
    legacy = tmp_path / "legacy.json"
    legacy.write_text(json.dumps({"rows": []}))
    assert prov.check_files([written, legacy]) == {legacy: ["no 'provenance' block"]}


def writes_without_overwrite(source: str) -> list[int]:
    """Lines of ``write_result(...)`` / ``report(name, columns, rows, out, meta)`` calls that do
    not pass ``overwrite=``: a writer that could never be told ``--overwrite``."""
    bad = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
        if (
            name == "write_result" or name == "report" and len(node.args) >= 4
        ) and not any(k.arg == "overwrite" for k in node.keywords):
            bad.append(node.lineno)
    return bad


@pytest.mark.parametrize(
    "script",
    sorted((REPO / "benchmark").glob("*/*.py")),
    ids=lambda p: p.relative_to(REPO).as_posix(),
)
def test_every_benchmark_writer_passes_overwrite(script):
    assert writes_without_overwrite(script.read_text()) == []


def test_the_overwrite_scan_finds_a_writer_that_ignores_it():
    assert writes_without_overwrite(
        "write_result(p, r)\nreport('n', c, r, o, m)\n"
    ) == [1, 2]
    assert (
        writes_without_overwrite(
            "write_result(p, r, overwrite=a.overwrite)\nreport('n', c, r, o, m, overwrite=x)\n"
            "report(complete=True)\n"
        )
        == []
    )
    sys.path.insert(0, str(REPO / "benchmark"))
    import harness

    assert harness.arg_parser("x").parse_args(["--overwrite"]).overwrite is True
    assert harness.arg_parser("x").parse_args([]).overwrite is False


# ---------------------------------------------------------------- the harness commit


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, text=True, check=True
    ).stdout.strip()


def test_the_commit_is_the_repositorys_and_says_when_it_differs(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "a.py").write_text("x = 1\n")
    _git(repo, "add", "a.py")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "a")
    head = _git(repo, "rev-parse", "HEAD")
    assert prov.harness_commit(repo) == head
    (repo / "untracked.txt").write_text("")  # not the harness
    assert prov.harness_commit(repo) == head
    (repo / "a.py").write_text("x = 2\n")
    assert prov.harness_commit(repo) == head + "-dirty"
    # a stray COMMIT file in a work tree does not stand for its HEAD
    (repo / prov.COMMIT_FILE).write_text("f" * 40 + "\n")
    assert prov.harness_commit(repo) == head + "-dirty"
    # an unpacked GPU bundle inside the checkout: its COMMIT file, not the checkout's HEAD
    bundle = repo / "build" / "gpu-bundle"
    bundle.mkdir(parents=True)
    (bundle / prov.COMMIT_FILE).write_text("e" * 40 + "\n")
    assert prov.harness_commit(bundle) == "e" * 40
    # neither: a value the check refuses
    bare = tmp_path / "bare"
    bare.mkdir()
    unknown = prov.harness_commit(bare)
    assert unknown.startswith(prov.UNKNOWN)
    block = {**prov.provenance(), "commit": unknown}
    assert prov.check({"provenance": block}) == ["provenance.commit missing or empty"]


def test_the_bundle_carries_the_commit_the_provenance_reads(tmp_path, monkeypatch):
    """The bundle's COMMIT sits where its copy of tools/e2e/provenance.py looks (its root), so a
    result written on a machine without git names the commit the bundle was built from.
    """
    from forklib import bundle

    for heavy in (
        "_tree_tarball",
        "_upstream_overlay",
        "_wheels",
    ):  # the network and xz
        monkeypatch.setattr(bundle, heavy, lambda *a, **k: 0)
    monkeypatch.setattr(bundle, "RUN_LIMIT", 2**40)
    dest = tmp_path / "gpu-bundle"
    bundle.make_bundle(tmp_path, "0.0.1+fork.1.0000000", dest)
    assert (dest / "COMMIT").read_text().strip() == bundle.repo_commit()
    assert bundle.repo_commit() == prov.harness_commit(REPO)
    code = "from e2e import provenance as p; print(p.harness_commit())"
    r = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,  # not inside any git repository's work tree that holds the bundle
        env={"PYTHONPATH": str(dest / "tools"), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == bundle.repo_commit()
    for script in ("gpu_bundle_run.sh", "gpu_e2e_run.sh"):
        text = (REPO / "tools" / script).read_text()
        assert "e2e.provenance" in text, script  # its JSON and its logs are stamped


def test_a_result_evaluated_elsewhere_keeps_the_producing_machines_block(tmp_path):
    gpu = {**prov.provenance(), "device": "NVIDIA H200", "torch": "2.11.0"}
    path = prov.write_result(tmp_path / "r.json", {"rows": []}, produced_by=gpu)
    payload = json.loads(path.read_text())
    assert payload["provenance"] == gpu
    assert payload["evaluated_by"] == prov.provenance()
    # produced here: no second block
    path = prov.write_result(tmp_path / "s.json", {"rows": []})
    assert "evaluated_by" not in json.loads(path.read_text())


# ---------------------------------------------------------------- every committed result

RESULTS = REPO / "benchmark" / "results"
ARCHIVE = RESULTS / prov.ARCHIVE


def test_every_committed_result_file_has_its_provenance():
    """The CI gate: every file under benchmark/results/ (not archive/) names its build, device,
    torch, triton, python and harness commit: a JSON or gzipped JSON in its ``provenance``
    block, a log, tarball, text or markdown file in ``<name>.provenance.json`` beside it. A file
    that cannot be re-run moves to archive/ (``git mv``), cited by no docs page."""
    bad = prov.check_results(RESULTS)
    assert bad == {}, "\n".join(
        f"{p.relative_to(REPO)}: {'; '.join(problems)}" for p, problems in bad.items()
    )


def test_the_results_check_names_the_file_and_the_field(tmp_path):
    block = prov.provenance()
    (tmp_path / "good-NVIDIA_H200.json").write_text(json.dumps({"provenance": block}))
    no_commit = {k: v for k, v in block.items() if k != "commit"}
    (tmp_path / "old-NVIDIA_H200.json").write_text(
        json.dumps({"provenance": no_commit})
    )
    (tmp_path / "bare-NVIDIA_H200.json").write_text(
        json.dumps({"device": "NVIDIA H200"})
    )
    with gzip.open(tmp_path / "raw-NVIDIA_H200.json.gz", "wt") as f:
        json.dump({"meta": {}, "provenance": {**block, "triton": ""}}, f)
    (tmp_path / "run.log").write_text("numbers\n")
    (tmp_path / "stamped.log").write_text("numbers\n")
    prov.write_sidecar(tmp_path / "stamped.log")
    (tmp_path / "torchless.txt").write_text("numbers\n")
    prov.write_sidecar(tmp_path / "torchless.txt", produced_by={**block, "torch": ""})
    (tmp_path / "orphan.tar.gz.provenance.json").write_text(
        json.dumps({"describes": "orphan.tar.gz", "provenance": block})
    )
    (tmp_path / prov.ARCHIVE).mkdir()
    (tmp_path / prov.ARCHIVE / "older.json").write_text("{}")  # exempt
    bad = {p.name: problems for p, problems in prov.check_results(tmp_path).items()}
    assert bad == {
        "old-NVIDIA_H200.json": ["provenance.commit missing or empty"],
        "bare-NVIDIA_H200.json": ["no 'provenance' block"],
        "raw-NVIDIA_H200.json.gz": ["provenance.triton missing or empty"],
        "run.log": [
            "not JSON and no sidecar run.log.provenance.json with its provenance"
        ],
        "torchless.txt": [
            "torchless.txt.provenance.json: provenance.torch missing or empty"
        ],
        "torchless.txt.provenance.json": ["provenance.torch missing or empty"],
        "orphan.tar.gz.provenance.json": [
            "sidecar of no file: 'describes' names 'orphan.tar.gz'"
        ],
    }
    # the command line says the same and fails
    r = subprocess.run(
        [sys.executable, str(REPO / "tools/e2e/provenance.py"), "check", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 1 and "old-NVIDIA_H200.json: provenance.commit" in r.stdout
    r = subprocess.run(
        [sys.executable, str(REPO / "tools/e2e/provenance.py"), "check", str(ARCHIVE)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 1  # what is archived is archived for a reason


def _archive_links(text: str) -> list[str]:
    """Paths to a file in the archive (the folder itself may be named)."""
    return re.findall(r"results/" + prov.ARCHIVE + r"/[^)\s`]+", text)


def citation_problems(page: Path) -> list[str]:
    """What is wrong with the results ``page`` cites: a path into the archive, or a link into
    benchmark/results/ to a file that is missing or fails the provenance check."""
    text = page.read_text()
    problems = [f"cites the archive: {a}" for a in _archive_links(text)]
    for target in re.findall(r"\]\(([^)#\s]*results/[^)#\s]+)\)", text):
        path = (page.parent / target).resolve()
        if not path.exists():
            problems.append(f"links a missing result: {target}")
        elif path.is_file() and prov.check_files([path]):
            problems.append(f"links a result without complete provenance: {target}")
    return problems


def test_no_docs_page_cites_an_archived_result():
    """A figure from an archived file is not evidence: the page names the file and says it
    awaits a re-run, and links only to results that pass the check above."""
    for page in prov.docs_pages() + [REPO / "CONTRIBUTING.md"]:
        assert citation_problems(page) == [], page.relative_to(REPO)


def test_the_citation_check_sees_an_archive_link_and_a_result_without_provenance(
    tmp_path,
):
    results = tmp_path / "benchmark" / "results"
    (results / prov.ARCHIVE).mkdir(parents=True)
    (results / prov.ARCHIVE / "old.json").write_text("{}")
    (results / "new.json").write_text(json.dumps({"provenance": prov.provenance()}))
    (results / "bare.json").write_text(json.dumps({"device": "NVIDIA H200"}))
    page = tmp_path / "docs" / "page.md"
    page.parent.mkdir()
    page.write_text(
        "[new](../benchmark/results/new.json), `old.json` (awaits a re-run), archived in\n"
        "`benchmark/results/archive/`\n"
        "[old](../benchmark/results/archive/old.json), see benchmark/results/archive/old.json\n"
        "[gone](../benchmark/results/gone.json), [bare](../benchmark/results/bare.json)\n"
    )
    assert citation_problems(page) == [
        "cites the archive: results/archive/old.json",
        "cites the archive: results/archive/old.json",
        "links a result without complete provenance: ../benchmark/results/archive/old.json",
        "links a missing result: ../benchmark/results/gone.json",
        "links a result without complete provenance: ../benchmark/results/bare.json",
    ]
    page.write_text(
        "[new](../benchmark/results/new.json), `old.json` (awaits a re-run), archived in\n"
        "`benchmark/results/archive/`\n"
    )
    assert citation_problems(page) == []


def test_the_archive_says_what_it_holds():
    text = (ARCHIVE / "README.md").read_text()
    files = sorted(
        p.relative_to(ARCHIVE).as_posix()
        for p in ARCHIVE.rglob("*")
        if p.is_file() and p.name != "README.md"
    )
    assert files, "an empty archive: remove it and this test"
    assert [f for f in files if f"`{f}`" not in text] == []


# ---------------------------------------------------------------- cited evidence


OLD = "0.0.1+fork.1.0000000"  # any build other than the one under test


def _repo(tmp_path: Path, cite: str | None) -> tuple[Path, Path]:
    """A repository with one result written by build ``OLD``; ``cite``: the docs page citing it."""
    results = tmp_path / "benchmark" / "results"
    results.mkdir(parents=True)
    path = results / "bench-NVIDIA_H200.json"
    path.write_text(
        json.dumps(
            {"rows": ["old"], "provenance": {**prov.provenance(), "fork_version": OLD}}
        )
    )
    if cite:
        page = tmp_path / cite
        page.parent.mkdir(parents=True, exist_ok=True)
        depth = "../" * (len(Path(cite).parts) - 1)
        page.write_text(
            f"# A page\n\nMeasured: [numbers]({depth}benchmark/results/{path.name}).\n"
        )
    return tmp_path, path


@pytest.mark.parametrize(
    "cite", ["docs/feature.md", "README.md", "benchmark/dspark/README.md"]
)
def test_a_cited_result_of_another_build_is_kept(tmp_path, cite, capsys):
    root, path = _repo(tmp_path, cite)
    written = prov.write_result(path, {"rows": ["new"]}, root=root)
    assert written != path and written.parent == path.parent
    assert (
        written.name == f"bench-NVIDIA_H200.{prov.build_tag(fork.fork_version())}.json"
    )
    assert json.loads(path.read_text())["rows"] == ["old"]  # the evidence is intact
    assert json.loads(written.read_text())["rows"] == ["new"]
    assert cite in capsys.readouterr().err
    # --overwrite replaces it
    assert prov.write_result(path, {"rows": ["new"]}, root=root, overwrite=True) == path
    assert json.loads(path.read_text())["rows"] == ["new"]


def test_a_cited_result_without_provenance_counts_as_a_past_build(tmp_path):
    root, path = _repo(tmp_path, "docs/feature.md")
    path.write_text(json.dumps({"rows": ["old"]}))
    assert prov.written_by(path) is None
    assert prov.write_result(path, {"rows": ["new"]}, root=root) != path
    assert json.loads(path.read_text()) == {"rows": ["old"]}


def test_what_may_be_replaced_is_replaced(tmp_path):
    # not cited by any page
    root, path = _repo(tmp_path / "a", None)
    assert prov.write_result(path, {"rows": ["new"]}, root=root) == path
    # cited, but written by this build (a rerun, or a writer that rewrites after every run)
    root, path = _repo(tmp_path / "b", "docs/feature.md")
    assert prov.write_result(path, {"rows": ["1"]}, root=root, overwrite=True) == path
    assert prov.write_result(path, {"rows": ["2"]}, root=root) == path
    assert json.loads(path.read_text())["rows"] == ["2"]
    # a page that names another file, or the name only as text, does not cite it
    root, path = _repo(tmp_path / "c", None)
    (root / "docs").mkdir()
    (root / "docs" / "x.md").write_text(
        f"[other](../benchmark/results/x{path.name}) and {path.name} in prose\n"
    )
    assert prov.citing_pages(path.name, root) == []
    assert prov.write_result(path, {"rows": ["new"]}, root=root) == path


def test_the_repository_links_no_archived_result():
    """The guard reads the real docs: no page links an archived file's name (its re-run lands in
    benchmark/results/ free to be written), and a synthetic page that does is seen."""
    for path in ARCHIVE.iterdir():
        if path.name != "README.md":
            assert prov.citing_pages(path.name) == [], path.name
    assert prov.citing_pages("no-such-result.json") == []


def test_the_rebase_drill_stamps_its_transcript(tmp_path):
    """A writer of a non-JSON result (the rebase drill's log) writes its sidecar with it."""
    sys.path.insert(0, str(REPO / "benchmark" / "rebase"))
    import rebase_drill

    d = rebase_drill.Drill(tmp_path, "0.5.22")
    d.log = tmp_path / "rebase-drill-0.5.22.log"
    d.lines = ["a transcript"]
    d.save()
    assert prov.check_results(tmp_path) == {}
    sidecar = json.loads((tmp_path / f"{d.log.name}{prov.SIDECAR}").read_text())
    assert sidecar["describes"] == d.log.name
    assert sidecar["provenance"]["commit"] == prov.harness_commit()
