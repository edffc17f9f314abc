"""Where a rebind of many tensors spends its time on this machine, in torch's and Python's own steps (issue 21).

    python benchmarks/rebind_parts.py --tensors 200000 --repeat 5

A rebind of N flat records (``attach.py --no-disk``'s case) is, per record, a handful of object operations that no
weightcache code sits between: make a view (``unbind`` below autograd, as ``views.table_bindings`` does), give it the
Parameter class, read the skeleton's meta Parameter's shape, put the new Parameter in the module's dict, free the meta
one. This times each of them alone, over N, on CPU tensors, so that two machines can be compared step by step (the
H200 host ran rebind 1.5x slower than this project's VM while its pure-Python manifest build ran as fast).
"""

from __future__ import annotations

import argparse
import collections
import gc
import itertools
import operator
import statistics
import sys
import time


def once(tensors: int) -> dict[str, float]:
    import torch

    Parameter = torch.nn.Parameter
    with torch.device("meta"):
        slots = {f"p{n}": Parameter(torch.empty(64, dtype=torch.uint8), requires_grad=False) for n in range(tensors)}
    base = torch.empty(tensors * 64, dtype=torch.uint8)
    times: dict[str, float] = {}

    def timed(step: str, work):
        start = time.perf_counter()
        result = work()
        times[step] = (time.perf_counter() - start) * 1e3
        return result

    gc.disable()
    try:
        with torch._C._AutoDispatchBelowADInplaceOrView():
            made = timed("unbind", lambda: list(base.view(tensors, 64).unbind(0)))
        timed(
            "class",
            lambda: collections.deque(map(setattr, made, itertools.repeat("__class__"), itertools.repeat(Parameter)), maxlen=0),
        )
        keys = list(slots)
        olds = timed("values", lambda: list(slots.values()))
        timed("types", lambda: set(map(type, olds)))
        shapes = timed("shapes", lambda: list(map(operator.attrgetter("shape"), olds)))
        made_shapes = [torch.Size([64])] * tensors
        timed("compare", lambda: shapes == made_shapes)
        timed("free shapes", lambda: shapes.clear())
        timed("update", lambda: slots.update(zip(keys, made, strict=True)))
        timed("free meta", lambda: olds.clear())
        timed("free made", lambda: (slots.clear(), made.clear()))
    finally:
        gc.enable()
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tensors", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    import torch

    runs = [once(args.tensors) for _ in range(args.repeat)]
    print(f"{args.tensors:,} records, torch {torch.__version__}, Python {sys.version.split()[0]}, median of {args.repeat}")
    print("| step | ms | µs a record |\n|---|---|---|")
    total = 0.0
    for step in runs[0]:
        median = statistics.median(run[step] for run in runs)
        total += median
        print(f"| {step} | {median:.1f} | {median * 1e3 / args.tensors:.3f} |")
    print(f"| all | {total:.1f} | {total * 1e3 / args.tensors:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
