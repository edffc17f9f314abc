"""A compiled forward kept beside a GPU entry and loaded in a fresh process (the CPU half: tests/core/test_compiled_forward.py).

Same checks on cuda:0 with bf16 weights: the restored forward equals the compiled one bit for bit, reads the weights
of the entry it is loaded for, and misses cleanly on other shapes, dtypes and torch versions.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from tests.core.test_compiled_forward import check_the_round_trip
from tests.helpers import run_python
from tests.models import save_random_model
from weightcache.core.arena.cuda import unavailable_reason

_REASON = unavailable_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"no CUDA GPU: {_REASON}")


def test_a_restored_forward_on_the_gpu_equals_the_compiled_one_and_reads_its_own_weights(server, tmp_path):
    models = [save_random_model("llama", tmp_path / f"llama-{seed}", dtype="bfloat16", seed=seed) for seed in (0, 1)]
    for model in models:  # published from a child: this process keeps no CUDA context
        run_python(
            "import sys; from weightcache.core.flow.loader import prepare, publish; from weightcache.core.request import LoadRequest;"
            "publish(prepare(LoadRequest(model=sys.argv[1], device='cuda:0')), sys.argv[2])",
            str(model),
            str(server.socket_dir),
        )
    published, restored = check_the_round_trip(server.socket_dir, *models, "cuda:0", tmp_path)
    print(
        f"\ncompile ahead {published['compile_s']:.2f} s; restore {restored['restore_s']:.2f} s ({published['published']} bytes)"
    )
