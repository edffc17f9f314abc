"""The node as one cache: filling GPU1 from the disk, a peer GPU, the host tier, or a peer node (NCCL), side by side.

    python3 benchmarks/node.py --json OUT.json                 # 2 GPUs: 16 GiB / 1,000 tensors, swap scenario
    python3 benchmarks/node.py --with-8b --json OUT.json       # also the 8 B Qwen3-shaped checkpoint, disk cold and warm

Every row is "ready on GPU1": the bytes copied into new arenas and the entry published
under GPU1's fingerprint (what an engine then attaches in milliseconds). The copies run in
this process, which has a CUDA context on both GPUs already (an engine has one too).

- peer GPU0 -> GPU1: ``fill.copy_from_node`` from GPU0's entry (peer access), then publish;
- host tier -> GPU1: the same from the host-tier copy (sealed memfds, read through page-locked bounce buffers);
- NCCL seeding GPU0 -> GPU1 across two servers (``weightcache.core.node.seeding``, two processes, one per "node");
- disk -> GPU1 (``--with-8b``): ``weightcache load``'s path on the 8 B checkpoint, cold and warm page cache;
- model swap: three 16 GiB models on the host tier, a GPU budget for one: time to switch GPU1 between them;
- checksum 16 GiB on a GPU and on the CPU: what verification adds (``weightcache.core.arena.checksum``).

Every fill is verified (the copy's checksum on GPU1 against the source's, before publishing;
its ``verify_s`` is in the JSON): verification is always on. ``--checksum-only`` runs just
the checksum rows (one GPU is enough).

Needs two CUDA GPUs with peer access; weightcache importable (or this checkout on PYTHONPATH, as tests/gpu/run_gpu.sh does).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import restart  # benchmarks/restart.py: the 8 B checkpoint, the child environment, the page cache

GIB = 1 << 30


def synthetic_fingerprint(name: str, gib: float, tensors: int, index: int):
    """A fingerprint for a synthetic model on cuda:``index`` (this process's real environment)."""
    from weightcache.core.device import Device
    from weightcache.core.fingerprint import Fingerprint, sha256_json
    from weightcache.core.identity.identity import Environment

    env = Environment.of(Device.parse(f"cuda:{index}"))
    return Fingerprint(
        checkpoint=sha256_json({"synthetic": name, "gib": gib, "tensors": tensors}),
        architecture=f"Synthetic-{name}",
        config=sha256_json({}),
        tp_size=1, tp_rank=0, pp_size=1, pp_rank=0, dp_size=1, ep_size=1, ep_rank=0,
        dtype="bfloat16", quantization="none", quantization_config="", adapter="benchmark", adapter_version="1",
        engine="", engine_version="", torch_version=env.torch_version, cuda_version=env.cuda_version,
        compute_capability=env.compute_capability, gpu_uuid=env.gpu_uuid,
    )  # fmt: skip


def publish_synthetic(fingerprint, gib: float, tensors: int, socket_dir, seed: int) -> None:
    """``tensors`` random bf16 tensors, ``gib`` GiB in all, published from cuda:0."""
    import torch

    from weightcache.core.flow.api import publish_state

    per = int(gib * GIB) // tensors // 2
    generator = torch.Generator(device="cuda:0").manual_seed(seed)
    state = {
        f"layers.{i}.weight": torch.randn(per, generator=generator, device="cuda:0", dtype=torch.bfloat16) for i in range(tensors)
    }
    publish_state(state, fingerprint, device="cuda:0", socket_dir=socket_dir, label=fingerprint.architecture)
    del state
    torch.cuda.empty_cache()


def fill_gpu1(fingerprint, socket_dir, tier: str) -> dict:
    """Fill cuda:1's entry of ``fingerprint`` from the source on ``tier`` (``peer`` or ``host``) and publish it; timings."""
    import torch

    from weightcache.core.fingerprint import HOST_TIER
    from weightcache.core.load.export import ArenaBuilder
    from weightcache.core.load.publish import publish_arenas
    from weightcache.core.node import fill

    wanted = [s for s in fill.sources(fingerprint, socket_dir) if (s.tier == HOST_TIER) == (tier == "host")]
    if not wanted:
        raise SystemExit(f"no {tier} source of {fingerprint.short} on the server")
    torch.cuda.synchronize(1)
    start = time.perf_counter()
    with ArenaBuilder("cuda:1") as builder:
        copied = fill.copy_from_node(fingerprint, builder, socket_dir, wanted[:1])
        if copied is None or copied.source != wanted[0]:
            raise SystemExit(f"the {tier} fill did not happen (see the log above)")
        filled = time.perf_counter()
        reply = publish_arenas(builder, fingerprint, copied.manifest, socket_dir, fingerprint.architecture)
    ready = time.perf_counter()
    nbytes = sum(spec.size for spec in copied.manifest.arenas)
    return {"ready_s": ready - start, "publish_s": ready - filled, "bytes": nbytes, "digest": reply.digest, **copied.timings}


def evict(socket_dir, fingerprint) -> None:
    from weightcache.core.client.client import Connection

    with Connection(socket_dir) as connection:
        connection.evict(fingerprint.digest, force=True)


def repeat(runs: int, once, between) -> list[dict]:
    results = []
    for run in range(runs):
        if run:
            between()
        results.append(once())
    return results


def median(results: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in results)


_SEED_CHILD = r"""
import json, os, sys, torch, torch.distributed as dist
from weightcache.core.fingerprint import Fingerprint
from weightcache.core.node import seeding
rank = int(os.environ["RANK"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
if rank == 0:
    report = seeding.send_entry(Fingerprint.from_json(json.loads(sys.argv[1])), sys.argv[2])
else:
    report = seeding.receive_entry(sys.argv[3], "cuda:1")
dist.barrier()
dist.destroy_process_group()
print(json.dumps({"rank": rank, "seconds": report.seconds, "bytes": report.bytes, "gbps": report.gb_per_s}), flush=True)
"""


def seed_gpu0_to_gpu1(fingerprint, socket_a, socket_b, env: dict) -> dict:
    """Two processes, one per "node" (GPU0 with server A, GPU1 with server B): rank 0 broadcasts its entry over NCCL."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    common = {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "NCCL_NVLS_ENABLE": "0"}
    args = [sys.executable, "-c", _SEED_CHILD, json.dumps(fingerprint.to_json()), str(socket_a), str(socket_b)]
    procs = [subprocess.Popen(args, env={**common, "RANK": str(rank)}, stdout=subprocess.PIPE, text=True) for rank in (0, 1)]
    reports = {}
    for proc in procs:
        out, _ = proc.communicate(timeout=600)
        if proc.returncode:
            raise SystemExit(f"a seeding rank failed (exit {proc.returncode})")
        line = json.loads(out.strip().splitlines()[-1])
        reports[line["rank"]] = line
    return {"ready_s": reports[1]["seconds"], "bytes": reports[1]["bytes"], "gbps": reports[1]["gbps"]}


def synthetic_rows(args, work: Path, env: dict) -> dict:
    from weightcache.core.node import fill
    from weightcache.core.server.server_process import ServerProcess

    rows: dict = {}
    server = ServerProcess.start(work / "node-a")
    other = ServerProcess.start(work / "node-b")
    try:
        f0 = synthetic_fingerprint("base", args.gib, args.tensors, 0)
        f1 = f0.on_device(synthetic_fingerprint("base", args.gib, args.tensors, 1).gpu_uuid)
        start = time.perf_counter()
        publish_synthetic(f0, args.gib, args.tensors, server.socket_dir, seed=0)
        rows["publish on GPU0 from memory"] = {"ready_s": time.perf_counter() - start}
        rows["peer GPU0 -> GPU1"] = repeat(
            args.runs, lambda: fill_gpu1(f1, server.socket_dir, "peer"), lambda: evict(server.socket_dir, f1)
        )
        evict(server.socket_dir, f1)
        start = time.perf_counter()
        fill.keep_entry_on_host(f0, server.socket_dir)
        rows["GPU0 -> host tier (once)"] = {"ready_s": time.perf_counter() - start}
        rows["host tier -> GPU1"] = repeat(
            args.runs, lambda: fill_gpu1(f1, server.socket_dir, "host"), lambda: evict(server.socket_dir, f1)
        )
        evict(server.socket_dir, f1)
        if args.no_nccl:
            return rows
        rows["NCCL seeding GPU0 -> GPU1 (two servers)"] = repeat(
            args.runs,
            lambda: seed_gpu0_to_gpu1(f0, server.socket_dir, other.socket_dir, env),
            lambda: evict(other.socket_dir, f1),
        )
    finally:
        server.stop()
        other.stop()
    return rows


def swap_rows(args, work: Path) -> dict:
    """Three models on the host tier, a GPU budget for one: each switch fills GPU1 from the host, evicting the last."""
    from weightcache.core.node import fill
    from weightcache.core.server.server_process import ServerProcess

    per_model = int(args.gib * GIB) + (256 << 20)
    server = ServerProcess.start(work / "swap", "--gpu-budget", str(per_model + (1 << 30)), "--host-budget", str(3 * per_model))
    try:
        models = []
        for seed, name in enumerate(("x", "y", "z")):
            f0 = synthetic_fingerprint(name, args.gib, args.tensors, 0)
            publish_synthetic(f0, args.gib, args.tensors, server.socket_dir, seed=seed)
            fill.keep_entry_on_host(f0, server.socket_dir)
            evict(server.socket_dir, f0)
            models.append(f0.on_device(synthetic_fingerprint(name, args.gib, args.tensors, 1).gpu_uuid))
        switches = [fill_gpu1(f1, server.socket_dir, "host") for f1 in (models * 2)[:5]]
    finally:
        server.stop()
    return {"model swap: switch GPU1 to another model (host tier, budget for one)": switches}


def model_rows(args, work: Path, env: dict) -> dict:
    """The 8 B checkpoint: disk cold and warm -> GPU1 through weightcache load's path, then peer and host fills."""
    import torch

    from weightcache.core.client.client import Connection
    from weightcache.core.flow.loader import prepare, publish
    from weightcache.core.request import LoadRequest
    from weightcache.core.server.server_process import ServerProcess

    model = restart.ensure_checkpoint("8b", "cuda:0", Path(args.keep_checkpoint or work / "model8b"), env)
    files = restart.checkpoint_files(model)
    server = ServerProcess.start(work / "node-8b")
    rows: dict = {}

    def load(device: str, tier: str = "device") -> dict:
        torch.cuda.synchronize()
        start = time.perf_counter()
        published = publish(prepare(LoadRequest(model=str(model), device=device)), server.socket_dir, tier=tier)
        return {"ready_s": time.perf_counter() - start, "source": published.source, "bytes": published.manifest.nbytes}

    def clear() -> None:
        with Connection(server.socket_dir) as connection:
            for row in connection.status()["entries"]:
                connection.evict(row["digest"], force=True)

    try:
        restart.drop_from_page_cache(files)
        rows["8B disk (cold page cache) -> GPU1"] = load("cuda:1")
        clear()
        restart.read_into_page_cache(files)
        rows["8B disk (warm page cache) -> GPU1"] = load("cuda:1")
        clear()
        load("cuda:0")
        rows["8B peer GPU0 -> GPU1"] = load("cuda:1")
        load("cuda:0", tier="host")
        with Connection(server.socket_dir) as connection:
            for row in connection.status()["entries"]:
                if row["tier"] != "host":
                    connection.evict(row["digest"], force=True)
        rows["8B host tier -> GPU1"] = load("cuda:1")
    finally:
        server.stop()
    return rows


def checksum_rows(args) -> dict:
    """Checksum ``args.gib`` GiB on cuda:0 (the verification a fill, seeding or a scrub adds there) and in host memory."""
    import torch

    from weightcache.core.arena.checksum import checksum

    nbytes = int(args.gib * GIB)
    rows: dict = {}
    places = [("GPU0", "cuda:0")] if torch.cuda.is_available() else []
    for where, device in [*places, ("the CPU (host tier)", "cpu")]:
        data = torch.empty(nbytes, dtype=torch.uint8, device=device)
        data.view(torch.int64).random_()
        checksum(data)  # warm-up
        runs = []
        for _ in range(args.runs if device != "cpu" else 1):
            start = time.perf_counter()
            checksum(data)
            runs.append({"ready_s": time.perf_counter() - start, "bytes": nbytes})
        rows[f"checksum {args.gib:g} GiB on {where}"] = runs
        del data
    return rows


def table(rows: dict, peer_gbps: float | None) -> str:
    lines = [f"{'ready on GPU1, verified (median)':58} {'s':>8} {'GB/s':>8} {'runs':>5}"]
    for name, value in rows.items():
        runs = value if isinstance(value, list) else [value]
        seconds = median(runs, "ready_s")
        nbytes = runs[0].get("bytes")
        rate = f"{nbytes / seconds / 1e9:8.1f}" if nbytes else f"{'':8}"
        lines.append(f"{name:58} {seconds:8.3f} {rate} {len(runs):5}")
    if peer_gbps:
        lines.append(f"NCCL seeding / peer copy bandwidth: {peer_gbps:.0%}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=16.0)
    parser.add_argument("--tensors", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--with-8b", action="store_true", help="also the 8 B Qwen3-shaped checkpoint (builds it: ~30 s)")
    parser.add_argument("--keep-checkpoint", help="where the 8 B checkpoint is kept or reused")
    parser.add_argument("--no-swap", action="store_true", help="skip the model-swap scenario")
    parser.add_argument("--no-nccl", action="store_true", help="skip NCCL seeding")
    parser.add_argument("--checksum-only", action="store_true", help="only the checksum rows (one GPU, or the CPU alone)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    import torch

    if args.checksum_only:
        rows = checksum_rows(args)
        print(table(rows, None))
        if args.json:
            Path(args.json).write_text(json.dumps({"gib": args.gib, "rows": rows}, indent=2, default=str))
        return 0
    if torch.cuda.device_count() < 2:
        raise SystemExit(f"needs two CUDA GPUs, this process sees {torch.cuda.device_count()}")
    work = Path(tempfile.mkdtemp(prefix="wc-node-"))
    env = restart.weightcache_env(work)
    sys.path[:0] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    os.environ.update({key: env[key] for key in ("WEIGHTCACHE_CACHE_DIR", "PYTHONPATH") if key in env})  # for the servers too
    for index in (0, 1):
        torch.empty(1, device=f"cuda:{index}")  # both CUDA contexts, as an engine of the node has its own
    rows = synthetic_rows(args, work, env)
    rows.update(checksum_rows(args))
    if not args.no_swap:
        rows.update(swap_rows(args, work))
    if args.with_8b:
        rows.update(model_rows(args, work, env))
    peer = median(rows["peer GPU0 -> GPU1"], "ready_s")
    nccl = median(rows["NCCL seeding GPU0 -> GPU1 (two servers)"], "ready_s") if not args.no_nccl else None
    result = {"machine": restart.machine("cuda:0", env), "gib": args.gib, "tensors": args.tensors, "rows": rows}
    print(f"\nnode fills: {args.gib:g} GiB in {args.tensors} tensors (synthetic) on {result['machine'].get('gpu')} x2")
    print(table(rows, peer / nccl if nccl else None))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
