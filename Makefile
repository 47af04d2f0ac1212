PYTHON ?= python3
PIP := $(PYTHON) -m pip
# Installed only when no torch is importable; an existing torch (CPU or CUDA build) is kept, and pip never
# resolves torch on its own here (--no-deps below). Given on the command line (make test
# TORCH_SPEC=torch==2.15.0), it is what the environment gets: pip installs it unless the torch there
# satisfies it (a virtual environment's own, over one it sees in the system's packages).
TORCH_SPEC ?= torch==2.13.0
TORCH_ASKED := $(if $(filter command line,$(origin TORCH_SPEC)),$(TORCH_SPEC))
# more pip arguments for that install, e.g. TORCH_PIP_ARGS="--index-url <a PyTorch wheel index>"
TORCH_PIP_ARGS ?=
# steps of `make demo` (CI runs a short one: make demo STEPS=20)
STEPS ?= 200
# more pytest arguments for `make test`, e.g. TEST_ARGS="-m exactness" (what .ci/run runs a second time)
TEST_ARGS ?=
# what `make test` runs: the whole suite, or e.g. TESTS="tests/test_compat.py tests/test_torchtitan.py"
TESTS ?= tests
# pytest processes `make test` runs the suite in (0: one, pytest's own)
TEST_WORKERS ?= 2
DEMO_DIR ?= build/demo

# What each target needs beyond torch. setuptools>=70.1 and wheel: a fresh venv's setuptools 65
# cannot build an editable install without build isolation.
BUILD_DEPS := "setuptools>=70.1" wheel ninja
DEMO_DEPS := numpy matplotlib
# transformers: the Hugging Face causal LMs that tests/test_hf.py trains (built from configs, never downloaded);
# a range pip resolves without touching torch (transformers does not require it)
HF_SPEC := "transformers>=5.0,<6"
# pytest-xdist runs the suite in TEST_WORKERS processes: much of it waits (timeouts a test provokes, ranks
# starting, rendezvous), and on 2 cores two workers took the suite from 21 to 14 minutes (docs/architecture.md, Build)
XDIST_DEPS := pytest-xdist==3.8.0 execnet==2.1.2
TEST_DEPS := pytest hypothesis nvtx $(HF_SPEC)
# TorchTitan's own pipeline code, the real client tests/test_torchtitan.py trains, with what its pipeline and
# model modules import (triton too, installed only where none is: a CUDA torch brings its own); --no-deps, so
# pip never resolves torch. Its trainer's datasets, tokenizers and tensorboard are not needed.
TITAN_DEPS := torchtitan==0.3.0 spmd_types==0.3.1 tyro==1.0.17 docstring_parser==0.18.0 \
	torchdata==0.11.0
TRITON_SPEC := triton==3.9.0

SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -ec

.PHONY: all install install-test demo test soak gpu-check coverage bench clean

all: install

# One stamp per Python environment, the torch and pipecore it imports and the build's settings: `make install`
# does its work again only when one of those, the build files, a C++ source or the built library changed.
ENV_KEY_CMD = $(PYTHON) -c "import sys, os, hashlib, importlib.metadata as m; \
	found = [next(iter(m.distributions(name=n)), None) for n in ('torch', 'pipecore')]; \
	dists = [(d.version, d.read_text('direct_url.json')) if d else None for d in found]; \
	env = [os.environ.get(v) for v in ('PIPECORE_NO_CUDA', 'PIPECORE_DEBUG_INFO', 'PIPECORE_TESTING', 'PIPECORE_COVERAGE', 'CC', 'CXX', 'TORCH_CUDA_ARCH_LIST')]; \
	print(hashlib.sha1(repr((sys.prefix, dists, env, '$(TORCH_ASKED)')).encode()).hexdigest()[:12])"
