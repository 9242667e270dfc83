"""Byte-preserving id_slot injection (property-based)."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from llmproxy.proxy.upstream.dialects.body import set_top_level

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3)
    ),
    max_leaves=10,
)


@given(
    st.dictionaries(st.text(max_size=8), json_values, max_size=6), st.integers(0, 64), st.booleans()
)
def test_set_id_slot_changes_only_that_field(obj: dict, slot: int, spaced: bool) -> None:
    raw = json.dumps(obj, indent=1 if spaced else None).encode()
    out = set_top_level(raw, "id_slot", slot)
    assert json.loads(out) == {**obj, "id_slot": slot}


def test_other_bytes_untouched() -> None:
    raw = b'{"id_slot":0,"input_prefix":"def f():\\n","top_p":0.90,"n_predict":128}'
    assert set_top_level(raw, "id_slot", 3) == raw.replace(b'"id_slot":0', b'"id_slot":3')
    raw2 = b'{ "prompt" : "x",  "top_p":0.90 }'
    assert set_top_level(raw2, "id_slot", 1) == b'{"id_slot":1, "prompt" : "x",  "top_p":0.90 }'


def test_escaped_key_is_replaced_not_duplicated() -> None:
    raw = b'{"\\u0069d_slot":0,"prompt":"x"}'
    assert json.loads(raw)["id_slot"] == 0
    for present in (None, True):
        out = set_top_level(raw, "id_slot", 2, present=present)
        assert json.loads(out) == {"id_slot": 2, "prompt": "x"}
        assert out.count(b"slot") == 1
