"""benchmarks/restart.py's parent: the scenarios, each an engine process (exec'd, or forked by the launcher) timed to its
first token; the warm spare and the evicted batch engine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

SCENARIOS = ("disk-cold", "disk-warm", "attach", "warm-spare", "launcher", "launcher-cuda", "evicted-batch")


LAUNCHED = ("launcher", "launcher-cuda", "evicted-batch")


class Runner:
    """Starts engine processes for one checkpoint and server, and collects what they report."""

    def __init__(self, model: Path, device: str, socket_dir: Path, env: dict, tokenizer: str | None = None):
        self.model = model
        self.device = device
        self.socket_dir = socket_dir
        self.env = env
        self.tokenizer = tokenizer
        self.launchers: dict[str, subprocess.Popen] = {}
        self.launcher_args: list[str] = []
        self.launcher_ready: dict[str, dict] = {}

    def command(self, *args: str) -> list[str]:
        return [
            sys.executable,
            str(Path(__file__).resolve().with_name("restart.py")),
            *args,
            "--model",
            str(self.model),
            "--device",
            self.device,
        ]

    def spawn_engine(self, scenario: str, hold: bool = False) -> subprocess.Popen:
        args = ["--role", "engine", "--scenario", scenario, "--socket-dir", str(self.socket_dir)] + (["--hold"] if hold else [])
        if self.tokenizer:
            args += ["--tokenizer", self.tokenizer]
        launch = self.launch_command(scenario) if scenario in LAUNCHED else None  # the launcher's start is paid before
        command = self.command(*args, "--spawned-at", repr(time.monotonic()))
        if launch is not None:
            command = [*launch, *command[1:]]
        return subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=self.env)

    def launch_command(self, scenario: str) -> list[str]:
        """``weightcache launch --strict --`` to the scenario's launcher, started first if it is not running (paid before),
        once its child forked ahead waits for the request (its CUDA context made, under ``--cuda-ready``)."""
        kind = "cuda-ready" if scenario == "launcher-cuda" else "plain"
        socket_dir = self.socket_dir / "cuda-ready" if kind == "cuda-ready" else self.socket_dir
        if kind not in self.launchers:
            extra = ["--cuda-ready", self.device] if kind == "cuda-ready" else []
            spawned = time.monotonic()
            self.launchers[kind] = launcher = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "weightcache.core.cli.cli",
                    "launcher",
                    "--socket-dir",
                    str(socket_dir),
                    *self.launcher_args,
                    *extra,
                ],
                stdout=subprocess.PIPE,
                text=True,
                env=self.env,
            )
            self.launcher_ready[kind] = {**json_line(launcher, "launcher"), "ready_after_spawn_s": time.monotonic() - spawned}
        wait_ahead_ready(socket_dir)
        return [
            sys.executable,
            "-m",
            "weightcache.core.cli.cli",
            "launch",
            "--socket-dir",
            str(socket_dir),
            "--strict",
            "--",
        ]

    def close(self) -> None:
        for launcher in self.launchers.values():
            launcher.terminate()
            launcher.wait(timeout=60)
            launcher.stdout.close()
        self.launchers.clear()

    def evicted_batch(self) -> dict:
        """An online engine (exec'd, attached) and a batch engine (launched) on one device; the batch engine is
        SIGKILLed and asked back through the launcher; its first token, the online engine still running."""
        online = self.spawn_engine("attach", hold=True)
        batch = None
        try:
            online_report = json_line(online, "online engine")
            batch = self.spawn_engine("evicted-batch", hold=True)
            first = json_line(batch, "batch engine")
            evicted = time.monotonic()
            os.kill(first["pid"], signal.SIGKILL)  # the engine itself, as an eviction does
            batch.wait(timeout=120)
            batch.stdout.close()
            batch = None
            back = self.engine("evicted-batch")
            back["kill_to_back_s"] = time.monotonic() - evicted  # the kill, the batch engine's exit, its restart
            back["online_still_running"] = online.poll() is None
            back["same_token_as_online"] = back["token"] == online_report["token"]
            return back
        finally:
            reap(online, batch)

    def engine(self, scenario: str) -> dict:
        proc = self.spawn_engine(scenario)
        out, _ = proc.communicate(timeout=600)
        if proc.returncode:
            raise SystemExit(f"the {scenario} engine failed with status {proc.returncode}")
        return json.loads(out.strip().splitlines()[-1])

    def warm_spare(self) -> dict:
        """A primary (attached engine) and a standby watching it; SIGKILL the primary; the spare's first token."""
        primary = self.spawn_engine("attach", hold=True)
        standby = None
        try:
            primary_report = json_line(primary, "primary")
            spawned = time.monotonic()
            standby = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "weightcache.core.cli.cli",
                    "standby",
                    "--model",
                    str(self.model),
                    "--device",
                    self.device,
                    "--socket-dir",
                    str(self.socket_dir),
                    "--watch-pid",
                    str(primary.pid),
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                text=True,
                env=self.env,
            )
            ready = json_line(standby, "standby")
            ready_after = time.monotonic() - spawned
            killed = time.monotonic()
            os.kill(primary.pid, signal.SIGKILL)
            took = json_line(standby, "standby")
            standby.wait(timeout=120)
        finally:
            reap(primary, standby)
        timings = ready["timings"]
        return {
            "ready_after_spawn_s": ready_after,
            "standby_timings": timings,
            "skeleton_s": None,
            "trigger_s": took["trigger_at"] - killed,
            "first_token_s": took["first_token_at"] - took["trigger_at"],
            "total_s": took["first_token_at"] - killed,
            "token": took["token"],
            "same_token_as_primary": took["token"] == primary_report["token"],
            "parameters_outside_arenas": ready["parameters_outside_arenas"],
            "private_growth_bytes": ready["private_growth_bytes"],
        }


def wait_ahead_ready(socket_dir: Path, timeout: float = 120.0) -> None:
    """Until the launcher's child forked ahead waits for a request (``hello``'s ``ahead_ready``)."""
    from weightcache.core.cli.launch import ask

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ask(socket_dir, {"op": "hello"}).get("ahead_ready"):
            return
        time.sleep(0.05)
    raise SystemExit(f"the launcher at {socket_dir} had no child ready for a request within {timeout:g} s")


def reap(*procs: subprocess.Popen | None) -> None:
    """Kill each process of ``procs`` still running (None: never started), wait for it and close its stdout."""
    for proc in procs:
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            proc.stdout.close()


def json_line(proc: subprocess.Popen, who: str) -> dict:
    line = proc.stdout.readline()
    if not line:
        raise SystemExit(f"the {who} exited with status {proc.wait()} before reporting")
    return json.loads(line)
