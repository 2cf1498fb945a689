# Front door of the fork. `make` builds and installs the forked engine into .venv; `make test` tests it.
PYTHON ?= python3
VENV ?= .venv
FORK := $(PYTHON) tools/fork
PYTEST_ARGS ?=

.PHONY: all check tree refresh rebase export test gpu-bundle sm90-compile clean

# Fetch the pinned wheel, assemble build/tree, package build/dist/*.whl, install into .venv, print the patch table.
all:
	$(FORK) --python $(PYTHON) build --install $(VENV)

# Headers complete, every file under python/sglang owned by exactly one patch, and upstream's
# hooks (black, isort, codespell, ruff F401 at its pins, installed into .venv by `make`; scripts
# with a shebang executable) clean.
check:
	$(FORK) check

# Assemble build/tree without the version stamp, to edit a patch (then `make refresh`).
tree:
	$(FORK) --python $(PYTHON) tree

# Write build/tree's commits back to patches/ and python/sglang/.
refresh:
	$(FORK) refresh

# Replay the series onto another release (TO=0.5.24, or older), classify each patch, write back when all apply.
# Resume with `tools/fork rebase --continue` / `--drop <patch>`, or `--abort`. After the write-back it
# builds and runs the Tests: of every merged or resolved patch; NO_TEST=1 (--no-test) skips that.
rebase:
	@test -n "$(TO)" || { echo "usage: make rebase TO=<release> [NO_TEST=1]"; exit 2; }
	$(FORK) rebase $(TO) $(if $(NO_TEST),--no-test)

# One patch as a diff against the pinned upstream + PR text, in build/export/.
export:
	@test -n "$(FEATURE)" || { echo "usage: make export FEATURE=<patch name or number>"; exit 2; }
	$(FORK) export $(FEATURE)

# CPU test suite (GPU tests are marked `gpu` and skipped without CUDA). Its temporary trees come
# to about 2.4 GB; only a failed test's are kept, so runs do not pile up on a shared /tmp.
test: all
	$(VENV)/bin/python -m pytest -o tmp_path_retention_policy=failed test $(PYTEST_ARGS)

clean:
	rm -rf build $(VENV)

# build/gpu-bundle: GPU tests + benchmarks (bash build/gpu-bundle/run.sh) and the end-to-end matrix
# (bash build/gpu-bundle/e2e.sh) for a machine with only torch, triton and nvcc. docs/gpu-testing.md.
gpu-bundle:
	$(FORK) gpu-bundle

# Compile the Hopper (Gluon) kernels for SM90 on this machine, GPU or not: shared memory,
# registers and spills of each shipped configuration (tools/sm90_compile.py).
sm90-compile: all
	env -u TRITON_INTERPRET $(VENV)/bin/python tools/sm90_compile.py
