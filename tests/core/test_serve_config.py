"""`weightcache serve --config FILE.toml`: settings, flags over them, a warm list loaded in the background, SIGHUP."""

from __future__ import annotations

import signal
import subprocess

import pytest

from tests.core.support import make_fingerprint, publish_host_entry
from tests.helpers import ServerProcess, wait_until
from weightcache.core.client.attach import Attachment
from weightcache.core.client.client import Connection
from weightcache.core.server.serve_config import ConfigError, ServeFile, ServeSource


def _status(socket_dir) -> dict:
    with Connection(socket_dir, timeout=10) as conn:
        return conn.status()


def test_the_file_gives_settings_and_the_warm_list_and_flags_win(tmp_path):
    path = tmp_path / "serve.toml"
    path.write_text(
        '[server]\nbyte_budget = "2G"\nhost_budget = 1048576\nidle_timeout = 0\n'
        '[[warm]]\nmodel = "/models/a"\ndevice = "cpu"\ntier = "host"\n'
        '[[warm]]\nmodel = "org/b"\ndtype = "bfloat16"\nquant = "fp8-block"\n'
    )
    settings, warm = ServeSource(path, {"byte_budget": 3 << 30}).read()
    assert settings == {"byte_budget": 3 << 30, "host_budget": 1 << 20, "idle_timeout_s": None}
    assert [item.model for item in warm] == ["/models/a", "org/b"]
    assert warm[0].tier == "host" and warm[1].quant == "fp8-block"
    command = warm[1].command("/run/wc")
    assert command[command.index("--dtype") + 1] == "bfloat16" and command[command.index("--quant") + 1] == "fp8-block"


def test_the_file_sets_everything_the_flags_set(tmp_path):
    """Every option of ``serve`` that is a setting (not an action like --detach or --take-over) has a key."""
    from weightcache.core.cli.cli import build_parser
    from weightcache.core.server.serve_config import _SERVER_KEYS

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    actions = {"--detach", "--take-over", "--check-config", "--config", "--help"}
    options = {option for action in serve._actions for option in action.option_strings if option.startswith("--")}
    assert {option[2:].replace("-", "_") for option in options - actions} <= set(_SERVER_KEYS)
    path = tmp_path / "serve.toml"
    path.write_text('[server]\nmetrics_port = 9464\nmetrics_host = "0.0.0.0"\nlog_format = "json"\nlog_file = "/x.log"\n')
    loaded = ServeFile.load(path)
    assert loaded.settings == {"metrics_port": 9464, "metrics_host": "0.0.0.0"}
    assert loaded.logging == {"log_format": "json", "log_file": "/x.log"}


def test_check_config_says_valid_or_names_the_mistake_in_one_line(tmp_path, model_dir):
    from tests.core.test_cli import cli

    path = tmp_path / "serve.toml"
    model = model_dir("llama")
    path.write_text(f'[server]\nsocket_dir = "{tmp_path}/wc"\nmetrics_port = 9464\n[[warm]]\nmodel = "{model}"\n')
    run = cli("serve", "--config", str(path), "--check-config", fork=True)
    assert run.code == 0 and "the settings are valid" in run.stdout and "metrics = 127.0.0.1:9464" in run.stdout, run
    assert f"{model} (cpu, tier device)" in run.stdout and not (tmp_path / "wc").exists(), "a check serves nothing"
    path.write_text('[server]\nbyte_budget = "lots"\n')
    run = cli("serve", "--config", str(path), "--check-config", fork=True)
    assert run.code == 1 and run.stderr[-1].startswith("weightcache: error: ") and "byte_budget" in run.stderr[-1], run
    run = cli("serve", "--metrics-port", "1", "--metrics-host", "no-such-host.invalid", "--check-config", fork=True)
    assert run.code == 1 and "no-such-host.invalid" in run.stderr[-1], run


def test_check_config_takes_each_warm_item_as_far_as_a_start_would_and_holds_the_budgets_to_the_machine(tmp_path, model_dir):
    """What `serve --check-config` called valid and a start then failed at: a model that is not there, an adapter or
    a device that does not resolve; and what would run but not as the file reads: budgets too big or too small."""
    from tests.core.test_cli import cli

    model, missing = model_dir("llama"), tmp_path / "no-such-model"
    path = tmp_path / "serve.toml"
    path.write_text(
        f'[server]\nbyte_budget = "4K"\nhost_budget = "1000T"\n[[warm]]\nmodel = "{missing}"\n[[warm]]\nmodel = "{model}"\n'
        f'[[warm]]\nmodel = "{model}"\nadapter = "no-such-adapter"\n[[warm]]\nmodel = "{model}"\ntier = "host"\n'
    )
    for run in (
        cli("check-config", "--config", str(path), fork=True),
        cli("serve", "--config", str(path), "--check-config", fork=True),
    ):
        assert run.code == 1 and "3 errors, 2 warnings" in run.stdout.splitlines()[0], run
        problems = [line for line in run.stderr if line.startswith("weightcache: ")]
        assert len(problems) == 5, run.stderr
        assert problems[0].startswith(f"weightcache: error: warm item 1 ({missing}): {missing}: no such file"), problems
        assert (
            problems[1].startswith("weightcache: error: warm item 3")
            and "no weightcache adapter named 'no-such-adapter'" in problems[1]
        )
        assert problems[2].startswith("weightcache: error: warm item 4") and "needs a CUDA --device" in problems[2]
        assert "host_budget 1000.0 TiB is more than this machine's memory" in problems[3]
        assert f"warm item {model} needs" in problems[4] and "over byte_budget 4.0 KiB" in problems[4]
    path.write_text(f'[[warm]]\nmodel = "{model}"\n')
    run = cli("check-config", "--config", str(path), fork=True)
    assert run.code == 0 and run.stdout.startswith(f"weightcache check-config: the settings are valid ({path})"), run
    assert not [line for line in run.stderr if line.startswith("weightcache: ")], run.stderr


