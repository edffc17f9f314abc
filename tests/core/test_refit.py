"""Refit through real processes and a real server: a version published from a state dict, engines switching in place,
logits equal to a fresh disk load of that version, old versions freed, layouts and budgets enforced."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tests.helpers import assert_tensors_equal, wait_until
from weightcache.core.client.client import Connection
from weightcache.core.errors import LayoutMismatch, ServerError, VersionNotFound
from weightcache.core.flow.loader import prepare, publish
from weightcache.core.flow.modes import load_model
from weightcache.core.refit import publish_version
from weightcache.core.request import LoadRequest


def outputs(model):
    import torch

    device = next(model.parameters()).device
    input_ids = (torch.arange(32, dtype=torch.long, device=device).reshape(2, 16) * 31) % model.config.vocab_size
    with torch.no_grad():
        return model(input_ids=input_ids)[0]


def trained(path, step: int) -> dict:
    """The checkpoint's state dict after a made-up training step ``step`` (every floating tensor moved a little)."""
    import torch
    from safetensors.torch import load_file

    state = {}
    for file in sorted(path.glob("*.safetensors")):
        state.update(load_file(str(file)))
    generator = torch.Generator().manual_seed(step)
    return {
        name: (t + 0.01 * torch.randn(t.shape, generator=generator).to(t.dtype)) if t.dtype.is_floating_point else t
        for name, t in state.items()
    }


