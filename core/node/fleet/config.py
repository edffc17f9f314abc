"""Where a node finds its fleet: the registry's endpoints, the shared secret, this node's name and the deadlines.

Read once from the environment (``FleetConfig.from_env``), so a ``load`` and an engine
in ``daemon`` mode see the same settings as the node's sharing agent:

    WEIGHTCACHE_FLEET_ETCD          etcd endpoints, comma-separated (http://10.0.0.5:2379); unset: no fleet
    WEIGHTCACHE_FLEET_SECRET_FILE   a file (0600, this user's) holding the fleet's shared secret
    WEIGHTCACHE_FLEET_SECRET        the secret itself (tests; a file keeps it out of process listings)
    WEIGHTCACHE_FLEET_NODE          this node's name in the registry (default: the host name, and for a user other
                                    than root ``-u<uid>`` after it: two users' servers on one host are two nodes)
    WEIGHTCACHE_FLEET_DEADLINE_S    longest wait for one registry request (default 2)
    WEIGHTCACHE_FLEET_WAIT_S        longest wait for another node that is filling the same entry (default 600)
    WEIGHTCACHE_FLEET_PREFIX        the registry's key prefix (default /weightcache), one per fleet sharing an etcd
    WEIGHTCACHE_FLEET_LEASE_TTL_S   how long a node's records outlive it when it dies without revoking (default 10)
    WEIGHTCACHE_FLEET_DEVICES       network interfaces the transport may use, comma-separated (default: its choice)
    WEIGHTCACHE_FLEET_FANOUT        how many nodes read from one holder at once (default 2); the others wait for a
                                    slot on it or on a node that has finished (the fill spreads as a tree)
    WEIGHTCACHE_FLEET_RELAY         1 (default): a node serves the arenas it has checked while it pulls, and reads
                                    from the relay ahead of it (a chain); 0: it reads from full holders only
    WEIGHTCACHE_FLEET_PIECE_BYTES   the least a relaying node reads of an arena at once (default 1048576); it lists
                                    each piece as it lands, for the node behind it to read (a read of more than 64
                                    pieces' worth goes in 64 larger ones)
    WEIGHTCACHE_FLEET_ETCD_CA, _CERT, _KEY, _USER, _PASSWORD_FILE
                                    TLS with a private CA and a client certificate, and etcd's user/password auth
                                    (``etcd_access``)
"""

from __future__ import annotations

import os
import socket
import typing

import attrs

from weightcache.core.node.fleet.etcd import endpoints_tuple
from weightcache.core.node.fleet.etcd_access import EtcdAccess, read_private_file

ENV_ETCD: typing.Final = "WEIGHTCACHE_FLEET_ETCD"
ENV_SECRET_FILE: typing.Final = "WEIGHTCACHE_FLEET_SECRET_FILE"
ENV_SECRET: typing.Final = "WEIGHTCACHE_FLEET_SECRET"
ENV_NODE: typing.Final = "WEIGHTCACHE_FLEET_NODE"
ENV_DEADLINE: typing.Final = "WEIGHTCACHE_FLEET_DEADLINE_S"
ENV_WAIT: typing.Final = "WEIGHTCACHE_FLEET_WAIT_S"
ENV_PREFIX: typing.Final = "WEIGHTCACHE_FLEET_PREFIX"
ENV_LEASE_TTL: typing.Final = "WEIGHTCACHE_FLEET_LEASE_TTL_S"
ENV_DEVICES: typing.Final = "WEIGHTCACHE_FLEET_DEVICES"
ENV_FANOUT: typing.Final = "WEIGHTCACHE_FLEET_FANOUT"
ENV_RELAY: typing.Final = "WEIGHTCACHE_FLEET_RELAY"
ENV_PIECE_BYTES: typing.Final = "WEIGHTCACHE_FLEET_PIECE_BYTES"
MIN_PIECE_BYTES: typing.Final = 4096
SHARED_WAIT_S: typing.Final = 10.0
"""How long a claimant that published waits for its node's sharing agent to list the entry before it lets go (an
agent on a loaded 2-core machine took more than 5 s to register and list an entry)."""
MIN_SECRET_BYTES: typing.Final = 16
MAX_SECRET_BYTES: typing.Final = 4096


