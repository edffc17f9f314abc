"""A compiled forward beside an entry: compiled ahead of time in one fresh process, loaded without tracing in another.

Real server, real checkpoints (two Llamas of one architecture with other random
weights), real fresh processes with empty inductor and Triton caches. The
restored function must read the weights of the engine that loads it, never the
publisher's: put beside another entry, it gives that entry's outputs, equal bit
for bit to a ``torch.compile`` of that model. Keys and guards that do not match
(other shapes, dtypes, torch version) miss with one line and compile as usual.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from tests.helpers import run_python
from tests.models import save_random_model
from weightcache.core.flow.loader import prepare, publish
from weightcache.core.request import LoadRequest

_COMMON = """
import hashlib, json, logging, sys, time
import torch
from weightcache.core.client.client import Connection
from weightcache.core.flow.modes import load_model
from weightcache.core.spare import compiled_forward as cf

logging.basicConfig(level=logging.WARNING, format="LOG %(levelname)s %(message)s")
socket_dir, first_dir, second_dir, device = sys.argv[1:5]
first = load_model(first_dir, mode="client", device=device, socket_dir=socket_dir, strict=True)
ids = ((torch.arange(32).reshape(2, 16) * 31) % first.model.config.vocab_size).to(device)
inputs = {"input_ids": ids}
report = {}

def digest(output):
    return hashlib.sha256(output.logits.float().cpu().numpy().tobytes()).hexdigest()

def compiled_digest(model, inputs):
    with torch.inference_mode():
        return digest(torch.compile(model)(**inputs))

def log_mark():
    print("LOG MARK", file=sys.stderr, flush=True)
"""

_PUBLISH = (
    _COMMON
    + """
start = time.perf_counter()
forward = cf.compile_ahead(first.model, inputs)
report["compile_s"] = time.perf_counter() - start
report["ahead"] = forward.ahead
report["digest"] = digest(forward(**inputs))
report["compiled_digest"] = compiled_digest(first.model, inputs)
published = cf.publish_compiled(first, forward, strict=True)
report.update(published=published.nbytes, key=published.key)
print(json.dumps(report))
"""
)

_RESTORE = (
    _COMMON
    + """
second = load_model(second_dir, mode="client", device=device, socket_dir=socket_dir, strict=True)

start = time.perf_counter()
forward = cf.restore_compiled(first, inputs, strict=True)
report["restore_s"] = time.perf_counter() - start
report["origin"] = forward.origin
report["digest"] = digest(forward(**inputs))

# the bytes published with the first entry's weights, kept beside the second entry (same architecture, other weights)
with Connection(socket_dir, timeout=10) as conn:
    fd, size = conn.get_artifact(first.attachment.digest, cf.compiled_key(first, first.model, cf.signature_of(inputs), None))
    conn.put_artifact(second.attachment.digest, cf.compiled_key(second, second.model, cf.signature_of(inputs), None), fd)
on_second = cf.restore_compiled(second, inputs, strict=True)
report["second_digest"] = digest(on_second(**inputs))
report["second_compiled_digest"] = compiled_digest(second.model, inputs)
with torch.inference_mode():
    report["second_eager_digest"] = digest(second.model(**inputs))

# other shapes: another key, so nothing is found; compiled_forward then compiles as usual
short = {"input_ids": ids[:, :8]}
log_mark()
report["short_restored"] = cf.restore_compiled(first, short) is not None
# a call the guards refuse: one warning, then a plain torch.compile, whose outputs it gives
report["short_call_digest"] = digest(forward(**short))
report["short_call_digest_again"] = digest(forward(**short))
report["short_compiled_digest"] = compiled_digest(first.model, short)

# another dtype under a forged key: the guards refuse it when it is restored
as_int32 = {"input_ids": ids.to(torch.int32)}
with Connection(socket_dir, timeout=10) as conn:
    fd, size = conn.get_artifact(first.attachment.digest, cf.compiled_key(first, first.model, cf.signature_of(inputs), None))
    conn.put_artifact(first.attachment.digest, cf.compiled_key(first, first.model, cf.signature_of(as_int32), None), fd)
log_mark()
report["int32_restored"] = cf.restore_compiled(first, as_int32) is not None

# another torch version under a forged key: torch's own check refuses to load it
real_version, real_key = torch.__version__, cf.compiled_key(first, first.model, cf.signature_of(inputs), None)
torch.__version__ = "0.0.0+other"
other_key = cf.compiled_key(first, first.model, cf.signature_of(inputs), None)
assert "torch=0.0.0+other" in other_key
with Connection(socket_dir, timeout=10) as conn:
    fd, size = conn.get_artifact(first.attachment.digest, real_key)
    conn.put_artifact(first.attachment.digest, other_key, fd)
