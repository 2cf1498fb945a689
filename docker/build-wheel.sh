#!/usr/bin/env bash
# The image's first stage (and CI, from a clean clone): build the fork wheel for the serving image's
# Python from this repository, into DEST. Needs python3, git and PyPI (the pinned upstream wheel).
#   bash docker/build-wheel.sh DEST [WHEEL_TAG]
set -euo pipefail
dest=${1:?usage: docker/build-wheel.sh DEST [WHEEL_TAG]}
tag=${2:-cp312-cp312-manylinux_2_34_x86_64}
cd "$(dirname "$0")/.."
python3 tools/fork build --tag "$tag"
mkdir -p "$dest"
cp build/dist/sglang-*+fork.*-"${tag%%-*}"-*.whl "$dest"/
