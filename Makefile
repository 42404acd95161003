# `make demo` and `make test` work on a fresh machine: they create .venv,
# install segcache into it (with an optimized BLAS where the system allows),
# and run.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test bench compat blas clean

demo: $(STAMP)
	$(VENV)/bin/segcache demo

test: $(STAMP)
	$(PY) -m pytest tests

# docs/compatibility.md and README's table, from tests/test_families.py
compat: $(STAMP)
	$(PY) tools/compat_table.py

bench: $(STAMP)
	$(PY) bench/hotpath.py
	$(PY) bench/branch.py
	$(PY) bench/speculative.py
	$(PY) bench/apc.py

$(STAMP): pyproject.toml | blas
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# OpenBLAS speeds up mlx[cpu] 30-50x on Linux. Installed with apt where we
# can; skipped (with a note) elsewhere: macOS uses Accelerate.
blas:
	@if [ "$$(uname -s)" != "Linux" ]; then \
		echo "blas: not Linux, MLX uses the platform BLAS; nothing to install"; \
	elif ls /usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0 >/dev/null 2>&1; then \
		echo "blas: OpenBLAS present"; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		echo "blas: installing libopenblas0-pthread with apt-get"; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libopenblas0-pthread >/dev/null) \
			|| echo "blas: apt-get failed; continuing on the reference BLAS (slow)"; \
	else \
		echo "blas: cannot install OpenBLAS here (no apt-get or not root); continuing on the reference BLAS (slow)"; \
	fi

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .hypothesis