ENV_KEY := $(shell $(ENV_KEY_CMD))
INSTALLED := build/installed-$(or $(ENV_KEY),unknown)
BUILD_INPUTS := Makefile setup.py pyproject.toml $(wildcard csrc/*.cpp csrc/*.h csrc/cuda/* csrc/testing/* pipecore/_C*.so)

install: $(INSTALLED)
	@echo "pipecore is installed for $(PYTHON)"

# pipecore in editable mode and its extension, compiled once: objects stay in build/obj-*, so an install
# after a change recompiles only what changed. A line per compiled file; the whole log in build/install.log.
$(INSTALLED): $(BUILD_INPUTS)
	@$(PYTHON) -c "import sys, sysconfig, os; \
		managed = sys.prefix == sys.base_prefix and os.path.exists(os.path.join(sysconfig.get_path('stdlib'), 'EXTERNALLY-MANAGED')); \
		sys.exit(managed)" || { echo "pipecore: $(PYTHON) is the system's Python, which pip may not change (PEP 668)." \
		"Make a virtual environment and use it:"; \
		echo "    python3 -m venv --system-site-packages .venv && make $(MAKECMDGOALS) PYTHON=.venv/bin/python"; exit 1; }
	@$(PIP) --version >/dev/null 2>&1 || { echo "pipecore: $(PYTHON) has no pip. Install it (Debian: apt-get install" \
		"python3-pip python3-venv) or use a virtual environment: python3 -m venv .venv && make $(MAKECMDGOALS)" \
		"PYTHON=.venv/bin/python"; exit 1; }
	$(PIP) install -q $(BUILD_DEPS) $(DEMO_DEPS)
	@if [ -n "$(TORCH_ASKED)" ]; then \
		echo "installing $(TORCH_ASKED) $(TORCH_PIP_ARGS) (pip keeps a torch that satisfies it)"; \
		$(PIP) install -q "$(TORCH_ASKED)" $(TORCH_PIP_ARGS); \
		$(PYTHON) -c "import torch; print('torch', torch.__version__)"; \
	elif $(PYTHON) -c "import torch" >/dev/null 2>&1; then :; else \
		echo "torch not importable; installing $(TORCH_SPEC) $(TORCH_PIP_ARGS)"; \
		$(PIP) install -q "$(TORCH_SPEC)" $(TORCH_PIP_ARGS); \
		$(PYTHON) -c "import torch"; \
	fi
	@mkdir -p build
	@touch build/build-started  # (a source changed while building makes the next make build again: below)
	@echo "building pipecore._C (log: build/install.log)"
	@start=$$(date +%s); \
	$(PIP) install -v --no-deps --no-build-isolation -e . 2>&1 | tee build/install.log | sed -un \
		-e 's|^ *\[\([0-9]*/[0-9]*\)\] .* -c [^ ]*\(csrc/[^ ]*\) -o .*|  [\1] compiled \2|p' \
		-e 's|^ *ninja: no work to do.*|  nothing to compile: every object is up to date|p' \
		-e 's|^ *\(.*-shared .* -o [^ ]*\(_C[^ /]*\.so\)\).*|  linked \2|p' \
		-e '/error:/p' \
		-e 's|^ *\(pipecore setup.py: no GPU is visible.*\)|  \1|p' \
		-e 's|^ *\(pipecore setup.py: the CUDA toolkit at.*\)|  \1|p' \
	| awk '!seen[$$0]++ { print; fflush() }' \
	|| { echo "pipecore: the build failed; the end of build/install.log:"; tail -n 40 build/install.log; exit 1; }; \
	echo "  done in $$(( $$(date +%s) - start )) s"
	$(PYTHON) -m pipecore.tools.build_check
	@rm -f $(INSTALLED)
	@$(PYTHON) -c "import sys, torch; print(f'Python {sys.version.split()[0]} at {sys.prefix}, torch {torch.__version__}')" \
		> build/installed-$$($(ENV_KEY_CMD))
	@if [ -n "$$(find csrc setup.py pyproject.toml Makefile -newer build/build-started -type f \
		\( -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.py' -o -name '*.toml' -o -name Makefile \) | head -n 1)" ]; then \
		rm -f build/installed-$$($(ENV_KEY_CMD)); echo "pipecore: sources changed during the build: the next make builds again"; fi

