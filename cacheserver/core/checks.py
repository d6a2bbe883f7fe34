"""Admission's checks that need no server state (cacheserver.core.admission has the
whole order). The server's `Admission` runs them, and so does a bulk worker
(cacheserver.worker), a process with no policy, store or audit log of its own: the
same functions, so a worker can never take for valid what the server would refuse.
"""

from __future__ import annotations

from collections.abc import Sequence

from policy.types import BlockDigest, ModelName, parse_digest, parse_model


def parse_names(model: str, digests: Sequence[bytes]) -> tuple[ModelName, list[BlockDigest]]:
    """Steps 4-5 before naming: the model name and each digest checked, what the
    tenant's naming key then turns into storage keys."""
    model_name = parse_model(model)
    return model_name, [parse_digest(digest, index) for index, digest in enumerate(digests)]
