"""Attach vs disk load on a synthetic checkpoint, measured side by side in one run.

    python benchmarks/attach.py                       # host arenas, 2 GiB / 1,000 tensors
    python benchmarks/attach.py --device cuda --gib 16 --extra-gib 64
    python benchmarks/attach.py --device cuda --gib 16 --tensors 50000 --no-disk   # attach only, published from memory

Rows: safetensors ``load_file`` (cold when root can drop the page cache, and
warm), weightcache's own load (disk -> arenas -> published), the raw disk
bandwidth with direct-I/O reads, and attach-to-ready-model in a fresh engine
process (median of several attaches; the meta skeleton is built before the
clock, as an engine builds its model either way). ``--extra-gib`` publishes
that many GiB of random tensors straight from memory (no checkpoint on disk)
and times attach again, to show attach stays flat as size grows. ``--no-disk`` skips the checkpoint and the disk
rows: the entry is published from memory, and the per-tensor cost of every phase is printed (publish's manifest
build, sealing and checksumming the arenas, the publish request with the server's check and storage, and the
engine's request, manifest, map, views and rebind). The ready model is ``rebind_module`` onto the skeleton (as every
adapter does); ``--no-disk`` names its tensors without dots, so that one module holds them all. "views" is ~0: the
attachment's tensors dict is made on its first read, and rebind makes its Parameters from the table without reading
it (the grouping of the records into runs is then part of "rebind").
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GIB = 1 << 30


def make_checkpoint(directory: Path, gib: float, tensors: int, files: int = 4, device: str = "cpu") -> list[Path]:
    import torch
    from safetensors.torch import save_file

    per = int(gib * GIB) // tensors // 2
    per -= per % 256
    paths = []
    where = device if device.startswith("cuda") else "cpu"  # random numbers are quicker on a GPU
    generator = torch.Generator(device=where).manual_seed(0)
    per_file = -(-tensors // files)
    for f in range(files):
        names = range(f * per_file, min(tensors, (f + 1) * per_file))
        shard = {
            f"layers.{i}.weight": torch.randn(per, generator=generator, device=where, dtype=torch.bfloat16).cpu() for i in names
        }
        path = directory / f"model-{f:05d}-of-{files:05d}.safetensors"
        save_file(shard, path)
        paths.append(path)
        del shard
    os.sync()
    return paths


def drop_page_cache() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def touch_pages(tensors) -> None:
    """Read one byte of every 4 KiB page, so lazily mapped memory is really there."""
    for tensor in tensors:
        tensor.reshape(-1).view(-1).view(__import__("torch").uint8)[::4096].sum()


def time_safetensors(paths, device: str, touch: bool = False) -> float:
    """``load_file`` of every file; on the CPU it maps the files lazily, so ``touch`` reads every page too."""
    from safetensors.torch import load_file

    synchronize(device)
    start = time.perf_counter()
    for path in paths:
        state = load_file(path, device=device)
        if touch:
            touch_pages(state.values())
        del state
    synchronize(device)
    return time.perf_counter() - start


def direct_read_gbps(paths, threads: int = 8) -> float:
    """Disk bandwidth with O_DIRECT reads (page cache bypassed), ``threads`` streams."""
    block = 64 << 20
    jobs = [(p, off) for p in paths for off in range(0, os.path.getsize(p), block)]

    def read(job):
        path, offset = job
        buffer = mmap.mmap(-1, block)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        try:
            return os.preadv(fd, [buffer], offset)
        finally:
            os.close(fd)
            buffer.close()

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(read, jobs))
    return total / 1e9 / (time.perf_counter() - start)


ENGINE = r"""
import json, statistics, sys, time, torch
from weightcache.core.flow import api
from weightcache.core.fingerprint import Fingerprint
from weightcache.core.load.rebind import rebind_module
fp = Fingerprint.from_json(json.loads(sys.argv[1])); socket_dir = sys.argv[2]; device = sys.argv[3]; repeat = int(sys.argv[4])
if device.startswith("cuda"):
    torch.zeros(1, device=device); torch.cuda.synchronize()
