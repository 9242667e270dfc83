"""relay/sse.py: an upstream's event stream framed once, each event's JSON parsed once."""

from __future__ import annotations

import math

from llmproxy.common.fastjson import loads
from llmproxy.proxy.relay.assemble import Assembler
from llmproxy.proxy.relay.sse import Framer, SseEvent
from llmproxy.proxy.reuse.generation import Generation
from llmproxy.proxy.upstream.resume import Transcript

STREAM = (
    b'data: {"content":"a","stop":false}\n\n'
    b'data: {"content":"b","stop":false}\r\n\r\n'
    b": a comment\n\n"
    b'data: {"content":"","stop":true,"stop_type":"eos"}'
)


def test_events_end_at_a_blank_line_and_keep_their_bytes() -> None:
    framer = Framer()
    events = [e for i in range(len(STREAM)) for e in framer.feed(STREAM[i : i + 1])]
    events += framer.flush()  # the last one came without its blank line
    assert b"".join(e.raw for e in events) == STREAM
    assert [e.fields for e in events] == [
        {"content": "a", "stop": False},
        {"content": "b", "stop": False},
        None,
        {"content": "", "stop": True, "stop_type": "eos"},
    ]


def test_every_reader_gets_the_same_parsed_event() -> None:
    """One parse per event however many read it: the assembler, type-through's record and a
    transcript all take the same objects, and none of them changes them."""
    events = Framer().feed(STREAM + b"\n\n")
    before = [dict(e.fields) if e.fields else None for e in events]
    assembler, transcript = Assembler("/completion"), Transcript("/completion")
    generation = Generation("/completion", {"prompt": "x"}, oai=False, stream=False)
    for reader in (assembler.take, transcript.take, generation.take):
        reader(events)
    assert assembler.render()[1] == b'{"content":"ab","stop":true,"stop_type":"eos"}'
    assert transcript.text == generation.text == "ab"
    assert [e.obj for e in generation.events] == [e.fields for e in events]
    assert generation.events[0].obj is events[0].obj
    assert [dict(e.fields) if e.fields else None for e in events] == before


def test_json_reads_as_the_standard_library_reads_it() -> None:
    """orjson first; what it refuses (NaN, a lone surrogate) as the standard library reads it."""
    assert loads(b'{"a": [1, 2.5, "x"]}') == {"a": [1, 2.5, "x"]}
    assert math.isnan(loads(b'{"a": NaN}')["a"])
    assert loads(b'"\\ud800"') == "\ud800"
    assert SseEvent(b"data: {oops\n\n").bad
    assert SseEvent(b"data: [DONE]\n\n").done and SseEvent(b"data: [DONE]\n\n").obj is None


def test_a_framer_with_a_limit_gives_up_on_an_event_that_never_ends() -> None:
    framer = Framer(limit=100)
    assert framer.feed(b"data: " + b"x" * 50) == []
    (event,) = framer.feed(b"y" * 60)
    assert event.bad and len(event.raw) == 116 and framer.pending == 0


def test_an_event_that_comes_whole_reads_as_one_framed_bytewise() -> None:
    """The common case, one event per read, takes a shorter path to the same events."""
    chunks = [b'data: {"content":"a","stop":false}\n\n', b"data: [DONE]\n\n", b"\n\n", b"x\n\n"]
    whole = [e for c in chunks for e in Framer().feed(c)]
    framer = Framer()
    bytewise = [e for c in b"".join(chunks) for e in framer.feed(bytes([c]))]
    assert [(e.raw, e.data, e.obj, e.bad) for e in whole] == [
        (e.raw, e.data, e.obj, e.bad) for e in bytewise
    ]
