"""The ways a model reaches the server outside an engine, each in a process of its own: ``load_model`` and a trainer's
``publish_version`` (``weightcache load`` is the CLI itself).

    python -m tests.engines.identity_paths --adapter vllm|sglang --model DIR --socket-dir D --steps publish,... [--tp-size N]

Steps, in order, in one process: ``publish`` (``load_model`` in mode ``daemon``: loads and publishes when the server
holds no entry), ``attach`` (``load_model`` as a strict client: a miss raises), ``publish_version`` (every tensor of
the checkpoint as version 1, as a trainer publishes after a step). ``STEP@K`` runs the step for tensor-parallel rank
K of ``--tp-size`` (default: rank 0). One ``WCRESULT {json}`` line per step: ``step`` as given, ``source`` and
``digest``, ``version``, or ``error`` and ``message``.
"""

from __future__ import annotations

import argparse
import sys

from tests.engines.engine_child import emit

DTYPE = "bfloat16"
"""As the engines in tests/engines/entry_points.py load the models."""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--adapter", choices=("vllm", "sglang"), required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--socket-dir", required=True)
    parser.add_argument("--steps", required=True, help="comma-separated: publish, attach, publish_version")
    parser.add_argument("--state", help="publish_version: the checkpoint whose tensors are version 1 (default: --model)")
    parser.add_argument("--tp-size", type=int, default=1, help="the tensor-parallel size of the engine the ranks are for")
    args = parser.parse_args(argv)
    for step in args.steps.split(","):
        name, _, rank = step.partition("@")
        try:
            result = STEPS[name](args, parallel(args.tp_size, int(rank or 0)))
        except Exception as exc:  # the step's error is its result
            result = {"error": type(exc).__name__, "message": str(exc)}
        emit({"step": step, **result})
    return 0


def parallel(tp_size: int, tp_rank: int):
    from weightcache import ParallelSpec

    return ParallelSpec(tp_size=tp_size, tp_rank=tp_rank)


def load(args, parallel, mode: str) -> dict:
    from weightcache import load_model

    loaded = load_model(
        args.model,
        adapter=args.adapter,
        mode=mode,
        dtype=DTYPE,
        parallel=parallel,
        socket_dir=args.socket_dir,
        strict=mode == "client",
    )
    return {"source": loaded.source, "digest": loaded.attachment.digest if loaded.attachment is not None else None}


def trainer_version(args, parallel) -> dict:
    from tests.engines.entry_points import checkpoint_state
    from weightcache.refit import publish_version

    state = checkpoint_state(args.state or args.model)  # the whole model: the adapter shards it for the rank
    published = publish_version(
        args.model, state, 1, adapter=args.adapter, dtype=DTYPE, parallel=parallel, socket_dir=args.socket_dir
    )
    return {"version": published.version, "digest": published.digest}


STEPS = {
    "publish": lambda args, parallel: load(args, parallel, "daemon"),
    "attach": lambda args, parallel: load(args, parallel, "client"),
    "publish_version": trainer_version,
}


if __name__ == "__main__":
    sys.exit(main())
