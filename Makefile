# Two commands on a fresh machine: `make demo` and `make test`. Each creates .venv if missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
LINT := $(wildcard src tests benchmarks examples tools)

.PHONY: demo test test-full test-slow fuzz lint format bench bench-quick docs clean venv

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[test,examples]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m memsafe.demo
	$(BIN)/python -m benchmarks.headline

test: $(STAMP)
	$(BIN)/ruff check $(LINT)
	$(BIN)/ruff format --check $(LINT)
	$(BIN)/python -m pytest -n 2 -q

# Every test, the slow ones included, with every property test's and fuzz seed's full count.
test-full: $(STAMP)
	MEMSAFE_FULL_TESTS=1 $(BIN)/python -m pytest -n 2 -q -m "" --timeout=3600

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow --timeout=3600

# Differential fuzzing: random programs under memsafe.jit against jax.jit (tests/fuzz/); a table
# per op family, fuzz-report.json, and a non-zero exit on any wrong answer, footprint over the
# limit or crash (a case past --case-timeout, 300 s, is killed and counted as a timeout).
# 2,000 programs take about an hour on 2 cores. FUZZ_ARGS="--seed 5000" to change the run; FUZZ_ARGS="--seeds 4,23" or
# FUZZ_ARGS="--seeds-from fuzz-report.json --outcomes refused,timeout" to rerun chosen seeds.
FUZZ_ARGS ?=
fuzz: $(STAMP)
	$(BIN)/python -m tests.fuzz --budget 5400 --cases 2000 --jobs 2 --quiet $(FUZZ_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check $(LINT)

format: $(STAMP)
	$(BIN)/ruff format $(LINT)
	$(BIN)/ruff check --fix $(LINT)

bench-quick: $(STAMP)
	$(BIN)/python -m pip install -q -e ".[bench]"
	$(BIN)/python -m benchmarks.run --size quick

bench: $(STAMP)
	$(BIN)/python -m pip install -q -e ".[bench]"
	$(BIN)/python -m benchmarks.run --size full

# The documentation site (mkdocs-material, mkdocstrings, tutorials executed at build time) into
# site/; warnings are errors.
docs: $(STAMP)
	$(BIN)/python -m pip install -q -e ".[docs]"
	$(BIN)/mkdocs build --strict -d site

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis fuzz-report.json site
