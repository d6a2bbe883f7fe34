"""The committed stubs in kvcommon/v1 match proto/ (CI fails on drift)."""

from __future__ import annotations

import subprocess
import sys

from tests.support.repo import REPO


def test_generated_stubs_match_the_proto() -> None:
    result = subprocess.run(
        [sys.executable, "scripts/gen_proto.py", "--check"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
