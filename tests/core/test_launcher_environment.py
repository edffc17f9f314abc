"""What a launcher counts as its preloads' dependencies on the environment (core/spare/environment.py): names read one
by one; not a copy of the whole environment, not the lookup of a command ``subprocess`` runs, never a session's names."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess

from weightcache.core.spare.environment import differences, recording_reads


def test_copies_and_scans_of_the_whole_environment_are_no_read_of_each_name(monkeypatch):
    monkeypatch.setenv("WC_ENV_ONE", "1")
    read: set[str] = set()
    with recording_reads(read):
        platform.architecture()  # CPython's helper: dict(os.environ, LC_ALL="C") to run `file`
        platform.processor()  # `uname -p`, looked up on PATH
        subprocess.run(["true"], check=True)
        dict(os.environ)
        os.environ.copy()
        _ = {**os.environ}
        list(os.environ.items())
        dict(os.environb)
    assert read == set(), sorted(read)


def test_reads_by_name_and_prefix_scans_are_dependencies(monkeypatch):
    monkeypatch.setenv("WC_ENV_SCANNED", "1")
    read: set[str] = set()
    with recording_reads(read):
        os.environ.get("WC_ENV_GET")
        assert "WC_ENV_IN" not in os.environ
        os.getenv("WC_ENV_GETENV")
        os.environb.get(b"WC_ENV_BYTES")
        shutil.which("true")  # keeps what it found: PATH is read by name
        for name in os.environ:  # a scan that reads what it picks
            if name.startswith("WC_ENV_SC"):
                os.environ[name]
    assert read == {"WC_ENV_GET", "WC_ENV_IN", "WC_ENV_GETENV", "WC_ENV_BYTES", "PATH", "WC_ENV_SCANNED"}, sorted(read)


def test_a_callers_session_names_never_differ_and_what_the_imports_set_is_the_callers_too():
    launcher = {"HOME": "/home/u", "SHLVL": "1", "PWD": "/", "_": "/usr/bin/weightcache", "TERM": "xterm", "OMP_X": "1"}
    caller = {
        "HOME": "/home/u", "SHLVL": "3", "PWD": "/srv", "OLDPWD": "/", "_": "/usr/bin/nice", "TERM": "dumb",
        "SSH_TTY": "/dev/pts/1", "LC_TERMINAL": "iTerm2", "INVOCATION_ID": "ab", "OMP_X": "1", "SET_BY_IMPORT": "v",
    }  # fmt: skip
    read = {"HOME", "TERM", "PWD", "SET_BY_IMPORT"}
    assert differences(read, launcher, caller, {"SET_BY_IMPORT": "v"}) == []
    assert differences(read, launcher, {**caller, "HOME": "/other", "OMP_X": "2", "LC_ALL": "C"}) == [
        "HOME", "LC_ALL", "OMP_X", "SET_BY_IMPORT",
    ]  # fmt: skip


def test_a_gomp_cpu_affinity_of_one_cpu_is_taken_by_a_fork_and_any_other_differs():
    """libgomp binds the thread that loads it to the first CPU of ``GOMP_CPU_AFFINITY``; a fork bound to that one CPU
    is what an exec'd child is (vLLM gives each CPU worker one). A list of several is libgomp's places: exec'd."""
    launcher = {"OMP_NUM_THREADS": "1"}
    assert differences(set(), launcher, {**launcher, "GOMP_CPU_AFFINITY": "1"}) == []
    assert differences(set(), {**launcher, "GOMP_CPU_AFFINITY": "0"}, {**launcher, "GOMP_CPU_AFFINITY": " 1 "}) == []
    for caller, launchers in (("0 1", None), ("0-1", None), ("1", "0 1"), (None, "0")):
        env = {**launcher, **({"GOMP_CPU_AFFINITY": launchers} if launchers else {})}
        asked = {**launcher, **({"GOMP_CPU_AFFINITY": caller} if caller else {})}
        assert differences(set(), env, asked) == ["GOMP_CPU_AFFINITY"], (caller, launchers)
