"""A stand-in for systemd's fd store (sd_notify's datagram protocol), for tests and benchmarks/server_restart.py."""

from __future__ import annotations

import array
import os
import socket
import subprocess
import threading

from weightcache.core.server.entry_record import read_record
from weightcache.core.server.server_process import serve_command
from weightcache.core.wire.protocol import close_fds


class StandInManager:
    """Records FDSTORE/FDSTOREREMOVE datagrams as systemd would: one fd per name here (the server sends one per name)."""

    def __init__(self, path: str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.settimeout(0.2)
        self.store: dict[str, int] = {}
        self.messages: list[dict] = []
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        space = socket.CMSG_SPACE(253 * 4)
        while not self._stop.is_set():
            try:
                data, ancillary, _, _ = self.sock.recvmsg(4096, space)
            except TimeoutError:
                continue
            fds = array.array("i")
            for level, kind, blob in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.frombytes(blob[: len(blob) - len(blob) % fds.itemsize])
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            with self.lock:
                self.messages.append(fields)
                name = fields.get("FDNAME", "stored")
                if fields.get("FDSTORE") == "1":
                    close_fds([self.store.pop(name)] if name in self.store else [])
                    self.store[name] = fds[0]
                    close_fds(fds[1:])
                elif fields.get("FDSTOREREMOVE") == "1":
                    close_fds([self.store.pop(name)] if name in self.store else [])
                else:
                    close_fds(fds)

    def digests(self) -> set[str]:
        """The entries stored whole: the record, the table and every arena the record names (the server sends them
        one datagram each, so a test that reads the store mid-way must not take the record's arrival for the entry)."""
        whole = set()
        with self.lock:
            for name, fd in self.store.items():
                _, digest, index = name.split(".")
                arenas = len(read_record(fd)["manifest"]["arenas"]) if index == "0" else -1
                if arenas >= 0 and all(f"wc.{digest}.{n}" in self.store for n in range(1, 2 + arenas)):
                    whole.add(digest)
        return whole

    def start_server(self, socket_dir, log) -> subprocess.Popen:
        """Start a server as systemd restarts a unit: the stored fds from fd 3 on, named in LISTEN_FDNAMES."""
        with self.lock:
            names, fds = list(self.store), list(self.store.values())
        high = [os.dup(fd) for fd in fds]  # out of the way of fds 3..n

        def arrange() -> None:
            for offset, fd in enumerate(high):
                os.dup2(fd, 3 + offset)

        env = {
            **os.environ,
            "NOTIFY_SOCKET": self.sock.getsockname(),
            "LISTEN_FDS": str(len(fds)),
            "LISTEN_FDNAMES": ":".join(names),
        }
        command = ["sh", "-c", 'LISTEN_PID=$$ exec "$@"', "sh", *serve_command(socket_dir)]
        try:
            with open(log, "ab") as out:
                return subprocess.Popen(command, env=env, stdout=out, stderr=out, close_fds=False, preexec_fn=arrange)
        finally:
            close_fds(high)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close()
        close_fds(self.store.values())
