PYTHON ?= python3
PIP := $(PYTHON) -m pip
# Installed only when no torch is importable; an existing torch (CPU or CUDA
# build, any version) is always kept. Never let pip resolve torch on its own.
TORCH_SPEC ?= torch==2.13.0
# setuptools and wheel: a fresh venv brings setuptools 65, which builds an editable install without
# build isolation only with the separate wheel package
DEV_DEPS := "setuptools>=70.1" wheel ninja pybind11 pytest hypothesis numpy matplotlib nvtx

.PHONY: all install demo test bench clean

all: install

install:
	@if $(PYTHON) -c "import torch" >/dev/null 2>&1; then \
		echo "torch already installed: $$($(PYTHON) -c 'import torch; print(torch.__version__)')"; \
	else \
		echo "torch not importable; installing $(TORCH_SPEC)"; \
		$(PIP) install -q "$(TORCH_SPEC)" || exit 1; \
		$(PYTHON) -c "import torch" || exit 1; \
	fi
	$(PIP) install -q $(DEV_DEPS)
	$(PIP) install -q --no-build-isolation -e .
	$(PYTHON) -m pipecore.build_check

# pipeline-parallel training of a GPT on 4 CPU processes (torchrun), a few minutes after install
demo: install
	$(PYTHON) examples/train_gpt.py --ranks 4 --steps 200 --checkpoint-dir build/demo-checkpoint \
		--timeline build/gpt_timeline.png

test: install
	$(PYTHON) -m pytest -q tests

bench:
	$(PYTHON) bench/build.py

clean:
	rm -rf build *.egg-info pipecore.egg-info
	find pipecore -name '*.so' -type f -delete 2>/dev/null || true
