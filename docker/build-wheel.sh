#!/usr/bin/env bash
# The image's first stage (and CI, from a clean clone): build the fork wheel for the serving image's
# Python from this repository, into DEST. Needs python3, git and PyPI (the pinned upstream wheel).
# Without WHEEL_TAG the tag is the pinned upstream wheel that this python3 installs
# (docker/wheel_tag.py): in the image's first stage, the image's own Python.
#   bash docker/build-wheel.sh DEST [WHEEL_TAG]
set -euo pipefail
dest=${1:?usage: docker/build-wheel.sh DEST [WHEEL_TAG]}
cd "$(dirname "$0")/.."
tag=${2:-$(python3 docker/wheel_tag.py)}
echo "fork wheel for ${tag}" >&2
python3 tools/fork build --tag "$tag"
mkdir -p "$dest"
cp build/dist/sglang-*+fork.*-"${tag}".whl "$dest"/
