# Two commands set everything up on a fresh machine: `make demo` and `make test`.
# Both create .venv and (re)install the project when pyproject.toml changes.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck unit bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m commands.demo $(DEMO_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

# Whole modules go to one worker (`loadfile`), so a module's fixtures start once.
TEST_WORKERS ?= 3

test: lint typecheck
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python -m bench $(BENCH_ARGS)
	test -n "$(BENCH_ARGS)" || $(BIN)/python -m bench rollout
	test -n "$(BENCH_ARGS)" || $(BIN)/python -m bench classes
	test -n "$(BENCH_ARGS)" || $(BIN)/python -m bench cost

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