def test_sighup_without_a_config_file_changes_nothing_and_the_server_serves_on(socket_dir):
    server = ServerProcess.start(socket_dir)
    try:
        publish_host_entry(socket_dir)
        server.proc.send_signal(signal.SIGHUP)
        assert wait_until(lambda: "SIGHUP: the server runs without --config; nothing to re-read" in server.log())
        assert server.proc.poll() is None and len(_status(socket_dir)["entries"]) == 1
    finally:
        server.close()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[server]\nbyte_budjet = "1G"\n', "unknown key 'byte_budjet'; did you mean 'byte_budget'?"),
        ('[server]\nbyte_budget = "lots"\n', "byte_budget: 'lots' is not a size"),
        ("[[warm]]\ndevice = 'cpu'\n", "give the model"),
        ("[[warm]]\nmodel = 'x'\ntier = 'disk'\n", "tier is one of device, host, both"),
        ("[server\n", "is not valid TOML"),
        ("[servers]\n", "unknown key 'servers'"),
        ('[server]\nmetrics_port = "9464"\n', "metrics_port: '9464' is not a port number"),
        ("[server]\nmetrics_port = 70000\n", "metrics_port: "),
        ('[server]\nlog_format = "xml"\n', "log_format: 'xml' is not one of text, json"),
        ('[server]\nlog_level = "loud"\n', "log_level: 'loud' is not one of debug, info, warning, error"),
    ],
)
def test_a_bad_file_is_refused_with_what_to_fix(tmp_path, text, message):
    path = tmp_path / "serve.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        ServeFile.load(path)
    assert message in str(caught.value)


def test_the_server_is_ready_at_once_loads_the_warm_list_in_order_and_sighup_rereads_it(socket_dir, tmp_path, model_dir):
    path = tmp_path / "serve.toml"
    missing = tmp_path / "no-such-model"
    path.write_text(f'[server]\nbyte_budget = "1G"\n[[warm]]\nmodel = "{missing}"\n[[warm]]\nmodel = "{model_dir("llama")}"\n')
    server = ServerProcess.start(socket_dir, "--config", str(path), "--host-budget", "512M")
    try:
        status = _status(socket_dir)  # answers before the list is loaded
        assert status["budgets"] == {"total": 1 << 30, "host": 512 << 20, "per_gpu": None}
        assert [row["model"] for row in status["warm"]] == [str(missing), str(model_dir("llama"))]
        assert wait_until(lambda: _status(socket_dir)["warm"][1]["state"] == "done", timeout=120), _status(socket_dir)["warm"]
        rows = _status(socket_dir)
        assert rows["warm"][0]["state"] == "failed" and rows["warm"][0]["detail"], rows["warm"][0]
        assert len(rows["entries"]) == 1
        assert f"WARNING weightcache.core.server.rewarm: warm list: {missing} failed" in server.log(), server.log()
        assert rows["metrics"]["warm_items"] == {"pending": 0, "loading": 0, "done": 1, "failed": 1}

        held = publish_host_entry(socket_dir, make_fingerprint(architecture="Held"))
        attachment = Attachment.open(held.fingerprint, socket_dir)
        try:
            path.write_text('[server]\nbyte_budget = "4K"\ngpu_budget = "1G"\n')  # smaller than what is held
            server.proc.send_signal(signal.SIGHUP)
            assert wait_until(lambda: _status(socket_dir)["budgets"]["total"] == 4096, timeout=10)
            after = _status(socket_dir)
            assert after["budgets"] == {"total": 4096, "host": 512 << 20, "per_gpu": 1 << 30}, "the flag must still win"
            assert after["warm"] == []
            said = f"SIGHUP: re-read {path}: budgets 4.0 KiB in all, 512.0 MiB on the host, 1.0 GiB per GPU; nothing to keep warm"
            assert wait_until(lambda: said in server.log(), timeout=10), "the line names the budgets in words, not a repr"
            assert held.digest in {row["digest"] for row in after["entries"]}, "a reload must not evict"
            assert len(after["entries"]) == 2, "nothing is evicted by a reload"
        finally:
            attachment.close()
    finally:
        server.close()
    assert "Traceback" not in server.log()


def test_python_without_a_toml_reader_is_told_what_to_install(tmp_path):
    path = tmp_path / "serve.toml"
    path.write_text("")
    code = (
        "import sys; sys.modules['tomllib'] = None; sys.modules['tomli'] = None\n"
        "from weightcache.core.server.serve_config import ServeFile, ConfigError\n"
        f"try:\n    ServeFile.load({str(path)!r})\nexcept ConfigError as exc:\n    print(exc)\n"
    )
    out = subprocess.run([__import__("sys").executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
    assert "pip install tomli" in out
