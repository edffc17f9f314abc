"""``weightcache check-config`` and ``serve --check-config``: what a start with these settings would do, checked
without serving.

The settings are parsed as ``serve`` parses them (a mistake there is one error line). Then each warm item is taken as
far as its ``weightcache load`` would go before reading a weight: the model resolves (a path, or a hub id in the local
cache) and its weight files' headers read, the adapter, dtype, device and quantization method resolve, the adapter
describes the model. Then the budgets are held against the machine and the warm items' sizes. Each problem is one
line: an error where the start would fail at it, a warning where it would run but not as the file reads. Exit 0 when
there is no error (warnings or not), 1 when there is one.
"""

from __future__ import annotations

import argparse
import logging
import sys
import typing

import attrs

from weightcache.core.cli.cli_options import add_command

if typing.TYPE_CHECKING:
    from weightcache.core.server.serve_config import WarmItem
    from weightcache.core.server.server import ServerConfig

log = logging.getLogger(__name__)


@attrs.frozen
class Problem:
    """One problem found: ``error`` (a start fails at it) or ``warning`` (it runs, not as the file reads)."""

    level: str
    text: str


def add_parser(commands: argparse._SubParsersAction) -> None:
    """``check-config`` and its option."""
    check = add_command(
        commands,
        "check-config",
        "check a serve config file as a start would (settings, each warm item's model, adapter and options, the "
        "budgets against this machine) without serving; exit 0 valid (warnings or not), 1 with an error",
    )
    check.add_argument("--config", metavar="FILE.toml", help="the file `serve --config` would read (default: none)")


def run(args: argparse.Namespace) -> int:
    """``weightcache check-config [--config F]``."""
    from pathlib import Path

    from weightcache.core.server.serve_config import ServeSource
    from weightcache.core.server.server import ServerConfig

    source = ServeSource(Path(args.config) if args.config else None, {})
    settings, warm = source.read()
    config = ServerConfig(**{"socket_dir": None, **settings})
    logged = source.logging()
    shown = {"log_level": logged.get("log_level", "info"), "log_format": logged.get("log_format", "text")}
    return report("weightcache check-config", config, warm, shown, args.config)


def report(who: str, config: ServerConfig, warm: typing.Sequence[WarmItem], logged: dict, path: object) -> int:
    """Check ``config`` and ``warm``, print the settings, the warm list and a line per problem; the exit status."""
    from weightcache.core.server.http_endpoint import resolve

    if config.metrics_port is not None:
        resolve(config.metrics_host, config.metrics_port, "--metrics-host")  # ListenerUnavailable: one line
    problems = check(config, warm)
    errors = sum(1 for problem in problems if problem.level == "error")
    warnings = len(problems) - errors
    verdict = "the settings are valid" if not errors else _count(errors, "error")
    if warnings:
        verdict += f", {_count(warnings, 'warning')}"
    print(f"{who}: {verdict}{f' ({path})' if path else ''}")
    shown = {field: getattr(config, field) for field in ("socket_dir", "byte_budget", "host_budget", "gpu_budget")}
    shown |= {field: getattr(config, field) for field in ("idle_timeout_s", "max_connections", "frame_deadline_s")}
    shown |= {"metrics": None if config.metrics_port is None else f"{config.metrics_host}:{config.metrics_port}"}
    shown |= logged
    for key, value in shown.items():
        print(f"  {key} = {value if value is not None else 'none'}")
    print(f"  warm: {_count(len(warm), 'item')}")
    for item in warm:
        print(f"    {item.model} ({item.device}, tier {item.tier}{f', {item.dtype}' if item.dtype else ''})")
    sys.stdout.flush()
    for problem in problems:
        print(f"weightcache: {problem.level}: {problem.text}", file=sys.stderr)
    return 1 if errors else 0


def check(config: ServerConfig, warm: typing.Sequence[WarmItem]) -> list[Problem]:
    """Every problem of ``warm``'s items and of the budgets, in the order a start meets them."""
    problems: list[Problem] = []
    sizes: list[tuple[WarmItem, int]] = []
    for index, item in enumerate(warm, 1):
        name = f"warm item {index} ({item.model})"
        try:
            sizes.append((item, _item_bytes(item)))
        except Exception as exc:
            from weightcache.core.cli.reporting import user_error

            text = user_error(exc)
            if text is None:
                raise
            problems.append(Problem("error", f"{name}: {text}"))
    problems += _budget_problems(config, sizes)
    return problems


def _item_bytes(item: WarmItem) -> int:
    """What ``weightcache load`` checks before reading a weight, for ``item``; the least bytes its entry holds."""
    from weightcache.core.fingerprint import ParallelSpec
    from weightcache.core.flow import loader
    from weightcache.core.identity import hub
    from weightcache.core.identity.safetensors_io import check_checkpoint
    from weightcache.core.load import preflight
    from weightcache.core.request import LoadRequest

    where = hub.require_cached(hub.resolve(item.model, None))
    request = LoadRequest(
        model=where.path,
        adapter=item.adapter,
        dtype=item.dtype,
        device=item.device,
        quantization=item.quant,
        parallel=ParallelSpec(),
    )
    loader.Tier(item.tier, request.device)
    headers = check_checkpoint(request.model)  # the files exist, this user reads them, their headers are sound
    preflight.check_device(request.device)
    prepared = loader.prepare(loader.check(request))
    return preflight.estimated_bytes(headers, prepared.description)


def _budget_problems(config: ServerConfig, sizes: list[tuple[WarmItem, int]]) -> list[Problem]:
    """Budgets larger than this machine's memory, and warm items that cannot fit their budget."""
    from weightcache.core.progress import format_bytes

    problems = []
    memory = _host_memory()
    for value, name in ((config.byte_budget, "byte_budget"), (config.host_budget, "host_budget")):
        if value is not None and memory and value > memory:
            problems.append(
                Problem(
                    "warning",
                    f"{name} {format_bytes(value)} is more than this machine's memory ({format_bytes(memory)}): "
                    "the kernel, not the budget, would stop the server first; lower it",
                )
            )
    for item, nbytes in sizes:
        on_host = item.tier in ("host", "both") or not item.device.startswith("cuda")
        limits = [(config.byte_budget, "byte_budget")]
        limits += [(config.host_budget, "host_budget")] if on_host else []
        limits += [(config.gpu_budget, "gpu_budget")] if item.device.startswith("cuda") and item.tier != "host" else []
        for value, name in limits:
            if value is not None and nbytes > value:
                problems.append(
                    Problem(
                        "warning",
                        f"warm item {item.model} needs {format_bytes(nbytes)} or more, over {name} "
                        f"{format_bytes(value)}: it will fail with over_budget; raise {name} or drop the item",
                    )
                )
    return problems


def _host_memory() -> int | None:
    """This machine's memory in bytes (``MemTotal``), None where /proc does not say."""
    from weightcache.core.load.prefetch import meminfo_bytes

    return meminfo_bytes("MemTotal")


def _count(n: int, word: str) -> str:
    return f"{n} {word}{'s' if n != 1 else ''}"
