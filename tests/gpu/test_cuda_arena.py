"""The CUDA arena backend, through real processes and real fds (needs a GPU and cuda-bindings)."""

from __future__ import annotations

import gc
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys

import pytest

from weightcache.core.arena.base import ArenaSpec
from weightcache.core.arena.cuda import CudaArenaBackend, unavailable_reason
from weightcache.core.device import (
    device_index_for_uuid,
    device_label,
    gpu_uuid,
    visible_gpu_uuids,
)
from weightcache.core.errors import ArenaClosed, ArenaError, DeviceNotFound

_REASON = unavailable_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"no CUDA GPU: {_REASON}")

SIZE = (8 << 20) + 123  # not a multiple of any granularity: create must round up
UUID_PATTERN = r"^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$"

# One script for every child role; the last line it prints is a JSON report.
CHILD = r"""
import hashlib, json, os, socket, sys


def sha256(view):
    return hashlib.sha256(view.cpu().numpy().tobytes()).hexdigest()


def keeper(inbox_fd, outbox_fd):
    # Holds the arena fd with no torch and no CUDA, then hands it on when told.
    inbox, outbox = socket.socket(fileno=int(inbox_fd)), socket.socket(fileno=int(outbox_fd))
    inbox.settimeout(300)
    outbox.settimeout(300)
    message, fds, _, _ = socket.recv_fds(inbox, 1 << 16, 1)
    inbox.close()
    if outbox.recv(2) != b"go":
        sys.exit("keeper: expected go")
    report = json.loads(message)
    report["keeper_has_torch"] = "torch" in sys.modules or "cuda" in sys.modules
    socket.send_fds(outbox, [json.dumps(report).encode()], fds)
    for fd in fds:
        os.close(fd)
    outbox.close()
    print(json.dumps({"ok": True}))


def create(sock_fd, size, seed):
    import torch
    from weightcache.core.arena.cuda import CudaArenaBackend

    backend = CudaArenaBackend()
    arena = backend.create(int(size), "cuda")
    view = arena.bytes_view()
    generator = torch.Generator(device=view.device).manual_seed(int(seed))
    view.copy_(torch.randint(0, 256, (view.numel(),), dtype=torch.uint8, device=view.device, generator=generator))
    backend.seal(arena)
    report = {"spec": arena.spec.to_json(), "sha256": sha256(view), "pid": os.getpid()}
    fd = arena.export_fd()
    socket.send_fds(socket.socket(fileno=int(sock_fd)), [json.dumps(report).encode()], [fd])
    print(json.dumps(report), flush=True)
    os._exit(0)  # hard: no close, no CUDA teardown


def map_(fd, spec_json, mode, fill=None):
    import torch
    from weightcache.core.arena.base import ArenaSpec
    from weightcache.core.arena.cuda import CudaArenaBackend
    from weightcache.core.device import gpu_uuid, visible_gpu_uuids

    arena = CudaArenaBackend().map(int(fd), ArenaSpec.from_json(json.loads(spec_json)), writable=mode == "rw")
    os.close(int(fd))
    view = arena.bytes_view()
    if fill is not None:
        view.fill_(int(fill))
        torch.cuda.synchronize(view.device)
    report = {
        "sha256": sha256(view),
        "index": arena.device_index,
        "uuid": gpu_uuid(arena.device_index),
        "visible": visible_gpu_uuids(),
        "writable": arena.writable,
    }
    del view
    arena.close()
    print(json.dumps(report))


if __name__ == "__main__":
    role, args = sys.argv[1], sys.argv[2:]
    {"keeper": keeper, "create": create, "map": map_}[role](*args)
"""


def _child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env.update(extra)
    return env


def _child(role: str, *args) -> list[str]:
    return [sys.executable, "-c", CHILD, role, *map(str, args)]