@attrs.frozen
class FleetConfig:
    """One node's view of its fleet (see the module's docstring for the environment it is read from)."""

    endpoints: tuple[str, ...] = attrs.field(converter=endpoints_tuple)
    secret: bytes = attrs.field(repr=False)
    node: str
    deadline_s: float = 2.0
    wait_s: float = 600.0
    prefix: str = "/weightcache"
    lease_ttl_s: int = 10
    devices: str = ""
    fanout: int = 2
    relay: bool = True
    piece_bytes: int = 1 << 20
    access: EtcdAccess = attrs.field(factory=EtcdAccess, repr=False)

    @secret.validator
    def _check_secret(self, _attribute, value: bytes) -> None:
        if not MIN_SECRET_BYTES <= len(value) <= MAX_SECRET_BYTES:
            raise ValueError(
                f"the fleet secret has {len(value)} bytes; use {MIN_SECRET_BYTES} to {MAX_SECRET_BYTES} "
                "(e.g. `head -c 32 /dev/urandom | base64 > secret`)"
            )

    @classmethod
    def from_env(cls, environ: typing.Mapping[str, str] | None = None) -> "FleetConfig | None":
        """The fleet the environment names, or None when ``WEIGHTCACHE_FLEET_ETCD`` is unset (no fleet).

        ValueError, saying which variable to fix, for a fleet named without a usable secret or with a bad number.
        """
        environ = os.environ if environ is None else environ
        endpoints = tuple(e.strip() for e in environ.get(ENV_ETCD, "").split(",") if e.strip())
        if not endpoints:
            return None
        for endpoint in endpoints:
            if not endpoint.startswith(("http://", "https://")):
                raise ValueError(f"{ENV_ETCD}: {endpoint!r} is not an http:// or https:// address of etcd")
        return cls(
            endpoints,
            _secret(environ),
            environ.get(ENV_NODE) or default_node(),
            deadline_s=_number(environ, ENV_DEADLINE, 2.0),
            wait_s=_number(environ, ENV_WAIT, 600.0),
            prefix=environ.get(ENV_PREFIX, "/weightcache").rstrip("/") or "/weightcache",
            lease_ttl_s=max(1, round(_number(environ, ENV_LEASE_TTL, 10))),
            devices=environ.get(ENV_DEVICES, "").strip(),
            fanout=_fanout(environ),
            relay=_switch(environ, ENV_RELAY, True),
            piece_bytes=_piece_bytes(environ),
            access=EtcdAccess.from_env(environ, endpoints),
        )

    def key(self, *parts: str) -> bytes:
        """The registry key ``PREFIX/part/part...``."""
        return "/".join((self.prefix, *parts)).encode()


def default_node() -> str:
    """This node's default name: the host name, with ``-u<uid>`` for a user other than root (each user runs a server
    of its own, with entries of its own: one name for two of them would mix their records)."""
    host = socket.gethostname() or "localhost"
    uid = os.getuid()
    return host if uid == 0 else f"{host}-u{uid}"


def _secret(environ: typing.Mapping[str, str]) -> bytes:
    path = environ.get(ENV_SECRET_FILE)
    if path:
        return read_private_file(ENV_SECRET_FILE, path, MAX_SECRET_BYTES + 1).strip()
    secret = environ.get(ENV_SECRET, "").encode()
    if not secret:
        raise ValueError(
            f"{ENV_ETCD} is set but neither {ENV_SECRET_FILE} nor {ENV_SECRET}: every node of a fleet needs its shared "
            "secret (records without it are refused)"
        )
    return secret


def _number(environ: typing.Mapping[str, str], name: str, default: float) -> float:
    text = environ.get(name)
    if text is None or text == "":
        return default
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a number of seconds") from None
    if not value > 0:
        raise ValueError(f"{name}={text!r}: use a number of seconds above 0")
    return value


def _fanout(environ: typing.Mapping[str, str]) -> int:
    text = environ.get(ENV_FANOUT, "").strip()
    if not text:
        return 2
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{ENV_FANOUT}={text!r}: use a whole number of readers per holder, 1 or more")
    return int(text)


def _piece_bytes(environ: typing.Mapping[str, str]) -> int:
    text = environ.get(ENV_PIECE_BYTES, "").strip()
    if not text:
        return 1 << 20
    if not text.isdigit() or int(text) < MIN_PIECE_BYTES:
        raise ValueError(f"{ENV_PIECE_BYTES}={text!r}: use a whole number of bytes, {MIN_PIECE_BYTES} or more")
    return int(text)


def _switch(environ: typing.Mapping[str, str], name: str, default: bool) -> bool:
    text = environ.get(name, "").strip()
    if not text:
        return default
    if text not in ("0", "1"):
        raise ValueError(f"{name}={text!r}: use 1 (on) or 0 (off)")
    return text == "1"
