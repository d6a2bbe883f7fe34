"""A server config the live-reload tests rewrite between reloads: tenants, principals
and extra TOML, written whole each time, and a server started from it that can reload
(cacheserver.reload.ConfigSource set, as `kvshare serve --config` does)."""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from cacheserver.reload import ConfigSource
from kvcommon.v1 import kvshare_pb2 as pb
from kvshare.reload_cli import request_reload
from replica_agent.client import ClientTls
from tests.support.servers import Running, Tenancy, launch, with_test_workers

MODEL = "reload/model@r1;fp32;L2;H2;D8;B4;tp0/1"


@dataclass
class Grant:
    tenants: list[str]
    actions: list[str]
    token: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    requests_per_s: int | None = None


@dataclass
class LiveConfig:
    """The file's contents as data: change a field, then `write()` and reload."""

    directory: Path
    tenants: dict[str, int]  # id -> quota_bytes
    principals: dict[str, Grant]
    extra: str = ""  # TOML before the tenants (e.g. [bulk] workers = 2, [tls])
    tail: str = ""  # TOML after the principals (e.g. certificate principals)
    sealed: set[str] = field(default_factory=set)  # tenants with require_sealed

    @property
    def path(self) -> Path:
        return self.directory / "kvshare.toml"

    def text(self) -> str:
        lines = [
            f'data_dir = "{self.directory / "data"}"',
            'listen = "127.0.0.1:0"',
            self.extra,
        ]
        for tenant, quota in self.tenants.items():
            lines += ["[[tenants]]", f'id = "{tenant}"', f"quota_bytes = {quota}"]
            if tenant in self.sealed:
                lines.append("require_sealed = true")
        for name, grant in self.principals.items():
            lines += [
                "[[principals]]",
                f'name = "{name}"',
                f'token_sha256 = "{hashlib.sha256(grant.token.encode()).hexdigest()}"',
                "tenants = [" + ", ".join(f'"{t}"' for t in grant.tenants) + "]",
                "actions = [" + ", ".join(f'"{a}"' for a in grant.actions) + "]",
            ]
            if grant.requests_per_s is not None:
                lines.append(f"requests_per_s = {grant.requests_per_s}")
        return "\n".join(lines) + "\n" + self.tail

    def write(self, text: str | None = None) -> None:
        self.path.write_text(self.text() if text is None else text)

    def tokens(self) -> dict[str, str]:
        return {name: grant.token for name, grant in self.principals.items()}


def start(live: LiveConfig) -> Running:
    """The real server, in-process, started from `live`'s file; it reloads that file with
    what `launch` laid over it (KVSHARE_TEST_BULK_WORKERS), as `kvshare serve` reloads
    with its flags."""
    live.write()
    running = launch(Tenancy(live.path, live.tokens()))
    source = ConfigSource(live.path, overrides=with_test_workers)
    running.server.server.reloader.source = source  # type: ignore[union-attr]
    return running


def reload(
    running: Running, live: LiveConfig, admin: str = "root", tls: ClientTls | None = None
) -> pb.ReloadResponse:
    """The admin RPC Reload, as `kvshare admin reload` sends it; the running server's
    tokens follow the file's."""
    token = running.tokens[admin]
    reply = request_reload(running.address, token, tls or running.tls())
    if reply.applied:
        running.tokens.update(live.tokens())
    return reply


def seconds_until(condition: Callable[[], bool], limit_s: float = 10.0) -> float:
    """How long after now `condition()` first held (polled); AssertionError past `limit_s`."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > limit_s:
            raise AssertionError(f"not within {limit_s} s")
        time.sleep(0.005)
    return time.monotonic() - start


def digest(label: str, index: int) -> bytes:
    return hashlib.sha256(f"{label}/{index}".encode()).digest()
