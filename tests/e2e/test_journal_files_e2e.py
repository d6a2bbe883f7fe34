"""Where the put journal lives: never at a name others can plant.

/dev/shm is world-writable. The journal used to sit at a name anyone could compute
(uid + a hash of the data dir): a planted file stopped the server (exit 2) and a planted
link crashed it (exit 1, a traceback). Now each start makes a private directory with an
unpredictable name; a configured journal_dir must be private; every failure is one line.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import pytest

from replica_agent.client import BlockClient
from tests.support.servers import ServerProcess, one_line_error, run_cli, write_config

pytestmark = pytest.mark.slow  # every test here takes seconds

MODEL = "journal-files;fp32"
SHM = Path("/dev/shm")
JOURNAL_NAME = "put.journal"


def legacy_name(data_dir: Path) -> Path:
    digest = hashlib.sha256(str(data_dir.resolve()).encode("utf-8")).hexdigest()[:16]
    return SHM / f"kvshare-{os.getuid()}-{digest}.journal"


def journal_dirs_of(data_dir: Path) -> list[Path]:
    """This user's private journal directories whose journal belongs to `data_dir`
    (other servers, of other test sessions too, may have theirs beside them)."""
    found = []
    for directory in SHM.glob(f"kvshare-{os.getuid()}-*"):
        try:
            with (directory / JOURNAL_NAME).open("rb") as journal:
                head = journal.read(8192)
        except OSError:
            continue
        if str(data_dir.resolve()).encode() in head:  # the superblock names its data dir
            found.append(directory)
    return found


def test_files_planted_at_the_old_name_change_nothing(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir(mode=0o700)
    planted = legacy_name(data_dir)
    planted.write_bytes(b"planted")  # a file where the journal used to go
    link = legacy_name(tmp_path / "data2")
    link.symlink_to(tmp_path / "elsewhere")  # and a link, for a second server
    try:
        for directory in (data_dir, tmp_path / "data2"):
            server = ServerProcess("--listen", "127.0.0.1:0", "--data-dir", str(directory))
            try:
                token = (directory / "dev.token").read_text().strip()
                with BlockClient(server.address, token) as client:
                    assert client.put("dev", MODEL, [os.urandom(32)], [b"v" * 100]) == [True]
                made = journal_dirs_of(directory)
                assert len(made) == 1  # its own private directory, an unpredictable name
                (journal_dir,) = made
                assert stat.S_IMODE(journal_dir.stat().st_mode) == 0o700
                assert (journal_dir / JOURNAL_NAME).exists()
            finally:
                code, _ = server.terminate()
            assert code == 0
            assert not journal_dir.exists()  # removed at a clean stop
        assert planted.read_bytes() == b"planted"  # never opened, never changed
    finally:
        planted.unlink(missing_ok=True)
        link.unlink(missing_ok=True)


def test_a_journal_dir_others_may_write_is_a_one_line_error(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    tenancy = write_config(tmp_path, extra=f'[storage]\njournal_dir = "{shared}"\n')
    line = one_line_error(run_cli("serve", "--config", str(tenancy.path)))
    assert "not a private directory of this user" in line
    shared.chmod(0o700)  # positive control: made private, it is used
    server = ServerProcess("--config", str(tenancy.path))
    try:
        assert list(shared.glob("kvshare-*.journal"))
    finally:
        server.terminate()