def skeleton(manifest):
    # The module tree of the dotted names, parameters on the meta device (names without dots: one module holds them all).
    root, modules = torch.nn.Module(), {}
    modules[""] = root
    for r in manifest.tensors:
        path, _, leaf = r.name.rpartition(".")
        owner = modules.get(path)
        if owner is None:
            owner, walked = root, ""
            for part in path.split("."):
                walked = f"{walked}.{part}" if walked else part
                child = modules.get(walked)
                if child is None:
                    child = modules[walked] = torch.nn.Module(); owner.add_module(part, child)
                owner = child
        owner.register_parameter(leaf, torch.nn.Parameter(torch.empty(r.shape, dtype=getattr(torch, r.dtype), device="meta"), requires_grad=False))
    return root
first = api.attach(fp, socket_dir); manifest = first.manifest; first.close()
times, touched, phases = [], [], []
for _ in range(repeat):
    model = skeleton(manifest)
    start = time.perf_counter()
    attachment = api.attach(fp, socket_dir)
    attached = time.perf_counter()
    rebind_module(model, attachment.tensors, attachment.manifest)  # what every adapter does: Parameters, checks, eval()
    done = time.perf_counter()
    times.append(done - start)
    phases.append({**attachment.timings, "rebind_s": done - attached})
    if device == "cpu":
        for t in attachment.tensors.values():
            t.view(torch.uint8)[::4096].sum()
        touched.append(time.perf_counter() - start)
    del model
    attachment.close()
print(json.dumps({"median_s": statistics.median(times), "min_s": min(times), "tensors": len(manifest.tensors), "arenas": len(manifest.arenas),
                  "touched_median_s": statistics.median(touched) if touched else None,
                  "phases_ms": {k: round(1000 * statistics.median(p[k] for p in phases), 2) for k in phases[0]}}))
