# kvcache developer commands. `make run` and `make test` work on a fresh machine: they set up .venv first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PY := $(BIN)/python
STAMP := $(VENV)/.kvcache-setup

.DEFAULT_GOAL := help
.PHONY: help setup run test lint typecheck unit proto proto-check bench demo gpu-test clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'

setup: $(STAMP) ## create .venv and install kvcache[dev] (torch 2.13.0 CPU unless a torch is importable)

$(STAMP): pyproject.toml scripts/setup.sh
	@bash scripts/setup.sh "$(PYTHON)" "$(VENV)"
	@touch $@

test: setup lint typecheck unit ## ruff, mypy (core and client), pytest

lint: setup ## ruff
	@$(BIN)/ruff check --quiet . && echo "[lint] ruff: clean"

typecheck: setup ## mypy on cache_service/core and engine_client
	@$(BIN)/mypy --no-error-summary && echo "[typecheck] mypy: clean"

unit: setup ## pytest
	@$(BIN)/pytest -q

clean: ## remove .venv and caches
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
