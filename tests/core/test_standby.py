"""``weightcache standby``: a warm spare in a real process, attached to a real server, taking over on each trigger.

The take-over when the primary dies (timed by benchmarks/standby.py and benchmarks/restart.py) is
tests/core/test_restart.py::test_hot_standby_takes_over_at_once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests import zygote
from tests.helpers import wait_until
from weightcache.core.errors import StandbyError
from weightcache.core.flow.loader import prepare, publish
from weightcache.core.request import LoadRequest
from weightcache.core.spare.standby import TAKEOVER_REQUEST, _Triggers, exit_begun


class StandbyProcess:
    """``weightcache standby --model MODEL --socket-dir DIR ARGS...`` in its own process; its JSON lines read one by one."""

    def __init__(self, model, socket_dir, *args: str, stdin=subprocess.DEVNULL):
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = zygote.popen(
            [
                sys.executable,
                "-m",
                "weightcache.core.cli.cli",
                "standby",
                "--model",
                str(model),
                "--socket-dir",
                str(socket_dir),
                *args,
            ],
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stderr(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def line(self) -> dict:
        text = self.proc.stdout.readline()
        if not text:
            raise AssertionError(f"the standby exited ({self.proc.wait(timeout=60)}):\n{self.stderr()[-4000:]}")
        return json.loads(text)

    def request(self, text: str) -> None:
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def close(self) -> int:
        if self.proc.poll() is None:
            self.proc.kill()
        code = self.proc.wait(timeout=60)
        for stream in (self.proc.stdin, self.proc.stdout, self.log):
            if stream is not None:
                stream.close()
        return code


def _memfd_inodes_mapped(pid: int) -> set[int]:
    """Inodes of the weightcache arenas (memfds) ``pid`` maps."""
    with open(f"/proc/{pid}/maps") as maps:
        return {int(line.split()[4]) for line in maps if "weightcache-arena" in line}


def _memfd_inodes_held(pid: int) -> set[int]:
    """Inodes of the weightcache arenas ``pid`` holds open (the server: its entries)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if "weightcache-arena" in os.readlink(f"/proc/{pid}/fd/{fd}"):
                inodes.add(os.stat(f"/proc/{pid}/fd/{fd}").st_ino)
        except OSError:
            pass
    return inodes


@pytest.fixture(scope="module")
def mid_model(tmp_path_factory) -> Path:
    """A Llama of ~110 MB (float32): large enough that a private copy of its weights would show in the standby's memory."""
    import torch
    import transformers
    from transformers.initialization import no_init_weights

    config = transformers.LlamaConfig(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(0)
    with no_init_weights():
        model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02)
    directory = tmp_path_factory.mktemp("llama-110m")
    model.eval().save_pretrained(directory)
    return directory


def test_a_standby_maps_the_entry_holds_no_copy_and_takes_over_on_sigusr1(server, mid_model):
    published = publish(prepare(LoadRequest(model=str(mid_model))), server.socket_dir)
    standby = StandbyProcess(mid_model, server.socket_dir)
    try:
        ready = standby.line()
        assert ready["event"] == "ready" and ready["digest"] == published.digest
        assert ready["parameters_outside_arenas"] == 0, "every parameter must view the entry's arenas"
        assert ready["mapped_bytes"] == published.manifest.nbytes > 100 << 20
        assert ready["private_growth_bytes"] < ready["mapped_bytes"] // 4, (
            f"the standby's private memory grew by {ready['private_growth_bytes']} bytes while attaching "
            f"{ready['mapped_bytes']} bytes: it holds a copy of the weights"
        )
        mapped = _memfd_inodes_mapped(standby.pid)
        assert mapped and mapped == _memfd_inodes_held(server.pid), "the standby maps exactly the server's entry arenas"
        signalled = time.monotonic()
        os.kill(standby.pid, signal.SIGUSR1)
        took = standby.line()
        assert (took["event"], took["reason"], took["detail"]) == ("took_over", "signal", "SIGUSR1")
        assert took["trigger_at"] >= signalled and took["first_token_at"] >= took["trigger_at"]
        assert isinstance(took["token"], int)
        assert standby.proc.wait(timeout=60) == 0
    finally:
        standby.close()


