"""The `[redis_cluster]` contract's security keys against a real cluster: TLS with a CA
(`tls`, `tls_ca`), a Redis ACL user (`username`) whose password is in an owner-only file
(`password_file`), and whose keys are limited to `key_prefix` — so everything kvshare
writes, scripts and streams included, stays under its prefix."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from pathlib import Path

import pytest

from kvshare.bench.redis_cluster import ClusterAccess, LocalRedisCluster
from tests.support.certs import Certs
from tests.support.cluster import (
    MODEL,
    NOT_SERVING,
    SERVING,
    Servers,
    blocks,
    eventually,
    health,
    make_cluster,
)

pytestmark = pytest.mark.slow  # every test here takes seconds


def _secured(tmp_path: Path, certs: Certs, password: str) -> LocalRedisCluster:
    peer = certs.ca.client_cert("redis-node", common_name="redis-node")
    access = ClusterAccess(
        certs.ca.cert_path,
        certs.server.cert,
        certs.server.key,
        peer.cert,
        peer.key,
        username="kvshare",
        password=password,
        key_pattern="kvshare:*",
    )
    cluster = make_cluster(tmp_path / "redis")
    cluster.access = access
    return cluster


def _table(tmp_path: Path, certs: Certs, password: str) -> str:
    path = tmp_path / f"redis-{secrets.token_hex(4)}.pw"
    path.write_text(password + "\n")
    path.chmod(0o600)
    return (
        f'username = "kvshare"\npassword_file = "{path}"\n'
        f'tls = true\ntls_ca = "{certs.ca.cert_path}"\n'
    )


def test_servers_share_blocks_over_tls_as_an_acl_user_confined_to_the_prefix(
    tmp_path: Path, certs: Certs, start_servers: Callable[..., Servers]
) -> None:
    password = secrets.token_urlsafe(16)
    with _secured(tmp_path, certs, password) as cluster:
        servers = start_servers(cluster, extra=_table(tmp_path, certs, password))
        digests, payloads = blocks(6)
        assert servers[0].client("a", transport="grpc").put("alpha", MODEL, digests, payloads)
        servers.settle()
        reader = servers[1].client("a", transport="grpc")
        assert reader.get("alpha", MODEL, digests) == payloads
        assert reader.delete("alpha", MODEL, digests[:1]) == 1  # the stream, under the prefix
        assert health(servers[1].address, "kvshare.cluster") == SERVING
        # Negative control: the wrong password reaches nothing, and fails no request.
        wrong = start_servers(cluster, 1, extra=_table(tmp_path, certs, "not-" + password))[0]
        client = wrong.client("a", transport="grpc")
        assert client.get("alpha", MODEL, digests[1:]) == []
        assert client.put("alpha", MODEL, *blocks(1)) == [True]
        assert eventually(lambda: health(wrong.address, "kvshare.cluster") == NOT_SERVING)
