"""Where the repository and the suite's known-answer vectors are on disk."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VECTORS_DIR = REPO / "tests" / "vectors"