def report_and_exit(loaded) -> int:
    """A ``--then`` function: report what it was handed, exit with status 7."""
    print(
        json.dumps({"then": True, "source": loaded.source, "mode": loaded.mode, "class": type(loaded.model).__name__}), flush=True
    )
    return 7


def test_a_takeover_request_on_stdin_calls_the_then_function(server, model_dir):
    model = model_dir("llama")
    publish(prepare(LoadRequest(model=str(model))), server.socket_dir)
    standby = StandbyProcess(model, server.socket_dir, "--then", f"{__name__}:report_and_exit", stdin=subprocess.PIPE)
    try:
        assert standby.line()["event"] == "ready"
        standby.request("status please")  # not a request the standby knows: logged and ignored
        standby.request(TAKEOVER_REQUEST)
        took = standby.line()
        assert (took["event"], took["reason"]) == ("took_over", "request") and "token" not in took
        assert standby.line() == {"then": True, "source": "cache", "mode": "client", "class": "LlamaForCausalLM"}
        assert standby.proc.wait(timeout=60) == 7, "the then function's int is the exit status"
        assert "ignoring the request 'status please'" in standby.stderr()
    finally:
        standby.close()


@pytest.mark.parametrize("case", ["no entry", "no server"])
def test_a_standby_that_cannot_attach_says_why_and_exits_non_zero(server, model_dir, case, tmp_path):
    socket_dir = server.socket_dir
    if case == "no server":
        socket_dir = tmp_path / "nobody"
        socket_dir.mkdir(mode=0o700)
    standby = StandbyProcess(model_dir("llama"), socket_dir)
    try:
        assert standby.proc.wait(timeout=240) == 1
        error = standby.stderr()
        assert "cannot attach" in error and "publish the model first" in error, error[-3000:]
        assert ("no cached entry" if case == "no entry" else "no weightcache server") in error
        assert standby.proc.stdout.read() == "", "a standby that is not ready never says it is"
    finally:
        standby.close()


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--watch-pid", "999999999"], "there is no process 999999999 to watch"),
        (["--then", "no_such_module_anywhere:serve"], "--then 'no_such_module_anywhere:serve': No module named"),
        (["--then", "json"], "expected MODULE:FUNCTION"),
    ],
)
def test_a_bad_watch_pid_or_then_is_refused_before_anything_slow(socket_dir, model_dir, args, words):
    code = "import sys; from weightcache.core.cli.cli import main; code = main(sys.argv[1:]); print('torch' in sys.modules); sys.exit(code)"
    proc = subprocess.run(
        [sys.executable, "-c", code, "standby", "--model", str(model_dir("llama")), "--socket-dir", str(socket_dir), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1 and words in proc.stderr, proc.stderr[-3000:]
    assert proc.stdout.strip() == "False", "refused before importing torch"


@pytest.mark.parametrize("pidfd", [True, False], ids=["pidfd", "polling"])
def test_a_primarys_exit_is_seen_by_pidfd_or_by_polling(pidfd):
    primary = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    triggers = _Triggers(primary.pid, None, use_pidfd=pidfd)
    try:
        assert triggers.wait(timeout=0.2) is None, "nothing happened yet"
        killed = time.monotonic()
        primary.kill()  # not reaped: a zombie has exited too
        trigger = triggers.wait(timeout=10)
        assert trigger is not None and (trigger.reason, trigger.detail) == ("primary_exited", f"pid {primary.pid}")
        assert trigger.at - killed < 0.5
    finally:
        triggers.close()
        primary.wait()
    assert wait_until(lambda: signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL), "the SIGUSR1 handler is restored"
    with pytest.raises(StandbyError, match="there is no process"):
        _Triggers(primary.pid, None, use_pidfd=pidfd)


SLOW_EXIT = "import mmap, time; m = mmap.mmap(-1, 1 << 30); m.write(b'x' * (1 << 30)); print(flush=True); time.sleep(60)"
"""A primary that takes long to die: 1 GiB of host memory to free after the kill (as a GPU primary's mappings)."""


@pytest.mark.parametrize("pidfd", [True, False], ids=["pidfd", "polling"])
def test_a_killed_primary_is_seen_within_a_few_milliseconds_long_before_it_is_a_zombie(pidfd):
    """An exit that has begun (PF_EXITING, no memory map) counts, with or without a pidfd (which fires only at the
    zombie): a primary that takes long to tear its memory down is seen at once."""
    seen, zombie = [], []
    for _ in range(5):
        primary = subprocess.Popen([sys.executable, "-c", SLOW_EXIT], stdout=subprocess.PIPE)
        primary.stdout.readline()  # its memory is there
        triggers = _Triggers(primary.pid, None, use_pidfd=pidfd)
        try:
            assert ("pidfd and polling" if pidfd else "polling /proc/PID/stat every 1 ms") in triggers.watched_by
            assert triggers.wait(timeout=0.05) is None
            killed = time.monotonic()
            primary.kill()
            trigger = triggers.wait(timeout=10)
            seen.append(trigger.at - killed)
            os.waitid(os.P_PID, primary.pid, os.WEXITED | os.WNOWAIT)
            zombie.append(time.monotonic() - killed)
        finally:
            triggers.close()
            primary.wait()
            primary.stdout.close()
    figures = f"kill -> seen {[round(s * 1000, 1) for s in seen]} ms, -> zombie {[round(z * 1000, 1) for z in zombie]} ms"
    # an order of magnitude, not a timing (benchmarks/standby.py --detection measures it): the watcher polls every
    # millisecond, so a median of a tenth of a second is a watcher that waited for something else
    assert sorted(seen)[2] < 0.1, figures


@pytest.mark.parametrize(
    ("line", "begun"),
    [
        (b"7 (python3) S 1 7 7 0 -1 4194560 9 0 0 0 1 2 0 0 20 0 3 0 100 123904000 4000 18446744073709551615", False),
        (b"7 (a) b) S 1 7 7 0 -1 4194560 9 0 0 0 1 2 0 0 20 0 3 0 100 123904000 4000 0", False),  # a ")" in the name
        (b"7 (python3) S 1 7 7 0 -1 4194564 9 0 0 0 1 2 0 0 20 0 3 0 100 123904000 4000 0", True),  # PF_EXITING
        (b"7 (python3) Z 1 7 7 0 -1 4194560 9 0 0 0 1 2 0 0 20 0 1 0 100 0 0 0", True),
        # gVisor: flags always 0, the state "R" until the zombie; the leader's map released: vsize 0
        (b"7 (python3) R 1 7 7 0 0 0 0 0 0 0 1 2 0 0 20 0 3 0 100 0 0 0", True),
        (b"7 (python3) R 1 7 7 0 0 0 0 0 0 0 1 2 0 0 20 0 3 0 100 123904000 4000 0", False),
        (b"garbage", True),
    ],
)
def test_exit_begun_reads_the_state_the_flags_and_the_memory_map(line, begun):
    assert exit_begun(line) is begun


def test_early_cuda_set_up_does_nothing_on_the_cpu_and_hands_its_error_to_the_waiter():
    import torch

    from weightcache.core.errors import ArenaError
    from weightcache.core.spare.warm import start_cuda_early

    on_cpu = start_cuda_early("cpu")
    assert on_cpu.done and on_cpu._thread is None, "no thread: nothing to set up on the CPU"
    on_cpu.wait(timeout=0)  # returns without waiting (a thread would need its timeout)
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the set-up would succeed")
    early = start_cuda_early("cuda:0")
    with pytest.raises(ArenaError, match="cuda:0"):  # raised in the background thread, handed over here
        early.wait(timeout=60)
    assert early.done
