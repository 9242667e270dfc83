"""``llmproxy bench soak`` for ~10 s against the fake upstream, and its invariant checks."""

from __future__ import annotations

import asyncio
import os
import sys
from collections import Counter
from pathlib import Path

from llmproxy.bench.fake.upstream import FakeUpstream, Script
from llmproxy.bench.soak.result import SoakResult, outcomes_from_metrics
from llmproxy.common.children import child_preexec

LLMPROXY = str(Path(sys.executable).with_name("llmproxy"))


def test_invariants_flag_each_failure() -> None:
    good = SoakResult(
        capacity=2,
        client=Counter({"200": 3, "aborted": 1}),
        outcomes={"completed": 3, "superseded": 1},
        max_concurrency=2,
        rss_start_kb=1000,
        rss_end_kb=1050,
        permits_free=2,
    )
    assert good.failures() == []
    bad = SoakResult(
        capacity=2,
        client=Counter({"200": 3}),
        outcomes={"completed": 2, "error": 2},
        max_concurrency=3,
        rss_start_kb=1000,
        rss_end_kb=1100,
        permits_free=1,
    )
    assert len(bad.failures()) == 5


def test_outcomes_from_metrics() -> None:
    text = (
        'llmproxy_requests_total{outcome="completed",route="/infill"} 3.0\n'
        'llmproxy_requests_created{outcome="completed",route="/infill"} 1.7e9\n'
        'llmproxy_requests_total{outcome="completed",route="/completion"} 2.0\n'
        'llmproxy_requests_total{outcome="superseded",route="/infill"} 4.0\n'
    )
    assert outcomes_from_metrics(text) == {"completed": 5.0, "superseded": 4.0}


async def test_soak_short_run_against_fake() -> None:
    script = lambda _p, _b: Script(tokens=16, token_delay_s=0.005)  # noqa: E731
    async with FakeUpstream(kind="llamacpp", slots=2, script=script, abort_linger_s=0.05) as fake:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLMPROXY_")}
        proc = await asyncio.create_subprocess_exec(
            LLMPROXY,
            "bench",
            "soak",
            "--minutes",
            "0.17",
            "--capacity",
            "2",
            "--editors",
            "4",
            "--upstream",
            fake.url,
            "--start-timeout-s",
            "30",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=env,
            preexec_fn=child_preexec(),
        )
        out, _ = await asyncio.wait_for(proc.communicate(), 60)
        text = out.decode()
        assert proc.returncode == 0, text
        assert "all invariants hold" in text
        rows = dict(
            line.rsplit(None, 1)
            for line in text.splitlines()
            if line.startswith(("max upstream", "permits free"))
        )
        assert rows == {"max upstream concurrency": "2", "permits free at end": "2"}
        assert fake.max_concurrent == 2  # the fake's own view agrees
        assert len(fake.generations) > 20
