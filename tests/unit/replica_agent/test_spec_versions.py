"""The weight version in a spec's wire model, and the namespaces of a version that an
operator deletes (replica_agent/spec.py)."""

from __future__ import annotations

import pytest

from replica_agent.spec import MAX_WEIGHT_VERSION_CHARS, ModelSpec, namespaces_of_version

BASE = ModelSpec("org/m", "main", 2, 2, 8, "bfloat16", 16, tp_rank=1, tp_size=2)


def test_the_weight_version_ends_the_wire_model_and_none_leaves_it_as_it_was() -> None:
    assert BASE.wire_model() == "org/m@main;bf16;L2;H2;D8;B16;tp1/2"
    versioned = ModelSpec("org/m", "main", 2, 2, 8, "bfloat16", 16, 1, 2, "step-7")
    assert versioned.wire_model() == BASE.wire_model() + ";Wstep-7"
    other = ModelSpec("org/m", "main", 2, 2, 8, "bfloat16", 16, 1, 2, "step-8")
    assert len({BASE.wire_model(), versioned.wire_model(), other.wire_model()}) == 3


@pytest.mark.parametrize(
    "bad", ["v;L9", "v 1", "v@x", "x" * (MAX_WEIGHT_VERSION_CHARS + 1)], ids=str
)
def test_a_version_cannot_fake_another_field_or_run_long(bad: str) -> None:
    with pytest.raises(ValueError, match="weight_version"):
        ModelSpec("org/m", "main", 2, 2, 8, "bfloat16", 16, weight_version=bad)


def test_the_namespaces_of_a_version_are_every_shard_of_it() -> None:
    one_shard = ModelSpec("org/m", "main", 2, 2, 8, "bfloat16", 16, 1, 2, "step-7")
    shards = [
        ModelSpec("org/m", "main", 2, 2, 8, "bfloat16", 16, rank, 2, "step-6").wire_model()
        for rank in range(2)
    ]
    assert namespaces_of_version(one_shard.wire_model(), "step-6") == shards
    assert namespaces_of_version(BASE.wire_model(), "step-6") == shards
    unversioned = [s.rsplit(";", 1)[0] for s in shards]
    assert namespaces_of_version(one_shard.wire_model(), "") == unversioned


@pytest.mark.parametrize(
    "namespace", ["org/m", "org/m@main;bf16", "org/m@main;tp0/0", "@main;tp0/1", ""], ids=repr
)
def test_what_is_not_a_replicas_namespace_is_refused_saying_where_to_find_one(
    namespace: str,
) -> None:
    with pytest.raises(ValueError, match="copy it from a replica"):
        namespaces_of_version(namespace, "v1")
