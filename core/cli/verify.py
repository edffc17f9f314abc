"""Scrubbing a server's entries: every arena's bytes checked against the checksum published with it.

    weightcache verify [ID] [--drop [--force]] [--socket-dir S]

Each entry the server holds (or the one whose digest starts with ID) is attached by its
digest, every arena is checksummed where it lives (a GPU entry on its GPU: this process
needs CUDA and that GPU; a host-tier or CPU entry on the CPU) and compared with the
checksum its publisher computed when it sealed the arena. One line per entry:
``ok``, ``CORRUPT arena N[, M...]`` or ``SKIPPED (why)``. An entry found ok that was
not verified since a server crash is verified from then on (served to every client).

With ``--drop`` a corrupt entry is evicted, so no engine attaches it again; one that
engines have attached is evicted only with ``--force`` as well (their mappings stay,
and they keep running on the corrupt bytes until restarted).

Exit status: 0 every entry checked is ok; 2 an entry is corrupt; 3 none is corrupt
but some could not be checked (a GPU not visible here); 1 an error (no server, no
entry matches ID).
"""

from __future__ import annotations

import argparse
import logging
import typing

import attrs

from weightcache.core.arena.checksum import mismatched
from weightcache.core.cli.cli_options import help_text
from weightcache.core.client.attach import Attachment
from weightcache.core.client.client import Connection
from weightcache.core.client.replies import HeldEntry, ServerStatus
from weightcache.core.errors import AmbiguousDigest, ServerError, WeightCacheError
from weightcache.core.progress import ByteProgress, NoProgress, byte_progress, counted, format_bytes
from weightcache.core.socket_dir import SocketDir, SocketDirLike

log = logging.getLogger(__name__)

OK, CORRUPT, SKIPPED = 0, 2, 3
"""Exit statuses of ``weightcache verify`` (1 is any error, as for every command)."""


@attrs.frozen
class Verdict:
    """What checking one entry found: ``corrupt`` arena indices, or why it was ``skipped``; ``dropped`` if evicted."""

    digest: str
    label: str
    nbytes: int
    corrupt: tuple[int, ...] = ()
    skipped: str = ""
    attached_pids: tuple[int, ...] = ()
    dropped: bool = False

    @property
    def ok(self) -> bool:
        return not self.corrupt and not self.skipped

    def line(self) -> str:
        """The line ``weightcache verify`` prints for this entry."""
        head = f"{self.digest[:12]}  {self.label or '-'}  {format_bytes(self.nbytes)}: "
        if self.skipped:
            return head + f"SKIPPED ({self.skipped})"
        if not self.corrupt:
            return head + "ok"
        text = head + f"CORRUPT arena {', '.join(map(str, self.corrupt))}"
        if self.dropped:
            return text + " (dropped)"
        if self.attached_pids:
            return text + f" (attached by pids {list(self.attached_pids)}: restart those engines from disk)"
        return text


def verify_entries(
    socket_dir: SocketDirLike = None,
    prefix: str = "",
    drop: bool = False,
    force: bool = False,
    progress: "ByteProgress | NoProgress | None" = None,
    report: typing.Callable[[Verdict], None] | None = None,
) -> list[Verdict]:
    """Check every entry (or the one whose digest starts with ``prefix``); evict corrupt ones with ``drop``.

    ``report`` is called with each verdict as soon as it is known; ``progress`` counts the bytes checked.
    """
    socket_dir = SocketDir.parse(socket_dir)
    with Connection(socket_dir) as connection:
        held = ServerStatus.from_json(connection.status()).entries
    rows = [row for row in held if row.digest.startswith(prefix)]
    if prefix and not rows:
        raise ValueError(f"no entry's digest starts with {prefix!r}; `weightcache status` lists them")
    if prefix and len(rows) > 1:
        raise AmbiguousDigest(prefix, sorted(row.digest for row in rows))
    progress = progress or NoProgress()
    verdicts = []
    for row in rows:
        verdict = _verify(row, socket_dir, progress)
        if verdict.corrupt and drop:
            verdict = _drop(verdict, socket_dir, force)
        verdicts.append(verdict)
        if report is not None:
            report(verdict)
    progress.close()
    return verdicts


def _verify(row: HeldEntry, socket_dir: SocketDir, progress) -> Verdict:
    verdict = Verdict(row.digest, row.label, row.nbytes)
    try:
        attachment = Attachment.by_digest(row.digest, socket_dir)
    except ServerError as exc:
        if exc.code == "not_found":  # evicted since the status
            return attrs.evolve(verdict, skipped="evicted meanwhile")
        raise
    except WeightCacheError as exc:  # a GPU entry where that GPU or CUDA is not usable
        return attrs.evolve(verdict, skipped=str(exc).splitlines()[0][:300])
    try:
        corrupt = tuple(index for index, _ in mismatched(attachment.arenas, progress))
        if not corrupt:
            attachment.confirm_verified()  # an entry back from a crash is served to every client from now on
        if attachment.connection is not None:
            attachment.connection.detach(attachment.digest)  # before an evict: this scrub holds no entry attached
    finally:
        attachment.close()
    for index in corrupt:
        log.error("entry %s (%s): arena %d does not match its checksum", row.digest[:12], verdict.label, index)
    return attrs.evolve(verdict, corrupt=corrupt)


def _drop(verdict: Verdict, socket_dir: SocketDir, force: bool) -> Verdict:
    with Connection(socket_dir) as connection:
        pids = connection.drop_corrupt(verdict.digest, force=force)
    if pids is None:
        return attrs.evolve(verdict, dropped=True)
    return attrs.evolve(verdict, attached_pids=pids)


def exit_status(verdicts: typing.Sequence[Verdict]) -> int:
    """OK, CORRUPT (any corrupt entry) or SKIPPED (none corrupt, some not checked)."""
    if any(verdict.corrupt for verdict in verdicts):
        return CORRUPT
    if any(verdict.skipped for verdict in verdicts):
        return SKIPPED
    return OK


# --- the `weightcache verify` command (registered under the `weightcache.commands` entry points) ------------------------


def add_parser(subparsers: "argparse._SubParsersAction") -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "verify",
        help="check every held entry's bytes against their checksums (a scrub); --drop evicts corrupt ones",
        description=help_text(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from weightcache.core.cli.cli_options import add_socket_dir

    add_socket_dir(parser)
    parser.add_argument("id", nargs="?", default="", metavar="ID", help="check only the entry whose digest starts with ID")
    parser.add_argument("--drop", action="store_true", help="evict each corrupt entry (unless engines have attached it)")
    parser.add_argument("--force", action="store_true", help="with --drop: evict a corrupt entry even if engines attached it")
    return parser


def run(args: argparse.Namespace) -> int:
    if args.force and not args.drop:
        raise ValueError("--force only goes with --drop")
    with Connection(args.socket_dir) as connection:
        held = ServerStatus.from_json(connection.status()).entries
    total = sum(row.nbytes for row in held if row.digest.startswith(args.id))
    verdicts = verify_entries(
        args.socket_dir,
        args.id,
        drop=args.drop,
        force=args.force,
        progress=byte_progress("verifying", total),
        report=lambda verdict: print(verdict.line(), flush=True),
    )
    corrupt = sum(1 for verdict in verdicts if verdict.corrupt)
    print(f"{counted(len(verdicts), 'entry')} checked, {corrupt} corrupt", flush=True)
    return exit_status(verdicts)
