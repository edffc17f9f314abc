"""``weightcache status`` and ``weightcache evict``: the entries the server holds, listed or dropped."""

from __future__ import annotations

import argparse
import json

from weightcache.core.cli.cli_options import Commands, add_command, add_socket_dir


def add_parser(commands: Commands) -> None:
    """``status`` and its options."""
    status = add_command(commands, "status", "list the server's entries: model, rank, device, size, attached engines")
    add_socket_dir(status)
    status.add_argument("--json", action="store_true", help="print the server's reply as JSON (fields: docs/operations.md)")


def add_evict_parser(commands: Commands) -> None:
    """``evict`` and its options."""
    evict = add_command(commands, "evict", "drop an entry (memory is freed once no engine maps it)")
    add_socket_dir(evict)
    evict.add_argument("digest", help="the entry's digest or a prefix of it (>= 4 characters), as `weightcache status` shows it")
    evict.add_argument("--force", action="store_true", help="evict even while engines are attached (their mappings stay valid)")


def run(args: argparse.Namespace) -> int:
    from weightcache.core.client.client import Connection

    with Connection(args.socket_dir) as connection:
        status = connection.status()
    if args.json:
        print(json.dumps(status, indent=2))
    else:
        print("\n".join(status_table(status)))
    return 0


def status_table(status: dict) -> list[str]:
    """The lines ``weightcache status`` prints for a status reply: a summary, then one row per entry."""
    from weightcache.core.progress import format_bytes

    entries = status["entries"]
    count = len(entries) + status.get("omitted", 0)
    budget = f" of a {format_bytes(status['byte_budget'])} budget" if status.get("byte_budget") else " (no budget)"
    lines = [
        f"server pid {status['pid']} (weightcache {status['version']}): {count} {'entry' if count == 1 else 'entries'}, "
        f"{format_bytes(status['held_bytes'])} held{budget}"
    ]
    lines += _tier_lines(status)
    lines += _counter_lines(status)
    if not entries:
        return lines
    rows = [("ID", "MODEL", "RANK", "DEVICE", "DTYPE", "SIZE", "TENSORS", "ATTACHED PIDS")]
    for e in entries:
        rows.append(
            (
                e["digest"][:12],
                (e["label"] or "-") + (" (unverified)" if e.get("verified") is False else ""),
                _rank(e["rank"]),
                _device_cell(e["device"]),
                e["dtype"],
                format_bytes(e["bytes"]),
                str(e["tensors"]),
                ",".join(map(str, e["attached_pids"])) or "-",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
    if status.get("omitted"):
        lines.append(f"... and {status['omitted']} more (a status reply holds as many rows as fit one frame; see --json)")
    return lines


def _tier_lines(status: dict) -> list[str]:
    """Bytes held per tier, when there is more than one or a tier has a budget of its own."""
    from weightcache.core.progress import format_bytes

    tiers = status.get("tiers") or {}
    if len(tiers) < 2 and not any(t.get("budget") for t in tiers.values()):
        return []
    lines = []
    for tier, held in tiers.items():
        budget = f" of {format_bytes(held['budget'])}" if held.get("budget") else ""
        lines.append(f"  {'host memory' if tier == 'host' else 'GPU ' + tier[:12]}: {format_bytes(held['held'])} held{budget}")
    return lines


def _counter_lines(status: dict) -> list[str]:
    """What the server counted since it started (``metrics``; absent from an older server's reply)."""
    metrics = status.get("metrics")
    if not isinstance(metrics, dict):
        return []

    def count(value: int, noun: str, plural: str | None = None) -> str:
        return f"{value} {noun if value == 1 else plural or noun + 's'}"

    return [
        f"  since its start {_duration(metrics.get('uptime_s', 0))} ago: {count(metrics.get('hits', 0), 'attach', 'attaches')}, "
        f"{count(metrics.get('misses', 0), 'miss', 'misses')}, {count(sum(metrics.get('fallbacks', {}).values()), 'fallback')} "
        f"reported, {count(sum(metrics.get('evictions', {}).values()), 'eviction')}, "
        f"{count(sum(metrics.get('refusals', {}).values()), 'refusal')}"
    ]


def _duration(seconds: float) -> str:
    """``42 s``, ``12 min``, ``5.2 h``, ``3.1 d``."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def _rank(text: str) -> str:
    """``tp0/2 pp0/1 ep0/1`` -> ``tp0/2``: the tensor-parallel rank, and the others only where they split the model."""
    parts = text.split()
    return " ".join(part for index, part in enumerate(parts) if index == 0 or not part.endswith("/1")) or "-"


def _device_cell(device: str) -> str:
    """``cpu (host)`` for a CPU engine's weights, ``host tier`` for a GPU's kept in host memory,
    ``cuda GPU-8f3e2a1b`` (the UUID's first 8 digits) for a GPU's."""
    if device == "cpu":
        return "cpu (host)"
    if device == "host":
        return "host tier"
    return f"cuda {device[:12]}"


def run_evict(args: argparse.Namespace) -> int:
    from weightcache.core.client.client import Connection

    with Connection(args.socket_dir) as connection:
        evicted = connection.evict(args.digest, force=args.force)
    for digest in evicted:
        print(f"evicted {digest[:12]}")
    return 0
