"""deploy/systemd/weightcache.service under a real systemd: the fd store, a crash, a restart, an in-place restart, a stop.

systemd boots as pid 1 of new PID and mount namespaces, with private tmpfs over /tmp, /var/tmp and /run (its
tmpfiles and generators must not touch the machine's) and ``$SYSTEMD_UNIT_PATH`` naming only the unit under test
and stub targets. Opt-in (``WC_REAL_SYSTEMD=1``, as root, with systemd and unshare installed): a whole init
system is more than a shared CI machine should boot unasked. Run on 2026-12-01 with systemd 252 (Debian 12).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import wait_until

ROOT = Path(__file__).resolve().parents[1]
UNIT = ROOT / "deploy" / "systemd" / "weightcache.service"
SYSTEMD = Path("/lib/systemd/systemd")
STUB_TARGETS = ["sysinit", "basic", "shutdown", "network", "multi-user", "sockets", "paths", "slices", "timers"]
STUB_TARGETS += ["local-fs", "local-fs-pre", "swap", "umount"]

pytestmark = pytest.mark.skipif(
    os.environ.get("WC_REAL_SYSTEMD") != "1" or os.geteuid() != 0 or not SYSTEMD.exists() or not shutil.which("unshare"),
    reason="boots a real systemd in namespaces: set WC_REAL_SYSTEMD=1 (root, systemd and unshare installed)",
)

BOOT = """\
set -e
mount -t tmpfs tmpfs /run
mkdir /run/wc-units
mount --bind "$1" /run/wc-units
mount -t tmpfs tmpfs /tmp
mount -t tmpfs tmpfs /var/tmp
mount -t proc proc /proc
SYSTEMD_UNIT_PATH=/run/wc-units exec {systemd} --system --unit=wc.target
"""

CLIENT = """\
import json, sys
sys.path.insert(0, {root!r})
from tests.core.support import make_fingerprint, publish_host_entry
from weightcache.core.client.client import Connection
for n in range(int(sys.argv[1])):
    publish_host_entry("/run/weightcache", make_fingerprint(architecture=f"Sd{{n}}"), label=f"sd{{n}}")
with Connection("/run/weightcache", timeout=10) as conn:
    if len(sys.argv) > 2:
        conn.evict(sys.argv[2])
    status = conn.status()
