"""What the ``weightcache`` command shows: load's progress on a terminal and its one result line, status's table and JSON,
each command's help, sizes in fitting units, the demo's and the attach benchmark's tables. The refusals are in
test_cli.py."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pty
import re
import select
import shlex
import struct
import subprocess
import sys
import time

import pytest

from tests import zygote
from tests.core.support import make_fingerprint, publish_host_entry
from tests.core.test_cli import ROOT, cli
from weightcache.core import __version__
from weightcache.core.progress import format_bytes, format_speedup

# --- load: shows progress on a terminal, prints its result once ------------------------------------------


def run_on_terminal(args: list[str], env: dict) -> tuple[int, str, str]:
    """Run ``args`` with stderr on a pseudo-terminal (120 columns); its exit status, stdout and what the terminal showed."""
    import fcntl
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = zygote.popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=slave, cwd=ROOT, env={**os.environ, **env})
    os.close(slave)
    shown = b""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            shown += chunk
        elif proc.poll() is not None:
            break
    os.close(master)
    with proc.stdout:
        stdout = proc.stdout.read().decode()
    return proc.wait(timeout=60), stdout, shown.decode(errors="replace").replace("\r\n", "\n")


def test_load_shows_progress_on_a_terminal_then_finds_the_entry_cached_without_loading(model_dir, server, tmp_path):
    path = model_dir("llama")
    digests = {"WEIGHTCACHE_CACHE_DIR": str(tmp_path / "digests")}  # a store of its own: the files are seen for the first time
    code, stdout, shown = run_on_terminal(
        [sys.executable, "-m", "weightcache.core.cli.cli", "load", "--model", str(path), "--socket-dir", str(server.socket_dir)],
        digests,
    )
    assert code == 0, shown
    assert shown.startswith(f"checking {path} ...\n"), "the first thing on the terminal says what is happening"
    assert "first sight of these weight files: their digests are computed from the bytes read, in the same pass" in shown
    assert "hashing" not in shown, "a first load reads each byte once: no hashing pass of its own"
    assert re.search(r"loading: 100%\|.*\| [\d.]+/[\d.]+ MiB \[.*MiB/s\]", shown), shown
    [line] = stdout.splitlines()
    label = f"{path.name} (LlamaForCausalLM, hf)"  # the checkpoint directory's name
    assert re.fullmatch(rf"published [0-9a-f]{{12}}  {re.escape(label)}: \d+ tensors, [\d.]+ MiB in 1 arena, [\d.]+ s", line), (
        line
    )
    assert "published" not in shown, "the result is printed once, on stdout"

    digest = line.split()[1]
    again = cli("load", "--model", str(path), "--socket-dir", str(server.socket_dir), env=digests)
    assert again.code == 0 and again.stderr == [], again
    assert re.fullmatch(rf"already cached: {digest}  {re.escape(label)}, [\d.]+ MiB; nothing was loaded\n", again.stdout), again
    assert "weightcache.core.load.reader" not in again.imported, "a cached entry is not loaded again"


def test_the_publish_log_does_not_claim_publishing_an_entry_that_existed(model_dir, server):
    path = model_dir("llama")
    code = f"""
import logging, sys
logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
from weightcache.core.flow.loader import prepare, publish
from weightcache.core.request import LoadRequest
for _ in range(2):
    publish(prepare(LoadRequest(model={str(path)!r})), {str(server.socket_dir)!r})
