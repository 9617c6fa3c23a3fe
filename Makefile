# `make run` and `make test` set everything up on first use: a .venv, torch pinned to the CPU build
# (installed before the project so nothing pulls a CUDA build), then pdserve with its dev extras.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: install run generate test test-fast bench bench-compare model tools clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $@

install: $(VENV)/.installed

model: install
	$(BIN)/pdserve model pull
	$(BIN)/python -m shared.kernels.cpu_ext

run: install model
	$(BIN)/pdserve up

generate: install model
	$(BIN)/pdserve generate --chat --stats "What is the capital of France? Answer in one sentence."

# the system tools some tests drive: chromium (the dashboard, headless), promtool (the metrics
# format) and ip (iproute2: the played hosts' network namespaces); Debian packages, installed when
# missing and this is root on a Debian-like system. And kubectl (the kustomize overlays), into the
# virtualenv from npm's registry (scripts/get_kubectl.py: Debian's is too old)
APT_INSTALL = DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium prometheus iproute2 >/dev/null
tools: $(BIN)/kubectl
	@command -v chromium >/dev/null && command -v promtool >/dev/null && command -v ip >/dev/null || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	    { $(APT_INSTALL) || { apt-get update -q >/dev/null && $(APT_INSTALL); }; }; } || \
	  echo "make tools: chromium/promtool/ip missing and not installable here; their tests will say so"

$(BIN)/kubectl: | $(BIN)/python
	@$(BIN)/python scripts/get_kubectl.py $@ || echo "make tools: kubectl not installable here; the overlay tests will say so"

# the suite in TEST_JOBS processes (pytest-xdist, a test file to a process: its module's stack starts
# once), then alone the tests that time this machine (marked serial). Exit status 5 is pytest's "no
# test collected": a PYTEST_ARGS that names only one kind of test.
TEST_JOBS ?= 2
test: install model tools
	$(BIN)/python -m pytest -q -n $(TEST_JOBS) --dist loadfile -m "not serial" --durations=15 $(PYTEST_ARGS) || [ $$? = 5 ]
	$(BIN)/python -m pytest -q -m serial $(PYTEST_ARGS) || [ $$? = 5 ]

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

bench: install model
	$(BIN)/python benchmarks/bench_model.py

# pdserve (disaggregated, colocated, colocated without chunking) vs llama.cpp's llama-server, ~25 min;
# builds llama-server once from the llama-cpp-python sdist into ~/.cache/pdserve (~15 min)
bench-compare: install model
	PYTHON=$(BIN)/python benchmarks/build_llama_server.sh
	$(BIN)/python benchmarks/bench_compare.py

clean:
	rm -rf $(VENV) .pytest_cache
