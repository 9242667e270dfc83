"""``llmproxy bench burst --profile minuet``: minuet-ai.nvim's triggers (debounce, throttle,
n identical requests, the previous trigger's killed), read as minuet reads answers."""

from __future__ import annotations

import pytest

from llmproxy.bench.burst.editor import trigger_times
from llmproxy.bench.burst.run import run_target
from llmproxy.bench.burst.settings import BurstSettings
from llmproxy.bench.fake.upstream import FakeUpstream, Script
from tests.helpers.proxy import run_proxy

SCRIPT = lambda _p, _b: Script(tokens=10, token_delay_s=0.03)  # noqa: E731  0.3 s a generation


def test_triggers_follow_minuets_debounce_and_throttle() -> None:
    keys = [k * 0.05 for k in range(5)]  # typing faster than the debounce: one trigger
    assert trigger_times(keys, 0.4, 1.0) == [(4, 0.2 + 0.4)]
    keys = [k * 0.5 for k in range(6)]  # 0.5 s apart: the throttle swallows keystrokes
    assert [k for k, _ in trigger_times(keys, 0.4, 1.0)] == [0, 3]
    assert [k for k, _ in trigger_times(keys, 0.1, 0.05)] == list(range(6))


def settings(**kw: object) -> BurstSettings:
    base = dict(
        profile="minuet",
        keystrokes=4,
        interval_ms=200,
        debounce_ms=100,
        throttle_ms=50,  # every keystroke triggers, and kills the previous trigger's requests
        bursts=1,
        baseline_runs=1,
        gap_ms=0,
        n_predict=10,
        slots_poll_ms=5,
    )
    return BurstSettings(**{**base, **kw})


@pytest.mark.parametrize(
    ("admission", "type_through"),
    [
        ("pool", "off"),
        ("single", "off"),
        ("pool", "on"),
        ("single", "on"),
    ],
)
async def test_minuet_through_the_proxy_sees_no_error_and_no_cut_suggestion(
    admission: str, type_through: str
) -> None:
    async with FakeUpstream(slots=3, abort_linger_s=0.02, script=SCRIPT) as fake:
        if admission == "single":
            proxy = run_proxy(fake.url, type_through=type_through)
        else:
            specs = [{"url": fake.url, "name": "u0"}]
            proxy = run_proxy(None, upstreams=specs, type_through=type_through)
        async with proxy as px:
            s = (await run_target(px.url, settings())).summary()
    assert s["requests"] == 4 * 3  # three twins a trigger, a trigger a keystroke
    assert (s["errors_shown"], s["cut_suggestions_shown"]) == (0, 0)
    assert s["failed_bursts"] == 0
    if type_through == "off":
        assert s["suggestions_shown"] == 3  # the last trigger's three
    else:  # a follower may also be answered before the next trigger kills it
        assert s["suggestions_shown"] >= 3
    assert s["max_running"] == 3  # each twin on a slot of its own
    finals = [g for g in fake.generations if g.body and "PLACEHOLDER" in str(g.body)][-3:]
    bodies = [{k: v for k, v in (g.body or {}).items() if k != "id_slot"} for g in finals]
    assert bodies[0] == bodies[1] == bodies[2]  # identical, but for the slot the proxy set
    assert sorted((g.body or {})["id_slot"] for g in finals) == [0, 1, 2]
