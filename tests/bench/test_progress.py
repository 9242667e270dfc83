"""Progress of long benches on stderr (bench/progress.py), and ``bench overhead --page``."""

from __future__ import annotations

import asyncio
import io

import pytest

from llmproxy.bench.burst.run import _main
from llmproxy.bench.burst.settings import BurstSettings
from llmproxy.bench.fake.upstream import FakeUpstream, Script
from llmproxy.bench.overhead.run import OverheadSettings, _bench
from llmproxy.bench.progress import Steps


def test_plain_lines_say_the_step_and_the_time_left() -> None:
    out = io.StringIO()  # not a terminal: one line per step
    with Steps(3, "bench x", stream=out) as steps:
        for label in ("a", "b", "c"):
            steps.step(label)
    lines = out.getvalue().splitlines()
    assert lines[0] == "bench x: [1/3] a"
    assert lines[1].startswith("bench x: [2/3] b, about ") and lines[1].endswith(" s left")
    assert lines[3].startswith("bench x: done in ")


def test_overhead_with_a_page_open_reports_each_step(capsys: pytest.CaptureFixture[str]) -> None:
    settings = OverheadSettings(
        requests=6, warmup=1, concurrency=[2], modes=["nonstream"], tokens=2,
        token_delay_ms=[1.0], rounds=2, floor=False, raw=False, page=True,
    )  # fmt: skip
    cases = asyncio.run(_bench(settings))
    assert len(cases) == 1 and cases[0].proxied is not None and cases[0].proxied.ok == 6
    err = capsys.readouterr().err
    steps = [ln for ln in err.splitlines() if ln.startswith("bench overhead: [")]
    assert [ln.split("] ", 1)[1].split(",")[0] for ln in steps] == [
        "1 ms/token nonstream c=2 round 1/2 direct",
        "1 ms/token nonstream c=2 round 1/2 proxied",
        "1 ms/token nonstream c=2 round 2/2 direct",
        "1 ms/token nonstream c=2 round 2/2 proxied",
    ]


async def test_burst_reports_the_baseline_and_each_burst_per_target(
    capsys: pytest.CaptureFixture[str],
) -> None:
    settings = BurstSettings(
        keystrokes=3, interval_ms=30, bursts=2, baseline_runs=1, gap_ms=0, n_predict=4,
        poll_slots=False, profile="continue",
    )  # fmt: skip
    script = lambda _p, _b: Script(tokens=4, token_delay_s=0.005)  # noqa: E731
    async with FakeUpstream(slots=2, script=script) as a, FakeUpstream(slots=2, script=script) as b:
        await _main(a.url, settings.model_copy(update={"compare": [b.url]}))
    err = capsys.readouterr().err
    steps = [ln.split("] ", 1)[1].split(",")[0] for ln in err.splitlines() if "] " in ln]
    assert steps == [
        f"{u} {what}" for u in (a.url, b.url) for what in ("baseline", "burst 1/2", "burst 2/2")
    ]
    assert "bench burst: done in " in err
