"""deploy/: the systemd unit, the container recipes and the Kubernetes manifests, checked as far as this machine allows.

The unit goes through ``systemd-analyze verify`` (where installed) and a parser; every weightcache command
line in these files is parsed by weightcache's own argument parser, so a renamed or dropped option fails
here. The images are not built (no container engine runs on the CI machines).
"""

from __future__ import annotations

import configparser
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from weightcache.core.cli.cli import build_parser

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
UNIT = DEPLOY / "systemd" / "weightcache.service"
SOCKET_DIR = "/run/weightcache"


def parses(argv: list[str]) -> None:
    """``weightcache ARGV`` parses (argparse exits 2 on an unknown option or a bad value)."""
    assert argv[0].endswith("weightcache"), argv
    build_parser().parse_args(argv[1:])


def unit() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=True, interpolation=None, comment_prefixes=("#", ";"))
    parser.optionxform = str  # systemd keys are case-sensitive
    parser.read_string(UNIT.read_text())
    return parser


def test_the_unit_is_a_notify_service_that_serves_the_runtime_directory():
    service = unit()["Service"]
    assert service["Type"] == "notify" and service["NotifyAccess"] == "main"
    assert service["RuntimeDirectory"] == "weightcache" and service["RuntimeDirectoryMode"] == "0700"
    argv = shlex.split(service["ExecStart"])
    parses(argv)
    assert argv[argv.index("--socket-dir") + 1] == SOCKET_DIR
    assert "--detach" not in argv, "under systemd the server stays in the foreground"
    assert int(service["LimitNOFILE"]) >= 65536
    assert unit()["Install"]["WantedBy"] == "multi-user.target"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verifies_the_unit(tmp_path):
    # verify checks that ExecStart's program exists: point it at this environment's weightcache.
    program = shutil.which("weightcache", path=os.path.dirname(sys.executable)) or shutil.which("weightcache")
    assert program, "weightcache is not installed in this environment"
    text = UNIT.read_text().replace("/opt/weightcache/bin/weightcache", program)
    text = re.sub(r"^(User|Group)=.*$", "", text, flags=re.MULTILINE)  # no such user on a test machine
    copy = tmp_path / "weightcache.service"
    copy.write_text(text)
    proc = subprocess.run(["systemd-analyze", "verify", str(copy)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "weightcache.service" not in proc.stderr, proc.stderr  # no warning about our unit


MAX_EXPOSURE = 3.5
"""The most ``systemd-analyze security`` may rate the shipped unit (0 safest, 10 unsafe)."""


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed (apt-get install systemd)")
def test_the_unit_is_sandboxed_as_systemd_analyze_security_rates_it(tmp_path):
    copy = tmp_path / "weightcache.service"
    copy.write_text(UNIT.read_text())
    proc = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", "--no-pager", str(copy)], capture_output=True, text=True, timeout=60
    )
    found = re.search(r"Overall exposure level for weightcache.service: ([0-9.]+)", proc.stdout + proc.stderr)
    assert found, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert float(found[1]) <= MAX_EXPOSURE, proc.stdout
    service = unit()["Service"]
    for key in ("NoNewPrivileges", "ProtectSystem", "ProtectHome", "PrivateTmp", "RestrictAddressFamilies"):
        assert key in service, f"the unit sets no {key}="
    assert service["UMask"] == "0077" and service["ExecReload"] == "/bin/kill -HUP $MAINPID"


def test_the_sysusers_and_tmpfiles_files_make_the_units_user_and_config():
    user = UNIT.parent / "weightcache.sysusers"
    tmpfiles = UNIT.parent / "weightcache.tmpfiles"
    rows = [line.split() for line in user.read_text().splitlines() if line and not line.startswith("#")]
    assert rows[0][:2] == ["u", unit()["Service"]["User"]]
    argv = shlex.split(unit()["Service"]["ExecStart"])
    config = argv[argv.index("--config") + 1]
    created = [line.split()[:2] for line in tmpfiles.read_text().splitlines() if line and not line.startswith("#")]
    assert ["f", config] in created, "the unit's --config file exists even without a warm list"


def test_the_shipped_config_file_is_valid_and_names_only_keys_the_server_knows():
    from weightcache.core.server.serve_config import ServeFile

    shipped = ServeFile.load(UNIT.parent / "serve.toml")
    assert shipped.settings["host_budget"] == 200 << 30 and shipped.logging == {"log_level": "info"}
    assert shipped.warm == (), "the shipped file loads no model: the operator names them"


def _dockerfile_commands(path: Path) -> dict[str, list[str]]:
    """The JSON-form CMD and HEALTHCHECK of a Dockerfile, and its FROM image."""
    found: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        if line.startswith("FROM "):
            found["FROM"] = line.split()[1:]
        elif line.startswith("CMD "):
            found["CMD"] = json.loads(line.removeprefix("CMD "))
        elif line.startswith("HEALTHCHECK "):
            found["HEALTHCHECK"] = json.loads(line[line.index("CMD ") + 4 :])
    return found


@pytest.mark.parametrize(("name", "base"), [("Dockerfile.cpu", "python:"), ("Dockerfile.cuda", "nvidia/cuda:")])
def test_the_container_recipes_serve_and_probe_with_options_that_exist(name, base):
    found = _dockerfile_commands(DEPLOY / "container" / name)
    assert found["FROM"][0].startswith(base)
    parses(found["CMD"])
    assert "serve" in found["CMD"] and "--detach" not in found["CMD"], "the container's main process is the server"
    assert found["HEALTHCHECK"][:2] == ["weightcache", "probe"]
    parses(found["HEALTHCHECK"])


def _documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def test_the_daemonset_probes_the_server_over_http_and_shares_its_socket_directory_with_engines():
    _namespace, daemonset, service = _documents(DEPLOY / "kubernetes" / "daemonset.yaml")
    assert daemonset["kind"] == "DaemonSet" and daemonset["apiVersion"] == "apps/v1"
    pod = daemonset["spec"]["template"]["spec"]
    [server] = pod["containers"]
    parses(server["command"])
    argv = server["command"]
    port = int(argv[argv.index("--metrics-port") + 1])
    assert argv[argv.index("--metrics-host") + 1] == "0.0.0.0", "the kubelet probes the pod's IP"
    assert {"name": "metrics", "containerPort": port} in server["ports"]
    paths = {probe: server[probe]["httpGet"]["path"] for probe in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert paths == {"startupProbe": "/healthz", "readinessProbe": "/readyz", "livenessProbe": "/healthz"}
    assert {server[probe]["httpGet"]["port"] for probe in paths} == {"metrics"}
    context = server["securityContext"]
    assert context["allowPrivilegeEscalation"] is False and context["readOnlyRootFilesystem"] is True
    assert context["capabilities"] == {"drop": ["ALL"]} and context.get("privileged") is False
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    assert service["kind"] == "Service" and service["spec"]["selector"] == daemonset["spec"]["selector"]["matchLabels"]
    assert service["spec"]["ports"] == [{"name": "metrics", "port": port, "targetPort": "metrics"}]
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    mounted = {mount["mountPath"]: mount["name"] for mount in server["volumeMounts"]}
    assert volumes[mounted[SOCKET_DIR]]["hostPath"]["path"] == SOCKET_DIR

    [engine] = _documents(DEPLOY / "kubernetes" / "engine-pod.yaml")
    engine_spec = engine["spec"]
    engine_volumes = {volume["name"]: volume for volume in engine_spec["volumes"]}
    [container] = engine_spec["containers"]
    engine_mounts = {mount["mountPath"]: mount["name"] for mount in container["volumeMounts"]}
    assert engine_volumes[engine_mounts[SOCKET_DIR]]["hostPath"]["path"] == SOCKET_DIR, "the engine sees the same directory"
    assert engine_spec["securityContext"]["runAsUser"] == pod["securityContext"]["runAsUser"], "one uid (SO_PEERCRED)"
    assert engine_spec.get("hostIPC") == pod.get("hostIPC") is True
    assert {"name": "WEIGHTCACHE_SOCKET_DIR", "value": SOCKET_DIR} in container["env"]


def test_the_manifests_create_the_namespace_they_use_before_anything_in_it():
    """``kubectl apply -f deploy/kubernetes/`` takes the files in name order and each file's documents in order."""
    documents = [doc for path in sorted((DEPLOY / "kubernetes").glob("*.yaml")) for doc in _documents(path)]
    used = {doc["metadata"]["namespace"] for doc in documents if "namespace" in doc["metadata"]}
    assert documents[0] == {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": "weightcache", "labels": {"app.kubernetes.io/name": "weightcache"}},
    }
    assert used == {"weightcache"}, used


def test_the_unit_shown_in_the_operations_guide_is_the_deployed_one():
    guide = (Path(__file__).resolve().parents[1] / "docs" / "operations.md").read_text()
    shown = guide.split("The unit (`deploy/systemd/weightcache.service`", 1)[1].split("```ini", 1)[1].split("```", 1)[0]
    deployed = {line.strip() for line in UNIT.read_text().splitlines()}
    lines = [line.split("#", 1)[0].strip() for line in shown.splitlines()]
    missing = [line for line in lines if line and line not in deployed]
    assert not missing, f"docs/operations.md shows unit lines the deployed unit lacks: {missing}"


def test_the_real_systemd_test_skips_where_its_boot_would_hide_the_checkout():
    """Its boot mounts a tmpfs over /tmp (and more): a clone there failed with "No module named 'weightcache'"."""
    from tests.test_systemd_real import hidden

    assert "clone it elsewhere" in str(hidden(Path("/tmp/clone/weightcache")))
    assert "under /var/tmp" in str(hidden(Path("/var/tmp/x")))
    assert hidden(Path("/root/weightcache")) is None and hidden(Path("/tmpfoo/weightcache")) is None
