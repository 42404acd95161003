# `make demo` and `make test` work on a fresh machine: they create .venv,
# install segcache into it (with an optimized BLAS where the system allows),
# and run.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-long bench compat blas redis clean mlx-lm-tests agents

demo: $(STAMP)
	$(VENV)/bin/segcache demo

test: $(STAMP) mlx-lm-tests agents
	$(PY) -m pytest tests

# The store's state machine for 5,000 programs (operations and damage), 2,000 fuzzed
# request bodies against a real server, 24 fork / commit / rollback programs per
# sharded model on two ranks (not 2), the two-rank server pipeline parallel too, and
# 200 json_schema requests per drafter (not 20), 220 runtime state-machine programs (not 110);
# minutes, not seconds.
test-long: $(STAMP)
	SEGCACHE_LONG=1 $(PY) -m pytest -q -p no:cacheprovider tests/test_store_state.py tests/test_serve_fuzz.py \
		--hypothesis-show-statistics
	SEGCACHE_LONG=1 $(PY) -m pytest -q -p no:cacheprovider tests/test_serve_sampling.py -k json_schema_requests
	SEGCACHE_LONG=1 $(PY) -m pytest -q -p no:cacheprovider tests/test_distributed.py -k "programs or slice"
	SEGCACHE_LONG=1 $(PY) -m pytest -q -p no:cacheprovider tests/test_distributed_serve.py -k pipeline
	SEGCACHE_LONG=1 $(PY) -m pytest -q -p no:cacheprovider tests/test_state_machine.py

# mlx-lm's own test files (tests/test_compat_mlx_lm.py runs its cache tests on
# segcache's layers). They are not in the wheel: fetched from the PyPI sdist of
# the installed version into a gitignored folder, never committed. Offline, the
# shim skips with the reason.
UPSTREAM := tests/.upstream
mlx-lm-tests: $(STAMP)
	@v=$$($(PY) -c "import importlib.metadata as m; print(m.version('mlx-lm'))"); \
	if [ -d $(UPSTREAM)/mlx_lm-$$v/tests ]; then exit 0; fi; \
	mkdir -p $(UPSTREAM) && \
	($(PY) -m pip download --quiet --no-deps --no-binary :all: "mlx-lm==$$v" -d $(UPSTREAM) \
	 && tar -xzf $(UPSTREAM)/mlx_lm-$$v.tar.gz -C $(UPSTREAM) mlx_lm-$$v/tests) \
	|| echo "mlx-lm-tests: could not fetch the mlx-lm $$v sdist; its cache tests will be skipped"

# docs/compatibility.md and README's table, from tests/test_families.py
compat: $(STAMP)
	$(PY) tools/compat_table.py

bench: $(STAMP)
	$(PY) bench/hotpath.py
	$(PY) bench/branch.py
	$(PY) bench/speculative.py
	$(PY) bench/apc.py
	$(PY) bench/serve.py

$(STAMP): pyproject.toml | blas redis
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

# redis-server for the remote-tier tests (tests/test_store_remote*.py start their own on a
# free port). Installed with apt where we can; elsewhere those tests skip, saying why.
redis:
	@if command -v redis-server >/dev/null 2>&1 || command -v valkey-server >/dev/null 2>&1; then \
		echo "redis: redis-server or valkey-server present"; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		echo "redis: installing redis-server with apt-get"; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null) \
			|| echo "redis: apt-get failed; the remote-tier tests will be skipped"; \
	else \
		echo "redis: cannot install redis-server here (no apt-get or not root; try brew install redis); the remote-tier tests will be skipped"; \
	fi

# The coding agents tests/test_agent_clients.py runs against segcache serve: Claude Code,
# Codex CLI and opencode from npm (where npm exists), aider in a venv of its own; never in .venv, never
# committed. A client that could not be installed is skipped by its test, saying why.
AGENTS := tests/.agents
AGENT_NPM := @anthropic-ai/claude-code@2.1.197 @openai/codex@0.171.0 opencode-ai@1.18.33
AGENT_AIDER := aider-chat==0.86.2
agents:
	@if [ -x $(AGENTS)/npm/node_modules/.bin/claude ] && [ -x $(AGENTS)/npm/node_modules/.bin/codex ] \
		&& [ -x $(AGENTS)/npm/node_modules/.bin/opencode ]; then \
		echo "agents: Claude Code, Codex CLI and opencode present"; \
	elif command -v npm >/dev/null 2>&1; then \
		echo "agents: installing $(AGENT_NPM) with npm into $(AGENTS)/npm"; \
		mkdir -p $(AGENTS)/npm && npm install --silent --no-audit --no-fund --prefix $(AGENTS)/npm $(AGENT_NPM) >/dev/null \
			|| echo "agents: npm install failed; the Claude Code, Codex CLI and opencode tests will be skipped"; \
	else \
		echo "agents: no npm here; the Claude Code, Codex CLI and opencode tests will be skipped"; \
	fi
	@if [ -x $(AGENTS)/aider/bin/aider ]; then \
		echo "agents: aider present"; \
	else \
		echo "agents: installing $(AGENT_AIDER) into its own venv $(AGENTS)/aider"; \
		($(PYTHON) -m venv $(AGENTS)/aider && $(AGENTS)/aider/bin/pip install --quiet $(AGENT_AIDER) >/dev/null) \
			|| echo "agents: installing aider failed; its test will be skipped"; \
	fi

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .hypothesis $(UPSTREAM) $(AGENTS)
