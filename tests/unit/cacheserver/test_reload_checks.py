"""cacheserver.reload.check_live: which edits a live reload applies and which it refuses
as needing a restart, each refusal one line naming the file, the line and the key.
No server: two configs read from files."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cacheserver.config import load_config, read_config_text
from cacheserver.reload import check_live
from kvcommon.errors import ConfigError
from policy.config_text import ConfigText

TOKEN = "a" * 64
BASE = f"""listen = "127.0.0.1:0"
data_dir = "data"

[limits]
requests_per_s = 100

[[tenants]]
id = "alpha"
quota_bytes = 1000000

[[principals]]
name = "a"
token_sha256 = "{TOKEN}"
tenants = ["alpha"]
actions = ["read", "write"]
"""


def check(tmp_path: Path, old: str, new: str) -> None:
    before, after = tmp_path / "before.toml", tmp_path / "kvshare.toml"
    before.write_text(old)
    after.write_text(new)
    text = ConfigText(str(after), read_config_text(after))
    check_live(load_config(before), load_config(after), text)


@pytest.mark.parametrize(
    "edit",
    [
        lambda t: t.replace("quota_bytes = 1000000", "quota_bytes = 10"),
        lambda t: t.replace("requests_per_s = 100", "requests_per_s = 5\nrequest_burst_s = 4"),
        lambda t: t + '[[tenants]]\nid = "beta"\n',
        lambda t: t.replace('actions = ["read", "write"]', 'actions = ["read"]'),
        lambda t: t.replace('token_sha256 = "' + TOKEN, 'token_sha256 = "' + "b" * 64),
        lambda t: t.replace(
            '[[tenants]]\nid = "alpha"', '[[tenants]]\nid = "alpha"\nrequire_sealed = true'
        ),
        lambda t: t.replace(
            "_s = 100\n",
            "_s = 100\nmax_digests_per_call = 4\nmax_block_bytes = 1048576\n"
            "get_frame_bytes = 65536\n",
        ),
    ],
    ids=["quota", "rates", "tenant-added", "actions", "token", "require-sealed", "limits"],
)
def test_what_applies_live_passes(tmp_path: Path, edit: object) -> None:
    check(tmp_path, BASE, edit(BASE))  # type: ignore[operator]


RESTART_EDITS = {  # name: (edit, where the refusal points)
    "listen": (lambda t: t.replace(":0", ":1", 1), r":1: listen:"),
    "data-dir": (lambda t: t.replace('"data"', '"other"'), r":2: data_dir:"),
    "storage": (lambda t: t + "[storage]\nmemory_budget_bytes = 1048576\n", r"storage\."),
    "grpc-message-size": (
        lambda t: t.replace("_s = 100\n", "_s = 100\nmax_message_bytes = 2097152\n"),
        r":6: limits\.max_message_bytes: changed; gRPC's largest message is fixed",
    ),
    "bulk": (lambda t: t + "[bulk]\nworkers = 3\n", r": bulk\.workers:"),
    "epoch": (
        lambda t: t.replace("= 1000000", "= 1000000\nepoch = 2"),
        r": tenants\[0\]\.epoch:",
    ),
    "new-tenant-epoch": (
        lambda t: t + '[[tenants]]\nid = "beta"\nepoch = 1\n',
        r": tenants\[1\]\.epoch:",
    ),
    "public": (lambda t: t + "[public]\nquota_bytes = 1000\n", r": public: adding or removing"),
}


@pytest.mark.parametrize(("edit", "where"), RESTART_EDITS.values(), ids=RESTART_EDITS.keys())
def test_what_needs_a_restart_is_refused_in_one_line(
    tmp_path: Path, edit: object, where: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        check(tmp_path, BASE, edit(BASE))  # type: ignore[operator]
    message = str(refused.value)
    assert "\n" not in message
    assert re.search(r"kvshare\.toml:\d+", message) and re.search(where, message), message
    assert "restart" in message


def test_tls_and_mutual_tls_turned_on_or_off_need_a_restart(tmp_path: Path) -> None:
    tls = '[tls]\ncert = "c.pem"\nkey = "k.pem"\n'
    with pytest.raises(ConfigError, match=r"tls: turning TLS on or off needs a restart"):
        check(tmp_path, BASE, BASE + tls)
    mtls = tls + 'client_ca = "ca.pem"\n'
    with pytest.raises(ConfigError, match=r"tls\.client_ca: turning mutual TLS on or off"):
        check(tmp_path, BASE + tls, BASE + mtls)
    check(tmp_path, BASE + tls, BASE + tls.replace("c.pem", "c2.pem"))  # new files: live


def test_with_a_cluster_tier_tenants_and_quotas_need_a_restart(tmp_path: Path) -> None:
    cluster = '[redis_cluster]\nnodes = ["127.0.0.1:7000"]\n'
    with pytest.raises(ConfigError, match=r"tenants\[0\]: with \[redis_cluster\]"):
        check(tmp_path, BASE + cluster, (BASE + cluster).replace("1000000", "10"))
    with pytest.raises(ConfigError, match=r"tenants: with \[redis_cluster\]"):
        check(tmp_path, BASE + cluster, BASE + '[[tenants]]\nid = "beta"\n' + cluster)
    check(tmp_path, BASE + cluster, (BASE + cluster).replace('["read", "write"]', '["read"]'))
    # The shared tier sizes its values by max_block_bytes at start-up.
    with pytest.raises(ConfigError, match=r"limits\.max_block_bytes: changed; with \[redis_"):
        check(
            tmp_path,
            BASE + cluster,
            (BASE + cluster).replace("_s = 100\n", "_s = 100\nmax_block_bytes = 1048576\n"),
        )
