"""kvshare itself: `kvshare serve` as a subprocess, driven by `BlockClient`.

Plain `kvshare` runs the server's and client's defaults, as a user on the server's
host would: the put journal, no TLS on loopback, no sealing, and the bulk channel's
same-host transport (payloads through a shared-memory arena). The server reads a
config file that says what dev mode would (tenant `dev`, one principal with read and
write at an unlimited rate, its token made per run) and changes one default: the
bench's one principal may hold `MAX_BULK_CONNECTIONS` same-host arenas (`[bulk]
max_arenas`, `max_arenas_per_principal`), as every client process of one replica
host would need; with the default 8, clients past the 8th would be refused an arena
and use TCP, so a 16-client cell would measure a mix. A client that was refused one
anyway fails the cell (`KvshareClient.prepare`), as a cell that fell back to gRPC fails
the run (`KvshareSystem.clear`). Variants are the same system with options, so their
ratio to a base within a round is the cost of an option:

- `kvshare-tcp`: the client's same-host transport off (`same_host=False`): the bulk
  channel over TCP, as a replica on another host uses it;
- `kvshare-tls`: the server gets a throw-away self-signed certificate (`--tls-cert`,
  `--tls-key`) and the client trusts it (`ClientTls(root_ca=...)`); over TCP, since
  TLS protects bytes that cross a network (a same-host client skips it): its base is
  `kvshare-tcp`;
- `kvshare-sealed`: the client seals each block with the agent's `BlockSealer`
  (AES-256-GCM, `policy.sealing`) before PUT and opens it after GET, as the replica
  agent does, into buffers the client keeps (`seal_into`, `open_into`: a save's send
  buffer, a restore's staging); figures count plaintext bytes. The server's tenant `dev` has
  `require_sealed = true`, as in production;
- `kvshare-tls-sealed`: both, the configuration the docs recommend for production
  across hosts: the client opens every block, so it asks for the sealed-payload
  channel (`BlockClient(sealed_channel=True)`, docs/secure-channel.md), which OpenBulk
  grants over TLS for a tenant that requires sealed blocks;
- `kvshare-nosync`: `--no-sync-writes` (PUT acknowledged before fsync). Opt-in.
- `kvshare-grpc`: the client's bulk channel off, payloads over gRPC streams only (the
  fallback path). Opt-in.
- `kvshare-tcp-2w`, `kvshare-tcp-4w`: `kvshare-tcp` with `--bulk-workers 2` (or 4):
  that many processes serve the bulk channel (docs/architecture.md, "Bulk workers").
  Opt-in.

Across two hosts (`--two-host`) the server listens on the wildcard address, as a store
beside a pool of replica hosts does (`--listen 0.0.0.0:0`, so the bulk listener is on
0.0.0.0 too and OpenBulk announces a wildcard: clients dial the server's address).
There the client's same-host transport finds another network namespace and uses TCP,
so `kvshare` measures what `kvshare-tcp` does, and `kvshare-sealed` is sealing over TCP
without TLS.
"""

from __future__ import annotations

import hashlib
import importlib.util
import secrets
import sys
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvshare.bench.peers.base import BenchError, ServerProcess
from kvshare.bench.placement import LOOPBACK, Placement

TENANT = "dev"  # dev mode's tenant name, made by the bench's config (`_write_config`)
MODEL = "kvshare-bench"
SERVING_LINE = r"serving on (\S+):(\d+)"
METRICS_LINE = r"metrics on (\S+) "
DATA_KEY_BYTES = 32
# cacheserver.transport.bulk.handshake.SEALED_HELLO
SEALED_HELLO_METHOD = "kvshare.bulk/SealedHello"
# One principal's bulk connections (cacheserver.transport.bulk.slots.MAX_PER_PRINCIPAL):
# the most client processes a cell can have without falling back to gRPC; the bench's
# server gives the principal as many same-host arenas.
MAX_BULK_CONNECTIONS = 64


@dataclass(frozen=True)
class KvshareClientSpec:
    address: str
    token: str
    tls_root_ca: str | None = None
    data_key: bytes | None = None  # set: seal blocks under this tenant data key
    tenant: str = TENANT
    model: str = MODEL
    bulk: bool = True
    same_host: bool = True

    def connect(self) -> KvshareClient:
        from replica_agent.client import BlockClient, ClientTls

        tls = None if self.tls_root_ca is None else ClientTls(root_ca=Path(self.tls_root_ca))
        client = BlockClient(
            self.address,
            token=self.token,
            tls=tls,
            bulk=self.bulk,
            same_host=self.same_host,
            sealed_channel=self.data_key is not None,  # every block read is opened
        )
        sealer = None
        if self.data_key is not None:
            from policy.sealing import BlockSealer, Keyring, TenantKeys

            sealer = BlockSealer(Keyring({self.tenant: TenantKeys({1: self.data_key})}))
        return KvshareClient(client, sealer, self.tenant, self.model)


