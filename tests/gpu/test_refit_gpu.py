"""Refit on a GPU: CUDA arenas take another allocation's memory under the same reserved range, CUDA graphs captured on
version v replay version v+1, and the switched model equals a fresh load of v+1 bit for bit (skipped without a GPU)."""

from __future__ import annotations

import os

import pytest

from tests.helpers import assert_tensors_equal

torch = pytest.importorskip("torch")

from weightcache.core.arena.cuda import unavailable_reason  # noqa: E402

_reason = unavailable_reason()
pytestmark = pytest.mark.skipif(_reason is not None, reason=f"no CUDA GPU: {_reason}")

DEVICE = "cuda:0"


def test_a_cuda_arena_takes_another_arenas_memory_and_a_captured_graph_replays_it():
    from weightcache.core.arena.cuda import CudaArenaBackend

    backend = CudaArenaBackend()
    size = 4096 * 4096 * 2
    made = [backend.create(size, DEVICE) for _ in range(2)]
    weights = [torch.randn(4096, 4096, device=DEVICE, dtype=torch.bfloat16) for _ in made]
    for arena, weight in zip(made, weights, strict=True):
        arena.bytes_view()[: weight.numel() * 2].view(torch.bfloat16).view(4096, 4096).copy_(weight)
        backend.seal(arena)
    fds = [arena.export_fd() for arena in made]
    mapped = [backend.map(fd, arena.spec) for fd, arena in zip(fds, made, strict=True)]
    try:
        w = mapped[0].bytes_view()[:size].view(torch.bfloat16).view(4096, 4096)
        address = w.data_ptr()
        x = torch.randn(8, 4096, device=DEVICE, dtype=torch.bfloat16)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            y = x @ w
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                y = x @ w
        graph.replay()
        torch.cuda.synchronize()
        assert_tensors_equal("graph on the first arena", y, x @ weights[0])
        mapped[0].take_memory_of(mapped[1])
        graph.replay()
        torch.cuda.synchronize()
        assert w.data_ptr() == address == mapped[0].address
        assert_tensors_equal("graph replayed after the switch", y, x @ weights[1])
        del w, y, graph
    finally:
        for arena in (*mapped, *made):
            arena.close()
        for fd in fds:
            os.close(fd)


@pytest.mark.parametrize("quantization", [None, "fp8-block"])
def test_a_version_from_gpu_tensors_switches_in_place_and_graphs_replay_it(server, tmp_path, quantization):
    from tests.core.test_refit import outputs, saved, trained
    from tests.models import save_random_model
    from weightcache.core.flow.loader import prepare, publish
    from weightcache.core.flow.modes import load_model
    from weightcache.core.refit import publish_version
    from weightcache.core.request import LoadRequest

    path = save_random_model("llama", tmp_path / "model", dtype="bfloat16")
    options = {"device": DEVICE, "quantization": quantization}
    publish(prepare(LoadRequest(model=str(path), **options)), server.socket_dir)
    engine = load_model(str(path), mode="client", socket_dir=server.socket_dir, strict=True, **options)
    try:
        mlp = engine.model.model.layers[0].mlp
        x = torch.randn(4, engine.model.config.hidden_size, device=DEVICE, dtype=torch.bfloat16)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream), torch.no_grad():
            y = mlp(x)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                y = mlp(x)
        before = {name: t.data_ptr() for name, t in engine.model.state_dict().items()}
        state = {name: t.to(DEVICE) for name, t in trained(path, 1).items()}  # the trainer's tensors on the GPU
        publish_version(str(path), state, 1, socket_dir=server.socket_dir, **options)
        assert engine.refit()
        assert {name: t.data_ptr() for name, t in engine.model.state_dict().items()} == before
        graph.replay()
        torch.cuda.synchronize()
        with torch.no_grad():
            assert_tensors_equal("graph replayed on version 1", y, mlp(x))
        fresh = load_model(str(saved(path, trained(path, 1), tmp_path / "v1")), mode="off", **options)
        for name, tensor in fresh.model.state_dict().items():
            assert_tensors_equal(name, engine.model.state_dict()[name], tensor)
        assert_tensors_equal("logits on version 1", outputs(engine.model), outputs(fresh.model))
        del graph, y
    finally:
        engine.close()
