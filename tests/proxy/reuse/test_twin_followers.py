"""Type-through and twins (proxy/twins.py), on the registry itself: a twin's arrival makes
none of its siblings stale, and a generation answers no twin of a request it answers."""

from __future__ import annotations

import asyncio

from llmproxy.proxy.reuse.generation import Generation
from llmproxy.proxy.reuse.registry import Follow, Generations
from tests.helpers.net import wait_until

ROUTE = "/completion"


async def test_a_twin_of_a_waiting_follower_gets_a_sample_of_its_own() -> None:
    gens = Generations(ttl_s=10)
    generation = Generation(ROUTE, {"prompt": "x = "}, oai=False, stream=True)
    gens.begin("editor", generation)
    typed = {"prompt": "x = t0 "}  # typed ahead of the model: the first twin waits
    first = asyncio.ensure_future(gens.follow("editor", ROUTE, typed))
    await wait_until(lambda: generation.live == 2, what="the first twin waiting")
    # its twin (minuet's second request) does not read the same sample: through the gate
    assert await asyncio.wait_for(gens.follow("editor", ROUTE, dict(typed)), 5) is None
    generation.feed(b'data: {"content":"t0 ","stop":false}\n\n')
    follow = await asyncio.wait_for(first, 5)
    assert isinstance(follow, Follow) and follow.skip == 3
    assert not follow.stale()  # the twin that came after it is no newer keystroke
    assert await gens.follow("editor", ROUTE, {"prompt": "x = zz"}) is None
    assert follow.stale()  # a different one is
