"""Property-based stress of the gate's invariants under random load (real loopback servers).

Random arrivals, sessions, client aborts, upstream errors, slow aborts, requests on
several slots at once (``n_cmpl``), keystrokes that type what the session's previous
request was answered (type-through continuations) and twins (identical requests of a
session at once, proxy/twins.py). Invariants (docs/design.md):
generations at the upstream (each ``n_cmpl`` completion counts) <= N at every instant; all
N permits free at quiescence; exactly one outcome per request; what the proxy says reached
the upstream is exactly what the upstream saw, so superseded, queue-cancelled and reused
requests never reach it.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import aiohttp
import structlog
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from llmproxy.bench.fake.upstream import FakeUpstream, Script
from llmproxy.proxy.telemetry.metrics import OUTCOMES
from tests.helpers.net import wait_until
from tests.helpers.proxy import run_proxy


@dataclass(frozen=True)
class Op:
    delay_ms: int
    session: int
    abort_ms: int | None
    stream: bool
    tokens: int
    upstream: str  # "ok" | "500" | "reset"
    warmup: bool
    n_cmpl: int  # completions at once (slots); more than the capacity must be refused (400)
    typed: int  # > 0: type this many more characters of the session's previous request's output
    twins: int = 0  # as many more identical requests at once (minuet's n_completions)


ops_strategy = st.lists(
    st.builds(
        Op,
        delay_ms=st.integers(0, 30),
        session=st.integers(0, 3),
        abort_ms=st.none() | st.integers(0, 60),
        stream=st.booleans(),
        tokens=st.integers(1, 12),
        upstream=st.sampled_from(["ok", "ok", "ok", "500", "reset"]),
        warmup=st.booleans(),
        n_cmpl=st.sampled_from([1, 1, 1, 2, 3]),
        typed=st.sampled_from([0, 0, 1, 2, 4]),
        twins=st.sampled_from([0, 0, 0, 1, 2]),
    ),
    min_size=1,
    max_size=14,
)


def script_for(_path: str, body: dict) -> Script:
    kind = body.get("upstream", "ok")
    if kind == "500":
        return Script(status=500)
    return Script(
        tokens=body["tokens"],
        token_delay_s=0.004,
        fail="reset_mid_stream" if kind == "reset" else None,
    )


async def scenario(
    ops: list[Op], capacity: int, linger: float, policy: str
) -> list[dict[str, object]]:
    async with (
        FakeUpstream(slots=capacity, abort_linger_s=linger, script=script_for) as fake,
        run_proxy(
            fake.url,
            max_queue=4,
            queue_timeout_s=3,
            supersede_inflight=policy,
            on_disconnect=policy,
        ) as px,
        aiohttp.ClientSession() as http,
    ):
        # requests are numbered 10 * op + twin (twin 0: the op's own request)
        statuses: dict[int, int] = {}
        last: dict[int, tuple[dict[str, object], int]] = {}  # session -> (first body, typed)
        sent: dict[int, dict[str, object]] = {}  # what each request sent
        with structlog.testing.capture_logs() as logs:

            async def client(i: int, op: Op) -> None:
                await asyncio.sleep(op.delay_ms / 1000 * i)
                body: dict[str, object] = {
                    "prompt": "p",
                    "seq": i,
                    "stream": op.stream,
                    "tokens": op.tokens,
                    "upstream": op.upstream,
                    "n_predict": 0 if op.warmup else 64,
                    "n_cmpl": op.n_cmpl,
                }
                if op.typed and op.session in last:  # the user types the previous suggestion
                    first, typed = last[op.session]
                    output = "".join(f"t{k} " for k in range(int(str(first["tokens"]))))
                    typed = min(typed + op.typed, len(output))
                    body = {**first, "prompt": str(first["prompt"]) + output[:typed]}
                    last[op.session] = (first, typed)
                else:
                    last[op.session] = (body, 0)

                async def call(n: int) -> None:
                    sent[n] = body
                    async with http.post(
                        px.url + "/completion",
                        json=body,
                        headers={"X-LLMProxy-Session": str(op.session), "X-Request-Id": f"r{n}"},
                    ) as r:
                        with contextlib.suppress(aiohttp.ClientPayloadError):  # a cut stream
                            await r.read()
                        statuses[n] = r.status

                tasks = [asyncio.create_task(call(10 * i + j)) for j in range(1 + op.twins)]
                if op.abort_ms is not None:
                    _, pending = await asyncio.wait(tasks, timeout=op.abort_ms / 1000)
                    for task in pending:
                        task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

            await asyncio.gather(*(client(i, op) for i, op in enumerate(ops)))
            await asyncio.wait_for(px.state.pool.wait_quiescent(), 15)
            px.flush_log()
            # A client aborted at once may never reach the proxy; every other one must be logged.
            must = {
                f"r{10 * i + j}"
                for i, op in enumerate(ops)
                for j in range(1 + op.twins)
                if op.abort_ms is None
            }
            await wait_until(
                lambda: must <= {e.get("request_id") for e in logs if e.get("event") == "request"},
                10,
                what="one canonical line per request",
            )
        gate = px.member.gate
        assert gate.free == capacity and len(px.state.pool.queue) == 0 and gate.inflight == 0
        assert fake.max_concurrent <= capacity, fake.snapshot()
        events = [e for e in logs if e.get("event") == "request"]
        ids = [e["request_id"] for e in events]
        assert len(ids) == len(set(ids)), "a request got more than one outcome"
        assert must <= set(ids) <= {f"r{n}" for n in sent}
        assert all(e["outcome"] in OUTCOMES for e in events)
        reached_proxy = {int(e["request_id"][1:]) for e in events if e["reached_upstream"]}
        reached_fake = {int(r.headers["X-Request-Id"][1:]) for r in fake.generations}
        # Everything the upstream saw, the proxy says it sent (a send cancelled while connecting
        # may be counted as sent without arriving: that direction is harmless).
        assert reached_fake <= reached_proxy, (reached_fake, reached_proxy)
        for e in events:
            if not e["reached_upstream"]:
                assert e["outcome"] in ("superseded", "cancelled_queued", "rejected", "reused"), e
            if e["outcome"] == "reused":
                assert not e["reached_upstream"], e
        too_wide = {n for n, body in sent.items() if int(str(body["n_cmpl"])) > capacity}
        assert all(statuses[n] == 400 for n in too_wide if n in statuses), statuses
        # answered at once
        assert all(n in statuses for n in too_wide if ops[n // 10].abort_ms is None), statuses
        assert not too_wide & reached_fake
        return events


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)
@given(
    ops=ops_strategy,
    capacity=st.integers(1, 3),
    linger=st.sampled_from([0.0, 0.02, 0.08]),
    policy=st.sampled_from(["auto", "cancel", "finish"]),
)
@example(  # a keystroke typing a generation the upstream then reset: it runs on its own
    ops=[
        Op(6, 1, None, False, 11, "500", False, 3, 1),
        Op(18, 0, 3, False, 4, "reset", False, 1, 1),
        Op(18, 0, 3, False, 4, "reset", False, 1, 1),
    ],
    capacity=2,
    linger=0.02,
    policy="cancel",
)
def test_gate_invariants_under_random_load(
    ops: list[Op], capacity: int, linger: float, policy: str
) -> None:
    asyncio.run(scenario(ops, capacity, linger, policy))


def test_the_mix_includes_reused_continuations() -> None:
    """The random load's continuations do take the type-through path: one session's
    request, then keystrokes typing its output while it runs, among other sessions. Each
    keystroke that continues the generation supersedes the one before it."""

    def op(delay_ms: int, session: int, tokens: int, typed: int) -> Op:
        return Op(delay_ms, session, None, False, tokens, "ok", False, 1, typed)

    ops = [op(0, 0, 12, 0), op(5, 1, 3, 0), op(5, 0, 12, 2), op(5, 0, 12, 1)]
    events = asyncio.run(scenario(ops, capacity=2, linger=0.0, policy="auto"))
    outcomes = {e["request_id"]: e["outcome"] for e in events}
    assert outcomes == {
        "r0": "superseded",
        "r10": "completed",
        "r20": "superseded",
        "r30": "reused",
    }
