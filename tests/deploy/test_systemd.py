"""The systemd unit (deploy/systemd/kvshare.service): `systemd-analyze verify` accepts it
without a warning, its `systemd-analyze security` exposure stays in the "OK" band, it
keeps the hardening docs/deploy.md promises, and the config it expects
(deploy/systemd/kvshare.toml) is loaded by the server's own loader with every path on
a directory or credential the unit provides.

`verify` checks that ExecStart's program exists: it runs on a copy of the unit whose
ExecStart names this machine's `kvshare` instead of /opt/kvshare/bin/kvshare, the only
line changed.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from cacheserver.config import load_config
from tests.support.repo import REPO

SYSTEMD = REPO / "deploy" / "systemd"
UNIT = SYSTEMD / "kvshare.service"
INSTALLED = "/opt/kvshare/bin/kvshare"
# systemd-analyze security's "OK" band ends at 2.0 (lower is better; 10 is unprotected).
MAX_EXPOSURE = 2.0

pytestmark = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="needs systemd-analyze (Debian: systemd)"
)


def directives(text: str) -> dict[str, list[str]]:
    """`Section.Key` -> its values in order (a key may repeat: SystemCallFilter)."""
    found: dict[str, list[str]] = {}
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        found.setdefault(f"{section}.{key.strip()}", []).append(value.strip())
    return found


def local_copy(tmp_path: Path, text: str | None = None) -> Path:
    """The unit (or `text`) with ExecStart's program replaced by this machine's."""
    kvshare = shutil.which("kvshare")
    assert kvshare is not None, "kvshare is not installed (pip install -e .)"
    original = UNIT.read_text() if text is None else text
    local = original.replace(INSTALLED, kvshare)
    changed = [a for a, b in zip(original.splitlines(), local.splitlines(), strict=True) if a != b]
    assert len(changed) == 1 and changed[0].startswith("ExecStart="), changed
    path = tmp_path / UNIT.name
    path.write_text(local)
    return path


def analyze(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["systemd-analyze", *args], capture_output=True, text=True, timeout=120)


def test_systemd_analyze_verify_accepts_the_unit_without_a_warning(tmp_path: Path) -> None:
    result = analyze("verify", str(local_copy(tmp_path)))
    assert result.returncode == 0, result.stderr
    assert result.stderr == "" and result.stdout == ""


def test_verify_reports_a_misspelt_directive_and_a_bad_value(tmp_path: Path) -> None:
    """Positive control: `verify` exits 0 on these, so the check above also requires
    it to say nothing."""
    text = UNIT.read_text()
    broken = text.replace("NoNewPrivileges=yes", "NoNewPrivilege=yes").replace(
        "ProtectSystem=strict", "ProtectSystem=strictt"
    )
    assert broken != text
    result = analyze("verify", str(local_copy(tmp_path, broken)))
    assert "Unknown key 'NoNewPrivilege'" in result.stderr
    assert "strictt" in result.stderr


def test_the_units_exposure_is_in_the_ok_band_and_recorded(tmp_path: Path) -> None:
    result = analyze("security", "--offline=true", str(local_copy(tmp_path)))
    assert result.returncode == 0, result.stderr
    match = re.search(r"Overall exposure level for kvshare\.service: (\d+\.\d)", result.stdout)
    assert match, result.stdout
    assert float(match[1]) <= MAX_EXPOSURE, result.stdout
    docs = (REPO / "docs" / "deploy.md").read_text()
    assert "systemd-analyze security --offline=true" in docs  # how to reproduce it
    assert f"exposure level {match[1]}" in docs, f"docs/deploy.md: record {match[1]}"


def test_the_unit_keeps_its_hardening() -> None:
    service = {k: v for k, v in directives(UNIT.read_text()).items() if k.startswith("Service.")}

    def one(key: str) -> str:
        (value,) = service[f"Service.{key}"]
        return value

    assert one("User") == "kvshare" and one("Group") == "kvshare"
    assert one("NoNewPrivileges") == "yes"
    assert one("ProtectSystem") == "strict"
    assert one("ProtectHome") == "yes"
    assert one("PrivateTmp") == "yes" and one("PrivateDevices") == "yes"
    assert one("CapabilityBoundingSet") == "" and one("AmbientCapabilities") == ""
    assert one("RestrictAddressFamilies") == "AF_UNIX AF_INET AF_INET6"
    assert one("MemoryDenyWriteExecute") == "yes"
    assert one("SystemCallArchitectures") == "native"
    assert service["Service.SystemCallFilter"] == ["@system-service", "~@privileged"]
    assert one("UMask") == "0077"
    assert one("ExecReload") == "/bin/kill -HUP $MAINPID"  # live reload on SIGHUP
    assert one("StateDirectoryMode") == "0700" and one("RuntimeDirectoryMode") == "0700"
    assert one("RuntimeDirectoryPreserve") == "restart"  # a crash's journal is replayed
    sysusers = (SYSTEMD / "kvshare.sysusers").read_text()
    assert re.search(r"^u kvshare - ", sysusers, re.MULTILINE)


def test_the_config_the_unit_expects_is_loaded_and_lives_where_the_unit_provides(
    tmp_path: Path,
) -> None:
    service = directives(UNIT.read_text())
    (exec_start,) = service["Service.ExecStart"]
    words = exec_start.split()
    assert words[:3] == [INSTALLED, "serve", "--config"]
    assert words[3] == "/etc/kvshare/kvshare.toml"
    config = load_config(SYSTEMD / "kvshare.toml")
    (state,) = service["Service.StateDirectory"]
    (runtime,) = service["Service.RuntimeDirectory"]
    assert config.data_dir == Path("/var/lib") / state
    assert Path(config.storage.journal_dir).parent == Path("/run") / runtime
    credentials = Path("/run/credentials") / UNIT.name
    loaded = {
        credentials / name: Path(source)
        for name, _, source in (v.partition(":") for v in service["Service.LoadCredential"])
    }
    assert config.tls is not None and config.access is not None
    for path in (config.secret_path, config.tls.private_key):
        assert path in loaded, f"{path}: no LoadCredential= provides it"
        assert loaded[path].parent == Path("/etc/kvshare/secrets")
    assert config.telemetry.metrics_listen.startswith("127.0.0.1:")  # no open /metrics