# the test variant of the extension (PIPECORE_TESTING: the executor's test hooks compiled in; its objects
# have their own build/obj-*-testing folder, so switching back and forth only links)
install-test:
	@PIPECORE_TESTING=1 $(MAKE) --no-print-directory install
	@$(PYTHON) -c "import pytest, hypothesis, nvtx, transformers; assert transformers.__version__.startswith('5.')" \
		2>/dev/null || $(PIP) install -q $(TEST_DEPS)
	@$(PYTHON) -c "import importlib.metadata as m; assert m.version('pytest-xdist') == '3.8.0'" 2>/dev/null \
		|| $(PIP) install -q --no-deps $(XDIST_DEPS)
	@$(PYTHON) -c "import triton" 2>/dev/null || $(PIP) install -q --no-deps $(TRITON_SPEC)
	@$(PYTHON) -c "import importlib.metadata as m; assert m.version('torchtitan') == '0.3.0'; \
		import torchtitan.distributed.pipeline_parallel" 2>/dev/null || $(PIP) install -q --no-deps $(TITAN_DEPS)

# pipeline-parallel training of a GPT on 4 CPU processes (torchrun), its timeline and a checkpoint
demo: install
	$(PYTHON) examples/train_gpt.py --ranks 4 --cpu --steps $(STEPS) --checkpoint-dir $(DEMO_DIR)/checkpoint \
		--timeline $(DEMO_DIR)/gpt_timeline.png

test: install-test
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist worksteal $(TESTS) $(TEST_ARGS)

# the generated configuration space at length (tests/config_space.py): SOAK_CONFIGS configurations drawn from a
# seed other than the suite's, each compared with one process; a failure is shrunk to a one-line reproducer.
# Then the searches the suite runs a part of (PIPECORE_SOAK=1, tests/soak.py) whole.
SOAK_CONFIGS ?= 5000
SOAK_SEED ?= 5858
soak: install-test
	CONFIG_SPACE_COUNT=$(SOAK_CONFIGS) CONFIG_SPACE_SEED=$(SOAK_SEED) $(PYTHON) -m pytest -q -rA \
		tests/test_config_space.py -k generated
	PIPECORE_SOAK=1 $(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist worksteal tests/test_device_syncs.py \
		tests/test_nccl_connections.py

# first contact with a GPU machine: the CUDA tests, probes, multi-GPU training and failure cases, a table in
# $(GPU_CHECK_OUT) (.ci/gpu_check.py; GPU_CHECK_ARGS=--cpu: its dry run on gloo). The build first, at most
# 5 minutes, its log kept there too.
GPU_CHECK_OUT ?= build/gpu-check
gpu-check:
	@mkdir -p $(GPU_CHECK_OUT)
	@echo "building the test variant (at most 5 min; log: $(GPU_CHECK_OUT)/build.log)"
	@timeout -k 10 300 $(MAKE) --no-print-directory install-test > $(GPU_CHECK_OUT)/build.log 2>&1 || { \
		echo "pipecore: the build failed or took over 5 minutes; the end of $(GPU_CHECK_OUT)/build.log:"; \
		tail -n 30 $(GPU_CHECK_OUT)/build.log; exit 1; }
	GPU_CHECK_OUT=$(GPU_CHECK_OUT) $(PYTHON) .ci/gpu_check.py $(GPU_CHECK_ARGS)

# gcov line coverage of the device path's code under the suite (or TEST_ARGS), in a build of its own
# (-O0 --coverage; `make test` relinks the usual one); the counts go to a temporary folder (GCOV_PREFIX),
# and .ci/coverage.py prints the table
coverage:
	@PIPECORE_COVERAGE=1 $(MAKE) --no-print-directory install-test
	@counts=$$(mktemp -d); trap 'rm -rf "$$counts"' EXIT; \
	GCOV_PREFIX=$$counts $(PYTHON) -m pytest -q tests $(TEST_ARGS); \
	$(PYTHON) .ci/coverage.py --counts $$counts

bench:
	$(PYTHON) bench/build.py

clean:
	rm -rf build *.egg-info pipecore.egg-info
	find pipecore -name '*.so' -type f -delete 2>/dev/null || true
