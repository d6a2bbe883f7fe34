"""The transformers weight fingerprint (replica_agent/adapters/hf_weights.py): the same
weights give the same version wherever they are loaded; any change a fine-tune makes,
or a cast, gives another; weights not loaded give none."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from replica_agent.adapters.hf_tiny import TinyLlama
from replica_agent.adapters.hf_weights import FINGERPRINT_PREFIX, weights_fingerprint
from replica_agent.spec import ModelSpec
from tests.support.replicas import small_model


def small(seed: int = 0) -> TinyLlama:
    return small_model(seed, vocab_size=128)


def test_the_same_weights_give_the_same_version_and_it_fits_a_spec() -> None:
    version = weights_fingerprint(small())
    assert version == weights_fingerprint(small())  # another replica, same checkpoint
    assert version.startswith(FINGERPRINT_PREFIX) and len(version) == 39
    ModelSpec("m", "r", 1, 1, 1, "float32", weight_version=version)  # a valid version


def test_what_a_fine_tune_changes_changes_the_version() -> None:
    base = small()
    version = weights_fingerprint(base)
    tuned = copy.deepcopy(base)
    with torch.no_grad():
        tuned.model.layers[0].mlp.down_proj.weight.mul_(1.001)
    assert weights_fingerprint(tuned) != version
    assert weights_fingerprint(small(seed=1)) != version  # other weights altogether
    untyped: Any = copy.deepcopy(base)  # transformers' decorated `to` confuses mypy
    cast = untyped.to(torch.bfloat16)
    assert weights_fingerprint(cast) != version  # other dtype: other KV


def test_where_the_model_was_loaded_from_is_not_part_of_the_version() -> None:
    base = small()
    moved = copy.deepcopy(base)
    moved.config._name_or_path = "/another/mount/of/the/same/checkpoint"
    assert weights_fingerprint(moved) == weights_fingerprint(base)
    moved.config._commit_hash = "0123456789abcdef0123456789abcdef01234567"
    assert weights_fingerprint(moved) != weights_fingerprint(base)  # a known commit counts


def test_weights_that_are_not_loaded_have_no_version() -> None:
    with torch.device("meta"):
        empty = small()
    with pytest.raises(ValueError, match="not loaded"):
        weights_fingerprint(empty)
