"""Where the server's socket lives, and the checks that keep other users out of it (both sides).

One rule set, two strictnesses: the server makes and keeps its directory
private (owned by itself, no group or other bits); a client trusts a
directory owned by itself or root that nobody else can write, and a server
process that runs as itself or root. A cache miss is always safe; a wrong
hit never is, so a client refuses before it sends anything.
"""

from __future__ import annotations

import os
import pwd
import socket
import stat
import struct
from pathlib import Path

from weightcache.core.errors import AccessDenied
from weightcache.core.socket_dir import ENV_SOCKET_DIR

ROOT_UID = 0

_ELSEWHERE = f"choose another socket directory with --socket-dir or {ENV_SOCKET_DIR}"
_WHAT_TO_DO = f"remove it, or {_ELSEWHERE}"
_UCRED = struct.Struct("3i")


def user_label(uid: int) -> str:
    """``uid 65534 (nobody)``, or ``uid 65534`` when the user database does not know it."""
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def trusted_uid(uid: int, own_uid: int) -> bool:
    """Whether a process of ``own_uid`` may trust a directory or server process of ``uid``: its own, or root's."""
    return uid in (own_uid, ROOT_UID)


def _check_dir(path: Path, allow_root: bool, forbidden_mode: int) -> os.stat_result:
    """The one rule for a socket directory: a real directory (lstat), owned by this user (or root), no ``forbidden_mode`` bits.

    Raises FileNotFoundError when it is missing and AccessDenied when it breaks the rule.
    """
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        raise AccessDenied(
            f"socket directory {path} is a symlink; use a real directory owned by you with mode 0700: {_WHAT_TO_DO}"
        )
    if not stat.S_ISDIR(info.st_mode):
        raise AccessDenied(f"socket directory {path} is not a directory; {_WHAT_TO_DO}")
    own = os.geteuid()
    if not (trusted_uid(info.st_uid, own) if allow_root else info.st_uid == own):
        or_root = " or root" if allow_root and own != ROOT_UID else ""
        raise AccessDenied(
            f"socket directory {path} belongs to {user_label(info.st_uid)}, not to you (uid {own}){or_root}: "
            f"another user may have made it to stand in for your server; {_WHAT_TO_DO}"
        )
    if info.st_mode & forbidden_mode:
        raise AccessDenied(
            f"socket directory {path} has mode {stat.S_IMODE(info.st_mode):04o}; others could replace the socket. "
            f"Run `chmod 700 {path}` as its owner, or {_ELSEWHERE}"
        )
    return info


def check_client_dir(path: str | os.PathLike) -> Path:
    """A client's check of the server's directory: owned by this user or root, not a symlink, nobody else may write it.

    Raises FileNotFoundError when it is missing and AccessDenied when it breaks the rule.
    """
    path = Path(path)
    _check_dir(path, allow_root=True, forbidden_mode=0o022)
    return path


def check_parent_dir(path: str | os.PathLike) -> None:
    """The directory holding a socket directory: owned by this user or root; others may write it only with the sticky bit.

    Otherwise another user could rename the socket directory away and put their own in its place.
    """
    parent = Path(path).parent
    info = os.stat(parent)
    if not trusted_uid(info.st_uid, os.geteuid()):
        raise AccessDenied(
            f"{parent}, which holds socket directory {Path(path).name}, belongs to {user_label(info.st_uid)}: that user "
            f"could replace the socket directory; {_ELSEWHERE}"
        )
    if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
        raise AccessDenied(
            f"{parent}, which holds socket directory {Path(path).name}, has mode {stat.S_IMODE(info.st_mode):04o}: others "
            f"may write it without the sticky bit and could replace the socket directory. Run `chmod o-w,g-w {parent}` "
            f"(or `chmod +t`), or {_ELSEWHERE}"
        )


def ensure_private_dir(path: str | os.PathLike) -> Path:
    """The server's directory: create ``path`` with mode 0700 if missing, then check it and its parent.

    Refuses a symlink, a directory owned by another user, one that the group
    or others can write or enter, and a parent that others could write
    without the sticky bit: any of these would let another user swap the
    socket for their own.
    """
    path = Path(path)
    if path.parent.exists():
        check_parent_dir(path)
    try:
        path.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    check_parent_dir(path)
    _check_dir(path, allow_root=False, forbidden_mode=0o077)
    return path


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end of ``sock`` (SO_PEERCRED)."""
    return _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))


def check_server_peer(sock: socket.socket, path: str | os.PathLike) -> None:
    """A client's check of the process it reached at ``path``: it must run as this user or root."""
    pid, uid, _ = peer_credentials(sock)
    if not trusted_uid(uid, os.geteuid()):
        raise AccessDenied(
            f"the server at {path} (pid {pid}) runs as {user_label(uid)}, not as you (uid {os.geteuid()}) or root: "
            f"it may be another user's stand-in, so nothing was sent to it. Remove {Path(path).parent}, or {_ELSEWHERE}"
        )