log_mark()
report["other_torch_restored"] = cf.restore_compiled(first, inputs) is not None
torch.__version__ = real_version
print(json.dumps(report))
"""
)

_FALLBACK = (
    _COMMON
    + """
del torch.compiler.load_compiled_function  # a torch without the ahead-of-time compile
log_mark()
forward = cf.compiled_forward(first, inputs)
again = cf.compiled_forward(first, inputs)
report.update(supported=cf.supported(), ahead=forward.ahead, origin=forward.origin, again=again.origin)
report["digest"] = digest(forward(**inputs))
report["compiled_digest"] = compiled_digest(first.model, inputs)
print(json.dumps(report))
"""
)


def _fresh_process(code: str, role: str, socket_dir, first, second, device: str, tmp_path) -> tuple[dict, list[list[str]]]:
    """Run ``code`` with empty inductor and Triton caches; its JSON report and its log lines, split at each mark."""
    caches = tmp_path / role
    env = {
        "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"),
        "TRITON_CACHE_DIR": str(caches / "triton"),
        "TORCHINDUCTOR_COMPILE_THREADS": "1",
    }
    assert not caches.exists()
    proc = run_python(code, str(socket_dir), str(first), str(second), device, env=env, timeout=900)
    sections: list[list[str]] = [[]]
    for line in proc.stderr.splitlines():
        if line == "LOG MARK":
            sections.append([])
        elif line.startswith("LOG WARNING weightcache:"):
            sections[-1].append(line)
    return json.loads(proc.stdout.strip().splitlines()[-1]), sections


def check_the_round_trip(socket_dir, first, second, device: str, tmp_path) -> tuple[dict, dict]:
    """Publish a compiled forward of ``first`` in one fresh process, restore it in another; every check of the module.

    Returns the two reports (compile and restore seconds among them).
    """
    published, publish_logs = _fresh_process(_PUBLISH, "publish", socket_dir, first, second, device, tmp_path)
    assert published["ahead"] and published["published"] > 0, (published, publish_logs)
    assert published["digest"] == published["compiled_digest"], "the ahead-of-time forward differs from torch.compile's"
    assert "torch.compile.aot;torch=" in published["key"] and ";inputs=" in published["key"] and ";model=" in published["key"]

    restored, logs = _fresh_process(_RESTORE, "restore", socket_dir, first, second, device, tmp_path)
    assert restored["origin"] == "restored"
    assert restored["digest"] == published["digest"], "the restored forward differs from the one published"
    assert restored["second_digest"] == restored["second_compiled_digest"], (
        "on the second entry the restored forward must give that entry's compiled outputs bit for bit"
    )
    assert restored["second_digest"] != restored["digest"], "the second entry's outputs are the first's: weights were baked in"
    assert restored["second_eager_digest"] != restored["digest"]
    _, shapes, dtype, version = logs
    assert restored["short_restored"] is False
    assert restored["short_call_digest"] == restored["short_call_digest_again"] == restored["short_compiled_digest"]
    assert len(shapes) == 1 and "guards refuse these inputs (input_ids:int64[2x8" in shapes[0], shapes
    assert restored["int32_restored"] is False
    assert len(dtype) == 1 and "refuses these inputs (input_ids:int32[2x16" in dtype[0], dtype
    assert restored["other_torch_restored"] is False
    assert len(version) == 1 and "does not load here" in version[0] and "PyTorch version" in version[0], version
    return published, restored


@pytest.fixture
def two_entries(server, model_dir, tmp_path):
    """Two cached Llamas of one architecture with other random weights."""
    first = model_dir("llama")
    second = save_random_model("llama", tmp_path / "second", seed=1)
    for model in (first, second):
        publish(prepare(LoadRequest(model=str(model))), server.socket_dir)
    return first, second


def test_a_restored_forward_reads_the_loading_engines_weights_and_misses_cleanly(server, two_entries, tmp_path, record_property):
    published, restored = check_the_round_trip(server.socket_dir, *two_entries, "cpu", tmp_path)
    record_property("aot_compile_s", round(published["compile_s"], 2))
    record_property("aot_restore_s", round(restored["restore_s"], 2))


def test_a_torch_without_the_ahead_of_time_compile_keeps_the_cache_artifacts_instead(server, two_entries, tmp_path):
    report, logs = _fresh_process(_FALLBACK, "fallback", server.socket_dir, *two_entries, "cpu", tmp_path)
    assert report["supported"] is False and report["ahead"] is False
    assert (report["origin"], report["again"]) == ("compiled", "restored"), "the second call restores the artifacts"
    assert report["digest"] == report["compiled_digest"]
    fallback = [line for line in logs[1] if "no ahead-of-time compile" in line]
    assert len(fallback) == 1, logs


_GRAPH_BREAK = """
import json, logging, torch
from weightcache.core.spare.compiled_forward import compile_ahead

