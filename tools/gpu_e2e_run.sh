#!/usr/bin/env bash
# The GPU bundle's end-to-end entry (make gpu-bundle): serve the tiny DeepSeek-V4 + DSpark through
# the real launch_server, row by row (tools/e2e/matrix.py), on a machine with torch, triton and nvcc
# but no sglang dependencies and no network (the H200 harness: functional stand-ins included).
#   bash e2e.sh [RESULTS_DIR] [matrix args: --rows off,cap_3 --budget 500 ...]
# Writes e2e-<device>.json, e2e-raw-<device>.json.gz (tokens and logprobs, for --evaluate) and
# e2e-logs.tar.gz (one server log per row, with its e2e-logs.tar.gz.provenance.json) to RESULTS_DIR.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
results=$(mkdir -p "${1:-${OUT:-$here/results}}" && cd "${1:-${OUT:-$here/results}}" && pwd)
shift || true
work=$(mktemp -d)
echo "==> unpacking sglang $(cat "$here/VERSION") into $work"
tar -xJf "$here/sglang-tree.tar.xz" -C "$work" || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$work/site" \
    "$here"/wheels/*.whl "$here"/serve-wheels/*.whl || exit 1
# The pinned release beside it: the fork tree with upstream's own version of every file the series
# edits and without the files it adds (the bundle's overlay), served by the matrix's upstream rows.
mkdir -p "$work/upstream" && cp -a "$work/python" "$work/upstream/" || exit 1
tar -xJf "$here/upstream-tree.tar.xz" -C "$work/upstream" || exit 1
(cd "$work/upstream" && xargs -r rm -f < "$here/upstream-added.txt") || exit 1
export PYTHONPATH="$here/tools:$here/standins:$work/python:$work/site"
export PYTHONUNBUFFERED=1
nvcc=$(command -v nvcc || ls /usr/local/cuda*/bin/nvcc 2>/dev/null | head -1)
[ -n "$nvcc" ] && export CUDA_HOME="${CUDA_HOME:-$(dirname "$(dirname "$nvcc")")}" && export PATH="$CUDA_HOME/bin:$PATH"
python3 -m e2e.matrix --standins --upstream "$work/upstream/python" --out "$results/e2e" "$@"
rc=$?
mv "$results"/e2e/e2e-*.json "$results"/e2e/e2e-raw-*.json.gz "$results"/ 2>/dev/null
tar -czf "$results/e2e-logs.tar.gz" -C "$results/e2e" e2e-logs && rm -rf "$results/e2e"
python3 -m e2e.provenance stamp "$results/e2e-logs.tar.gz" || rc=1
exit $rc
