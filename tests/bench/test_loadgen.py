"""The closed-loop load generator (bench/loadgen.py) against the fake upstream."""

from __future__ import annotations

import json

from llmproxy.bench.fake.upstream import FakeUpstream, Script
from llmproxy.bench.loadgen import run_load


async def test_loadgen_against_fake() -> None:
    async with FakeUpstream(slots=4, script=lambda _p, _b: Script(tokens=3, token_delay_s=0)) as up:
        body = json.dumps({"prompt": "x", "stream": True}).encode()
        res = await run_load(
            up.url + "/completion",
            body,
            requests=40,
            warmup=5,
            concurrency=4,
            duration_s=30,
            stream=True,
            headers=lambda w: {"X-LLMProxy-Session": f"s{w}"},
        )
        assert (res.ok, res.errors, res.capped) == (40, 0, False)
        assert len(up.completed) == 45 and 1 < up.max_concurrent <= 4
        assert {r.headers["X-LLMProxy-Session"] for r in up.received} == {"s0", "s1", "s2", "s3"}
        assert 0 < res.percentile_ms(50) <= res.percentile_ms(99) and res.rps > 0