logging.basicConfig(level=logging.WARNING, format="LOG %(levelname)s %(message)s")

class Breaks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.linear(x)
        torch._dynamo.graph_break()
        return y * 2

model = Breaks().eval()
x = torch.arange(16, dtype=torch.float32).reshape(2, 8)
forward = compile_ahead(model, {"x": x})
with torch.inference_mode():
    expected = model(x)
print(json.dumps({"ahead": forward.ahead, "close": bool(torch.allclose(forward(x=x), expected))}))
"""


def test_a_model_that_does_not_compile_as_one_graph_compiles_as_usual_with_one_warning(tmp_path):
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    proc = run_python(_GRAPH_BREAK, env=env, timeout=600)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report == {"ahead": False, "close": True}, report
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("LOG WARNING weightcache:")]
    assert len(warnings) == 1 and "Breaks cannot be compiled ahead of time" in warnings[0], warnings


# A model in the fashion of transformers with the ``kernels`` package (5.25 and later): a function wrapped in a module
# of a class made inside a function, called through a global instance and through a per-module copy kept in a dict.
_WRAPPED_MODEL = """
import torch


def _wrap(function):
    class Func(torch.nn.Module):
        def forward(self, *args):
            return function(*args)

    return Func()


def _scale(x, factor=2):
    return x * factor


scale = _wrap(_scale)


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(8, 8)
        self._wrappers = {"scale": type(scale)()}

    def forward(self, x):
        return self._wrappers["scale"](self.linear(x)) + scale(x)
"""

_WRAPPED_ROUND_TRIP = """
import hashlib, json, logging, sys, torch
sys.path.insert(0, sys.argv[1])
from wrapped import Block
from weightcache.core.spare import compiled_forward as cf

logging.basicConfig(level=logging.WARNING, format="LOG %(levelname)s %(message)s")
model = Block().eval()
x = torch.arange(16, dtype=torch.float32).reshape(2, 8)
with torch.inference_mode():
    eager = model(x)
if sys.argv[2] == "publish":
    forward = cf.compile_ahead(model, {"x": x})
    output = forward(x=x)
    with open(sys.argv[3], "wb") as kept:
        kept.write(cf._pack(forward))
else:
    with open(sys.argv[3], "rb") as kept:
        forward = cf._unpack(kept.read(), model, cf.signature_of({"x": x}), None)
    output = forward(x=x)
print(json.dumps({"ahead": forward.ahead, "digest": hashlib.sha256(output.numpy().tobytes()).hexdigest(),
                  "close": bool(torch.allclose(output, eager)), "model": cf.model_digest(model)}))
"""


def test_a_model_calling_a_module_of_a_class_made_in_a_function_compiles_ahead_and_restores(tmp_path):
    """Torch cannot rebuild such an object in another process: the guards on it are left out, not the whole compile
    (transformers 5.25 with ``kernels`` wraps ``apply_rotary_pos_emb`` so, and every Llama fell back)."""
    (tmp_path / "wrapped.py").write_text(_WRAPPED_MODEL)
    kept = tmp_path / "forward.aot"
    reports, logs = [], []
    for role in ("publish", "restore"):
        env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / role), "TORCHINDUCTOR_COMPILE_THREADS": "1"}
        proc = run_python(_WRAPPED_ROUND_TRIP, str(tmp_path), role, str(kept), env=env, timeout=600)
        reports.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        logs += [line for line in proc.stderr.splitlines() if line.startswith("LOG WARNING weightcache:")]
    published, restored = reports
    assert published["ahead"] and restored["ahead"], logs
    assert not logs, logs
    assert published["close"] and restored["digest"] == published["digest"]
    assert restored["model"] == published["model"]


def test_the_model_digest_follows_the_code_of_its_classes_and_forwards_set_on_instances(tmp_path, monkeypatch):
    """Another release of the model's code, or a forward replaced on an instance (``kernels.kernelize``), is another key:
    the guards standing for them are the ones torch cannot keep."""
    import importlib
    import sys

    from weightcache.core.spare.compiled_forward import model_digest

    monkeypatch.syspath_prepend(str(tmp_path))
    source = tmp_path / "wrapped.py"
    source.write_text(_WRAPPED_MODEL)
    model = importlib.import_module("wrapped").Block()
    try:
        first = model_digest(model)
        assert model_digest(model) == first
        source.write_text(_WRAPPED_MODEL.replace("factor=2", "factor=3"))
        patched = model_digest(model)
        assert patched != first, "other code under the same class names kept the key"
        model._wrappers["scale"].forward = lambda *args: args[0]
        assert model_digest(model) != patched, "a kernelized wrapper kept the key"
        del model._wrappers["scale"].forward
        model.linear.forward = textwrap.dedent  # any callable set on the instance
        assert model_digest(model) != patched
    finally:
        sys.modules.pop("wrapped", None)
