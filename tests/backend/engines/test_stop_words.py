"""Stop words: the earliest one ends the text, a partial one at the end is held back."""

from __future__ import annotations

from llmproxy.backend.engines.stops import find_stop, partial_stop_len, split_held


def test_stop_word_helpers() -> None:
    assert find_stop("abc\n\ndef", ("\n\n",)) == (3, "\n\n")
    assert find_stop("a END b STOP", ("STOP", "END")) == (2, "END")
    assert find_stop("nothing", ("x",)) is None
    assert partial_stop_len("foo\n", ("\n\n",)) == 1
    assert partial_stop_len("foo EN", ("END",)) == 2
    assert partial_stop_len("foo", ("END",)) == 0
    # (emit, held, stopping word): a stop word ends the text, a partial one is held back
    assert split_held("abc\n\ndef", ("\n\n",)) == ("abc", "", "\n\n")
    assert split_held("foo EN", ("END",)) == ("foo ", "EN", None)
    assert split_held("foo EN", ()) == ("foo EN", "", None)
    assert split_held("END", ("END",)) == ("", "", "END")