print(json.dumps({{"pid": status["pid"], "entries": {{row["label"]: row["digest"] for row in status["entries"]}}}}))
"""


class Systemd:
    """A systemd booted in namespaces of its own; ``run`` runs a command in them."""

    def __init__(self, units: Path, log: Path):
        boot = units.parent / "boot.sh"
        boot.write_text(BOOT.format(systemd=SYSTEMD))
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                ["unshare", "--pid", "--fork", "--kill-child", "--mount", "--propagation", "private", "sh", str(boot), units],
                stdout=out,
                stderr=out,
                start_new_session=True,
            )
        self.pid = 0
        assert wait_until(self._found, timeout=30), log.read_text()[-2000:]
        assert wait_until(lambda: self.run("systemctl", "is-system-running", check=False).stdout.strip() == "running", 60)

    def _found(self) -> bool:
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        self.pid = int(children[0]) if children else 0
        return bool(self.pid)

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        command = ["nsenter", "-t", str(self.pid), "-m", "-p", f"--wd={ROOT}", "--", *argv]
        return subprocess.run(command, capture_output=True, text=True, timeout=60, check=check)

    def show(self, *props: str) -> dict[str, str]:
        out = self.run("systemctl", "show", "weightcache.service", *(f"-p{p}" for p in props)).stdout
        return dict(line.split("=", 1) for line in out.splitlines())

    def client(self, publish: int = 0, evict: str = "") -> dict:
        script = CLIENT.format(root=str(ROOT))
        return json.loads(self.run(sys.executable, "-c", script, str(publish), *([evict] if evict else [])).stdout)

    def close(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


@pytest.fixture
def units(tmp_path) -> Path:
    """The directory systemd reads units from (a test may add ``environment``, read when the unit starts)."""
    units = tmp_path / "units"
    units.mkdir()
    return units


@pytest.fixture
def systemd(units):
    for name in [*STUB_TARGETS, "wc"]:
        (units / f"{name}.target").write_text(f"[Unit]\nDescription=stub {name}\nDefaultDependencies=no\n")
    lines = []
    for line in UNIT.read_text().splitlines():  # the deployed unit, run as root from this checkout
        if line.startswith(("User=", "Group=")):
            continue
        if line.startswith("ExecStart="):
            line = f"ExecStart={sys.executable} -m weightcache.core.cli.cli serve --socket-dir /run/weightcache"
            lines.append("EnvironmentFile=-/run/wc-units/environment")  # a test's handover hooks
        lines.append(line)
    (units / "weightcache.service").write_text("\n".join(lines) + "\n")
    manager = Systemd(units, units.parent / "systemd.log")
    try:
        yield manager
    finally:
        manager.close()


def _served_by_another(systemd: Systemd, pid: int) -> dict:
    """The status of the first server other than ``pid`` that answers (a restarted unit takes a moment to listen)."""
    seen: list[dict] = []

    def answered() -> bool:
        try:
            seen.append(systemd.client())
        except subprocess.CalledProcessError:
            return False
        return seen[-1]["pid"] != pid

    assert wait_until(answered, timeout=30), seen[-1:]
    return seen[-1]


def _settled(systemd: Systemd, main_pid: str) -> dict[str, str]:
    assert wait_until(lambda: systemd.show("MainPID", "ActiveState") == {"MainPID": main_pid, "ActiveState": "active"}, 30)
    return systemd.show("MainPID", "NRestarts", "NFileDescriptorStore", "ActiveState")


def test_the_unit_keeps_every_entry_through_a_crash_a_restart_and_an_in_place_restart(systemd):
    systemd.run("systemctl", "start", "weightcache.service")
    first = systemd.client(publish=5)
    assert len(first["entries"]) == 5
    assert wait_until(lambda: systemd.show("NFileDescriptorStore")["NFileDescriptorStore"] == "15", 10), "3 fds an entry"

    systemd.run("systemctl", "kill", "-s", "KILL", "weightcache.service")  # a crash: Restart=always, fds from the store
    crashed = _served_by_another(systemd, first["pid"])
    assert crashed["entries"] == first["entries"] and systemd.show("NRestarts")["NRestarts"] == "1"

    systemd.run("systemctl", "restart", "weightcache.service")  # the store is kept across a restart job
    restarted = _served_by_another(systemd, crashed["pid"])
    assert restarted["entries"] == first["entries"]

    systemd.run("systemctl", "kill", "-s", "USR2", "--kill-whom=main", "weightcache.service")
    in_place = _served_by_another(systemd, restarted["pid"])
    state = _settled(systemd, str(in_place["pid"]))
    assert state["NRestarts"] == "0" and state["NFileDescriptorStore"] == "15", state  # the successor is main: no restart
    assert in_place["entries"] == first["entries"]

    systemd.client(evict=first["entries"]["sd0"])  # FDSTOREREMOVE, fd by fd
    assert wait_until(lambda: systemd.show("NFileDescriptorStore")["NFileDescriptorStore"] == "12", 10)

    systemd.run("systemctl", "stop", "weightcache.service")  # a stop empties the store
    assert systemd.show("NFileDescriptorStore", "ActiveState") == {"NFileDescriptorStore": "0", "ActiveState": "inactive"}
    systemd.run("systemctl", "start", "weightcache.service")
    assert systemd.client()["entries"] == {}


def test_a_successor_started_from_a_shell_becomes_the_main_process_of_a_unit_run_as_root(systemd):
    """The old server names its successor with ``MAINPID=``; systemd accepts a main process outside the unit's cgroup
    only from a privileged sender (as here), so a unit with ``User=`` uses SIGUSR2 instead. Before ``MAINPID=`` was
    sent, this way sent the unit into a restart loop (its new servers found the lock taken)."""
    systemd.run("systemctl", "start", "weightcache.service")
    first = systemd.client(publish=2)
    systemd.run(
        sys.executable, "-m", "weightcache.core.cli.cli", "serve", "--socket-dir", "/run/weightcache", "--take-over", "--detach"
    )
    taken = _served_by_another(systemd, first["pid"])
    assert taken["entries"] == first["entries"]
    state = _settled(systemd, str(taken["pid"]))
    time.sleep(2)  # RestartSec=1: a restart loop would show by now
    assert systemd.show("NRestarts", "ActiveState") == {"NRestarts": "0", "ActiveState": "active"}, state


@pytest.mark.parametrize("step", ["packing", "sent"])
def test_an_old_server_killed_during_an_in_place_restart_leaves_every_entry_in_the_restarted_unit(systemd, units, step):
    """Killed before its one handover message or right after it, before ``MAINPID=``: systemd sees its main process
    die, stops the rest of the unit (the successor) and restarts it; the fd store gives every entry back."""
    from weightcache.core.server.handover import DIE_AT_ENV

    (units / "environment").write_text(f"{DIE_AT_ENV}={step}\n")  # the successor's steps have other names
    systemd.run("systemctl", "start", "weightcache.service")
    first = systemd.client(publish=5)
    systemd.run("systemctl", "kill", "-s", "USR2", "--kill-whom=main", "weightcache.service")
    assert wait_until(lambda: systemd.show("NRestarts")["NRestarts"] == "1", 30), "systemd did not restart the unit"
    after = _served_by_another(systemd, first["pid"])  # the restarted server: the successor was stopped with the unit
    state = _settled(systemd, str(after["pid"]))
    assert after["entries"] == first["entries"], state
    assert state["NRestarts"] == "1" and state["NFileDescriptorStore"] == "15", state
