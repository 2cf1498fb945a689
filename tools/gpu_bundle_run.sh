#!/usr/bin/env bash
# Entry point of the GPU bundle (make gpu-bundle): runs the fork's GPU tests and benchmarks on
# a machine that has torch and triton but no sglang dependencies and no network.
#   bash run.sh [RESULTS_DIR]      (default: $OUT if set, else ./results)
#   BENCH='bench_wo_a_*.py dspark/tune_*.py' bash run.sh ...   runs only those benchmarks, in that order
#   (space-separated globs: a bare name matches in every feature folder benchmark/*/, a name with a
#   folder under benchmark/; BENCH=none: tests only; TESTS=none: benchmarks only, for a probe run;
#   TESTS='test/test_x.py -k y': those tests only)
# Writes gpu-tests.log, gpu-tests.xml, every benchmark's JSON and bundle-run.json (summary), each
# with this machine's provenance (build, device, torch, triton, the bundle's COMMIT): in the JSON,
# or in a <file>.provenance.json sidecar (tools/e2e/provenance.py).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
results=$(mkdir -p "${1:-${OUT:-$here/results}}" && cd "${1:-${OUT:-$here/results}}" && pwd)
work=$(mktemp -d)
echo "==> unpacking sglang $(cat "$here/VERSION") into $work"
tar -xJf "$here/sglang-tree.tar.xz" -C "$work" || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$work/site" \
    "$here"/wheels/*.whl || exit 1
export PYTHONPATH="$here/standins:$work/python:$work/site"
export PYTHONUNBUFFERED=1 FORK_RESULTS="$results"
cd "$here"

tests_rc=0
if [ "${TESTS:-}" != none ]; then
    echo "==> pytest -m gpu"
    read -ra selection <<< "${TESTS:-test}"
    python3 -m pytest -m gpu "${selection[@]}" -p no:cacheprovider -rA --junitxml "$results/gpu-tests.xml" \
        2>&1 | tee "$results/gpu-tests.log"
    tests_rc=${PIPESTATUS[0]}
fi

bench_rc=0
read -ra patterns <<< "${BENCH:-bench_*.py}"  # split on spaces, globbed only under benchmark/
for pattern in "${patterns[@]}"; do
    case "$pattern" in */*) where=benchmark/$pattern ;; *) where=benchmark/*/$pattern ;; esac
    for bench in $where; do
        [ -e "$bench" ] || continue
        echo "==> $bench"
        python3 "$bench" --out "$results" || bench_rc=1
    done
done

PYTHONPATH="$here/tools:$PYTHONPATH" python3 - "$results" "$tests_rc" "$bench_rc" <<'PY'
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path
from e2e.provenance import write_result, write_sidecar
results, tests_rc, bench_rc = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
cases = []
xml = results / "gpu-tests.xml"
for case in ET.parse(xml).iter("testcase") if xml.exists() else ():
    outcome = "passed"
    for tag in ("failure", "error", "skipped"):
        if case.find(tag) is not None:
            outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
    cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                  "seconds": float(case.get("time", 0))})
summary = {
    "pytest_exit_code": tests_rc, "benchmarks_ok": bench_rc == 0,
    "benchmark_json": sorted(p.name for p in results.glob("*.json") if p.name != "bundle-run.json"),
    "tests": cases,
}
for name in ("gpu-tests.log", "gpu-tests.xml"):
    if (results / name).is_file():
        write_sidecar(results / name)
summary = json.loads(write_result(results / "bundle-run.json", summary, overwrite=True).read_text())
print(json.dumps({k: v for k, v in summary.items() if k != "tests"}, indent=1))
print(f"{sum(c['outcome'] == 'passed' for c in cases)} passed, "
      f"{sum(c['outcome'] in ('failed', 'error') for c in cases)} failed")
PY
exit $(( tests_rc != 0 || bench_rc != 0 ))
