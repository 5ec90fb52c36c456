"""A hypothesis strategy for JSON documents, shared by the tests of the JSON writers and columns."""

from __future__ import annotations

from hypothesis import strategies as st


def json_values(*, max_integer: int, size: int = 4, leaves: int = 20) -> st.SearchStrategy[object]:
    """Any JSON value: null, booleans, integers within ±``max_integer``, finite floats, text, and lists and
    string-keyed objects of up to ``size`` members."""
    return st.recursive(
        st.none()
        | st.booleans()
        | st.integers(min_value=-max_integer, max_value=max_integer)
        | st.floats(allow_nan=False, allow_infinity=False)
        | st.text(),
        lambda children: (
            st.lists(children, max_size=size) | st.dictionaries(st.text(), children, max_size=size)
        ),
        max_leaves=leaves,
    )
