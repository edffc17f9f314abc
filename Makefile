# Set-up and the two everyday commands. `make demo` and `make test` each build .venv on first use.
# TORCH is pinned here (the CPU build on the CI machines' local disk); the package itself needs only torch>=2.4.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin

# The engine test venv: vLLM and SGLang on CPU torch, for tests/engines (`make test` runs them there when it exists).
ENGINE_PYTHON ?= python3.11
ENGINE_VENV := .engine-venv
ENGINES ?= vllm==0.33.0 sglang==0.5.23

.PHONY: demo test lint typecheck setup clean gpu engine-venv

$(BIN)/weightcache: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

setup: $(BIN)/weightcache

demo: setup
	HF_HUB_OFFLINE=1 $(BIN)/weightcache demo

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# mypy needs the import names: a tree of symlinks gives core/, adapters/ and conformance/ theirs (pyproject's [tool.mypy]).
typecheck: setup
	mkdir -p $(VENV)/typecheck/weightcache
	for part in core adapters conformance; do ln -sfn ../../../$$part $(VENV)/typecheck/weightcache/$$part; done
	MYPYPATH=$(VENV)/typecheck $(BIN)/mypy -p weightcache.core -p weightcache.adapters -p weightcache.conformance

test: lint typecheck
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest

gpu:
	tests/gpu/run_gpu.sh out/gpu

# Engines and their dependencies with --no-deps (they would pull CUDA torch 2.14); see tests/engines/engine-venv.txt.
$(ENGINE_VENV)/.ready: pyproject.toml tests/engines/engine-venv.txt Makefile
	rm -rf $(ENGINE_VENV)
	$(ENGINE_PYTHON) -m venv $(ENGINE_VENV)
	$(ENGINE_VENV)/bin/python -m pip install -q --upgrade pip
	$(ENGINE_VENV)/bin/python -m pip install -q "$(TORCH)"
	$(ENGINE_VENV)/bin/python -m pip install -q --no-deps $(ENGINES)
	$(ENGINE_VENV)/bin/python -m pip install -q --no-deps -r tests/engines/engine-venv.txt
	$(ENGINE_VENV)/bin/python -m pip install -q --no-deps -e .
	# Every Python process of this venv applies tests/engines/shims.py before it imports an engine (the engines start
	# subprocesses of their own): a .pth file in its site-packages.
	$(ENGINE_VENV)/bin/python -m tests.engines.shims "$$($(ENGINE_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
	cd /tmp && $(CURDIR)/$(ENGINE_VENV)/bin/python -c "import vllm, sglang, weightcache.adapters.vllm.loader"
	touch $@

engine-venv: $(ENGINE_VENV)/.ready

clean:
	rm -rf $(VENV) $(ENGINE_VENV) build *.egg-info
