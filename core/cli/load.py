"""``weightcache load``: check what can be checked before a weight is read, then load and publish."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import threading
import time
import typing

from weightcache.core.cli.cli_options import Commands, add_command, add_request_options

if typing.TYPE_CHECKING:
    from weightcache.core.flow.loader import Checked, Tier
    from weightcache.core.load.prefetch import Prefetch

log = logging.getLogger(__name__)


def add_parser(commands: Commands) -> None:
    """``load`` and its options."""
    load = add_command(commands, "load", "load a checkpoint into arenas and publish it to the server (once per model and rank)")
    add_request_options(load)
    load.add_argument(
        "--tier",
        choices=("device", "host", "both"),
        default="device",
        help="keep the model on --device (default), on the host tier only (GPU-made weights in host memory, "
        "from which a GPU fills again in about a second), or both; host and both need a CUDA --device",
    )
    load.add_argument(
        "--no-prefetch",
        dest="prefetch",
        action="store_false",
        help="do not read the weight files into the page cache while Python imports (by default at most half the "
        "available memory is read ahead, until the load reads them or finds them cached)",
    )


def run(args: argparse.Namespace) -> int:
    """Check everything that can be checked before reading a weight, then load and publish (see docs/operations.md)."""
    try:
        return _run(args)
    except KeyboardInterrupt:
        # The entry is published in one request at the end: a load stopped before its reply published nothing.
        print(f"weightcache: load of {args.model} stopped (Ctrl-C); nothing was published", file=sys.stderr, flush=True)
        raise


def _run(args) -> int:
    from weightcache.core.cli.cli_options import load_request
    from weightcache.core.client.client import Connection
    from weightcache.core.flow import loader
    from weightcache.core.flow.plan import no_other_source
    from weightcache.core.identity.safetensors_io import Sighting, check_checkpoint
    from weightcache.core.progress import note

    note(f"checking {args.model} ...")
    request = load_request(args)  # device, dtype, ranks, options; a hub id becomes its snapshot directory in the local hub cache
    tier = loader.Tier(args.tier, request.device)  # checked once, here; publish takes it as it is
    checked = loader.check(request)  # adapter, options, the method asked for: once, here; prepare goes on from it
    declared = checked.adapter.checkpoint_files(checked.request)
    headers = check_checkpoint(request.model, declared)  # no weight byte read
    log.debug("load: options and %d weight file headers checked", len(headers))
    with Connection(args.socket_dir) as connection:
        connection.hello()  # no server: say so now, before a thread starts importing beside this one
    log.debug("load: the server answered")
    # The adapter imports its framework meanwhile (nothing where the hf adapter remembers the model's layout), while
    # this thread makes the CUDA context and the plan. The disk starts now only where nothing but the disk can hold
    # these bytes (``no_other_source``); else once the plan says the disk.
    with _ReadAhead(headers, args.prefetch) as reading, _warming_up(checked.adapter, checked.request):
        if no_other_source(Sighting.of(request.model, headers=headers, declared=declared).identity is None):
            reading.start()
        return _load_checked(args, checked, tier, headers, reading)


@contextlib.contextmanager
def _warming_up(adapter, request):
    """The adapter's ``warm_up`` (its framework's and the model's imports) in a thread of its own, joined at the end of
    a load that succeeds.

    A failure here is left for the load itself to report, where it happens again with its context. A load that fails
    does not wait for the imports: its error is reported at once and the command exits (the thread is a daemon).
    """

    def warm_up() -> None:
        from weightcache.core.load.importing import importing

        began = time.monotonic()
        try:
            with importing():  # a read that starts meanwhile takes whole pieces (few returns to the interpreter lock)
                adapter.warm_up(request, for_publish=True)
        except Exception as exc:  # the load raises it again, with its context
            log.debug("warming up the %s adapter failed: %s", request.adapter, exc, exc_info=True)
        else:
            log.debug("load: the %s adapter warmed up (its imports) in %.2f s", request.adapter, time.monotonic() - began)

    thread = threading.Thread(target=warm_up, name="weightcache-warm-up", daemon=True)
    thread.start()
    yield  # an exception leaves here without the join
    thread.join()


class _ReadAhead:
    """Reads of the weight files into the page cache ahead of the load (a ``Prefetch``), from ``start()`` (at most
    once; nothing unless ``wanted``) to the end of the ``with`` (or the reader, which takes over).

    A restart's plan is known only once torch is imported and the CUDA context made (the fingerprint names the GPU and
    the CUDA version): its reads start when the plan says the disk. A first sight without a fleet starts at once.
    """

    def __init__(self, headers, wanted: bool):
        self.files = [header.file for header in headers]
        self.wanted = wanted
        self._prefetch: Prefetch | None = None

    def start(self) -> None:
        from weightcache.core.load.prefetch import Prefetch

        if self.wanted and self._prefetch is None:
            self._prefetch = Prefetch(self.files).__enter__()

    def __enter__(self) -> "_ReadAhead":
        return self

    def __exit__(self, *exc: object) -> None:
        if self._prefetch is not None:
            self._prefetch.stop()


def _load_checked(args, checked: "Checked", tier: "Tier", headers, reading: _ReadAhead) -> int:
    """``run`` once the options, the tier and the checkpoint's headers are checked: the plan, printed, then done."""
    from weightcache.core.flow import loader
    from weightcache.core.load import preflight
    from weightcache.core.progress import byte_progress, format_bytes, note

    request = checked.request
    preflight.check_device(request.device)
    log.debug("load: %s ready", request.device)
    prepared = loader.prepare(checked)  # the adapter reads the configs
    prepared.check_first_sight(headers)  # checked above: their versions identify the checkpoint, no stat again
    log.debug("load: the adapter described the model")
    plan = loader.plan_for(prepared, args.socket_dir, tier)  # the one question to the server: where the bytes come from
    note(f"plan: {plan.describe()}")
    log.info("load: the plan for %s: %s", prepared.label, plan.describe())
    if plan.settled:
        plan.close()
        for kept in plan.tiers:
            entry = plan.status.held([kept.digest])[kept.digest] if plan.status and kept.digest else None
            size = f", {format_bytes(entry.nbytes)}" if entry is not None else ""
            label = entry.label if entry is not None else prepared.label
            print(f"already cached{_WHERE[kept.name]}: {(kept.digest or '')[:12]}  {label}{size}; nothing was loaded")
        return 0
    if plan.fingerprint is None:
        note("first sight of these weight files: their digests are computed from the bytes read, in the same pass")
    needed = preflight.estimated_bytes(headers, prepared.description)
    for kept in plan.tiers:
        if not kept.held and plan.status is not None:
            preflight.check_room(plan.status, needed, tier=kept.kept_on)
    if plan.reads_disk_first:
        reading.start()
    note(f"loading {prepared.label} ({format_bytes(needed)} or more) into {request.device} arenas ...")
    published = loader.publish(prepared, args.socket_dir, progress=byte_progress("loading", total=needed), tier=tier, plan=plan)
    log.debug("load: published; its steps (s): %s", {key: round(value, 3) for key, value in published.timings.items()})
    _report(published, plan, prepared.label, tier)
    return 0