"""


def time_attach(fingerprint, socket_dir, device: str, repeat: int) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", ENGINE, json.dumps(fingerprint.to_json()), str(socket_dir), device, str(repeat)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if proc.returncode:
        raise SystemExit(f"attach engine failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def publish_random(gib: float, tensors: int, device: str, socket_dir, anchor: Path, timings: dict | None = None):
    """Publish ``gib`` of random bf16 tensors generated on ``device`` (nothing on disk); ``timings`` gets the manifest
    build's and the publish request's milliseconds."""
    timings = {} if timings is None else timings
    import torch

    from weightcache.core.flow import api

    per = int(gib * GIB) // tensors // 2
    per -= per % 256
    fp = api.fingerprint(anchor, architecture=f"synthetic-{gib}GiB", dtype="bfloat16", device=device)
    from weightcache.core.load.export import ArenaBuilder, NamedTensor
    from weightcache.core.load.publish import publish_arenas

    builder = ArenaBuilder(device)
    try:
        # generate tensor by tensor straight into the arenas: the peak stays at one tensor beyond the arenas
        items = []
        for i in range(tensors):
            # No dots: one module holds every tensor in the engine's skeleton (the per-tensor cost, no module tree).
            items.append(NamedTensor(f"layers_{i}_weight", "parameter", torch.empty(per, dtype=torch.bfloat16, device="meta")))
        slots = [builder.plan(per * 2) for _ in items]
        for slot in slots:
            builder.view(slot).view(torch.bfloat16).normal_()
        from weightcache.core.layout.manifest import Manifest, TensorRecord

        start = time.perf_counter()
        records = [
            TensorRecord(
                name=item.name,
                kind="parameter",
                dtype="bfloat16",
                shape=(per,),
                stride=(1,),
                storage_offset=0,
                arena=slot.arena,
                offset=slot.offset,
                nbytes=slot.nbytes,
            )
            for item, slot in zip(items, slots, strict=True)
        ]
        manifest = Manifest(tensors=records, arenas=builder.specs())
        built = time.perf_counter()
        published: dict = {}
        publish_arenas(builder, fp, manifest, socket_dir, f"random {gib} GiB", timings=published)
        timings.update(
            publisher_manifest_ms=(built - start) * 1000,
            publisher_seal_ms=published["seal_s"] * 1000,
            publish_request_ms=published["request_s"] * 1000,
        )
    finally:
        builder.close()
    return fp


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--tensors", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument(
        "--extra-gib", type=float, nargs="*", default=[], help="also time attach at these sizes (published from memory)"
    )
    parser.add_argument("--dir", help="where to write the checkpoint (default: a temp dir on disk)")
    parser.add_argument("--no-disk", action="store_true", help="no checkpoint: publish from memory and time attach only")
    parser.add_argument("--json", help="write the figures to this file")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)

    import torch

    from weightcache.core.client.client import wait_for_server

    work = Path(tempfile.mkdtemp(prefix="wc-bench-", dir=args.dir))
    socket_dir = Path(tempfile.mkdtemp(prefix="wc-bench-sock-"))
    server = subprocess.Popen(
        [sys.executable, "-m", "weightcache.core.cli.cli", "serve", "--socket-dir", str(socket_dir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    results: dict = {"device": args.device, "gib": args.gib, "tensors": args.tensors, "torch": torch.__version__}
    try:
        wait_for_server(socket_dir, 30)
        if args.device.startswith("cuda"):
            torch.zeros(1, device=args.device)
            results["gpu"] = torch.cuda.get_device_name()
        if args.no_disk:
            time_from_memory(args, work, socket_dir, results)
            return 0
        nbytes = time_from_disk(args, work, socket_dir, results)
    finally:
        server.terminate()
        server.wait(timeout=60)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(socket_dir, ignore_errors=True)
    print_table(results, nbytes)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def time_from_memory(args, work: Path, socket_dir: Path, results: dict) -> None:
    """``--no-disk``: publish random tensors from memory and time attach only; print the phases (and write the JSON)."""
    import torch
    from safetensors.torch import save_file

    (work / "config.json").write_text("{}")
    save_file({"anchor": torch.zeros(1)}, work / "model.safetensors")  # the fingerprints' checkpoint identity
    publish_timings: dict = {}
    fp = publish_random(args.gib, args.tensors, args.device, socket_dir, work, publish_timings)
    results["attach"] = time_attach(fp, socket_dir, args.device, args.repeat)
    results["attach"]["phases_ms"] = {**publish_timings, **results["attach"]["phases_ms"]}
    print_phases(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


def time_from_disk(args, work: Path, socket_dir: Path, results: dict) -> int:
    """Write the checkpoint; time safetensors (cold where the page cache can be dropped, then warm), weightcache's
    publish and attach, and attach at ``--extra-gib`` sizes. Returns the checkpoint's bytes."""
    from weightcache.core.client.client import Connection
    from weightcache.core.flow import api

    print(f"writing a {args.gib:g} GiB checkpoint of {args.tensors} bf16 tensors to {work} ...", flush=True)
    paths = make_checkpoint(work, args.gib, args.tensors, device=args.device)
    nbytes = sum(p.stat().st_size for p in paths)
    cold = drop_page_cache()
    results["page_cache_dropped"] = cold
    if cold:
        results["direct_io_gbps"] = direct_read_gbps(paths)
        drop_page_cache()
        results["safetensors_cold_s"] = time_safetensors(paths, args.device, touch=True)
    time_safetensors(paths, args.device)
    results["safetensors_warm_s"] = min(time_safetensors(paths, args.device) for _ in range(3))
    if args.device == "cpu":
        results["safetensors_warm_touched_s"] = min(time_safetensors(paths, args.device, touch=True) for _ in range(3))
    fingerprint = api.fingerprint(work, architecture="synthetic", dtype="bfloat16", device=args.device)
    if cold:
        drop_page_cache()
    start = time.perf_counter()
    api.publish_checkpoint(work, fingerprint, device=args.device, socket_dir=socket_dir)
    results["weightcache_load_s"] = time.perf_counter() - start
    results["weightcache_load_cold"] = cold
    results["attach"] = time_attach(fingerprint, socket_dir, args.device, args.repeat)
    results["extra"] = {}
    for gib in args.extra_gib:
        with Connection(socket_dir) as conn:  # make room: only one big entry at a time
            for entry in conn.status()["entries"]:
                conn.evict(entry["digest"], force=True)
        fp = publish_random(gib, args.tensors, args.device, socket_dir, work)
        results["extra"][str(gib)] = time_attach(fp, socket_dir, args.device, args.repeat)
    return nbytes