def _run(role: str, *args, pass_fds=(), **env: str) -> dict:
    proc = subprocess.run(
        _child(role, *args),
        check=False,
        pass_fds=pass_fds,
        capture_output=True,
        text=True,
        timeout=300,
        env=_child_env(**env),
    )
    if proc.returncode != 0:
        pytest.fail(f"child {role!r} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _sha256(view) -> str:
    return hashlib.sha256(view.cpu().numpy().tobytes()).hexdigest()


def _fill_random(view, seed: int) -> None:
    import torch

    generator = torch.Generator(device=view.device).manual_seed(seed)
    view.copy_(torch.randint(0, 256, (view.numel(),), dtype=torch.uint8, device=view.device, generator=generator))


def assert_bytes_equal(actual, expected, what: str) -> None:
    """Fail naming dtype, devices, how many bytes differ and the largest difference."""
    import torch

    if actual.shape == expected.shape and torch.equal(actual, expected.to(actual.device)):
        return
    if actual.shape != expected.shape:
        pytest.fail(f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    diff = (actual.int() - expected.to(actual.device).int()).abs()
    worst = int(diff.argmax())
    pytest.fail(
        f"{what}: {actual.dtype} on {actual.device} vs {expected.device}: {int((diff != 0).sum())} bytes differ; "
        f"largest difference {int(diff[worst])} at byte {worst}"
    )


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def backend() -> CudaArenaBackend:
    return CudaArenaBackend()


@pytest.fixture
def arena(backend):
    created = backend.create(SIZE, "cuda")
    try:
        yield created
    finally:
        created.close()


def test_create_rounds_up_and_names_the_gpu_by_uuid(backend, arena):
    import torch

    spec = arena.spec
    assert spec.backend == "cuda"
    assert spec.size >= SIZE and spec.size % backend.granularity(spec.device) == 0, spec
    assert spec.device == gpu_uuid(torch.cuda.current_device())
    assert ArenaSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec
    view = arena.bytes_view()
    assert (view.dtype, view.device.type, view.numel()) == (torch.uint8, "cuda", spec.size)
    assert view.data_ptr() == arena.address


def test_second_process_maps_the_same_bytes(backend, arena):
    _fill_random(arena.bytes_view(), seed=1)
    backend.seal(arena)
    expected = _sha256(arena.bytes_view())
    fd = arena.export_fd()
    try:
        report = _run("map", fd, json.dumps(arena.spec.to_json()), "ro", pass_fds=(fd,))
    finally:
        os.close(fd)
    assert report["sha256"] == expected, (
        f"uint8 arena of {arena.spec.size} B on {arena.spec.device}: the child read different bytes"
    )
    assert report["uuid"] == arena.spec.device


def test_writes_of_a_writable_mapping_in_another_process_are_seen_here(backend, arena):
    import torch

    arena.bytes_view().zero_()
    backend.seal(arena)
    fd = arena.export_fd()
    try:
        report = _run("map", fd, json.dumps(arena.spec.to_json()), "rw", 7, pass_fds=(fd,))
    finally:
        os.close(fd)
    assert report["writable"] is True
    view = arena.bytes_view()
    assert_bytes_equal(view, torch.full_like(view, 7), "arena after the child wrote 7")


def test_map_in_this_process_views_the_same_memory_at_a_new_address(backend, arena):
    _fill_random(arena.bytes_view(), seed=2)
    backend.seal(arena)
    fd = arena.export_fd()
    try:
        mapped = backend.map(fd, arena.spec)
    finally:
        os.close(fd)
    try:
        assert mapped.address != arena.address
        assert isinstance(mapped.writable, bool)
        assert_bytes_equal(mapped.bytes_view(), arena.bytes_view(), "second mapping of one arena")
        again = mapped.export_fd()  # an imported arena exports too (re-publish after a server restart)
        os.close(again)
    finally:
        mapped.close()


def test_memory_survives_the_creator_exiting_hard_while_a_cuda_free_process_holds_the_fd(backend):
    creator_end, keeper_in = socket.socketpair()
    test_end, keeper_out = socket.socketpair()
    keeper = subprocess.Popen(
        _child("keeper", keeper_in.fileno(), keeper_out.fileno()),
        pass_fds=(keeper_in.fileno(), keeper_out.fileno()),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_child_env(),
    )
    keeper_in.close()
    keeper_out.close()
    try:
        created = _run("create", creator_end.fileno(), SIZE, 3, pass_fds=(creator_end.fileno(),))
        creator_end.close()
        # The creator is gone; only the keeper (no torch, no CUDA) holds the memory.
        test_end.settimeout(120)
        test_end.sendall(b"go")
        message, fds, _, _ = socket.recv_fds(test_end, 1 << 16, 1)
        report = json.loads(message)
        assert report["keeper_has_torch"] is False
        assert len(fds) == 1, "the keeper sent no fd"
        try:
            mapped = backend.map(fds[0], ArenaSpec.from_json(report["spec"]))
        finally:
            os.close(fds[0])
        try:
            assert _sha256(mapped.bytes_view()) == created["sha256"], (
                f"uint8 arena on {mapped.spec.device}: bytes changed after the creator (pid {created['pid']}) exited"
            )
        finally:
            mapped.close()
        _, err = keeper.communicate(timeout=60)
        assert keeper.returncode == 0, f"keeper failed:\n{err[-4000:]}"
    finally:
        creator_end.close()
        test_end.close()
        if keeper.poll() is None:
            keeper.kill()
            keeper.wait()


def test_close_releases_gpu_memory_and_fds(backend):
    import torch

    size = 64 << 20  # one leaked arena would exceed the tolerance

    def cycle():
        created = backend.create(size, "cuda")
        created.bytes_view().fill_(1)
        backend.seal(created)
        fd = created.export_fd()
        try:
            mapped = backend.map(fd, created.spec)
        finally:
            os.close(fd)
        assert int(mapped.bytes_view()[-1]) == 1
        mapped.close()
        created.close()

    index = torch.cuda.current_device()
    cycle()  # warm-up: context, allocator, cuda-bindings
    gc.collect()
    torch.cuda.synchronize()
    free_before, fds_before = torch.cuda.mem_get_info(index)[0], _fd_count()
    for _ in range(100):
        cycle()
    gc.collect()
    torch.cuda.synchronize()
    free_after, fds_after = torch.cuda.mem_get_info(index)[0], _fd_count()
    tolerance = 16 << 20
    assert free_before - free_after <= tolerance, (
        f"{(free_before - free_after) >> 20} MiB of GPU memory not returned after 100 cycles of {size >> 20} MiB"
    )
    assert fds_after == fds_before, f"{fds_after - fds_before} fds leaked after 100 cycles"


def test_close_is_idempotent_and_final(backend):
    created = backend.create(SIZE, "cuda")
    created.close()
    created.close()
    assert created.closed
    with pytest.raises(ArenaClosed):
        created.bytes_view()
    with pytest.raises(ArenaClosed):
        created.export_fd()
    with pytest.raises(ArenaClosed):
        backend.seal(created)


def test_uuid_round_trips_for_every_visible_device():
    import torch

    visible = visible_gpu_uuids()
    assert len(visible) == torch.cuda.device_count()
    assert len(set(visible)) == len(visible), visible
    for index, uuid in enumerate(visible):
        assert uuid == gpu_uuid(index)
        assert re.match(UUID_PATTERN, uuid), uuid
        assert device_index_for_uuid(uuid) == index
        assert device_index_for_uuid(uuid.upper().replace("GPU-", "gpu-")) == index
        assert device_label(torch.device("cuda", index)) == uuid
        assert device_label(f"cuda:{index}") == uuid
    assert device_label("cpu") == "cpu"
    assert device_label(torch.device("cpu")) == "cpu"
    with pytest.raises(DeviceNotFound) as caught:
        device_index_for_uuid("GPU-00000000-0000-0000-0000-000000000000")
    assert caught.value.visible == tuple(visible)


def test_uuids_are_those_nvidia_smi_prints():
    if shutil.which("nvidia-smi") is None:
        pytest.skip("nvidia-smi is not on PATH")
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    listed = {line.strip() for line in out.stdout.splitlines() if line.strip()}
    assert set(visible_gpu_uuids()) <= listed, f"nvidia-smi lists {sorted(listed)}"


def test_child_with_another_device_order_maps_the_same_gpu(backend):
    visible = visible_gpu_uuids()
    last = len(visible) - 1
    created = backend.create(SIZE, f"cuda:{last}")
    try:
        _fill_random(created.bytes_view(), seed=4)
        backend.seal(created)
        expected = _sha256(created.bytes_view())
        order = ",".join(reversed(visible)) if len(visible) > 1 else visible[0]
        fd = created.export_fd()
        try:
            report = _run("map", fd, json.dumps(created.spec.to_json()), "ro", pass_fds=(fd,), CUDA_VISIBLE_DEVICES=order)
        finally:
            os.close(fd)
    finally:
        created.close()
    assert report["visible"] == order.split(","), report
    assert report["uuid"] == created.spec.device
    assert report["index"] == 0, f"the child should see {created.spec.device} as cuda:0, saw {report}"
    assert report["sha256"] == expected, f"uint8 arena on {created.spec.device}: the child read different bytes"


def test_map_refuses_a_spec_of_another_backend(backend, arena):
    fd = arena.export_fd()
    try:
        with pytest.raises(ArenaError, match="host"):
            backend.map(fd, ArenaSpec(backend="host", size=arena.spec.size, device="cpu"))
    finally:
        os.close(fd)


def test_map_refuses_a_spec_naming_another_gpu(backend, arena):
    visible = visible_gpu_uuids()
    if len(visible) < 2:
        pytest.skip(f"needs two GPUs, this process sees {len(visible)}")
    other = next(uuid for uuid in visible if uuid != arena.spec.device)
    fd = arena.export_fd()
    try:
        with pytest.raises(ArenaError, match="do not belong together"):
            backend.map(fd, ArenaSpec(backend="cuda", size=arena.spec.size, device=other))
    finally:
        os.close(fd)
