"""How a node gets into etcd beyond its address: TLS with a private CA and a client certificate, and etcd's
user/password auth. Read from the environment with the rest of the fleet's settings:

    WEIGHTCACHE_FLEET_ETCD_CA             the CA bundle (PEM) etcd's certificate must verify against (default: the
                                          system's CAs)
    WEIGHTCACHE_FLEET_ETCD_CERT           this node's client certificate (PEM), for etcd's --client-cert-auth
    WEIGHTCACHE_FLEET_ETCD_KEY            its private key (PEM, unencrypted); both or neither
    WEIGHTCACHE_FLEET_ETCD_USER           etcd's user name, with auth enabled (`etcdctl auth enable`)
    WEIGHTCACHE_FLEET_ETCD_PASSWORD_FILE  a file (0600, this user's) holding that user's password
    WEIGHTCACHE_FLEET_ETCD_PASSWORD       the password itself (tests; a file keeps it out of process listings)
"""

from __future__ import annotations

import os
import ssl
import stat
import typing

import attrs

ENV_CA: typing.Final = "WEIGHTCACHE_FLEET_ETCD_CA"
ENV_CERT: typing.Final = "WEIGHTCACHE_FLEET_ETCD_CERT"
ENV_KEY: typing.Final = "WEIGHTCACHE_FLEET_ETCD_KEY"
ENV_USER: typing.Final = "WEIGHTCACHE_FLEET_ETCD_USER"
ENV_PASSWORD_FILE: typing.Final = "WEIGHTCACHE_FLEET_ETCD_PASSWORD_FILE"
ENV_PASSWORD: typing.Final = "WEIGHTCACHE_FLEET_ETCD_PASSWORD"
MAX_PASSWORD_BYTES: typing.Final = 4096


@attrs.frozen
class EtcdAccess:
    """TLS files and credentials for etcd (each None: not used). ``context`` is built once, checked when made."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    user: str | None = None
    password: str | None = attrs.field(default=None, repr=False)
    context: ssl.SSLContext | None = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError(f"give {ENV_CERT} and {ENV_KEY} together: a client certificate needs its key")
        if (self.user is None) != (self.password is None):
            raise ValueError(f"{ENV_USER} needs {ENV_PASSWORD_FILE} (or {ENV_PASSWORD}), and a password needs its user")
        object.__setattr__(self, "context", self._context())

    @property
    def tls(self) -> bool:
        return self.ca_file is not None or self.cert_file is not None

    def _context(self) -> ssl.SSLContext:
        """The TLS context of every https:// endpoint: the private CA if given, the client certificate if given."""
        try:
            context = ssl.create_default_context(cafile=self.ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"{ENV_CA}: cannot use {self.ca_file} as a CA bundle ({_why(exc)})") from None
        if self.cert_file is not None:
            try:
                context.load_cert_chain(self.cert_file, self.key_file)
            except (OSError, ssl.SSLError) as exc:
                raise ValueError(
                    f"{ENV_CERT}/{ENV_KEY}: cannot use {self.cert_file} with {self.key_file} ({_why(exc)}); give a PEM "
                    "certificate and its unencrypted key"
                ) from None
        return context

    @classmethod
    def from_env(cls, environ: typing.Mapping[str, str], endpoints: typing.Sequence[str]) -> "EtcdAccess":
        """The access the environment names for ``endpoints``; ValueError naming the variable to fix."""
        files = {name: environ.get(name, "").strip() or None for name in (ENV_CA, ENV_CERT, ENV_KEY)}
        access = cls(files[ENV_CA], files[ENV_CERT], files[ENV_KEY], environ.get(ENV_USER) or None, _password(environ))
        plain = [endpoint for endpoint in endpoints if endpoint.startswith("http://")]
        if access.tls and plain:
            raise ValueError(f"{ENV_CA}/{ENV_CERT} are set but {plain[0]} is plain http://: write https:// to use TLS with etcd")
        return access


def _password(environ: typing.Mapping[str, str]) -> str | None:
    path = environ.get(ENV_PASSWORD_FILE)
    if not path:
        return environ.get(ENV_PASSWORD) or None
    return read_private_file(ENV_PASSWORD_FILE, path, MAX_PASSWORD_BYTES).decode(errors="replace").strip() or None


def read_private_file(variable: str, path: str, most: int) -> bytes:
    """Up to ``most`` bytes of ``path``, named by the environment variable ``variable``: opened without following a link,
    it must belong to this user (or root) and be private; else ValueError naming the variable and what to fix."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise ValueError(f"{variable}: cannot open {path} ({exc.strerror})") from None
    try:
        info = os.fstat(fd)
        if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO) or info.st_uid not in (os.getuid(), 0):
            raise ValueError(f"{variable}: {path} must belong to this user and be private (chmod 600)")
        return os.read(fd, most)
    finally:
        os.close(fd)


def _why(exc: BaseException) -> str:
    return getattr(exc, "strerror", None) or getattr(exc, "reason", None) or str(exc)
