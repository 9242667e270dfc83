"""Stop words: the earliest one ends the text, a partial one at the end is held back; the
automaton that finds them, fed piece by piece, agrees with the rule spelled out."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from llmproxy.backend.engines.stop_matcher import StopMatcher
from llmproxy.backend.engines.stops import find_stop, hold_scan, partial_stop_len, split_held


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


def naive_hold(text: str, stops: tuple[str, ...]) -> tuple[str, str, str | None]:
    """The rule spelled out: the earliest-starting stop word in ``text`` ends it, else the
    longest tail that is a proper prefix of a stop word is held back."""
    hits = [(text.find(w), w) for w in stops if w and w in text]
    if hits:
        idx = min(i for i, _ in hits)
        word = next(w for i, w in sorted(hits, key=lambda h: (h[0], len(h[1]))) if i == idx)
        return text[:idx], "", word
    keep = max((k for w in stops for k in range(1, len(w)) if text.endswith(w[:k])), default=0)
    return text[: len(text) - keep], text[len(text) - keep :], None


@given(
    stops=st.lists(st.text(alphabet="ab\n", min_size=1, max_size=4), max_size=4),
    pieces=st.lists(st.text(alphabet="ab\nc", max_size=3), max_size=12),
)
def test_incremental_matching_agrees_with_the_rule(stops: list[str], pieces: list[str]) -> None:
    """Fed one piece at a time (as engines do), the automaton emits what the rule applied to
    the held text + each piece emits, and stops at the same word."""
    words = tuple(stops)
    matcher = StopMatcher(words)
    held = ref_held = ""
    for piece in pieces:
        h = hold_scan(held, piece, matcher)
        emit, ref_held, word = naive_hold(ref_held + piece, words)
        assert (h.emit, h.held, h.word) == (emit, ref_held, word), (words, pieces)
        if word is not None:
            break
        held = h.held
