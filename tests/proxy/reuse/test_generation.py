"""A generation's record, and what a request that typed part of its text gets from it."""

from __future__ import annotations

import asyncio
import json

import pytest

from llmproxy.proxy.errors import Superseded
from llmproxy.proxy.reuse.answer import replay, whole
from llmproxy.proxy.reuse.generation import Generation
from llmproxy.proxy.reuse.registry import Follow, Generations, Waited

PIECES = ["Hel", "lo", ", ", "wor", "ld"]


def native(piece: str) -> bytes:
    return b'data: {"index":0,"content":"' + piece.encode() + b'","stop":false}\n\n'


FINAL = b'data: {"index":0,"content":"","stop":true,"tokens_predicted":5}\n\n'


def oai(piece: str, finish: str | None = None) -> bytes:
    choice = {"text": piece, "index": 0, "finish_reason": finish}
    return b"data: " + json.dumps({"choices": [choice]}, separators=(",", ":")).encode() + b"\n\n"


def events(data: bytes) -> list[dict[str, object]]:
    return [json.loads(block[6:]) for block in data.split(b"\n\n") if block]


def test_text_accumulates_across_split_chunks() -> None:
    gen = Generation("/completion", {}, oai=False, stream=True)
    stream = b"".join(native(p) for p in PIECES) + FINAL
    for i in range(0, len(stream), 7):  # chunks that cut events anywhere
        gen.feed(stream[i : i + 7])
    gen.end()
    assert gen.text == "Hello, world" and gen.ok and len(gen.events) == 6


@pytest.mark.parametrize("skip", [0, 1, 3, 4, 5, 11, 12])
def test_a_stream_reader_gets_the_text_after_what_it_typed(skip: int) -> None:
    gen = Generation("/completion", {}, oai=False, stream=True)
    gen.feed(b"".join(native(p) for p in PIECES) + FINAL)
    data, sent = gen.stream_from(0, skip)
    assert sent == 6
    got = events(data)
    assert "".join(str(e["content"]) for e in got) == "Hello, world"[skip:]
    assert got[-1]["stop"] is True
    assert all(e["content"] for e in got[:-1])  # no event left empty by the cut
    # events that start at or after the cut are the upstream's bytes as they came
    starts = [sum(map(len, PIECES[:i])) for i in range(len(PIECES))]
    untouched = b"".join(native(p) for p, s in zip(PIECES, starts, strict=True) if s >= skip)
    assert data.endswith(untouched + FINAL)


def test_openai_stream_is_cut_in_choices_text() -> None:
    gen = Generation("/v1/completions", {}, oai=True, stream=True)
    gen.feed(b"".join(oai(p) for p in PIECES) + oai("", "length") + b"data: [DONE]\n\n")
    data, _ = gen.stream_from(0, 4)
    assert b"data: [DONE]" in data
    texts = [e["choices"][0]["text"] for e in events(data.replace(b"data: [DONE]\n\n", b""))]
    assert "".join(texts) == "o, world"
    assert gen.tokens_after(4) == 4


def test_a_non_streaming_reader_gets_the_final_body_with_the_typed_text_removed() -> None:
    gen = Generation("/infill", {}, oai=False, stream=False)
    gen.feed(b"".join(native(p) for p in PIECES) + FINAL)
    gen.end()
    status, body = whole(gen, 5)
    assert status == 200
    assert body == b'{"index":0,"content":", world","stop":true,"tokens_predicted":5}'


def test_a_cut_generation_raises_its_error_for_a_non_streaming_reader() -> None:
    gen = Generation("/infill", {}, oai=False, stream=False)
    gen.feed(native("Hel"))
    gen.end(Superseded("superseded"))
    with pytest.raises(Superseded):
        whole(gen, 1)


BODY = {"prompt": "x = ", "n_predict": 8}


def begin(reg: Generations, grace_s: float = 0.05) -> tuple[Generation, asyncio.Event]:
    orphaned = asyncio.Event()
    gen = Generation("/completion", BODY, oai=False, stream=True, grace_s=grace_s)
    gen.on_orphaned = orphaned.set
    reg.begin("s", gen)
    return gen, orphaned


async def test_follow_waits_while_the_user_types_ahead_then_attaches() -> None:
    reg = Generations(ttl_s=30)
    gen, _ = begin(reg)
    gen.feed(native("4"))
    follow = asyncio.ensure_future(reg.follow("s", "/completion", {**BODY, "prompt": "x = 42"}))
    await asyncio.sleep(0)
    assert not follow.done()  # "42" typed, "4" written: not decided yet
    gen.feed(native("2 +"))
    got = await follow
    assert got is not None and got.generation is gen and got.skip == 2
    assert gen.live == 2 and gen.readers == 1


