"""deploy/systemd/ as shipped, under a real systemd: the unit, its sysusers.d and tmpfiles.d files, the fd store, a crash,
a restart, an in-place restart (SIGUSR2), a reload, a stop.

systemd boots as pid 1 of new PID, mount and network namespaces, with private tmpfs over /tmp, /var/tmp, /var/cache,
/var/log and /run, an overlay over /etc (where ``systemd-sysusers`` and ``systemd-tmpfiles`` run the shipped files: the
``weightcache`` user, /etc/weightcache/serve.toml) and a tmpfs over /opt holding ``/opt/weightcache/bin/weightcache``
(this checkout's interpreter), and ``$SYSTEMD_UNIT_PATH`` naming only the unit under test, journald and stub targets.
The unit file is copied unchanged: ``User=``, the sandboxing, the metrics port, the budget, JSON logs and
``--config``; a test that needs more adds a drop-in and says why. Clients run as the ``weightcache`` user.
Opt-in (``WC_REAL_SYSTEMD=1``, as root, with systemd, unshare, setpriv and ip installed): a whole init system is
more than a shared CI machine should boot unasked; each skip says which of these is missing, and a boot that ends
before systemd runs (namespaces or mounts this machine refuses) skips with the boot's own words. The in-place restart's
stop and restart run once per cgroup mode (CGROUPS: the host's, v1 only, v2 only).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from tests.helpers import wait_until

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy" / "systemd"
UNIT = DEPLOY / "weightcache.service"
SYSTEMD = Path("/lib/systemd/systemd")
JOURNALD = ["systemd-journald.service", "systemd-journald.socket", "systemd-journald-dev-log.socket"]
STUB_TARGETS = ["sysinit", "basic", "shutdown", "network", "multi-user", "sockets", "paths", "slices", "timers"]
STUB_TARGETS += ["local-fs", "local-fs-pre", "swap", "umount"]
USER = "weightcache"
NAMESPACES = ["unshare", "--pid", "--fork", "--kill-child", "--mount", "--net", "--propagation", "private"]
METRICS = "http://127.0.0.1:9464"


HIDDEN = ("/tmp", "/var/tmp", "/var/cache", "/var/log", "/opt", "/run")
"""What the boot mounts a tmpfs of its own over (BOOT): a checkout there is out of the booted system's sight."""


def hidden(root: Path) -> str | None:
    """Why the booted system cannot see the checkout at ``root`` (None: it can)."""
    for place in HIDDEN:
        if root == Path(place) or Path(place) in root.parents:
            return (
                f"this checkout is under {place}, which the booted systemd covers with a tmpfs of its own (its clients "
                "would not find weightcache): clone it elsewhere (under /root or /srv) to run this test"
            )
    return None


def _missing() -> str | None:
    if (reason := hidden(ROOT.resolve())) is not None:
        return reason
    if os.environ.get("WC_REAL_SYSTEMD") != "1":
        return "boots a real systemd in namespaces: set WC_REAL_SYSTEMD=1 (root, systemd, unshare, setpriv and ip installed)"
    if os.geteuid() != 0:
        return "needs root to boot systemd in namespaces"
    if not SYSTEMD.exists():
        return f"systemd is not installed ({SYSTEMD} is missing)"
    absent = [
        tool for tool in ("unshare", "nsenter", "setpriv", "ip", "systemd-sysusers", "systemd-tmpfiles") if not shutil.which(tool)
    ]
    return f"not installed: {', '.join(absent)}" if absent else None


pytestmark = pytest.mark.skipif(_missing() is not None, reason=str(_missing()))

BOOT = """\
set -e
mount -t tmpfs tmpfs /run
mkdir /run/wc-units /run/wc-etc
mount --bind "$1" /run/wc-units
units=/run/wc-units
for dir in /tmp /var/tmp /var/cache /var/log /opt; do mount -t tmpfs tmpfs "$dir"; done
mount -t proc proc /proc
{cgroup}
mkdir /run/wc-etc/upper /run/wc-etc/work
mount -t overlay overlay -o lowerdir=/etc,upperdir=/run/wc-etc/upper,workdir=/run/wc-etc/work /etc
systemd-sysusers "$units/weightcache.sysusers"
systemd-tmpfiles --create "$units/weightcache.tmpfiles"
cp "$units/serve.toml" /etc/weightcache/serve.toml
mkdir -p /opt/weightcache/python /opt/weightcache/bin /opt/weightcache/{site}
mount --bind {base} /opt/weightcache/python
ln -s /opt/weightcache/python/bin/{python} /opt/weightcache/bin/python
printf 'home = /opt/weightcache/python/bin\\ninclude-system-site-packages = false\\n' > /opt/weightcache/pyvenv.cfg
echo "import site; site.addsitedir({packages!r})" > /opt/weightcache/{site}/checkout.pth
cp "$units/weightcache" /opt/weightcache/bin/weightcache
chmod 755 /opt/weightcache/bin/weightcache
ip link set lo up
SYSTEMD_UNIT_PATH=/run/wc-units exec {systemd} --system --unit=wc.target
"""