def saved(path, state: dict, directory):
    """A checkpoint directory holding ``path``'s configs and ``state``: what a fresh disk load of the version reads."""
    from safetensors.torch import save_file

    directory.mkdir()
    for file in path.iterdir():
        if not file.name.endswith(".safetensors") and not file.name.endswith(".json.index") and file.is_file():
            shutil.copy(file, directory / file.name)
    (directory / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file(
        {name: t.contiguous() for name, t in state.items()}, str(directory / "model.safetensors"), metadata={"format": "pt"}
    )
    return directory


def pointers(model) -> dict:
    return {name: t.data_ptr() for name, t in model.state_dict().items()}


@pytest.mark.parametrize(
    "kind,dtype,quantization",
    [("llama", "float32", None), ("qwen2", "bfloat16", None), ("llama", "float32", "fp8-block"), ("bert", "float32", None)],
)
def test_a_version_from_memory_switches_in_place_and_equals_a_fresh_disk_load(
    server, model_dir, tmp_path, kind, dtype, quantization
):
    path = model_dir(kind, dtype, kind == "qwen2")
    publish(prepare(LoadRequest(model=str(path), quantization=quantization)), server.socket_dir)
    engine = load_model(str(path), mode="client", socket_dir=server.socket_dir, strict=True, quantization=quantization)
    try:
        before, was = pointers(engine.model), outputs(engine.model)
        state = trained(path, 1)
        published = publish_version(str(path), state, 1, socket_dir=server.socket_dir, quantization=quantization)
        assert published.created and published.fingerprint.version == 1
        assert_tensors_equal("logits before the switch", outputs(engine.model), was)  # nothing changes until it switches
        assert engine.refit() is True and engine.version == 1
        assert pointers(engine.model) == before, "a tensor moved"
        fresh = load_model(str(saved(path, state, tmp_path / "v1")), mode="off", quantization=quantization)
        for name, tensor in fresh.model.state_dict().items():
            assert_tensors_equal(name, engine.model.state_dict()[name], tensor)
        assert_tensors_equal("logits on version 1", outputs(engine.model), outputs(fresh.model))
        assert engine.refit() is False  # the newest already
        with Connection(server.socket_dir) as connection:
            held = [row.version for row in connection.versions(published.fingerprint.lineage)]
        assert held == [0, 1], held
    finally:
        engine.close()


def test_the_old_version_is_freed_once_no_engine_maps_it(server, model_dir):
    path = model_dir("llama")
    publish(prepare(LoadRequest(model=str(path))), server.socket_dir)
    first = load_model(str(path), mode="client", socket_dir=server.socket_dir, strict=True)
    second = load_model(str(path), mode="client", socket_dir=server.socket_dir, strict=True)
    try:
        lineage = first.fingerprint.lineage
        publish_version(str(path), trained(path, 1), 1, socket_dir=server.socket_dir)
        assert first.refit() and second.refit()
        publish_version(str(path), trained(path, 2), 2, socket_dir=server.socket_dir)
        with Connection(server.socket_dir) as connection:
            assert [row.version for row in connection.versions(lineage)] == [0, 1, 2]  # both engines still map 1
        assert first.refit(2)
        with Connection(server.socket_dir) as connection:
            assert [row.version for row in connection.versions(lineage)] == [0, 1, 2]  # the second still maps 1
        assert second.refit()
        with Connection(server.socket_dir) as connection:  # the server frees version 1 as it sees the old session close
            assert wait_until(lambda: [row.version for row in connection.versions(lineage)] == [0, 2])
            assert connection.status()["metrics"]["evictions"]["superseded"] == 1
        assert_tensors_equal("logits", outputs(first.model), outputs(second.model))
    finally:
        first.close()
        second.close()


def test_the_collector_waits_while_a_version_is_built_fetched_and_switched_to(server, model_dir):
    """A full pass of the collector over a trainer's or an engine's heap takes longer than a whole refit on a GPU: the
    collector waits until the version is staged, fetched and switched to (collections are forced between)."""
    import gc
    import sys

    path = model_dir("llama")
    publish(prepare(LoadRequest(model=str(path))), server.socket_dir)
    engine = load_model(str(path), mode="client", socket_dir=server.socket_dir, strict=True)
    watched = {"stage_version", "fetch_version", "switch_to"}
    inside: list[str] = []
    outside = []

    def seen(phase, info):
        if phase != "start":
            return
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_name not in watched:
            frame = frame.f_back
        (outside if frame is None else inside).append(frame and frame.f_code.co_name)

    thresholds = gc.get_threshold()
    gc.callbacks.append(seen)
    gc.set_threshold(1, 10**6, 10**6)  # young collections only, at every allocation wherever the collector may run
    try:
        publish_version(str(path), trained(path, 1), 1, socket_dir=server.socket_dir)
        assert engine.refit() is True and engine.version == 1
    finally:
        gc.set_threshold(*thresholds)
        gc.callbacks.remove(seen)
        engine.close()
    assert outside, "the collector never ran: the test shows nothing"
    assert inside == [], f"collections ran inside {sorted(set(inside))}"


def test_a_version_whose_layout_differs_is_refused_before_anything_changes(server, model_dir):
    import torch

    path = model_dir("llama")
    publish(prepare(LoadRequest(model=str(path))), server.socket_dir)
    state = trained(path, 1)
    name = "model.layers.0.mlp.up_proj.weight"
    cases = {
        "shape": ({**state, name: state[name][:-1]}, f"tensor '{name}' has shape"),
        "dtype": ({**state, name: state[name].to(torch.float16)}, f"tensor '{name}' has dtype float16 instead of float32"),
        "extra": ({**state, "model.extra.weight": state[name]}, "tensor 'model.extra.weight' is not in the checkpoint"),
        "missing": ({k: v for k, v in state.items() if k != name}, f"tensor '{name}' is missing"),
    }
    for case, (bad, message) in cases.items():
        with pytest.raises(LayoutMismatch, match=message) as caught:
            publish_version(str(path), bad, 1, socket_dir=server.socket_dir)
        assert "\n" not in str(caught.value), case
    with Connection(server.socket_dir) as connection:
        assert len(connection.status()["entries"]) == 1


def test_versions_are_ordered_and_need_the_model_published_first(server, model_dir):
    path = model_dir("llama")
    with pytest.raises(VersionNotFound, match="publish the model from disk first"):
        publish_version(str(path), trained(path, 1), 1, socket_dir=server.socket_dir)
    publish(prepare(LoadRequest(model=str(path))), server.socket_dir)
    publish_version(str(path), trained(path, 1), 1, socket_dir=server.socket_dir)
    with pytest.raises(ValueError, match="not newer than version 1"):
        publish_version(str(path), trained(path, 2), 1, socket_dir=server.socket_dir)
    engine = load_model(str(path), mode="client", socket_dir=server.socket_dir, strict=True)
    try:
        with pytest.raises(VersionNotFound, match=r"no version 5 of model .* \(it holds \[0, 1\]\)"):
            engine.refit(5)
        assert engine.version == 0
    finally:
        engine.close()


def test_budgets_count_both_versions_while_one_replaces_the_other(server, model_dir):
    from weightcache.core.server.server_process import ServerProcess

    path = model_dir("llama")
    size = publish(prepare(LoadRequest(model=str(path))), server.socket_dir).manifest.nbytes
    tight = ServerProcess.start(None, "--byte-budget", str(size * 3 // 2))  # one version and a half
    try:
        publish(prepare(LoadRequest(model=str(path))), tight.socket_dir)
        engine = load_model(str(path), mode="client", socket_dir=tight.socket_dir, strict=True)
        with pytest.raises(ServerError, match="do not fit the server's budget") as caught:
            publish_version(str(path), trained(path, 1), 1, socket_dir=tight.socket_dir)
        assert caught.value.code == "over_budget"
        engine.close()  # version 0 is attached by nobody now: it makes room
        assert publish_version(str(path), trained(path, 1), 1, socket_dir=tight.socket_dir).created
    finally:
        tight.close()


class Child:
    """tests/core/refit_child.py in a process of its own, read step by step and SIGKILLed at its stop."""

    def __init__(self, role: str, path, socket_dir, stop: str, version: int = 1):
        import subprocess
        import sys

        from tests import zygote

        args = [sys.executable, "-m", "tests.core.refit_child", role, "--model", str(path), "--socket-dir", str(socket_dir)]
        args += ["--stop", stop, "--version", str(version)]
        self.proc = zygote.popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.steps: dict[str, dict] = {}
        while stop not in self.steps:
            line = self.proc.stdout.readline()
            if not line:
                raise AssertionError(f"{role} exited ({self.proc.wait()}): {self.proc.stderr.read()[-3000:]}")
            step = json.loads(line)
            self.steps[step["step"]] = step

    def kill(self) -> None:
        import signal

        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        self.proc.stdout.close()
        self.proc.stderr.close()


def held_versions(socket_dir, lineage) -> list[int]:
    with Connection(socket_dir) as connection:
        return [row.version for row in connection.versions(lineage)]


@pytest.mark.parametrize("stop", ["prepared", "staged", "published"])
def test_a_trainer_killed_at_each_step_leaves_the_server_and_engines_consistent(server, model_dir, tmp_path, stop):
    path = model_dir("llama")
    publish(prepare(LoadRequest(model=str(path))), server.socket_dir)
    engine = load_model(str(path), mode="client", socket_dir=server.socket_dir, strict=True)
    try:
        was = outputs(engine.model)
        Child("trainer", path, server.socket_dir, stop).kill()
        lineage = engine.fingerprint.lineage
        assert held_versions(server.socket_dir, lineage) == ([0, 1] if stop == "published" else [0])
        assert_tensors_equal("logits of the running engine", outputs(engine.model), was)
        if stop != "published":  # nothing of the dead trainer's version is held: publish it again
            publish_version(str(path), trained(path, 1), 1, socket_dir=server.socket_dir)
        assert engine.refit()
        fresh = load_model(str(saved(path, trained(path, 1), tmp_path / "v1")), mode="off")
        assert_tensors_equal("logits on version 1", outputs(engine.model), outputs(fresh.model))
    finally:
        engine.close()


@pytest.mark.parametrize("stop", ["attached", "fetched", "switched"])
def test_an_engine_killed_at_each_step_leaves_the_server_and_other_engines_consistent(server, model_dir, stop):
    path = model_dir("llama")
    publish(prepare(LoadRequest(model=str(path))), server.socket_dir)
    other = load_model(str(path), mode="client", socket_dir=server.socket_dir, strict=True)
    try:
        lineage = other.fingerprint.lineage
        publish_version(str(path), trained(path, 1), 1, socket_dir=server.socket_dir)
        child = Child("engine", path, server.socket_dir, stop)
        child.kill()
        assert wait_until(lambda: _attached_pids(server.socket_dir) == {os.getpid()}), "the dead engine's sessions stayed"
        assert held_versions(server.socket_dir, lineage) == [0, 1]
        assert other.refit() and other.version == 1
        if stop == "switched":
            assert float(outputs(other.model).double().sum()) == child.steps["switched"]["logits"]
        publish_version(str(path), trained(path, 2), 2, socket_dir=server.socket_dir)
        assert other.refit()
        assert wait_until(lambda: held_versions(server.socket_dir, lineage) == [0, 2])  # 1 is mapped by nobody now
    finally:
        other.close()


def _attached_pids(socket_dir) -> set[int]:
    with Connection(socket_dir) as connection:
        return {pid for row in connection.status()["entries"] for pid in row["attached_pids"]}


def test_compiled_code_runs_the_new_version_without_recompiling(server, model_dir, tmp_path):
    """torch.compile (dynamo and AOT autograd, which lift the parameters into the graph's inputs) keeps running after a
    switch: no guard fails, and the outputs are the new version's (inductor's own code generation takes minutes on
    the test machine; the GPU test checks a CUDA graph)."""
    import torch
    from torch._dynamo.utils import counters

    path = model_dir("llama")
    publish(prepare(LoadRequest(model=str(path))), server.socket_dir)
    engine = load_model(str(path), mode="client", socket_dir=server.socket_dir, strict=True)
    try:
        torch._dynamo.reset()
        compiled = torch.compile(engine.model, backend="aot_eager")
        was = outputs(compiled)
        graphs = counters["stats"]["unique_graphs"]
        state = trained(path, 1)
        publish_version(str(path), state, 1, socket_dir=server.socket_dir)
        assert engine.refit()
        with torch._dynamo.config.patch(error_on_recompile=True):
            now = outputs(compiled)
        assert counters["stats"]["unique_graphs"] == graphs, "the switch made dynamo compile again"
        fresh = load_model(str(saved(path, state, tmp_path / "v1")), mode="off")
        assert_tensors_equal("compiled logits on version 1", now, outputs(fresh.model))
        assert not torch.equal(now, was)
    finally:
        torch._dynamo.reset()
        engine.close()


def test_a_switch_that_fails_halfway_leaves_the_engine_on_its_old_version(server, model_dir):
    """An arena that cannot take the new memory (here: the fetched version's second arena, closed) makes the switch
    map the old memory back under the arenas switched already: the engine never runs on a mix of versions."""
    path = model_dir("llama")
    publish(prepare(LoadRequest(model=str(path))), server.socket_dir, chunk_bytes=64 << 10)  # several arenas
    engine = load_model(str(path), mode="client", socket_dir=server.socket_dir, strict=True)
    try:
        assert len(engine.attachment.arenas) > 2
        before, was = pointers(engine.model), outputs(engine.model)
        publish_version(str(path), trained(path, 1), 1, socket_dir=server.socket_dir)
        pending = engine.attachment.fetch_version()
        pending.arenas[1].close()
        with pytest.raises(ValueError, match="arena is closed"):
            engine.attachment.switch_to(pending)
        pending.close()
        assert engine.version == 0 and pointers(engine.model) == before
        assert_tensors_equal("logits after the failed switch", outputs(engine.model), was)
        assert engine.refit() and engine.version == 1  # a later switch still works
    finally:
        engine.close()
