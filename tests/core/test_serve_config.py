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


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[server]\nbyte_budjet = "1G"\n', "unknown key 'byte_budjet'; did you mean 'byte_budget'?"),
        ('[server]\nbyte_budget = "lots"\n', "byte_budget: 'lots' is not a size"),
        ("[[warm]]\ndevice = 'cpu'\n", "give the model"),
        ("[[warm]]\nmodel = 'x'\ntier = 'disk'\n", "tier is one of device, host, both"),
        ("[server\n", "is not valid TOML"),
        ("[servers]\n", "unknown key 'servers'"),
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

        held = publish_host_entry(socket_dir, make_fingerprint(architecture="Held"))
        attachment = Attachment.open(held.fingerprint, socket_dir)
        try:
            path.write_text('[server]\nbyte_budget = "4K"\ngpu_budget = "1G"\n')  # smaller than what is held
            server.proc.send_signal(signal.SIGHUP)
            assert wait_until(lambda: _status(socket_dir)["budgets"]["total"] == 4096, timeout=10)
            after = _status(socket_dir)
            assert after["budgets"] == {"total": 4096, "host": 512 << 20, "per_gpu": 1 << 30}, "the flag must still win"
            assert after["warm"] == []
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
