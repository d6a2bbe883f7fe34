"""The weight version of a loaded transformers model: a fingerprint of its weights.

A block's identity includes the weights that computed it (ModelSpec.weight_version).
Metadata alone (parameter names, shapes, dtypes, the config, the checkpoint's commit)
cannot tell a fine-tune pushed under the same revision from the model it replaced:
every name and shape is the same. So the fingerprint also hashes a sample of each
parameter's values: `SAMPLES_PER_TENSOR` elements at evenly spaced flat positions,
first and last included. A fine-tune (full, or a merged LoRA, whose low-rank update
is dense) moves almost every element of the matrices it touches, so a sample sees it;
an update that changes only a handful of elements could pass unseen, which is why an
operator who knows the version passes it explicitly (`weight_version`).

Cost: one small gather per parameter and one copy to the host of a few hundred
values each; milliseconds once at start-up, never on the request path. Values are
widened to float64 before hashing (exact for every supported dtype), so the same
weights on another device give the same fingerprint.
"""

from __future__ import annotations

import hashlib
import json

import torch
from transformers import PreTrainedModel

SAMPLES_PER_TENSOR = 64
FINGERPRINT_PREFIX = "sha256:"
FINGERPRINT_HEX_CHARS = 32  # 128 bits: a collision between two versions is not a risk
# Config fields that say where the model was loaded from, not what it computes.
_PLACE_FIELDS = ("_name_or_path", "transformers_version", "_commit_hash")


def weights_fingerprint(model: PreTrainedModel) -> str:
    """`sha256:` and 32 hex digits over the model's config, its checkpoint commit (when
    loaded from a hub snapshot), each parameter's name, shape and dtype, and a sample
    of its values. ValueError when the weights are not loaded (meta tensors): a
    version that cannot be established must not be guessed."""
    digest = hashlib.sha256(b"kvshare/weights/v1\0")
    config = {k: v for k, v in model.config.to_dict().items() if k not in _PLACE_FIELDS}
    digest.update(json.dumps(config, sort_keys=True, default=str).encode())
    commit = getattr(model.config, "_commit_hash", None) or ""
    digest.update(b"\0commit\0" + str(commit).encode())
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.is_meta:
                raise ValueError(
                    f"parameter {name} is not loaded (a meta tensor): load the weights "
                    "first, or pass weight_version explicitly"
                )
            shape = ",".join(str(d) for d in parameter.shape)
            digest.update(f"\0{name}\0{shape}\0{parameter.dtype}\0".encode())
            digest.update(_sample(parameter))
    return FINGERPRINT_PREFIX + digest.hexdigest()[:FINGERPRINT_HEX_CHARS]


def _sample(parameter: torch.Tensor) -> bytes:
    flat = parameter.detach().reshape(-1)
    if flat.numel() == 0:
        return b""
    count = min(SAMPLES_PER_TENSOR, flat.numel())
    positions = torch.linspace(0, flat.numel() - 1, count, dtype=torch.float64).long()
    values = flat.index_select(0, positions.to(flat.device)).to(device="cpu", dtype=torch.float64)
    return values.numpy().tobytes()
