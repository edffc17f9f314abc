"""Keeping a restarted server's table full: engines publish what they map again, without touching the disk."""

from __future__ import annotations

import logging
import socket
import threading

from weightcache.core.errors import AccessDenied, ChecksumMismatch, ServerError, ServerUnavailable

log = logging.getLogger(__name__)


class Republisher(threading.Thread):
    """Watches an attachment's connection; when the server goes away, waits for the next one and re-publishes.

    The engine keeps running on its mapped weights all along: the memory lives
    as long as this process holds its fds and mappings.
    """

    def __init__(self, attachment, poll_s: float = 0.2):
        super().__init__(name=f"weightcache-watch-{attachment.digest[:8]}", daemon=True)
        self.attachment = attachment
        self.poll_s = poll_s
        self._stop_event = threading.Event()
        self.republished = threading.Event()  # set after each successful re-publish (tests wait on it)

    def run(self) -> None:
        while not self._stop_event.is_set():
            self._wait_for_server_loss()
            if self._stop_event.is_set():
                return
            log.warning(
                "weightcache: the server went away; %s stays mapped here and will be published again when a server is back",
                self.attachment.label or self.attachment.digest[:12],
            )
            self.republished.clear()
            while not self._stop_event.wait(self.poll_s):
                try:
                    created = self.attachment.reattach()
                except (ServerUnavailable, ConnectionError, OSError):
                    continue
                except (ServerError, AccessDenied, ChecksumMismatch) as exc:
                    log.error("weightcache: could not publish %s again: %s", self.attachment.digest[:12], exc)
                    return
                log.info(
                    "weightcache: published %s to the new server (%s)",
                    self.attachment.digest[:12],
                    "first" if created else "already there",
                )
                self.republished.set()
                break

    def _wait_for_server_loss(self) -> None:
        connection = self.attachment.connection
        if connection is None:
            return
        sock = connection._sock
        try:
            sock.settimeout(None)
            while not self._stop_event.is_set():
                if not sock.recv(1):  # the server never speaks unasked: EOF means it is gone
                    return
        except OSError:
            return

    def stop(self) -> None:
        self._stop_event.set()
        connection = self.attachment.connection
        if connection is not None:
            try:
                connection._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=5)
