"""How a generation ends, shared by the llama-cpp and torch engines.

* Stop words are matched on the generated text (``stop_matcher.StopMatcher``: linear in
  the text); text that could be the start of a stop word is held back until it is known
  not to be one, so a stop word never leaks into a stream (``hold_scan``).
* ``n_indent`` (llama-server's infill rule): once the generated text has a newline, every
  new line must start with at least ``n_indent`` spaces/tabs; the first line that does not
  ends the generation (stop type "limit") and is cut from its first non-blank character
  on (its leading whitespace stays, as in llama-server). The text after a newline is held
  back while its indentation is undecided, so the cut part never reaches a stream
  (``hold_back``).
* ``t_max_predict_ms``: the generation stops on time only on a token whose text has a
  newline (``time_up``), so it ends on a line boundary.

Pure functions: no state, no I/O; called on the engine's single thread. ``sequence.py``
applies them to a running request.
"""

from __future__ import annotations

from typing import NamedTuple

from llmproxy.backend.engines.stop_matcher import StopMatcher


def find_stop(text: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """The earliest occurrence of any (non-empty) stop word in ``text``: (index, word)."""
    return StopMatcher(stops).feed(text)


def partial_stop_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop word."""
    m = StopMatcher(stops)
    return 0 if m.feed(text) is not None else m.partial


def split_held(text: str, stops: tuple[str, ...]) -> tuple[str, str, str | None]:
    """Split pending text (held text + newly decoded text) into ``(emit, held, word)``.

    ``word`` is the stop word found (then ``emit`` is the text before it and ``held`` is
    empty: the generation ends there), else None and ``held`` is the tail that could
    still become a stop word.
    """
    emit, held, word, _ = hold_back(text, stops)
    return emit, held, word


INDENT_CHARS = " \t"  # what counts as indentation (llama-server: ' ' and '\t' only)


def indent_cut(text: str, n_indent: int) -> int | None:
    """Where llama-server's ``n_indent`` rule cuts ``text``, or None.

    Every line that starts after a newline of ``text`` is checked: at the first one whose
    first character other than a space or tab (a newline counts: a blank line ends the
    block too) comes after fewer than ``n_indent`` of them, the index of that character.
    The text before it (the newline and the line's short indentation) stays."""
    if n_indent <= 0:
        return None
    nl = text.find("\n")
    while nl >= 0:
        pos = nl + 1
        while pos < len(text) and text[pos] in INDENT_CHARS:
            pos += 1
        if pos < len(text) and pos - nl - 1 < n_indent:
            return pos
        nl = text.find("\n", nl + 1)
    return None


def indent_hold_start(text: str, n_indent: int) -> int:
    """Where text whose indentation is still undecided starts (``len(text)`` if none).

    That is the last newline of ``text`` when the line after it is, so far, only spaces
    and tabs and fewer than ``n_indent`` of them. The newline itself is held too, so the
    held text, rescanned with the next piece, still shows where its line starts."""
    if n_indent <= 0:
        return len(text)
    nl = text.rfind("\n")
    if nl < 0:
        return len(text)
    tail = text[nl + 1 :]
    if len(tail) < n_indent and not tail.strip(INDENT_CHARS):
        return nl
    return len(text)


class Hold(NamedTuple):
    """``hold_back``'s answer: emit ``emit`` now, keep ``held`` for the next piece."""

    emit: str
    held: str
    word: str | None = None  # a stop word was found: the generation ends after ``emit``
    indent_stop: bool = False  # a line indented less than n_indent began: ends after ``emit``


def hold_back(text: str, stops: tuple[str, ...], n_indent: int = 0) -> Hold:
    """``hold_scan`` of ``text`` as a whole (nothing held before it)."""
    return hold_scan("", text, StopMatcher(stops), n_indent)


def hold_scan(held: str, piece: str, matcher: StopMatcher, n_indent: int = 0) -> Hold:
    """Split pending text (``held`` text + newly decoded ``piece``) for the stop words and
    n_indent; ``matcher`` has been fed all text before ``piece`` and is fed ``piece`` here.

    A stop word found ends the generation before it (``word``); a line indented less than
    ``n_indent`` ends it at that line's first non-blank character (``indent_stop``),
    whichever comes first (a stop word at that very character wins, as in llama-server,
    which truncates at the stop word before checking the indentation). Otherwise
    ``held`` is the tail that could still become a stop word or whose indentation is
    undecided (from its newline on), and ``emit`` the text before it. The work is linear
    in ``held`` + ``piece`` (``held`` is at most the longest stop word or an undecided
    indentation).
    """
    text = held + piece
    hit = matcher.feed(piece)
    if hit is not None:
        hit = (len(held) + hit[0], hit[1])
    cut = indent_cut(text, n_indent)
    if hit is not None and (cut is None or hit[0] <= cut):
        return Hold(text[: hit[0]], "", hit[1])
    if cut is not None:
        return Hold(text[:cut], "", None, True)
    start = min(len(text) - matcher.partial, indent_hold_start(text, n_indent))
    return Hold(text[:start], text[start:])


def time_up(piece: str, t_first: float, now: float, t_max_predict_ms: int | None) -> bool:
    """llama-server's ``t_max_predict_ms``: stop on a token whose text (``piece``) has a
    newline once more than ``t_max_predict_ms`` passed since the first generated token,
    so the answer ends on a line boundary (llama-server: "we stop after a certain time
    limit, but only upon another new line"); never on a token without one."""
    if not t_max_predict_ms or t_max_predict_ms <= 0 or "\n" not in piece:
        return False
    return (now - t_first) * 1000.0 > t_max_predict_ms
