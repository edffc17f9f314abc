# Set-up and the two everyday commands. `make demo` and `make test` each build .venv on first use.
# TORCH is pinned here (the CPU build on the CI machines' local disk); the package itself needs only torch>=2.4.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test setup clean gpu

$(BIN)/weightcache: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

setup: $(BIN)/weightcache

demo: setup
	HF_HUB_OFFLINE=1 $(BIN)/weightcache demo

test: setup
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest

gpu:
	tests/gpu/run_gpu.sh out/gpu

clean:
	rm -rf $(VENV) build *.egg-info
