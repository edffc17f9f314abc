"""The engine suite: vLLM and SGLang's real code, in the engine venv (``make engine-venv``).

Where both engines import, their tests run here directly; elsewhere (the
project's own venv) only ``test_engine_venv.py`` is collected, and it runs
this suite in the engine venv as a subprocess, or skips saying how to make one.
"""

from __future__ import annotations

import importlib.util

ENGINES = ("vllm", "sglang")
ENGINES_HERE = all(importlib.util.find_spec(name) is not None for name in ENGINES)
ENGINE_TESTS = [
    "test_vllm.py",
    "test_sglang.py",
    "test_engine_hub_ids.py",
    "test_entry_points.py",
    "test_launched_engines.py",
    "test_one_identity.py",
    "test_launched_exit.py",
]

collect_ignore = ["test_engine_venv.py"] if ENGINES_HERE else ENGINE_TESTS

if ENGINES_HERE:
    from tests.engines import shims

    shims.install()  # before anything imports transformers or an engine

    import pytest

    from tests.engines.support import ENGINE_WARNINGS

    def pytest_configure(config):
        # Warnings raised inside the engines and their dependencies are theirs; ours stay errors.
        for line in ENGINE_WARNINGS:
            config.addinivalue_line("filterwarnings", line)

    @pytest.fixture(scope="session")
    def tiny_llama(tmp_path_factory):
        """A tiny random-weight Llama checkpoint (bf16 safetensors) written for this session."""
        from tests.engines.support import write_tiny_llama

        return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))

    @pytest.fixture(scope="session")
    def tiny_qwen3_moe(tmp_path_factory):
        """A tiny random-weight Qwen3-MoE checkpoint (4 experts, 2 per token)."""
        from tests.engines.support import write_tiny_model

        return write_tiny_model("qwen3_moe", tmp_path_factory.mktemp("tiny-qwen3-moe"))

    @pytest.fixture(scope="session")
    def tiny_deepseek_v3(tmp_path_factory):
        """A tiny random-weight DeepSeek-V3 checkpoint (MLA attention, a dense then a MoE layer)."""
        from tests.engines.support import write_tiny_model

        return write_tiny_model("deepseek_v3", tmp_path_factory.mktemp("tiny-deepseek-v3"))

    @pytest.fixture(scope="session")
    def tiny_fp8_block(tmp_path_factory):
        """A tiny block-FP8 Llama checkpoint: float8_e4m3fn weights with weight_scale_inv per 128x128 block."""
        from tests.engines.support import write_fp8_block, write_tiny_model

        source = write_tiny_model("llama_blocks", tmp_path_factory.mktemp("tiny-llama-blocks"))
        return write_fp8_block(source, tmp_path_factory.mktemp("tiny-fp8-block"))