_WHERE = {"device": "", "host": " on the host tier"}
"""How messages say a tier of the plan: nothing for the device's entry."""


def _report(published, plan, label: str, tier: "Tier") -> None:
    """The outcome, one line on stdout."""
    from weightcache.core.progress import format_bytes

    manifest = published.manifest
    source = "" if published.origin.kind == "disk" else f", copied from {published.origin}"
    both = tier.on_device and tier.on_host
    host = f"; kept on the host tier as {published.host_digest[:12]}" if published.host_digest and both else ""
    if not published.created:
        if host and published.host_digest and published.origin.kind == "this_gpu":
            print(f"kept {published.host_digest[:12]}  {label} on the host tier, copied from this GPU's entry")
        else:
            why = "another loader published it meanwhile" if plan.fingerprint is not None else "it held these bytes already"
            print(f"already cached: {published.digest[:12]}  {label} ({why})")
        return
    arenas = len(manifest.arenas)
    where = "" if tier.on_device else " on the host tier"
    print(
        f"published {published.digest[:12]}  {label}{where}: {len(manifest.tensors)} tensors, "
        f"{format_bytes(manifest.nbytes)} in {arenas} arena{'s' if arenas != 1 else ''}, "
        f"{sum(published.timings.values()):.2f} s{source}{host}"
    )
