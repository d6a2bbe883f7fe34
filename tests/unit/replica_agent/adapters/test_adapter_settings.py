"""Engine extra-config parsing shared by the vLLM and SGLang adapters."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcommon.errors import ConfigError
from replica_agent.adapters.settings import parse_store_settings


def _token(tmp_path: Path, mode: int = 0o600) -> Path:
    path = tmp_path / "token"
    path.write_text("secret-token\n")
    path.chmod(mode)
    return path


def test_minimal_settings_parse_with_defaults(tmp_path: Path) -> None:
    token = _token(tmp_path)
    settings = parse_store_settings(
        {"target": "127.0.0.1:1", "token_file": str(token), "tenant": "acme"}, source="t"
    )
    assert settings.targets == ("127.0.0.1:1",)
    assert settings.grpc_target == "127.0.0.1:1"
    assert settings.read_token() == "secret-token"
    assert settings.sealer() is None and settings.tls is None
    assert settings.timeout_s == 5.0 and settings.bulk and settings.same_host


def test_several_targets_round_robin(tmp_path: Path) -> None:
    settings = parse_store_settings(
        {"target": ["10.0.0.1:1", "10.0.0.2:1"], "token_file": "x", "tenant": "a"}, source="t"
    )
    assert settings.grpc_target == "ipv4:10.0.0.1:1,10.0.0.2:1"


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"token_file": "x", "tenant": "a"}, "`target` is required"),
        ({"target": "h:1", "tenant": "a"}, "`token_file` is required"),
        ({"target": "h:1", "token_file": "x"}, "`tenant` is required"),
        ({"target": "h:1", "token_file": "x", "tenant": "a", "keyring": "k"}, "unknown key"),
        ({"target": "nohostport", "token_file": "x", "tenant": "a"}, "HOST:PORT"),
        ({"target": "h:1", "token_file": "x", "tenant": "a", "timeout_s": 0}, "timeout_s"),
        ({"target": "h:1", "token_file": "x", "tenant": "a", "bulk": "yes"}, "bulk"),
        ({"target": "h:1", "token_file": "x", "tenant": "a", "tls_cert": "c"}, "tls_key"),
        ({"target": "h:1", "token_file": "x", "tenant": "Acme Corp"}, "tenant must match"),
    ],
)
def test_bad_settings_name_what_to_fix(raw: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_store_settings(raw, source="extra_config")


def test_engine_keys_are_passed_over() -> None:
    raw = {"target": "h:1", "token_file": "x", "tenant": "a", "backend_name": "kvshare"}
    parse_store_settings(raw, source="t", engine_keys={"backend_name"})


def test_a_token_readable_by_others_is_refused(tmp_path: Path) -> None:
    token = _token(tmp_path, 0o644)
    settings = parse_store_settings(
        {"target": "h:1", "token_file": str(token), "tenant": "a"}, source="t"
    )
    with pytest.raises(ConfigError, match="chmod 600"):
        settings.read_token()


def test_a_publisher_has_no_tenant_and_stores_in_the_public_scope() -> None:
    raw = {"target": "h:1", "token_file": "x"}
    assert parse_store_settings(raw, source="t", publisher=True).tenant == "@public"
    with pytest.raises(ConfigError, match="drop `tenant`"):
        parse_store_settings(raw | {"tenant": "a"}, source="t", publisher=True)
    with pytest.raises(ConfigError, match="`tenant` is required"):
        parse_store_settings(raw, source="t")  # positive control: a reader needs one