def print_phases(r: dict) -> None:
    """Attach -> ready model and each phase, in ms and in µs per tensor (the next bottleneck shows as the largest)."""
    attach, n = r["attach"], r["attach"]["tensors"]
    print(
        f"\n{r['gib']:g} GiB, {n:,} tensors on {r['device']}" + (f" ({r['gpu']})" if "gpu" in r else "") + f", torch {r['torch']}"
    )
    print(f"attach -> ready model: median {attach['median_s'] * 1000:,.1f} ms ({attach['median_s'] * 1e6 / n:.2f} µs a tensor)")
    for phase, ms in attach["phases_ms"].items():
        print(f"  {phase.removesuffix('_s').removesuffix('_ms'):<10} {ms:>10,.1f} ms  {ms * 1000 / n:>7.2f} µs a tensor")


def print_table(r: dict, nbytes: int) -> None:
    """One row per measure; the last column says how attach compares with it ("656.0x faster", "1.3x slower")."""
    from weightcache.core.progress import format_speedup

    attach = r["attach"]["median_s"]
    gb = nbytes / 1e9
    rows = [("measure", "time", "rate", "attach is")]

    def row(label, seconds, versus=None):
        rows.append((label, f"{seconds * 1000:,.1f} ms", f"{gb / seconds:,.2f} GB/s", versus or format_speedup(seconds, attach)))

    if "safetensors_cold_s" in r:
        row("safetensors load_file, cold cache", r["safetensors_cold_s"])
    row(
        "safetensors load_file, warm cache" + (" (lazy mmap)" if "safetensors_warm_touched_s" in r else ""),
        r["safetensors_warm_s"],
    )
    if "safetensors_warm_touched_s" in r:
        row("safetensors load_file, warm, every page read", r["safetensors_warm_touched_s"])
    row(f"weightcache load -> arenas ({'cold' if r['weightcache_load_cold'] else 'warm'})", r["weightcache_load_s"])
    rows.append(
        (
            f"attach -> ready model ({r['attach']['tensors']} tensors, {r['attach']['arenas']} arenas)",
            f"{attach * 1000:,.2f} ms",
            "",
            "-",
        )
    )
    if r["attach"].get("touched_median_s"):
        touched = r["attach"]["touched_median_s"]
        row(
            "attach -> ready model, every page read",
            touched,
            format_speedup(r["safetensors_warm_touched_s"], touched) + " (vs warm load, every page read)",
        )
    for gib, extra in r.get("extra", {}).items():
        rows.append(
            (
                f"attach at {gib} GiB (from memory)",
                f"{extra['median_s'] * 1000:,.2f} ms",
                "",
                f"{extra['median_s'] / attach:.2f}x the {r['gib']:g} GiB attach time",
            )
        )
    if "direct_io_gbps" in r:
        rows.append(("disk, direct-I/O reads (8 streams)", "", f"{r['direct_io_gbps']:,.2f} GB/s", ""))
        rows.append(
            ("weightcache load / direct-I/O bandwidth", "", f"{gb / r['weightcache_load_s'] / r['direct_io_gbps']:.0%}", "")
        )
    widths = [max(len(x[i]) for x in rows) for i in range(4)]
    title = (
        f"{r['gib']:g} GiB, {r['tensors']} tensors on {r['device']}"
        + (f" ({r['gpu']})" if "gpu" in r else "")
        + f", torch {r['torch']}"
    )
    print("\n" + title)
    for i, cells in enumerate(rows):
        print(
            "  ".join(
                c.rjust(w) if 0 < j < 3 else c.ljust(w) for j, (c, w) in enumerate(zip(cells, widths, strict=True))
            ).rstrip()
        )
        if i == 0:
            print("  ".join("-" * w for w in widths))
    n = r["attach"]["tensors"]
    phases = ", ".join(
        f"{k.removesuffix('_s')} {v:.1f} ({v * 1000 / n:.2f} µs/tensor)" for k, v in r["attach"]["phases_ms"].items()
    )
    print(f"attach phases (median ms): {phases}")


if __name__ == "__main__":
    sys.exit(main())
