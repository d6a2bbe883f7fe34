"""Store settings an engine hands an adapter as a plain mapping, parsed once.

vLLM passes `kv_connector_extra_config` and SGLang `--hicache-storage-backend-extra-config`
as JSON objects; both adapters read the same keys (docs/design.md §7 names `target`,
`token_file`, `tenant`; the rest are ours):

    target           "HOST:PORT", or a list of them (gRPC round robin across servers)
    token_file       a file holding the bearer token (owner-only: mode 0600); re-read
                     when it changes (replica_agent.credentials): rotate by renaming a
                     new file over it, no restart
    tenant           the tenant blocks are stored under (or the default tenant)
    keyring_file     the tenant data keys (policy.sealing.Keyring); blocks are sealed
                     with them before they leave the replica and opened on the way in;
                     re-read when it changes, like token_file
    weight_version   the version of the served weights (e.g. a checkpoint's commit or
                     an RL step): part of every block's identity, so replicas of
                     another version never load these blocks (default: none, a
                     namespace of its own)
    tls_ca           the server's CA (PEM); with tls_cert and tls_key: mTLS
    tls_cert, tls_key, tls_server_name
    model            the block namespace; by default each adapter derives one from the
                     served model and its KV layout, so layouts never mix
    timeout_s        every store call's deadline (default 5 s)
    bulk, same_host  the client's transports (default true)

Unknown keys are refused with the list of known ones: a misspelt `keyring_file` must
not silently turn sealing off. Adapters may pass `engine_keys` they handle themselves
(SGLang's `backend_name`, `module_path`, `class_name`, ...), which are ignored here.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcommon.errors import ConfigError
from policy.sealing import BlockSealer
from policy.types import PUBLIC, is_valid_tenant_id
from replica_agent.client import BlockClient, ClientTls
from replica_agent.credentials import KeyringFileSealer, TokenFile, read_secret_file
from replica_agent.spec import check_weight_version

DEFAULT_TIMEOUT_S = 5.0
KNOWN_KEYS = frozenset(
    {
        "target",
        "token_file",
        "tenant",
        "keyring_file",
        "tls_ca",
        "tls_cert",
        "tls_key",
        "tls_server_name",
        "model",
        "timeout_s",
        "bulk",
        "same_host",
        "weight_version",
    }
)


@dataclass(frozen=True)
class StoreSettings:
    targets: tuple[str, ...]
    token_file: Path
    tenant: str
    keyring_file: Path | None = None
    tls: ClientTls | None = None
    model: str = ""  # "": the adapter derives the namespace from the engine's layout
    timeout_s: float = DEFAULT_TIMEOUT_S
    bulk: bool = True
    same_host: bool = True
    weight_version: str = ""  # "": not versioned

    @property
    def grpc_target(self) -> str:
        """One gRPC target for all servers: `ipv4:a:p,b:p` round-robins across them."""
        if len(self.targets) == 1:
            return self.targets[0]
        return "ipv4:" + ",".join(self.targets)

    def read_token(self) -> str:
        return read_secret_file(self.token_file, "token_file")

    def sealer(self) -> BlockSealer | None:
        """A sealer over the keyring file, which it re-reads when the file changes."""
        if self.keyring_file is None:
            return None
        return KeyringFileSealer(self.keyring_file)

    def connect(self) -> BlockClient:
        """A client of the store (gRPC connects lazily: a store that is down now is not
        an error here; the adapter's breaker deals with it call by call)."""
        return BlockClient(
            self.grpc_target,
            TokenFile(self.token_file),  # each call sends the file's current token
            tls=self.tls,
            timeout_s=self.timeout_s,
            bulk=self.bulk,
            same_host=self.same_host,
            # With a keyring every block read is opened before use: over TLS, a tenant
            # that requires sealed blocks gets the sealed-payload channel.
            sealed_channel=self.keyring_file is not None,
        )


def parse_store_settings(
    raw: Mapping[str, Any],
    *,
    source: str,
    engine_keys: Collection[str] = (),
    publisher: bool = False,
) -> StoreSettings:
    """`raw` (an engine's extra config) as StoreSettings; ConfigError names the key.

    `publisher`: an engine that stores in the public scope only (SGLang's `"publish":
    true`): `tenant` must be absent, and the settings' tenant is `@public`."""
    unknown = sorted(set(raw) - KNOWN_KEYS - set(engine_keys))
    if unknown:
        raise ConfigError(
            f"{source}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(KNOWN_KEYS))}"
        )
    for required in ("target", "token_file") if publisher else ("target", "token_file", "tenant"):
        if not raw.get(required):
            raise ConfigError(f"{source}: `{required}` is required")
    if publisher and "tenant" in raw:
        raise ConfigError(
            f"{source}: drop `tenant`: a publishing engine stores every page in {PUBLIC}"
        )
    if not publisher and not is_valid_tenant_id(str(raw["tenant"])):
        raise ConfigError(f"{source}: tenant must match [a-z0-9][a-z0-9._-]{{0,62}}")
    target = raw["target"]
    targets = (target,) if isinstance(target, str) else tuple(target)
    if not targets or not all(isinstance(t, str) and ":" in t for t in targets):
        raise ConfigError(f"{source}: target: give HOST:PORT or a list of them")
    tls = None
    if raw.get("tls_ca") or raw.get("tls_cert") or raw.get("tls_key"):
        if bool(raw.get("tls_cert")) != bool(raw.get("tls_key")):
            raise ConfigError(f"{source}: give both tls_cert and tls_key (mTLS), or neither")
        tls = ClientTls(
            root_ca=_path(raw, "tls_ca", source),
            client_cert=_path(raw, "tls_cert", source),
            client_key=_path(raw, "tls_key", source),
            server_name=_str(raw, "tls_server_name", source) or None,
        )
    timeout_s = raw.get("timeout_s", DEFAULT_TIMEOUT_S)
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or timeout_s <= 0:
        raise ConfigError(f"{source}: timeout_s must be a number of seconds > 0")
    return StoreSettings(
        targets=targets,
        token_file=Path(_str(raw, "token_file", source)),
        tenant=PUBLIC if publisher else _str(raw, "tenant", source),
        keyring_file=_path(raw, "keyring_file", source),
        tls=tls,
        model=_str(raw, "model", source),
        timeout_s=float(timeout_s),
        bulk=_bool(raw, "bulk", source),
        same_host=_bool(raw, "same_host", source),
        weight_version=_weight_version(raw, source),
    )


def _weight_version(raw: Mapping[str, Any], source: str) -> str:
    """`weight_version`, checked as ModelSpec checks it (the message names the key)."""
    value = _str(raw, "weight_version", source)
    if value:
        try:
            check_weight_version(value)
        except ValueError as error:
            raise ConfigError(f"{source}: {error}") from None
    return value


def _str(raw: Mapping[str, Any], key: str, source: str) -> str:
    value = raw.get(key, "")
    if not isinstance(value, str):
        raise ConfigError(f"{source}: {key} must be a string")
    return value


def _path(raw: Mapping[str, Any], key: str, source: str) -> Path | None:
    value = _str(raw, key, source)
    return Path(value) if value else None


def _bool(raw: Mapping[str, Any], key: str, source: str) -> bool:
    value = raw.get(key, True)
    if not isinstance(value, bool):
        raise ConfigError(f"{source}: {key} must be true or false")
    return value