async def test_follow_gives_up_when_the_model_writes_something_else() -> None:
    reg = Generations(ttl_s=30)
    gen, _ = begin(reg)
    gen.feed(native("4"))
    follow = asyncio.ensure_future(reg.follow("s", "/completion", {**BODY, "prompt": "x = 42"}))
    await asyncio.sleep(0)
    gen.feed(native("3"))
    assert await follow == Waited()  # it waited: to the head of the queue
    assert await reg.follow("s", "/completion", {**BODY, "prompt": "x = 5"}) is None
    assert await reg.follow("other", "/completion", {**BODY, "prompt": "x = 4"}) is None


async def test_an_orphaned_generation_is_reported_after_the_grace_unless_followed() -> None:
    reg = Generations(ttl_s=30)
    gen, orphaned = begin(reg, grace_s=0.01)
    gen.feed(native("42"))
    gen.leave()  # the client that started it left...
    follow = await reg.follow("s", "/completion", {**BODY, "prompt": "x = 4"})
    assert follow is not None  # ...and the next keystroke continued it within the grace
    await asyncio.sleep(0.05)
    assert not orphaned.is_set()
    gen.leave()
    await asyncio.wait_for(orphaned.wait(), 5)


async def test_a_finished_generation_is_kept_for_the_ttl_only() -> None:
    reg = Generations(ttl_s=0.01)
    gen, _ = begin(reg)
    gen.feed(native("42") + FINAL)
    gen.end()
    assert await reg.follow("s", "/completion", {**BODY, "prompt": "x = 4"}) is not None
    await asyncio.sleep(0.02)
    assert await reg.follow("s", "/completion", {**BODY, "prompt": "x = 4"}) is None
    assert len(reg) == 0


def test_the_registry_is_bounded_and_drops_expired_generations() -> None:
    reg = Generations(ttl_s=30, max_sessions=3)
    gens = [Generation("/completion", BODY, oai=False, stream=True) for _ in range(5)]
    for i, gen in enumerate(gens):
        reg.begin(f"s{i}", gen)
    assert len(reg) == 3 and reg.latest("s0") is None and reg.latest("s4") is gens[4]
    expired = Generations(ttl_s=-1)  # every ended one has expired
    old = Generation("/completion", BODY, oai=False, stream=True)
    expired.begin("a", old)
    old.end()
    expired.begin("b", Generation("/completion", BODY, oai=False, stream=True))
    assert len(expired) == 1  # "a" ended and expired: dropped as "b" began


@pytest.mark.parametrize(("first", "joins"), [("4", True), ("7", False)])
async def test_a_keystroke_waits_on_a_generation_still_reading_its_prompt(
    first: str, joins: bool
) -> None:
    """The model has written nothing yet: the keystroke waits for its first piece (keeping
    the generation running after its client left), then follows it or goes on its own."""
    reg = Generations(ttl_s=30)
    gen, orphaned = begin(reg, grace_s=0.0)
    follow = asyncio.ensure_future(reg.follow("s", "/completion", {**BODY, "prompt": "x = 4"}))
    await asyncio.sleep(0)  # one loop step: it runs up to its wait
    assert not follow.done() and gen.live == 2  # waiting, and keeping the generation
    gen.leave()  # the editor closed the first request
    assert gen.live == 1 and gen._timer is None  # no grace started: it runs on
    gen.feed(native(first))
    got = await follow
    assert isinstance(got, Follow) if joins else got == Waited()
    assert gen.live == (1 if joins else 0)
    assert not orphaned.is_set() or not joins


async def test_a_replay_writes_what_arrived_during_its_last_write_at_once() -> None:
    """A piece that arrives while the previous one is being written (a slow client) goes
    out right after it, not only when the next piece or the end comes."""
    gen = Generation("/completion", {}, oai=False, stream=True)
    gen.feed(native("Hel"))
    written: list[bytes] = []
    both = asyncio.Event()

    async def write(data: bytes) -> None:
        if not written:
            gen.feed(native("lo"))  # arrives while the first piece is written
        written.append(data)
        if len(written) == 2:
            both.set()

    reader = asyncio.ensure_future(replay(gen, 0, write, gen.readers))
    await asyncio.wait_for(both.wait(), 5)  # before the generation ends
    assert not gen.done and written == [native("Hel"), native("lo")]
    gen.end()
    await reader