class KvshareClient:
    def __init__(self, client: Any, sealer: Any, tenant: str, model: str) -> None:
        self._client = client
        self._sealer = sealer
        self._tenant = tenant
        self._model = model
        # Sealed: where blocks are sealed before a PUT and opened after a GET, one
        # buffer per block of a call, kept from call to call (no fresh memory per block).
        self._sealing = _Kept()
        self._opening = _Kept()

    def prepare(self, value_bytes: int, blocks_per_call: int) -> None:
        """Before every cell: the gRPC channel is up, and no bulk connection of this
        client was refused a same-host arena (it would have used TCP instead)."""
        self._client.lookup(self._tenant, self._model, [bytes(32)])
        refused = self._client.transport_stats.same_host_fallbacks
        if refused:
            raise BenchError(
                f"{refused} same-host bulk connection(s) were refused an arena and used TCP "
                "(see the server log): the server's [bulk] max_arenas_per_principal must be "
                "at least the client count"
            )

    def lookup(self, keys: Sequence[bytes]) -> int:
        """One Lookup call over gRPC (no payload moves): the leading blocks held."""
        return int(self._client.lookup(self._tenant, self._model, list(keys)))

    def put(self, keys: Sequence[bytes], values: Sequence[memoryview]) -> None:
        payloads: list[Any] = list(values)
        if self._sealer is not None:
            from policy.sealing import sealed_bytes

            sizes = [sealed_bytes(memoryview(value).nbytes) for value in values]
            payloads = [
                self._sealer.seal_into(self._tenant, self._model, key, value, out)
                for key, value, out in zip(keys, values, self._sealing.take(sizes), strict=True)
            ]
        self._client.put(self._tenant, self._model, list(keys), payloads)

    def get(self, keys: Sequence[bytes]) -> Sequence[Any]:
        # Views into the client's reused buffer, as the agent decodes them (no copy).
        found: Sequence[Any] = self._client.get_views(self._tenant, self._model, list(keys))
        if self._sealer is None:
            return found
        from policy.sealing import opened_bytes

        outs = self._opening.take([opened_bytes(sealed) for sealed in found])
        return [
            self._sealer.open_into(self._tenant, self._model, key, sealed, out)
            for key, sealed, out in zip(keys, found, outs, strict=False)
        ]

    def close(self) -> None:
        self._client.close()


class _Kept:
    """Buffers kept from call to call: `take(sizes)` gives one of each size, grown when
    a call needs more or larger ones (valid until the next `take`)."""

    def __init__(self) -> None:
        self._buffers: list[bytearray] = []

    def take(self, sizes: Sequence[int]) -> list[memoryview]:
        while len(self._buffers) < len(sizes):
            self._buffers.append(bytearray())
        for index, size in enumerate(sizes):
            if len(self._buffers[index]) < size:
                self._buffers[index] = bytearray(size)
        return [memoryview(self._buffers[i])[:size] for i, size in enumerate(sizes)]


