"""llama-server's line rules for editor autocomplete (llama.vim / llama.vscode /infill):

* ``n_indent``: once the generated text has a newline, each new line must start with at
  least ``n_indent`` spaces/tabs; the first line that does not ends the generation (stop
  type "limit") and is cut from its first non-blank character on (llama-server,
  tools/server/server-context.cpp ``process_token``: ``generated_text.erase(pos)`` with
  ``pos`` past the line's leading whitespace). The cut part never reaches a stream.
* ``t_max_predict_ms``: past it, the generation stops only on a token whose text has a
  newline ("we stop after a certain time limit, but only upon another new line").

Pure tests of the shared holding logic (``engines/stops.py``), then both engines through
a real server and model (greedy, so the output is fixed).
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import pytest

from llmproxy.backend.engines.stops import hold_back, indent_cut, split_held, time_up
from llmproxy.backend.web.errors import BadRequest
from llmproxy.backend.web.params import sampling_params

# --- pure: the n_indent rule and the holding of undecided lines -------------------------


def test_indent_cut_follows_llama_server() -> None:
    assert indent_cut("x\n    y", 4) is None  # deep enough
    assert indent_cut("x\n  y", 4) == 4  # "x\n  " stays: the cut starts at "y"
    assert indent_cut("x\ny", 1) == 2
    assert indent_cut("x\n\ty", 1) is None  # a tab counts as indentation
    assert indent_cut("  x", 4) is None  # the first line (no newline before it) is never checked
    assert indent_cut("x\n  ", 4) is None  # only blanks so far: undecided
    assert indent_cut("x\n\ny", 4) == 2  # a blank line is a line indented 0: it ends the block
    assert indent_cut("x\n        a\n  b", 4) == 14  # the first shallow line, not the first line
    assert indent_cut("x\ny", 0) is None  # n_indent 0 (absent): no rule


def feed(
    pieces: list[str], stops: tuple[str, ...] = (), n_indent: int = 0
) -> tuple[list[str], str, Any]:
    """Run ``hold_back`` as an engine does, one decoded piece at a time: (emitted chunks,
    text still held at the end, the final Hold or None if the pieces ran out)."""
    held, emitted = "", []
    for piece in pieces:
        h = hold_back(held + piece, stops, n_indent)
        held = h.held
        if h.emit:
            emitted.append(h.emit)
        if h.word is not None or h.indent_stop:
            return emitted, held, h
    return emitted, held, None


def test_hold_back_holds_a_line_until_its_indentation_is_decided() -> None:
    # a shallow line: the newline and its blanks are held, then emitted without the line
    emitted, held, end = feed(["x", "\n", "  ", " ", "else", ":"], n_indent=4)
    assert emitted == ["x", "\n   "] and end.indent_stop and end.word is None
    assert "else" not in "".join(emitted)
    # a deep enough line is released as soon as its 4th blank arrives
    emitted, held, end = feed(["x", "\n", "  ", "  ", "y"], n_indent=4)
    assert emitted == ["x", "\n    ", "y"] and held == "" and end is None
    # undecided at the end of the pieces: still held (the engine's _finish flushes it)
    emitted, held, end = feed(["x", "\n  "], n_indent=4)
    assert emitted == ["x"] and held == "\n  " and end is None
    # a token holding a whole shallow line (the usual "\n   " + " else")
    emitted, held, end = feed([" with", " open()", "\n   ", " else"], n_indent=8)
    assert "".join(emitted) == " with open()\n    " and end.indent_stop
    # no n_indent: nothing held back for lines
    assert feed(["x", "\n", "y"]) == (["x", "\n", "y"], "", None)


def test_hold_back_with_stop_words() -> None:
    # the earlier of the stop word and the cut wins; at the same character the word wins
    assert hold_back("a\n\nb", ("\n\n",), 4) == ("a", "", "\n\n", False)
    assert hold_back("a\n  END", ("END",), 4) == ("a\n  ", "", "END", False)
    assert hold_back("a\nb END", ("END",), 4) == ("a\n", "", None, True)
    # a partial stop word and an undecided line: the held text starts at the earlier one
    assert hold_back("ab\n", ("b\nZ",), 4) == ("a", "b\n", None, False)
    assert hold_back("a\n ", ("x",), 4) == ("a", "\n ", None, False)
    # a whole stop word starting in the blanks wins; a partial one does not delay the cut
    # (llama-server also stops as soon as the line's first non-blank character arrives)
    assert feed(["a", "\n", " END"], (" END",), 4)[2] == ("\n", "", " END", False)
    assert feed(["a", "\n", " E"], (" END",), 4)[:2] == (["a", "\n "], "")
    # split_held (stop words only) is unchanged
    assert split_held("foo EN", ("END",)) == ("foo ", "EN", None)


def test_time_up_only_on_a_newline() -> None:
    t0 = 100.0
    assert not time_up(" with", t0, t0 + 5.0, 250)  # long past the limit, but mid-line
    assert time_up("\n   ", t0, t0 + 0.3, 250)
    assert time_up(")\n", t0, t0 + 0.3, 250)
    assert not time_up("\n", t0, t0 + 0.2, 250)  # not yet
    assert not time_up("\n", t0, t0 + 5.0, None) and not time_up("\n", t0, t0 + 5.0, 0)


def test_n_indent_parsing() -> None:
    assert sampling_params({}).n_indent == 0
    assert sampling_params({"n_indent": None}).n_indent == 0
    assert sampling_params({"n_indent": 4}).n_indent == 4
    assert sampling_params({"n_indent": -2}).n_indent == 0
    for bad in ("4", 4.5, True, [4]):
        with pytest.raises(BadRequest):
            sampling_params({"n_indent": bad})


# --- through a real server and model (both engines) --------------------------------------

# llama.vim's /infill body, cursor inside an ``if`` block; greedy. SmolLM2 writes
# ' with open(path, "r")' then a line "    else:" (indented 4 < 8), and more lines.
IN_BLOCK = {
    "id_slot": 0,
    "input_prefix": "import os\n\ndef load(path):\n    if os.path.exists(path):\n",
    "input_suffix": "\n",
    "input_extra": [],
    "prompt": "        ",
    "n_predict": 64,
    "stop": [],
    "top_k": 1,
    "top_p": 0.90,
    "samplers": ["top_k", "top_p", "infill"],
    "cache_prompt": True,
    "temperature": 0,
    "seed": 1,
}
# cursor at the end of "def load(path):": the first token is a newline ("\n   "), and the
# body that follows has a blank line after "return f.read()".
AFTER_DEF = {
    **IN_BLOCK,
    "input_prefix": "import os\n\ndef load(path):",
    "prompt": "",
    "n_predict": 48,
}


def stream_pieces(backend: Any, body: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """A streamed /infill: the content of each event (one per token here) and the last event."""
    req = urllib.request.Request(
        backend.url + "/infill", data=json.dumps({**body, "stream": True}).encode()
    )
    req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=60) as resp:
        raw = resp.read().decode()
    events = [json.loads(b[len("data: ") :]) for b in raw.split("\n\n") if b.startswith("data: {")]
    assert events and events[-1]["stop"] is True, raw
    return [e["content"] for e in events], events[-1]


@pytest.mark.parametrize(
    ("body", "n_indent"), [(IN_BLOCK, 8), (AFTER_DEF, 4)], ids=["shallow-line", "blank-line"]
)
def test_n_indent_cuts_the_first_shallower_line(
    backend: Any, body: dict[str, Any], n_indent: int
) -> None:
    status, free = backend.post("/infill", body)
    assert status == 200, free
    cut = indent_cut(free["content"], n_indent)
    assert cut is not None, (
        f"precondition: the model no longer leaves the block: {free['content']!r}"
    )
    want = free["content"][:cut]
    status, r = backend.post("/infill", {**body, "n_indent": n_indent})
    assert status == 200, r
    assert (r["content"], r["stop_type"]) == (want, "limit")
    assert r["tokens_predicted"] < free["tokens_predicted"]
    for line in r["content"].split("\n")[1:]:
        assert line.strip() == "" or len(line) - len(line.lstrip(" \t")) >= n_indent, line
    # streamed: the cut line never goes out, not even in a chunk sent before the cut
    pieces, last = stream_pieces(backend, {**body, "n_indent": n_indent})
    assert "".join(pieces) == want and last["stop_type"] == "limit"


def test_bad_n_indent_is_a_400(backend: Any) -> None:
    status, body = backend.post("/infill", {**IN_BLOCK, "n_indent": "4"})
    assert status == 400 and "n_indent" in body["error"]["message"], body


def test_t_max_predict_ms_stops_on_a_token_with_a_newline(backend: Any) -> None:
    # t_max_predict_ms 1: the time is up from the second token on (a token takes >1 ms);
    # the first token ("\n   ") was at 0 ms. llama-server then stops on the next token whose
    # text has a newline, not on the second token (which would leave "\n    with").
    pieces, last = stream_pieces(backend, AFTER_DEF)
    toks = pieces[:-1] if pieces[-1] == "" else pieces  # the final event carries no token
    assert "\n" in toks[0] and "\n" not in toks[1], f"precondition: {toks[:3]!r}"
    k = next(i for i in range(1, len(toks)) if "\n" in toks[i])
    want = "".join(toks[: k + 1])
    status, r = backend.post("/infill", {**AFTER_DEF, "t_max_predict_ms": 1})
    assert status == 200, r
    assert (r["content"], r["stop_type"], r["tokens_predicted"]) == (want, "limit", k + 1)
    assert r["content"].rsplit("\n", 1)[-1].strip() == ""  # ends on a line boundary
    # with n_indent too (llama.vim sends both): same stop, the held blanks are part of the answer
    status, r = backend.post("/infill", {**AFTER_DEF, "t_max_predict_ms": 1, "n_indent": 4})
    assert (r["content"], r["stop_type"]) == (want, "limit")
