"""`[telemetry]` in the server config: defaults export nothing; bad keys name the line."""

from __future__ import annotations

from pathlib import Path

import pytest

from cacheserver.config import TelemetryConfig, load_config
from kvcommon.errors import ConfigError


def config_with(tmp_path: Path, table: str) -> Path:
    path = tmp_path / "kvshare.toml"
    path.write_text(f'listen = "127.0.0.1:0"\n[telemetry]\n{table}\n')
    return path


def test_defaults_export_nothing_and_keys_parse(tmp_path: Path) -> None:
    assert TelemetryConfig() == TelemetryConfig(
        metrics_listen="", otlp_endpoint="", per_tenant_labels=False, log_format="text"
    )
    table = 'metrics_listen = "127.0.0.1:9464"\nper_tenant_labels = true\nlog_format = "json"'
    telemetry = load_config(config_with(tmp_path, table)).telemetry
    assert telemetry.metrics_listen == "127.0.0.1:9464"
    assert telemetry.per_tenant_labels and telemetry.log_format == "json"


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ("metrics_port = 9464", r"kvshare.toml:3: telemetry.metrics_port: unknown key"),
        ('log_format = "xml"', "log_format 'xml'; use text or json"),
        ("per_tenant_labels = 1", "telemetry.per_tenant_labels: must be bool"),
        ('otlp_endpoint = "collector:4318"', "OTLP/HTTP base URL"),
        ('metrics_listen = "metrics.internal"', r"is not \[HOST:\]PORT"),
        ("health_interval_ms = 0", "0 is out of range; use an integer from 1 to 86400000"),
    ],
)
def test_bad_telemetry_keys_are_errors(tmp_path: Path, table: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(config_with(tmp_path, table))


def test_a_bare_metrics_port_binds_loopback() -> None:
    """The endpoint has no authentication, so loopback is the default."""
    from cacheserver.telemetry import ServerTelemetry

    telemetry = ServerTelemetry(TelemetryConfig(metrics_listen="0"))
    try:
        assert telemetry.start().startswith("127.0.0.1:")
    finally:
        telemetry.shutdown()
