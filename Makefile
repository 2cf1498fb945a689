# Front door of the fork. `make` builds and installs the forked engine into .venv; `make test` tests it.
PYTHON ?= python3
VENV ?= .venv
FORK := $(PYTHON) tools/fork
PYTEST_ARGS ?=

.PHONY: all check tree refresh test gpu-bundle clean

# Fetch the pinned wheel, assemble build/tree, package build/dist/*.whl, install into .venv, print the patch table.
all:
	$(FORK) --python $(PYTHON) build --install $(VENV)

# Headers complete and every file under python/sglang owned by exactly one patch.
check:
	$(FORK) check

# Assemble build/tree without the version stamp, to edit a patch (then `make refresh`).
tree:
	$(FORK) --python $(PYTHON) tree

# Write build/tree's commits back to patches/ and python/sglang/.
refresh:
	$(FORK) refresh

# CPU test suite (GPU tests are marked `gpu` and skipped without CUDA).
test: all
	$(VENV)/bin/python -m pytest test $(PYTEST_ARGS)

clean:
	rm -rf build $(VENV)

# build/gpu-bundle: GPU tests + benchmarks for a machine with only torch and triton (bash build/gpu-bundle/run.sh).
gpu-bundle:
	$(FORK) gpu-bundle