class KvshareSystem:
    is_put_acknowledged = True
    supports_batch_get = True
    supports_lookup = True  # BlockClient.lookup: one call, on the bulk channel when it is up

    def __init__(
        self,
        *,
        tls: bool = False,
        sealed: bool = False,
        sync_writes: bool = True,
        bulk: bool = True,
        same_host: bool = True,
        bulk_workers: int = 1,
        placement: Placement = LOOPBACK,
    ) -> None:
        """`bulk_workers`: `kvshare serve --bulk-workers N` (docs/architecture.md)."""
        self._at = placement
        self._bulk_workers = bulk_workers
        self._same_host = same_host and not tls and bulk
        suffix = "-tcp" if bulk and not tls and not same_host else ""
        suffix += ("-tls" if tls else "") + ("-sealed" if sealed else "")
        suffix += ("" if sync_writes else "-nosync") + ("" if bulk else "-grpc")
        suffix += f"-{bulk_workers}w" if bulk_workers > 1 else ""
        self._bulk = bulk
        self.name = "kvshare" + suffix
        self._tls = tls
        self._sealed = sealed
        self._sync_writes = sync_writes
        self._server: ServerProcess | None = None
        self._metrics = ""  # the server's Prometheus endpoint (HOST:PORT)

    def unavailable_reason(self) -> str | None:
        needed = [("cacheserver.cli", "the server"), ("replica_agent.client", "BlockClient")]
        if self._sealed:
            needed.append(("policy.sealing", "block sealing"))
        for module, what in needed:
            if importlib.util.find_spec(module) is None:
                return f"{what} ({module}) is not built yet"
        return None

    def start(self, workdir: Path) -> KvshareClientSpec:
        data_dir = workdir / f"{self.name}-data"
        argv = [
            sys.executable,
            "-m",
            "kvshare.cli",
            "serve",
            "--data-dir",
            str(data_dir),
            "--listen",
            "0.0.0.0:0" if self._at.is_two_host else "127.0.0.1:0",
        ]
        if self._at.is_two_host and not self._tls:
            argv.append("--allow-insecure-listen")  # the veth is the benchmark's own
        root_ca = None
        if self._tls:
            from kvshare.bench.tls import write_self_signed

            cert_path, key_path = write_self_signed(workdir, self._at.server_host)
            argv += ["--tls-cert", str(cert_path), "--tls-key", str(key_path)]
            root_ca = str(cert_path)
        token = secrets.token_urlsafe(32)
        config = _write_config(workdir / f"{self.name}.toml", token, require_sealed=self._sealed)
        argv += ["--config", str(config)]
        if not self._sync_writes:
            argv.append("--no-sync-writes")
        if self._bulk_workers > 1:
            argv += ["--bulk-workers", str(self._bulk_workers)]
        argv += ["--metrics-listen", f"{self._at.server_host}:0"]  # where the harness can reach
        self._server = ServerProcess.launch(
            self._at.server_command(argv), workdir / f"{self.name}-server.log"
        )
        try:
            match = self._server.wait_for_line(SERVING_LINE)
            self._metrics = self._server.wait_for_line(METRICS_LINE).group(1)
        except (BenchError, OSError) as error:
            self.stop()
            raise BenchError(f"kvshare serve did not start: {error}") from error
        data_key = secrets.token_bytes(DATA_KEY_BYTES) if self._sealed else None
        host = self._at.server_host if self._at.is_two_host else match.group(1)
        return KvshareClientSpec(
            f"{host}:{match.group(2)}",
            token,
            root_ca,
            data_key,
            bulk=self._bulk,
            same_host=self._same_host,
        )

    def reserve(self, value_bytes: int, count: int) -> None:
        pass

    def clear(self) -> bool:
        """Called after each value size's cells: nothing is dropped (each client would
        have to delete its own keys; a fresh server per round), but the cells are checked
        to have measured the transport they are named after."""
        self._check_no_grpc_fallback()
        return False

    def _check_no_grpc_fallback(self) -> None:
        """With the bulk channel on, payloads must never have gone over gRPC: a client
        that fell back (unreachable bulk address, TLS failure) measures the fallback.
        `kvshare-tls-sealed` must have used the sealed-payload channel, not TLS."""
        if not self._bulk or not self._metrics:
            return
        with urllib.request.urlopen(f"http://{self._metrics}/metrics", timeout=10) as response:
            text = response.read().decode("utf-8")
        if self._tls and self._sealed and not _counted(text, SEALED_HELLO_METHOD):
            raise BenchError(
                f"{self.name}: no connection used the sealed-payload channel (see the "
                "server log): its figures would be those of sealed blocks over TLS"
            )
        fallbacks = sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("kvshare_rpc_requests_total{")
            and ('method="kvshare.v1.BlockStore/Get"' in line
                 or 'method="kvshare.v1.BlockStore/Put"' in line)
        )  # fmt: skip
        if fallbacks:
            raise BenchError(
                f"{self.name}: {fallbacks:.0f} gets/puts went over gRPC, not the bulk channel "
                "(see the server log): its figures would be the fallback's"
            )

    def server_pids(self) -> list[int]:
        return [] if self._server is None else [self._server.pid]

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None


def _counted(metrics: str, method: str) -> bool:
    """Whether the server counted a successful call of `method`."""
    prefix = f'kvshare_rpc_requests_total{{method="{method}",status="OK"}} '
    return any(
        line.startswith(prefix) and float(line.rsplit(" ", 1)[1]) > 0
        for line in metrics.splitlines()
    )


def _write_config(path: Path, token: str, *, require_sealed: bool) -> Path:
    """Tenant `dev` (requiring sealed blocks if `require_sealed`), one principal
    (unlimited rate, as dev mode's) whose bearer token is `token`, and room for
    `MAX_BULK_CONNECTIONS` same-host arenas, all of them the principal's."""
    digest = hashlib.sha256(token.encode("utf-8")).hexdigest()
    path.write_text(
        "[[tenants]]\n"
        f'id = "{TENANT}"\n'
        f"require_sealed = {str(require_sealed).lower()}\n\n"
        "[[principals]]\n"
        'name = "bench"\n'
        f'token_sha256 = "{digest}"\n'
        f'tenants = ["{TENANT}"]\n'
        'actions = ["read", "write"]\n'
        "requests_per_s = 0\n\n"
        "[bulk]\n"
        f"max_arenas = {MAX_BULK_CONNECTIONS}\n"
        f"max_arenas_per_principal = {MAX_BULK_CONNECTIONS}\n",
        encoding="utf-8",
    )
    return path