PROGRAM = """\
#!/bin/sh
export LD_LIBRARY_PATH=/opt/weightcache/python/lib
exec /opt/weightcache/bin/python -m weightcache.core.cli.cli "$@"
"""
PYTHON = ["env", "LD_LIBRARY_PATH=/opt/weightcache/python/lib", "/opt/weightcache/bin/python"]
"""The installation's interpreter, as the unit's user can run it (this checkout's may live under /root, which the
unit's ProtectHome= hides and its user may not read)."""

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

PROBE = """\
import sys, urllib.error, urllib.request
try:
    with urllib.request.urlopen(sys.argv[1], timeout=5) as response:
        print(response.status, response.read().decode().strip())
except urllib.error.HTTPError as exc:
    print(exc.code, exc.read().decode().strip())
"""


CGROUPS = {
    "host": "",
    "v1": "mount -t tmpfs tmpfs /sys/fs/cgroup\nmkdir /sys/fs/cgroup/systemd\n"
    "mount -t cgroup -o none,name=systemd cgroup /sys/fs/cgroup/systemd\n"
    "export SYSTEMD_PROC_CMDLINE='systemd.unified_cgroup_hierarchy=0 systemd.legacy_systemd_cgroup_controller=1'",
    "v2": "mount -t cgroup2 cgroup2 /sys/fs/cgroup\nexport SYSTEMD_PROC_CMDLINE=systemd.unified_cgroup_hierarchy=1",
}
"""What the boot mounts on /sys/fs/cgroup and the kernel command line systemd reads (``$SYSTEMD_PROC_CMDLINE``):
``host`` keeps the host's (hybrid on a host with both), ``v1`` only the legacy ``name=systemd`` hierarchy (a
cgroup-v1 host, ``systemd.unified_cgroup_hierarchy=0``), ``v2`` only the unified one."""


def cgroup_unavailable(mode: str) -> str | None:
    """Why this kernel cannot give the boot the cgroup ``mode`` (None: it can)."""
    if not CGROUPS[mode]:
        return None
    script = CGROUPS[mode] + "\nstat -fc %T /sys/fs/cgroup"
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-ec", script], capture_output=True, text=True, timeout=30
    )
    if done.returncode != 0:
        return f"this kernel cannot mount cgroup {mode} for the boot: {done.stderr.strip()[-300:]}"
    return None


