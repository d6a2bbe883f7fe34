"""`enc` keeps field boundaries: no two field tuples share an encoding."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcommon.encoding import enc

fields = st.lists(
    st.one_of(st.binary(max_size=8), st.text(max_size=4), st.integers(-(2**63), 2**63 - 1)),
    max_size=4,
)


def test_known_answer() -> None:
    assert enc(b"ab", "c", 1).hex() == (
        "000000030000000000000003626162000000000000000273630000000000000009690000000000000001"
    )


def test_split_points_differ() -> None:
    assert enc(b"ab", b"c") != enc(b"a", b"bc")
    assert enc(b"a") != enc(b"a", b"")
    assert enc("a") != enc(b"a")


def test_bool_is_refused() -> None:
    with pytest.raises(TypeError):
        enc(True)


@given(fields, fields)
def test_distinct_tuples_encode_distinctly(a: list[object], b: list[object]) -> None:
    def normal(xs: list[object]) -> list[tuple[str, object]]:
        return [(type(x).__name__, x) for x in xs]

    if normal(a) != normal(b):
        assert enc(*a) != enc(*b)  # type: ignore[arg-type]
