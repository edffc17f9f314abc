"""The checks of the engine scripts the GPU machine runs (tests/gpu/engine_llm.py, engine_pair.py), on the CPU: what
counts as identical tokens, one copy of the weights, a SIGKILL that changed nothing (issue 56)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
engine_llm = importlib.import_module("engine_llm")
engine_pair = importlib.import_module("engine_pair")

TOKENS = [[1, 2, 3], [4, 5]]
ENTRY = 16_416_505_856  # the 8 B's entry


def test_a_variant_without_tokens_is_never_identical():
    assert engine_llm.identical({"plain": {"tokens": TOKENS}, "daemon": {"tokens": TOKENS}, "client": {"error": "x"}}) == {
        "daemon": True,
        "client": False,
    }
    assert engine_llm.identical({"plain": {"error": "x"}, "daemon": {"error": "y"}}) == {"daemon": False}


def test_vllm_memory_lines_are_read():
    line = "(EngineCore pid=1904) INFO 12-05 21:48:35 [model_runner.py:428] Model loading took 0.36 GiB memory and 1.98 s"
    assert engine_pair.vllm_memory(line) == {"model_loading_gib": 0.36}
    kv = "(EngineCore pid=2443) INFO 12-05 21:49:47 [gpu_worker.py:772] Available KV cache memory: 26.86 GiB"
    assert engine_pair.vllm_memory(kv) == {"kv_cache_gib": 26.86}
    assert engine_pair.vllm_memory("INFO: Application startup complete.") == {}


def served(load_a: float | None = 0.0, load_b: float | None = 0.0, **overrides) -> dict:
    ready = lambda gib: {"event": "ready", "vllm": {} if gib is None else {"model_loading_gib": gib}}  # noqa: E731
    results = {
        "entry_bytes": ENTRY,
        "ready_A": ready(load_a),
        "ready_B": ready(load_b),
        "attached_pids": [11, 12],
        "tokens_both": [TOKENS, TOKENS],
        "tokens_after_kill": [TOKENS, TOKENS],
        "loop_during_kill": {"same": 40, "of": 40, "tokens": TOKENS},
        "alive_after_kill": [True, True],
        "gpu_server_only": {"used_mib": 15_700},
        "gpu_both_serving": {"used_mib": 31_000},
    }
    return results | overrides


def test_everything_holds_when_both_map_and_serve_through_the_kill():
    results = served()
    assert all(engine_pair.verdict(results, TOKENS).values())
    assert results["engines_added_bytes"] == (31_000 - 15_700) * 2**20


@pytest.mark.parametrize(
    ("results", "failed"),
    [
        (served(load_b=15.29), "one_copy"),  # engine B loaded the weights itself
        (served(load_a=None), "one_copy"),  # vLLM's figure was not seen: not shown, so not claimed
        (served(tokens_after_kill=[TOKENS, [[9]]]), "tokens_equal"),
        (served(loop_during_kill={"same": 39, "of": 40, "tokens": TOKENS}), "loop_unchanged"),
        (served(loop_during_kill={}), "loop_unchanged"),  # the loop never ran
        (served(attached_pids=[11]), "both_attached"),
        (served(alive_after_kill=[True, False]), "alive_after_kill"),
    ],
)
def test_each_check_fails_on_its_own(results, failed):
    verdict = engine_pair.verdict(results, TOKENS)
    assert [name for name, ok in verdict.items() if not ok] == [failed]


def test_without_a_plain_load_the_first_engine_is_the_reference():
    assert engine_pair.verdict(served(), None)["tokens_equal"]
    assert not engine_pair.verdict(served(tokens_both=[]), None)["tokens_equal"]