class Systemd:
    """A systemd booted in namespaces of its own; ``run`` runs a command in them; ``cgroup``: a key of CGROUPS."""

    def __init__(self, units: Path, log: Path, cgroup: str = "host"):
        boot = units.parent / "boot.sh"
        version = f"python{sys.version_info.major}.{sys.version_info.minor}"
        boot.write_text(
            BOOT.format(
                cgroup=CGROUPS[cgroup],
                systemd=SYSTEMD,
                base=sys.base_prefix,
                python=version,
                site=f"lib/{version}/site-packages",
                packages=sysconfig.get_paths()["purelib"],
            )
        )
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                [*NAMESPACES, "sh", str(boot), units],
                stdout=out,
                stderr=out,
                start_new_session=True,
            )
        self.pid = 0
        self.client_user: str | None = USER  # whom clients run as: the unit's user
        try:
            wait_until(lambda: self._found() or self.proc.poll() is not None, timeout=30)
            if not self._found():  # the boot script failed before systemd ran: this machine's namespaces or mounts
                pytest.skip(f"systemd could not boot here: {log.read_text()[-1500:]}")
            running = lambda: self.run("systemctl", "is-system-running", check=False).stdout.strip() == "running"  # noqa: E731
            assert wait_until(running, 60), self.run("systemctl", "--failed", check=False).stdout + log.read_text()[-2000:]
        except BaseException:
            self.close()
            raise

    def _found(self) -> bool:
        try:
            children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        except FileNotFoundError:  # the boot ended
            return False
        self.pid = int(children[0]) if children else 0
        return bool(self.pid) and Path(f"/proc/{self.pid}/comm").read_text().strip() == "systemd"

    def run(self, *argv: str, check: bool = True, user: str | None = None) -> subprocess.CompletedProcess:
        as_user = ["setpriv", f"--reuid={user}", f"--regid={user}", "--init-groups"] if user else []
        command = ["nsenter", "-t", str(self.pid), "-m", "-p", "-n", f"--wd={ROOT}", "--", *as_user, *argv]
        done = subprocess.run(command, capture_output=True, text=True, timeout=60)
        if check and done.returncode != 0:
            journal = "\n".join(self.journal()[-30:]) if argv[0] == "systemctl" else ""
            raise AssertionError(f"{' '.join(argv)[:200]} exited {done.returncode}: {done.stderr[-2000:]}\n{journal}")
        return done

    def show(self, *props: str) -> dict[str, str]:
        out = self.run("systemctl", "show", "weightcache.service", *(f"-p{p}" for p in props)).stdout
        return dict(line.split("=", 1) for line in out.splitlines())

    def client(self, publish: int = 0, evict: str = "") -> dict:
        """Publish ``publish`` entries (and evict ``evict``) as the unit's user, as its engines would; the status."""
        script = CLIENT.format(root=str(ROOT))
        argv = [*PYTHON, "-c", script, str(publish), *([evict] if evict else [])]
        return json.loads(self.run(*argv, user=self.client_user).stdout)

    def http(self, path: str) -> tuple[int, str]:
        """GET ``path`` on the unit's metrics port (in the namespaces' own network)."""
        code, _, body = self.run(*PYTHON, "-c", PROBE, METRICS + path).stdout.strip().partition(" ")
        return int(code), body

    def journal(self) -> list[str]:
        return self.run("journalctl", "-u", "weightcache.service", "-o", "cat", "--no-pager", check=False).stdout.splitlines()

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):  # a boot that failed has ended already
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


@pytest.fixture
def units(tmp_path) -> Path:
    """The directory systemd reads units from: the shipped unit as it is, and the shipped sysusers and tmpfiles files.

    A test may add a drop-in (``weightcache.service.d/``), read when the unit starts.
    """
    units = tmp_path / "units"
    units.mkdir()
    tmp_path.chmod(0o755)  # the unit's user reads nothing here, but systemd's checks walk the path
    for name in STUB_TARGETS:
        (units / f"{name}.target").write_text(f"[Unit]\nDescription=stub {name}\nDefaultDependencies=no\n")
    (units / "wc.target").write_text("[Unit]\nDescription=the test's boot\nWants=systemd-journald.socket\n")
    for name in JOURNALD:
        shutil.copy(Path("/lib/systemd/system") / name, units / name)
    shutil.copy(UNIT, units / UNIT.name)
    for name in ("weightcache.sysusers", "weightcache.tmpfiles"):
        shutil.copy(DEPLOY / name, units / name)
    shutil.copy(DEPLOY / "serve.toml", units / "serve.toml")
    (units / "weightcache").write_text(PROGRAM)
    return units


def drop_in(units: Path, text: str) -> None:
    directory = units / "weightcache.service.d"
    directory.mkdir(exist_ok=True)
    (directory / "test.conf").write_text("[Service]\n" + text)


@pytest.fixture
def systemd(units):
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
        except AssertionError:
            return False
        return seen[-1]["pid"] != pid

    assert wait_until(answered, timeout=30), seen[-1:]
    return seen[-1]


def _settled(systemd: Systemd, main_pid: str) -> dict[str, str]:
    assert wait_until(lambda: systemd.show("MainPID", "ActiveState") == {"MainPID": main_pid, "ActiveState": "active"}, 30)
    return systemd.show("MainPID", "NRestarts", "NFileDescriptorStore", "ActiveState")


def _healthy_pid(systemd: Systemd) -> int:
    """The pid ``/healthz`` on the metrics port names (``ok: pid N accepts on ...``)."""
    code, body = systemd.http("/healthz")
    assert code == 200 and body.startswith("ok: pid "), (code, body)
    return int(body.split()[2])


