"""Where a fleet on one machine talks: a network namespace per node joined by a bridge, or separate ports otherwise.

``Network.open()`` builds namespaces where the machine allows it (root, ``ip netns`` and
veth pairs work): a bridge in this namespace holds etcd's address, and every node gets a
namespace of its own with one end of a veth pair on the bridge's subnet, so a node's
NIXL/UCX agent reaches another node's only across two veths and the bridge. UCX is held
to TCP and that veth there (``UCX_TLS=tcp``): on one host it would otherwise move the
bytes through shared memory, whatever the namespaces. Both ends of a pair carry one
name: UCX lists interfaces from ``/sys/class/net``, and a thread or a forked child that
enters a network namespace still sees this mount namespace's sysfs, which lists the
bridge's end. Where namespaces cannot be made, every
node shares 127.0.0.1 (UCX on ``lo``) and ``Network.why`` says why; nothing falls back
silently.

Everything made here carries this process's id in its name (``wc<pid>-<node>``,
``wcb<pid hex>``, ``wcv<pid hex>x<n>``): ``close`` removes it, and the next ``open``
removes what a killed process left behind.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import typing
from pathlib import Path

import attrs

NETNS_DIR: typing.Final = Path("/run/netns")
ENV_MODE: typing.Final = "WEIGHTCACHE_TEST_FLEET_NETWORK"
"""``namespaces`` (fail where they cannot be made), ``ports`` (never make them), unset: namespaces where allowed."""


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise OSError(f"ip {' '.join(args)}: {done.stderr.strip() or done.returncode}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep() -> None:
    """Remove the namespaces and bridges of test processes that died without closing their network."""
    if NETNS_DIR.is_dir():
        for entry in NETNS_DIR.iterdir():
            found = re.fullmatch(r"wc(\d+)-.+", entry.name)
            if found and not _alive(int(found.group(1))):
                with contextlib.suppress(OSError):
                    _ip("netns", "del", entry.name)
    for link in Path("/sys/class/net").iterdir():
        found = re.fullmatch(r"wc[bv]([0-9a-f]+)(x\d+)?", link.name)
        if found and not _alive(int(found.group(1), 16)):
            with contextlib.suppress(OSError):
                _ip("link", "del", link.name)


@attrs.frozen
class NodeNetwork:
    """One node's network: its namespace (None: this one), the device UCX uses and its address."""

    namespace: Path | None
    device: str
    address: str
    host_veth: str | None = None

    def env(self) -> dict[str, str]:
        """The environment a node's process needs for this network (UCX's device; TCP only across namespaces)."""
        return {"WEIGHTCACHE_FLEET_DEVICES": self.device, **({"UCX_TLS": "tcp"} if self.namespace else {})}

    def popen_args(self) -> dict:
        """``tests.zygote.popen``'s keyword for a child in this node's namespace."""
        return {"netns": str(self.namespace)} if self.namespace else {}

    def command(self, args: list[str]) -> list[str]:
        """``args`` run in this node's namespace (exec'd through ``nsenter``)."""
        return ["nsenter", f"--net={self.namespace}", *args] if self.namespace else args

    def reaches(self, url: str) -> str:
        """Whether a TCP connection from this namespace to ``url``'s host and port opens, with the neighbour table
        (for a failure's evidence)."""
        if self.namespace is None:
            return "no namespace"
        host, port = url.rsplit("/", 1)[-1].rsplit(":", 1)
        probe = f"import socket; socket.create_connection(({host!r}, {port}), timeout=3).close(); print('connects')"
        shown = []
        for args in (["python3", "-c", probe], ["ip", "neigh"], ["ip", "-s", "link", "show", self.device]):
            done = subprocess.run(self.command(args), capture_output=True, text=True, timeout=30)
            shown.append(f"$ {' '.join(args[:2])}: {(done.stdout + done.stderr).strip()[-600:]}")
        return "\n".join(shown)

    def received_bytes(self) -> int:
        """Bytes this node's namespace received over its veth (the bridge's side sent them); 0 without one."""
        if self.host_veth is None:
            return 0
        return int(Path(f"/sys/class/net/{self.host_veth}/statistics/tx_bytes").read_text())


