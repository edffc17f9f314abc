"""A trainer or an engine of a refit in a process of its own, that stops for good at a named step (the test SIGKILLs it).

Trainer: ``prepared`` -> ``staged`` (the version built in arenas, checksummed, not published) -> ``published``.
Engine: ``attached`` (version 0 mapped) -> ``fetched`` (the newest version mapped and verified beside it) ->
``switched``. Each step prints one JSON line (the engine's with the logits' checksum); at ``--stop`` it waits forever.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def _reached(step: str, stop: str, **data) -> None:
    print(json.dumps({"step": step, **data}), flush=True)
    if step == stop:
        while True:
            time.sleep(60)


def _logits_sum(model) -> float:
    from tests.core.test_refit import outputs

    return float(outputs(model).double().sum())


def trainer(args) -> None:
    from pathlib import Path

    from tests.core.test_refit import trained
    from weightcache.core.flow.loader import prepare
    from weightcache.core.refit import stage_version
    from weightcache.core.request import LoadRequest

    prepared = prepare(LoadRequest(model=args.model))
    state = trained(Path(args.model), args.version)
    _reached("prepared", args.stop)
    staged = stage_version(prepared, state, args.version, args.socket_dir)
    _reached("staged", args.stop)
    staged.publish()
    _reached("published", args.stop)


def engine(args) -> None:
    from weightcache.core.flow.modes import load_model

    loaded = load_model(args.model, mode="client", socket_dir=args.socket_dir, strict=True)
    attachment = loaded.attachment
    _reached("attached", args.stop, logits=_logits_sum(loaded.model))
    pending = attachment.fetch_version()
    _reached("fetched", args.stop)
    attachment.switch_to(pending)
    _reached("switched", args.stop, logits=_logits_sum(loaded.model))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=("trainer", "engine"))
    parser.add_argument("--model", required=True)
    parser.add_argument("--socket-dir", required=True)
    parser.add_argument("--stop", required=True)
    parser.add_argument("--version", type=int, default=1)
    args = parser.parse_args(argv)
    (trainer if args.role == "trainer" else engine)(args)


if __name__ == "__main__":
    main(sys.argv[1:])
