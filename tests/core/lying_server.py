"""A server that speaks our framing but lies: ``python -m tests.core.lying_server SOCKET_DIR REPLY_FILE``.

It listens at SOCKET_DIR/weightcache.sock (the directory must be private, as a
client checks it) and prints ``ready``. Every ``locate`` request is answered
with the JSON object in REPLY_FILE, read again for each request so that a test
can change its lie between calls; any other request gets a plain ok reply.
It serves one connection at a time until it is killed.
"""

from __future__ import annotations

import contextlib
import json
import socket
import sys
from pathlib import Path

from weightcache.core.errors import ProtocolError
from weightcache.core.socket_dir import SOCKET_NAME
from weightcache.core.wire.protocol import FrameReader, close_fds, ok_reply, send_frame


def serve(socket_dir: Path, reply_file: Path) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(socket_dir / SOCKET_NAME))
    listener.listen(16)
    print("ready", flush=True)
    while True:
        conn, _ = listener.accept()
        with conn, contextlib.suppress(OSError, TimeoutError, ProtocolError):  # a client gone: wait for the next
            reader = FrameReader(conn, deadline_s=10)
            while (frame := reader.read(idle_timeout=10)) is not None:
                message, fds = frame
                close_fds(fds)
                reply = json.loads(reply_file.read_text()) if message.get("op") == "locate" else ok_reply()
                send_frame(conn, reply)


if __name__ == "__main__":
    serve(Path(sys.argv[1]), Path(sys.argv[2]))