def test_the_unit_as_shipped_keeps_every_entry_through_a_crash_a_restart_a_reload_and_an_in_place_restart(systemd):
    systemd.run("systemctl", "start", "weightcache.service")
    main = systemd.show("MainPID", "User")
    uid = systemd.run("stat", "-c", "%U", f"/proc/{main['MainPID']}").stdout.strip()
    assert main["User"] == USER and uid == USER, f"the server runs as {uid}, not as the unit's user"
    first = systemd.client(publish=5)
    assert len(first["entries"]) == 5
    assert systemd.http("/readyz")[0] == 200 and _healthy_pid(systemd) == first["pid"]
    assert wait_until(lambda: systemd.show("NFileDescriptorStore")["NFileDescriptorStore"] == "15", 10), "3 fds an entry"
    logs = [json.loads(line) for line in systemd.journal() if line.startswith("{")]
    assert any(row.get("entry") == first["entries"]["sd0"] and row["level"] == "info" for row in logs), logs[-5:]

    systemd.run("systemctl", "reload", "weightcache.service")  # ExecReload: SIGHUP re-reads --config
    assert wait_until(lambda: any("SIGHUP: re-read /etc/weightcache/serve.toml" in line for line in systemd.journal()), 10)
    assert systemd.show("MainPID")["MainPID"] == main["MainPID"]

    systemd.run("systemctl", "kill", "-s", "KILL", "weightcache.service")  # a crash: Restart=always, fds from the store
    crashed = _served_by_another(systemd, first["pid"])
    assert crashed["entries"] == first["entries"] and systemd.show("NRestarts")["NRestarts"] == "1"
    assert wait_until(lambda: _healthy_pid(systemd) == crashed["pid"], 10), "the restarted server binds the metrics port"

    systemd.run("systemctl", "restart", "weightcache.service")  # the store is kept across a restart job
    restarted = _served_by_another(systemd, crashed["pid"])
    assert restarted["entries"] == first["entries"]

    logged = len(systemd.journal())
    systemd.run("systemctl", "kill", "-s", "USR2", "--kill-whom=main", "weightcache.service")
    in_place = _served_by_another(systemd, restarted["pid"])
    state = _settled(systemd, str(in_place["pid"]))
    assert state["NRestarts"] == "0" and state["NFileDescriptorStore"] == "15", state  # the successor is main: no restart
    assert in_place["entries"] == first["entries"]
    assert _healthy_pid(systemd) == in_place["pid"], "the successor took the metrics port over"
    assert not [line for line in systemd.journal()[logged:] if "dropped" in line], "a handover drops nothing"

    systemd.client(evict=first["entries"]["sd0"])  # FDSTOREREMOVE, fd by fd
    assert wait_until(lambda: systemd.show("NFileDescriptorStore")["NFileDescriptorStore"] == "12", 10)

    systemd.run("systemctl", "stop", "weightcache.service")  # a stop empties the store
    assert systemd.show("NFileDescriptorStore", "ActiveState") == {"NFileDescriptorStore": "0", "ActiveState": "inactive"}
    systemd.run("systemctl", "start", "weightcache.service")
    assert systemd.client()["entries"] == {}


@pytest.fixture
def as_root(units):
    """The unit with ``User=root`` (a drop-in): systemd takes a main process from outside the cgroup only from root."""
    drop_in(units, "User=root\nGroup=root\n")


def test_a_successor_started_from_a_shell_becomes_the_main_process_of_a_unit_run_as_root(as_root, systemd):
    """The old server names its successor with ``MAINPID=``; systemd accepts a main process outside the unit's cgroup
    only from a privileged sender (as here), so the shipped unit (``User=``) uses SIGUSR2 instead. Before ``MAINPID=``
    was sent, this way sent the unit into a restart loop (its new servers found the lock taken)."""
    systemd.client_user = None  # root, as the server
    systemd.run("systemctl", "start", "weightcache.service")
    first = systemd.client(publish=2)
    systemd.run(
        "/opt/weightcache/bin/weightcache", "serve", "--socket-dir", "/run/weightcache", "--metrics-port", "9464",
        "--take-over", "--detach",
    )  # fmt: skip
    taken = _served_by_another(systemd, first["pid"])
    assert taken["entries"] == first["entries"]
    state = _settled(systemd, str(taken["pid"]))
    time.sleep(2)  # RestartSec=1: a restart loop would show by now
    assert systemd.show("NRestarts", "ActiveState") == {"NRestarts": "0", "ActiveState": "active"}, state


@pytest.mark.parametrize("step", ["packing", "sent"])
def test_an_old_server_killed_during_an_in_place_restart_leaves_every_entry_in_the_restarted_unit(systemd_killing, step):
    """Killed before its one handover message or right after it, before ``MAINPID=``: systemd sees its main process
    die, stops the rest of the unit (the successor) and restarts it; the fd store gives every entry back."""
    systemd = systemd_killing
    systemd.run("systemctl", "start", "weightcache.service")
    first = systemd.client(publish=5)
    systemd.run("systemctl", "kill", "-s", "USR2", "--kill-whom=main", "weightcache.service")
    assert wait_until(lambda: systemd.show("NRestarts")["NRestarts"] == "1", 30), "systemd did not restart the unit"
    after = _served_by_another(systemd, first["pid"])  # the restarted server: the successor was stopped with the unit
    state = _settled(systemd, str(after["pid"]))
    assert after["entries"] == first["entries"], state
    assert state["NRestarts"] == "1" and state["NFileDescriptorStore"] == "15", state


