"""Blocks sealed under a tenant's keys: a test keyring (alpha v1 and v2, beta v1) and
blocks sealed under alpha's primary key and under its retired v1."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from policy.sealing import BlockSealer, Keyring, TenantKeys
from replica_agent import codec
from replica_agent.spec import ModelSpec

SPEC = ModelSpec(
    "iso/model", "r1", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", block_tokens=4
)


MODEL = SPEC.wire_model()


KEYS = {name: os.urandom(32) for name in ("alpha1", "alpha2", "beta1")}


def keyring(**tenants: dict[int, bytes]) -> Keyring:
    return Keyring({t: TenantKeys(v) for t, v in tenants.items()})


CURRENT = keyring(alpha={1: KEYS["alpha1"], 2: KEYS["alpha2"]}, beta={1: KEYS["beta1"]})


V1_ONLY = keyring(alpha={1: KEYS["alpha1"]})


@dataclass(frozen=True)
class Sealed:
    digest: bytes
    tensor: torch.Tensor
    sealed: bytes  # under alpha's primary key (v2)
    sealed_v1: bytes  # under alpha's retired key v1


def make_blocks(count: int, seed: int) -> list[Sealed]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        tensor = torch.randn(SPEC.block_shape, generator=generator)
        plaintext = codec.encode_block(SPEC, tensor)
        digest = os.urandom(32)
        out.append(
            Sealed(
                digest,
                tensor,
                BlockSealer(CURRENT).seal("alpha", MODEL, digest, plaintext),
                BlockSealer(V1_ONLY).seal("alpha", MODEL, digest, plaintext),
            )
        )
    return out