@attrs.define
class Network:
    """The fleet's network: ``mode`` ``namespaces`` or ``ports``, ``why`` ports where namespaces were wanted."""

    mode: str
    why: str
    host: str
    bridge: str | None = None
    subnet: str = ""
    nodes: list[NodeNetwork] = attrs.Factory(list)

    @classmethod
    def open(cls) -> "Network":
        wanted = os.environ.get(ENV_MODE, "")
        if wanted == "ports":
            return cls("ports", f"{ENV_MODE}=ports", "127.0.0.1")
        problem = _namespaces_problem()
        if problem is None:
            try:
                return cls._bridged()
            except OSError as exc:
                problem = f"building the namespaces failed: {exc}"
        if wanted == "namespaces":
            raise RuntimeError(f"{ENV_MODE}=namespaces, but {problem}")
        return cls("ports", problem, "127.0.0.1")

    @classmethod
    def _bridged(cls) -> "Network":
        sweep()
        pid = os.getpid()
        bridge = f"wcb{pid:x}"
        subnet = f"10.{200 + pid % 50}.{(pid // 50) % 256}"
        network = cls("namespaces", "", f"{subnet}.1", bridge, subnet)
        # A bridge whose address nobody set takes the lowest of its ports' MACs, so it changes as nodes join; a node
        # that resolved the bridge's address before then keeps sending to a port's MAC, which the bridge does not
        # take for its own: every new connection to etcd timed out until the node's neighbour entry went stale.
        mac = f"02:77:{pid >> 24 & 0xFF:02x}:{pid >> 16 & 0xFF:02x}:{pid >> 8 & 0xFF:02x}:{pid & 0xFF:02x}"
        try:
            _ip("link", "add", bridge, "address", mac, "type", "bridge")
            _ip("addr", "add", f"{subnet}.1/24", "dev", bridge)
            _ip("link", "set", bridge, "up")
        except OSError:
            network.close()
            raise
        return network

    def node(self, name: str) -> NodeNetwork:
        """A new node's network: a namespace on the bridge, or 127.0.0.1."""
        if self.mode == "ports":
            return NodeNetwork(None, "lo", "127.0.0.1")
        index = len(self.nodes) + 2
        if index > 254:
            raise RuntimeError("a bridged test fleet holds at most 253 nodes")
        pid = os.getpid()
        namespace, veth = f"wc{pid}-{name}", f"wcv{pid:x}x{index}"
        address = f"{self.subnet}.{index}"
        _ip("netns", "add", namespace)
        made = NodeNetwork(NETNS_DIR / namespace, veth, address, veth)
        self.nodes.append(made)
        _ip("link", "add", veth, "type", "veth", "peer", "name", veth, "netns", namespace)
        _ip("link", "set", veth, "master", typing.cast(str, self.bridge), "up")
        _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", veth)
        _ip("-n", namespace, "link", "set", veth, "up")
        _ip("-n", namespace, "link", "set", "lo", "up")
        return made

    def describe(self) -> str:
        if self.mode == "namespaces":
            return f"network namespaces on bridge {self.bridge} ({self.subnet}.0/24, UCX over TCP)"
        return f"separate ports on 127.0.0.1 (no network namespaces: {self.why})"

    def close(self) -> None:
        """Remove every veth, namespace and the bridge (after the processes in the namespaces ended)."""
        for made in self.nodes:
            if made.host_veth is not None and Path(f"/sys/class/net/{made.host_veth}").exists():
                with contextlib.suppress(OSError):
                    _ip("link", "del", made.host_veth)  # both ends, even while a process keeps the namespace
            if made.namespace is not None:
                with contextlib.suppress(OSError):
                    _ip("netns", "del", made.namespace.name)
        self.nodes.clear()
        if self.bridge is not None:
            with contextlib.suppress(OSError):
                _ip("link", "del", self.bridge)
            self.bridge = None


def _namespaces_problem() -> str | None:
    """Why this process cannot build namespaces for a fleet (None: it can)."""
    if os.geteuid() != 0:
        return "not root (network namespaces and veth pairs need CAP_NET_ADMIN)"
    for tool in ("ip", "nsenter"):
        if subprocess.run(["which", tool], capture_output=True).returncode != 0:
            return f"no `{tool}` command (iproute2, util-linux)"
    probe = f"wc{os.getpid()}-probe"
    try:
        _ip("netns", "add", probe)
    except OSError as exc:
        return f"`ip netns add` fails here ({exc})"
    with contextlib.suppress(OSError):
        _ip("netns", "del", probe)
    return None