"""
    proc = zygote.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if f"({path.name} (LlamaForCausalLM, hf))" in line]
    assert proc.returncode == 0 and len(lines) == 2, proc.stdout + proc.stderr
    assert lines[0].startswith("published ") and lines[1].startswith("loaded, but the server already held "), lines


# --- status ----------------------------------------------------------------------------------------


def test_status_is_a_readable_table(server):
    entry = publish_host_entry(server.socket_dir, nbytes=1 << 20, label="tiny-llama (LlamaForCausalLM, hf)")
    run = cli("status", "--socket-dir", str(server.socket_dir))
    assert run.code == 0 and run.stderr == []
    lines = [re.sub(r"\d+ s ago", "N s ago", line) for line in run.stdout.splitlines()]
    assert lines == [
        f"server pid {server.pid} (weightcache {__version__}): 1 entry, 1.0 MiB held (no budget)",
        "  since its start N s ago: 0 attaches, 0 misses, 0 fallbacks reported, 0 evictions, 0 refusals",
        "ID            MODEL                              RANK   DEVICE      DTYPE    SIZE     TENSORS  ATTACHED PIDS",
        f"{entry.digest[:12]}  tiny-llama (LlamaForCausalLM, hf)  tp1/2  cpu (host)  float32  1.0 MiB  1        -",
    ]


def test_status_json_fields_are_the_documented_ones(server):
    publish_host_entry(server.socket_dir)
    reply = json.loads(cli("status", "--json", "--socket-dir", str(server.socket_dir)).stdout)
    documented = set(re.findall(r"^\| `([a-z_\[\].]+)` \|", (ROOT / "docs" / "operations.md").read_text(), flags=re.MULTILINE))
    assert {f"entries[].{key}" for key in reply["entries"][0]} | set(reply) == documented


def test_an_entry_published_through_the_api_without_a_label_gets_one(server):
    torch = pytest.importorskip("torch")
    from weightcache.core.flow import api

    fingerprint = make_fingerprint()
    api.publish_state({"w": torch.ones(4)}, fingerprint, socket_dir=server.socket_dir)
    run = cli("status", "--json", "--socket-dir", str(server.socket_dir))
    assert json.loads(run.stdout)["entries"][0]["label"] == "WireTestForCausalLM (wiretest)"


def test_a_closed_pipe_ends_status_quietly(server):
    publish_host_entry(server.socket_dir)
    read_end, write_end = os.pipe()
    os.close(read_end)  # `weightcache status | head -0`: the reader is gone before the first write
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "weightcache.core.cli.cli", "status", "--socket-dir", str(server.socket_dir)],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write_end)
    assert proc.returncode == 141 and proc.stderr == "", proc.stderr


# --- help, sizes and tables ---------------------------------------------------------------------------


def test_every_command_has_a_description_and_every_option_help():
    import argparse

    from weightcache.core.cli.cli import build_parser

    parser = build_parser()
    [commands] = [action for action in parser._actions if isinstance(action, argparse._SubParsersAction)]
    for name, command in commands.choices.items():
        assert command.description, f"`weightcache {name}` has no description"
        for action in command._actions:
            assert action.help, f"`weightcache {name} {'/'.join(action.option_strings) or action.dest}` has no help"
    shown = subprocess.run(
        [sys.executable, "-m", "weightcache.core.cli.cli", "load", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "--dtype {auto,bfloat16,float16,float32}" in shown


def test_sizes_read_and_show_in_fitting_units():
    from weightcache.core.cli.cli_options import size

    assert [size(text) for text in ("1M", "1MiB", "64g", "1.5T", "4096")] == [1 << 20, 1 << 20, 64 << 30, 3 << 39, 4096]
    assert [size(text) for text in ("10GiB", "10Gi", "10gi", "10G")] == [10 << 30] * 4
    assert [size(text) for text in ("10GB", "10gb", "1.5TB", "512MB", "2kB")] == [
        10 * 10**9,
        10 * 10**9,
        15 * 10**11,
        512 * 10**6,
        2000,
    ]
    assert [size(text) for text in ("4096B", "4096b")] == [4096, 4096]
    for wrong in ("10Gx", "10iB", "10GBi", "G"):
        with pytest.raises(argparse.ArgumentTypeError, match="is not a size"):
            size(wrong)
    assert [format_bytes(n) for n in (0, 512, 1 << 20, int(86.7 * 2**20), 1023.99 * 1024, 3 << 40)] == [
        "0 B",
        "512 B",
        "1.0 MiB",
        "86.7 MiB",
        "1.0 MiB",
        "3.0 TiB",
    ]


def test_the_demo_ends_with_commands_that_exist_to_try_next():
    from weightcache.core.cli.cli import build_parser
    from weightcache.core.cli.demo import next_steps

    lines = next_steps("/models/m")
    assert lines[0].startswith("what to try next")
    commands = [shlex.split(line.split("#")[0])[1:] for line in lines if line.strip().startswith("weightcache ")]
    assert [command[0] for command in commands] == ["serve", "load", "status"]
    for command in commands:
        build_parser().parse_args(command)  # each runs as shown
    assert any("load_model(" in line for line in lines)


def test_the_demo_table_says_slower_when_attach_is_slower():
    from weightcache.core.cli.demo import demo_table

    published = {
        "first_sight": True,
        "publish_s": 1.3,
        "timings": {"load_s": 0.2, "identify_s": 0.1, "export_s": 1.0, "publish_s": 0.1},
    }
    lines = demo_table(published, {"load_s": 0.04}, {"load_s": 0.05, "output_sha256": "ab" * 32}, True)
    assert "engine B, mode client: 1.2x slower than engine A's disk load" in lines[5]
    assert "loader: read 200.0 ms, copy into new shared memory 1,000.0 ms, publish 100.0 ms" in lines[3]
    assert "first sight: digested from the bytes read" in lines[2] and "100.0 ms" in lines[2]
    assert format_speedup(1.0, 0.1) == "10.0x faster" and format_speedup(0.8, 1.0) == "1.2x slower"


def test_the_attach_benchmark_table_has_no_fractional_faster_and_no_blown_out_column(capsys):
    spec = importlib.util.spec_from_file_location("bench_attach", ROOT / "benchmarks" / "attach.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    results = {
        "device": "cpu",
        "gib": 2.0,
        "tensors": 1000,
        "torch": "2.13",
        "safetensors_warm_s": 0.05,
        "safetensors_warm_touched_s": 0.9,
        "weightcache_load_s": 1.7,
        "weightcache_load_cold": False,
        "attach": {
            "median_s": 0.012,
            "tensors": 1000,
            "arenas": 2,
            "touched_median_s": 1.1,
            "phases_ms": {"connect_s": 0.3, "map_s": 2.1, "view_s": 5.0},
        },
    }
    bench.print_table(results, 2 << 30)
    out = capsys.readouterr().out
    assert not re.search(r"\b0\.\d+x faster", out) and "1.2x slower" in out, out
    rule = next(line for line in out.splitlines() if line.startswith("---"))
    assert len(rule.split()[1]) <= 12, f"the time column is blown out:\n{out}"


def test_commands_quote_the_socket_dir_as_given(tmp_path):
    spaced = tmp_path / "my sockets"
    spaced.mkdir(mode=0o700)
    run = cli("status", "--socket-dir", str(spaced))
    assert run.first.endswith(f"start one with `weightcache serve --socket-dir {shlex.quote(str(spaced))}`")


@pytest.mark.parametrize("command", ["seed", "standby", "verify"])
def test_help_shows_no_docstring_markup(command):
    run = cli(command, "--help")
    assert run.code == 0 and run.stdout
    for markup in ("``", ":param", ":class:", ":func:"):
        assert markup not in run.stdout, f"`weightcache {command} --help` prints {markup!r}"


def test_every_command_spells_its_deadline_timeout_and_still_takes_timeout_s():
    from weightcache.core.cli.cli import build_parser

    for command in ("seed", "standby"):
        shown = cli(command, "--help").stdout
        assert "--timeout SECONDS" in shown and "--timeout-s" not in shown, shown
    parser = build_parser()
    assert parser.parse_args(["standby", "--model", "m", "--timeout-s", "5"]).timeout == 5.0
    assert parser.parse_args(["standby", "--model", "m", "--timeout", "7"]).timeout == 7.0
    assert parser.parse_args(["seed", "--timeout-s", "9"]).timeout == 9.0


def test_serve_help_lists_its_signals_environment_and_exit_codes():
    run = cli("serve", "--help", fork=True)
    assert run.code == 0
    for text in ("SIGTERM", "SIGHUP", "SIGUSR2", "WEIGHTCACHE_SOCKET_DIR", "NOTIFY_SOCKET", "exit status:", "/healthz"):
        assert text in run.stdout, text


def test_serve_dash_v_says_that_v_goes_before_the_command():
    run = cli("serve", "-v", fork=True)
    assert run.code == 2 and "put it before the command (`weightcache -v serve ...`)" in run.stderr[-1], run
