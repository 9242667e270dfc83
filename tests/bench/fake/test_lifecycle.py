"""The fake upstream's stop, as a killed server's: the port refuses connections from then on,
and a connection it accepted before is closed, never left open with its request unread."""

from __future__ import annotations

import asyncio

from llmproxy.bench.fake.upstream import FakeUpstream, Script

REQUEST = b'POST /completion HTTP/1.1\r\nHost: x\r\nContent-Length: 15\r\n\r\n{"prompt": "p"}'


async def _exchange(port: int) -> str:
    """Connect, send a request, and say what came back within a deadline."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return "refused"
    try:
        writer.write(REQUEST)
        data = await asyncio.wait_for(reader.read(64), 5)
        return "answer" if data else "closed"
    except OSError:
        return "closed"  # reset
    except TimeoutError:
        return "no answer, still open"
    finally:
        writer.close()


async def test_a_connection_made_as_the_fake_stops_is_answered_or_closed() -> None:
    """Connections made in each loop iteration around a ``stop()``: each gets an answer, is
    closed, or is refused. A connection accepted just before the listener closed used to stay
    open and unread (asyncio's loop failing to attach it): its request waited forever."""
    outcomes = set()
    for iterations in range(12):
        fake = FakeUpstream(script=lambda _p, _b: Script(tokens=2, token_delay_s=0))
        await fake.start()
        port = int(fake.url.rsplit(":", 1)[1])
        exchange = asyncio.create_task(_exchange(port))
        for _ in range(iterations):
            await asyncio.sleep(0)  # the stop lands at a later step of the connection's
        await fake.stop()
        outcome = await exchange
        assert outcome != "no answer, still open", iterations
        outcomes.add(outcome)
    assert {"refused", "answer"} <= outcomes  # both ends of the race were reached
