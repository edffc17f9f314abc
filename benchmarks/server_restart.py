"""What a server restart keeps: entries kept, time until every entry is attachable again, bytes to read from disk again.

    python benchmarks/server_restart.py                      # 100 host entries of 4 MiB on the CPU
    python benchmarks/server_restart.py --entries 100 --mib 64 --successor-checkout /other/checkout
    python benchmarks/server_restart.py --device cuda:0 --entries 100 --mib 64 --json OUT   # CUDA VMM arenas

Publishes N synthetic entries (random bf16 tensors straight from memory, generated on ``--device``) into
arenas on ``--device``: host memfds on ``cpu``, CUDA VMM arenas on ``cuda:N``, which the server holds as fds
exactly like memfds (one code path; only the arenas' backend differs). It keeps
``--attached`` of them attached by this process (an engine that maps them, with ``watch()``, so it
re-publishes after a crash), then restarts the server each way, in this order:

- ``planned restart``: ``weightcache serve --take-over`` from this checkout (docs/decisions.md, 37);
- ``upgrade``: the same from ``--successor-checkout DIR`` (another checkout, put ahead of the installed
  one on PYTHONPATH; the row names the directory its ``weightcache.core`` was imported from; without it,
  this checkout again, and the row says so);
- ``SIGKILL, no fd store``: the server is SIGKILLed and a fresh ``weightcache serve`` started; what comes
  back is what the attached engine re-publishes.

"Attachable" is timed from the request (the successor's spawn, or the kill) until ``status`` lists every
entry that comes back, polled every 5 ms. "Disk bytes" is what a reload of the lost entries would read
(nothing moves through the disk in the restart itself: fds pass over the socket).

- ``SIGKILL, with fd store``: a server started with ``$NOTIFY_SOCKET`` pointing at a stand-in for systemd
  (``tests/fdstore_standin.py``, sd_notify's datagram protocol) keeps every entry's fds there; it is
  SIGKILLed and a new one started with the stored fds (``$LISTEN_FDS``), as systemd restarts a unit.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

MIB = 1 << 20


def fingerprint(n: int, device):
    """Entry ``n``'s fingerprint on ``device`` (a Device: its GPU's UUID, CUDA version and compute capability on a GPU)."""
    from tests.core.support import make_fingerprint
    from weightcache.core.identity.identity import Environment

    environment = Environment.of(device)
    return make_fingerprint(
        architecture=f"ServerRestartBench{n}",
        dtype="bfloat16",
        torch_version=environment.torch_version,
        cuda_version=environment.cuda_version or "none",
        compute_capability=environment.compute_capability or "none",
        gpu_uuid=environment.gpu_uuid,
    )


def publish_entry(n: int, args) -> str:
    """Publish entry ``n``: ``args.mib`` MiB of random bf16, generated on ``args.device`` and copied into arenas there."""
    import torch

    from weightcache.core.flow.api import publish_state

    state = {"w": torch.randn(int(args.mib * MIB) // 2, dtype=torch.bfloat16, device=args.device.torch())}
    return publish_state(
        state, fingerprint(n, args.device), device=str(args.device), socket_dir=args.socket_dir, label=f"bench{n}"
    ).digest


def parse_device(text: str):
    """``--device``: parsed once (``core/device.py``); a CUDA device must be visible to this torch."""
    from weightcache.core.arena.cuda import unavailable_reason
    from weightcache.core.device import Device

    try:
        device = Device.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    reason = unavailable_reason() if device.is_cuda else None
    if reason is not None:
        raise argparse.ArgumentTypeError(f"{text}: no CUDA GPU here ({reason}); run the CUDA rows on a GPU machine")
    return device


def status(socket_dir: Path) -> dict | None:
    from weightcache.core.client.client import Connection
    from weightcache.core.errors import ServerUnavailable

    try:
        with Connection(socket_dir, timeout=10) as conn:
            return conn.status()
    except (ServerUnavailable, OSError):
        return None


def wait_for(socket_dir: Path, pid: int, digests: set[str], settle_s: float, timeout: float = 60.0) -> tuple[float, set[str]]:
    """Seconds until server ``pid`` lists every digest of ``digests`` (or, after ``settle_s`` without change, what it lists)."""
    start = time.monotonic()
    seen: set[str] = set()
    changed = start
    while time.monotonic() - start < timeout:
        reply = status(socket_dir)
        if reply is not None and reply["pid"] == pid:
            now = {row["digest"] for row in reply["entries"]} & digests
            if now != seen:
                seen, changed = now, time.monotonic()
            if seen == digests:
                return changed - start, seen
            if seen and time.monotonic() - changed > settle_s:
                return changed - start, seen
        time.sleep(0.005)
    return float("nan"), seen


def wait_verified(socket_dir: Path, digests: set[str], since: float, timeout: float = 120.0) -> float:
    """Seconds from ``since`` (a ``time.monotonic()``) until the server lists every digest of ``digests`` as verified
    (entries back from a crash are served only to clients that checksum them until then: the scrub or a first client
    checks them); nan if that did not happen within ``timeout``."""
    while time.monotonic() - since < timeout:
        reply = status(socket_dir)
        rows = {row["digest"]: row for row in (reply or {"entries": []})["entries"]}
        if digests <= rows.keys() and all(rows[digest].get("verified", True) for digest in digests):
            return time.monotonic() - since
        time.sleep(0.01)
    return float("nan")


def successor(python: str, socket_dir: Path, log: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    command = [python, "-m", "weightcache.core.cli.cli", "serve", "--socket-dir", str(socket_dir), *args]
    with open(log, "ab") as out:
        return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True, env=env)


def checkout_env(checkout: Path, work: Path) -> tuple[dict, str]:
    """An environment whose ``weightcache`` is ``checkout`` (a shim on PYTHONPATH, ahead of the installed one), and the
    directory its ``weightcache.core`` is imported from there (checked, not assumed)."""
    package = work / "weightcache"
    package.mkdir(parents=True)
    for part in ("core", "adapters", "conformance"):
        (package / part).symlink_to(checkout.resolve() / part)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(work), os.environ.get("PYTHONPATH")]))}
    probe = "import weightcache.core, os; print(os.path.realpath(os.path.dirname(weightcache.core.__file__)))"
    where = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True).stdout.strip()
    return env, where


def fd_store_row(args, socket_dir: Path, current: subprocess.Popen, digests: set[str], entry_bytes: int, log: Path) -> dict:
    """SIGKILL under (a stand-in for) systemd: a server that kept every entry in the fd store, then one started with them."""
    from tests.fdstore_standin import StandInManager
    from weightcache.core.server.server_process import serve_command

    manager = StandInManager(str(socket_dir) + ".notify")
    procs = []
    try:
        current.terminate()  # the previous server: its entries come back from the engine and the take-over below
        current.wait(timeout=30)
        env = {**os.environ, "NOTIFY_SOCKET": manager.sock.getsockname()}
        with open(log, "ab") as out:
            kept_by_store = subprocess.Popen(serve_command(socket_dir), env=env, stdout=out, stderr=out)
        procs.append(kept_by_store)
        wait_for(socket_dir, kept_by_store.pid, set(), settle_s=0.0)
        held = {row["digest"] for row in (status(socket_dir) or {"entries": []})["entries"]}
        republish(args, digests - held)
        wait_until_stored = time.monotonic() + 30
        while manager.digests() != digests and time.monotonic() < wait_until_stored:
            time.sleep(0.01)
        stored = len(manager.digests() & digests)
        os.kill(kept_by_store.pid, signal.SIGKILL)
        kept_by_store.wait(timeout=30)
        restarted = manager.start_server(socket_dir, log)
        procs.append(restarted)
        began = time.monotonic()
        took, kept = wait_for(socket_dir, restarted.pid, digests, settle_s=2.0)
        verified_s = wait_verified(socket_dir, kept, since=began)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)
        manager.close()
    note = (
        f"a stand-in for systemd held {stored} entries; {args.attached} attached by an engine; "
        f"every entry checksummed (verified, served to every client) {verified_s:.2f} s after the restart"
    )
    return dict(
        way="SIGKILL, with fd store",
        note=note,
        kept=len(kept),
        of=len(digests),
        attachable_s=took,
        disk_bytes=(len(digests) - len(kept)) * entry_bytes,
    )


def republish(args, missing: set[str]) -> None:
    """Publish again the entries a crash lost (what the next engines would read from disk)."""
    for n in range(args.entries):
        if fingerprint(n, args.device).digest in missing:
            publish_entry(n, args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=100)
    parser.add_argument(
        "--device", type=parse_device, default="cpu", help="where the arenas live: cpu (host memfds) or cuda:N (VMM arenas)"
    )
    parser.add_argument("--mib", type=float, default=4.0, help="MiB per entry")
    parser.add_argument("--attached", type=int, default=10, help="entries this process keeps attached (an engine)")
    parser.add_argument(
        "--successor-checkout", type=Path, default=None, help="another checkout of weightcache, for the upgrade row"
    )
    parser.add_argument("--json", type=Path, default=None)
    return parser


def main(argv=None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' helpers: fingerprints, the fd-store stand-in
    args = build_parser().parse_args(argv)

    import torch

    from weightcache.core.flow.api import attach
    from weightcache.core.server.server_process import ServerProcess

    server = ServerProcess.start(None)
    socket_dir = server.socket_dir
    args.socket_dir = socket_dir
    procs: list[subprocess.Popen] = []
    attachments = []
    try:
        start = time.monotonic()
        digests = {publish_entry(n, args) for n in range(args.entries)}
        publish_s = time.monotonic() - start
        for n in range(args.attached):
            attachment = attach(fingerprint(n, args.device), socket_dir)
            attachment.watch(poll_s=0.05)
            attachments.append(attachment)
        rows = successions(args, server, digests, procs)
    finally:
        for attachment in attachments:
            attachment.close()
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)
        server.close()

    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
        "machine": f"{platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "device": str(args.device),
        "gpu": torch.cuda.get_device_name(args.device.torch()) if args.device.is_cuda else None,
        "torch": torch.__version__,
        "entries": args.entries,
        "mib_per_entry": args.mib,
        "attached": args.attached,
        "publish_s": publish_s,
        "rows": rows,
    }
    print(table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


def successions(args, server, digests: set[str], procs: list[subprocess.Popen]) -> list[dict]:
    """The rows: a planned restart, an upgrade (``--successor-checkout``), a SIGKILL without and with the fd store; each
    successor started is added to ``procs`` (the caller stops them)."""
    socket_dir, log = server.socket_dir, server.socket_dir / "successors.log"
    rows = []
    entry_bytes = int(args.mib * MIB)
    upgrade_env, upgrade_note = None, "this checkout again (no --successor-checkout)"
    if args.successor_checkout:
        upgrade_env, where = checkout_env(args.successor_checkout, socket_dir / "shim")
        upgrade_note = f"weightcache.core from {where}"
    ways = [("planned restart", None, "this checkout"), ("upgrade", upgrade_env, upgrade_note)]
    current = server.proc
    for name, env, note in ways:
        proc = successor(sys.executable, socket_dir, log, "--take-over", env=env)
        procs.append(proc)
        took, kept = wait_for(socket_dir, proc.pid, digests, settle_s=2.0)
        current.wait(timeout=30)
        rows.append(
            dict(
                way=name,
                note=note,
                kept=len(kept),
                of=len(digests),
                attachable_s=took,
                disk_bytes=(len(digests) - len(kept)) * entry_bytes,
            )
        )
        current = proc
    os.kill(current.pid, signal.SIGKILL)
    current.wait(timeout=30)
    proc = successor(sys.executable, socket_dir, log)
    procs.append(proc)
    took, kept = wait_for(socket_dir, proc.pid, digests, settle_s=2.0)
    rows.append(
        dict(
            way="SIGKILL, no fd store",
            note=f"{args.attached} attached by an engine",
            kept=len(kept),
            of=len(digests),
            attachable_s=took,
            disk_bytes=(len(digests) - len(kept)) * entry_bytes,
        )
    )
    rows.append(fd_store_row(args, socket_dir, proc, digests, entry_bytes, log))
    return rows


def where(result: dict) -> str:
    device = result.get("device", "cpu")
    return f"{device} ({result['gpu']})" if result.get("gpu") else f"{device} (host memfds)"


def table(result: dict) -> str:
    lines = [
        f"{result['entries']} entries of {result['mib_per_entry']:g} MiB on {where(result)}, {result['attached']} attached; "
        f"{result['date']}",
        "| way | entries kept | attachable again after | bytes to read from disk again | note |",
        "|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        kept = "—" if row["kept"] is None else f"{row['kept']} / {row['of']}"
        took = "—" if row["attachable_s"] is None else f"{1000 * row['attachable_s']:.0f} ms"
        disk = "—" if row["disk_bytes"] is None else f"{row['disk_bytes'] / MIB:.0f} MiB"
        lines.append(f"| {row['way']} | {kept} | {took} | {disk} | {row['note']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
