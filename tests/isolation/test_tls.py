"""TLS and mTLS end to end, with certificates generated per test session."""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import pytest

from cacheserver.config import load_config
from cacheserver.server import Server
from kvcommon.errors import ConfigError
from replica_agent.client import BlockClient, BlockStoreError, ClientTls
from tests.support.certs import Certs
from tests.support.isolation import MODEL, isolation_config, serve
from tests.support.servers import ServerProcess


def _unavailable(client: BlockClient) -> None:
    with pytest.raises(BlockStoreError) as info:
        client.lookup("alpha", MODEL, [os.urandom(32)])
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_tls_with_tokens_end_to_end(tmp_path: Path, certs: Certs) -> None:
    running = serve(isolation_config(tmp_path, certs), certs)
    digest, payload = os.urandom(32), os.urandom(100_000)
    try:
        with running.client("a") as a:
            assert a.put("alpha", MODEL, [digest], [payload]) == [True]
            assert a.get("alpha", MODEL, [digest]) == [payload]
        with BlockClient(running.address, running.tokens["a"], timeout_s=5) as plaintext:
            _unavailable(plaintext)  # no TLS: no connection at all
        untrusting = ClientTls(root_ca=certs.other_ca_client.cert)  # not the server's CA
        with BlockClient(running.address, running.tokens["a"], tls=untrusting, timeout_s=5) as c:
            _unavailable(c)
    finally:
        running.stop()


def test_mtls_identity_is_a_principal_and_a_client_without_a_certificate_is_refused(
    tmp_path: Path, certs: Certs
) -> None:
    running = serve(isolation_config(tmp_path, certs, mtls=True), certs)
    digest, payload = os.urandom(32), os.urandom(50_000)
    try:
        with running.client("", cert="cert-a") as owner:  # no token: the certificate decides
            assert owner.put("alpha", MODEL, [digest], [payload]) == [True]
            assert owner.get("alpha", MODEL, [digest]) == [payload]
            assert [t.tenant for t in owner.stats().tenants] == ["alpha"]
        no_cert = ClientTls(root_ca=certs.ca.cert_path)
        with BlockClient(running.address, running.tokens["a"], tls=no_cert, timeout_s=5) as c:
            _unavailable(c)  # mTLS required: even a valid token does not get in
        with running.client("a", cert="stranger") as token_over_mtls:
            assert token_over_mtls.get("alpha", MODEL, [digest]) == [payload]
    finally:
        running.stop()


def test_kvshare_serve_with_tls_flags_and_a_cert_principal(tmp_path: Path, certs: Certs) -> None:
    tenancy = isolation_config(tmp_path, certs, mtls=True)
    # The flags instead of the [tls] table: drop it from the file.
    text = tenancy.path.read_text()
    tenancy.path.write_text(text[: text.index("[tls]")] + text[text.index("[[tenants]]") :])
    server = ServerProcess(
        "--config", str(tenancy.path),
        "--tls-cert", str(certs.server.cert),
        "--tls-key", str(certs.server.key),
        "--tls-client-ca", str(certs.ca.cert_path),
    )  # fmt: skip
    try:
        files = certs.clients["cert-b"]
        tls = ClientTls(certs.ca.cert_path, files.cert, files.key)
        with BlockClient(server.address, "", tls=tls) as client:
            assert client.put("beta", MODEL, [b"d" * 32], [b"over mTLS"]) == [True]
            assert client.get("beta", MODEL, [b"d" * 32]) == [b"over mTLS"]
        with BlockClient(server.address, "", tls=ClientTls(certs.ca.cert_path), timeout_s=5) as c:
            _unavailable(c)
    finally:
        server.terminate()


def test_cert_principals_without_mtls_are_a_start_up_error(tmp_path: Path, certs: Certs) -> None:
    tenancy = isolation_config(tmp_path, certs, mtls=True)
    tenancy.path.write_text(tenancy.path.read_text().replace("client_ca =", "# client_ca ="))
    with pytest.raises(ConfigError, match=r"principal 'cert-a' authenticates by cert_identity"):
        Server(load_config(tenancy.path))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (("cert =", "certificate ="), r"tls\.certificate: unknown key"),
        (('key = "', 'key = 3 #"'), r"tls\.key: must be a path"),
        (("uri:spiffe", "url:spiffe"), r"principals\[3\]\.cert_identity: must be 'uri:"),
    ],
)
def test_tls_config_errors_name_the_key_and_line(
    tmp_path: Path, certs: Certs, edit: tuple[str, str], message: str
) -> None:
    tenancy = isolation_config(tmp_path, certs, mtls=True)
    tenancy.path.write_text(tenancy.path.read_text().replace(*edit, 1))
    with pytest.raises(ConfigError, match=rf"kvshare\.toml:\d+: {message}"):
        load_config(tenancy.path)
