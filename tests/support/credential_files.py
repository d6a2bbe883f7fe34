"""Credential files written as an operator rotates them: a new file, owner-only by
default, renamed over the old one (atomic), for the token-file and keyring-file tests
of the agent and the engine adapters. Standard library only: the vLLM and SGLang venvs
import it too."""

from __future__ import annotations

import os
from pathlib import Path


def write_secret(path: Path, text: str, *, mode: int = 0o600) -> None:
    """Write `text` to a new file beside `path` with `mode` and rename it over `path`."""
    new = path.with_name(path.name + ".new")
    fd = os.open(new, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    new.chmod(mode)  # os.open's mode passes through the umask
    new.replace(path)