@pytest.fixture
def systemd_killing(units, step):
    """The unit with the handover's kill hook set at ``step`` (a drop-in's environment; the successor's steps have other
    names, so only the old server dies)."""
    from weightcache.core.server.handover import DIE_AT_ENV

    drop_in(units, f"Environment={DIE_AT_ENV}={step}\n")
    manager = Systemd(units, units.parent / "systemd.log")
    try:
        yield manager
    finally:
        manager.close()


@pytest.fixture(params=sorted(CGROUPS))
def systemd_cgroup(units, request):
    """systemd booted with each cgroup mode of CGROUPS (skipped, saying why, where this kernel cannot mount it)."""
    if (reason := cgroup_unavailable(request.param)) is not None:
        pytest.skip(reason)
    manager = Systemd(units, units.parent / "systemd.log", cgroup=request.param)
    manager.cgroup = request.param
    try:
        yield manager
    finally:
        manager.close()


def _cgroups(systemd: Systemd, pid: int) -> dict[str, str]:
    """The hierarchies ``pid`` is in, by name (``name=systemd``, ``""`` for the unified one), and its cgroup there."""
    lines = systemd.run("cat", f"/proc/{pid}/cgroup").stdout.splitlines()
    return {line.split(":")[1]: line.split(":", 2)[2] for line in lines}


def _in_place(systemd: Systemd, before: int) -> dict:
    """SIGUSR2 to the unit's main process; the successor's status once systemd names it the main process."""
    systemd.run("systemctl", "kill", "-s", "USR2", "--kill-whom=main", "weightcache.service")
    successor = _served_by_another(systemd, before)
    _settled(systemd, str(successor["pid"]))
    parent = systemd.run("ps", "-o", "ppid=", "-p", str(successor["pid"])).stdout.strip()
    assert parent == "1", f"the successor's parent is {parent}, not systemd (pid 1): systemd would not wait for it"
    return successor


def test_after_an_in_place_restart_stop_and_restart_end_the_successor_cleanly(systemd_cgroup):
    """The successor is systemd's child and the main process after SIGUSR2, on a cgroup-v1, v2 or hybrid host:
    ``systemctl restart`` and ``stop`` send it SIGTERM (not SIGKILL at once) and wait; it stops cleanly, a restart
    keeps the store, and the unit ends ``inactive`` with ``Result=success``. No notification of the successor is
    refused and systemd supervises no process that is not its child."""
    systemd = systemd_cgroup
    systemd.run("systemctl", "start", "weightcache.service")
    first = systemd.client(publish=2)
    where = _cgroups(systemd, first["pid"])
    unit = "/system.slice/weightcache.service"
    legacy, unified = where.get("name=systemd") == unit, where.get("") == unit  # which hierarchies systemd tracks it in
    tracked = {"host": legacy or unified, "v1": legacy and not unified, "v2": unified and not legacy}
    assert tracked[systemd.cgroup], f"not the cgroup mode {systemd.cgroup}: {where}"

    in_place = _in_place(systemd, first["pid"])
    logged = len(systemd.journal())
    systemd.run("systemctl", "restart", "weightcache.service")
    restarted = _served_by_another(systemd, in_place["pid"])
    assert restarted["entries"] == first["entries"], "a restart keeps the store"
    since = systemd.journal()[logged:]
    assert any(f'"pid": {in_place["pid"]}, "message": "server stopping"' in line for line in since), since
    assert not [line for line in since if "SIGKILL" in line or "Failed with result" in line], since
    assert systemd.show("NRestarts")["NRestarts"] == "0"

    again = _in_place(systemd, restarted["pid"])
    logged = len(systemd.journal())
    systemd.run("systemctl", "stop", "weightcache.service")
    shown = systemd.show("ActiveState", "Result", "ExecMainStatus")
    since = systemd.journal()[logged:]
    assert shown == {"ActiveState": "inactive", "Result": "success", "ExecMainStatus": "0"}, (shown, since)
    assert any(f'"pid": {again["pid"]}, "message": "server stopping"' in line for line in since), since
    refused = [line for line in systemd.journal() if "reception only permitted" in line or "not our child" in line]
    assert not refused, refused
