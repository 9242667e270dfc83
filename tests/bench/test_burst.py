"""``llmproxy bench burst`` against the fake upstream, directly and through a real proxy process.

The report's backend counts (from /slots polling) must equal what the fake recorded.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from llmproxy.bench.burst import counters
from llmproxy.bench.burst.editor import send_times
from llmproxy.bench.burst.profiles import PROFILES, delivered_tokens
from llmproxy.bench.burst.report import format_table
from llmproxy.bench.burst.run import run_target
from llmproxy.bench.burst.settings import BurstSettings
from llmproxy.bench.burst.slots import SlotsPoller
from llmproxy.bench.fake.upstream import FakeUpstream, Script
from llmproxy.common.children import child_preexec
from llmproxy.proxy.state import METRICS
from tests.helpers.proxy import run_proxy
from tests.helpers.serve import serve

KEYS = 5
SCRIPT = lambda _p, _b: Script(tokens=10, token_delay_s=0.02)  # noqa: E731


def _settings(**kw: object) -> BurstSettings:
    base = dict(
        keystrokes=KEYS,
        interval_ms=50,
        bursts=1,
        baseline_runs=1,
        gap_ms=0,
        n_predict=10,
        slots_poll_ms=5,
    )
    return BurstSettings(**{**base, **kw})


@pytest.mark.parametrize("profile", ["llm-ls", "continue"])
async def test_direct_counts_match_the_fake(profile: str) -> None:
    # 8 slots and a long abort linger: every abandoned generation stays visible in /slots
    async with FakeUpstream(slots=8, abort_linger_s=0.5, script=SCRIPT) as fake:
        r = await run_target(fake.url, _settings(profile=profile))
        s = r.summary()
        burst_gens = [g for g in fake.generations if g.path == PROFILES[profile].route][
            4:
        ]  # after warm-up + baseline (2 requests each)
        assert len(burst_gens) == KEYS
        assert s["generations"] == KEYS == len(fake.aborted) + 1
        assert s["max_running"] == fake.max_concurrent == KEYS
        assert (s["requests"], s["completed"], s["aborted"], s["errors"]) == (KEYS, 1, KEYS - 1, 0)
        assert s["tokens_delivered"] == 10
        assert s["tokens_for_nobody"] > 0
        assert s["last_p50_ms"] >= 200  # 10 tokens x 20 ms
        # no /metrics (llama-server's default): the polled count, marked as a lower bound
        assert s["tokens_decoded_exact"] is False and s["prompt_tokens_evaluated"] is None
        assert f">={s['tokens_decoded']}" in format_table([r])


async def test_tokens_decoded_are_exact_where_the_backend_serves_metrics() -> None:
    fake = FakeUpstream(slots=8, abort_linger_s=0.5, script=SCRIPT, metrics_endpoint=True)
    async with fake:
        s = (await run_target(fake.url, _settings(profile="continue"))).summary()
    # every generation of the warm-up and baseline (4) ran to its 10 tokens before the bursts
    assert s["tokens_decoded_exact"] is True
    assert s["tokens_decoded"] == fake.table.tokens_decoded - 4 * 10
    assert s["prompt_tokens_evaluated"] == 0  # the prompt-cache model is off


async def test_through_proxy_backend_runs_at_most_capacity(tmp_path: Path) -> None:
    async with (
        FakeUpstream(slots=4, abort_linger_s=0.05, script=SCRIPT) as fake,
        serve(tmp_path, "--upstream", fake.url, "--capacity", "1") as (_proc, url),
    ):
        r = await run_target(url, _settings(bursts=2))
        s = r.summary()
        gens = len(fake.generations) - 4  # warm-up + baseline (2 requests each)
        assert s["generations"] == gens < 2 * KEYS  # superseded requests never reached the fake
        assert s["max_running"] == fake.max_concurrent == 1
        assert s["failed_bursts"] == 0 and s["completed"] == 2


async def test_serial_profile_sends_one_at_a_time() -> None:
    async with FakeUpstream(slots=2, script=SCRIPT) as fake:
        r = await run_target(fake.url, _settings(profile="llama-vim"))
        s = r.summary()
        assert fake.max_concurrent == 1 and s["max_running"] == 1
        assert (
            s["aborted"] == 0
            and s["requests"] == s["completed"] == s["generations"] == len(fake.generations) - 4
        )
        assert r.reqs[-1].keystroke == KEYS - 1  # the final text was asked for
        body = fake.generations[-1].raw
        assert (
            b'"input_prefix":"' in body and b'": ' not in body
        )  # compact JSON, as llama.vim sends


async def test_twinny_profile_ndjson_against_ollama_fake() -> None:
    async with FakeUpstream(kind="ollama", slots=1, script=SCRIPT) as fake:
        r = await run_target(fake.url, _settings(profile="twinny"))
        s = r.summary()
        assert s["generations"] is None  # Ollama has no /slots
        assert s["completed"] == 1 and s["tokens_delivered"] == 10 and s["aborted"] == KEYS - 1


def test_debounce_drops_keystrokes() -> None:
    assert [k for k, _ in send_times(_settings(debounce_ms=100), 0.0)] == [KEYS - 1]
    assert [k for k, _ in send_times(_settings(debounce_ms=10), 0.0)] == list(range(KEYS))


def test_delivered_tokens_formats() -> None:
    assert delivered_tokens(b'{"content":"a","tokens_predicted":7}') == 7
    assert delivered_tokens(b'data: {"content":"a"}\n\ndata: {"content":"b"}\n\n') == 2
    assert (
        delivered_tokens(
            b'{"response":"a","done":false}\n{"response":"","done":true,"eval_count":3}\n'
        )
        == 3
    )
    oai = (
        b'data: {"choices":[{"text":"x"}]}\n\n'
        b'data: {"choices":[],"usage":{"completion_tokens":4}}\n\n'
        b"data: [DONE]\n\n"
    )
    assert delivered_tokens(oai) == 4


async def test_cli_compare_json_and_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    async with FakeUpstream(slots=2, script=SCRIPT) as a, FakeUpstream(slots=2, script=SCRIPT) as b:
        out = tmp_path / "r.json"
        png = tmp_path / "p.png"
        cmd = [
            sys.executable,
            "-m",
            "llmproxy.proxy",
            "bench",
            "burst",
            a.url,
            "--compare",
            b.url,
            "--keystrokes",
            "3",
            "--bursts",
            "1",
            "--baseline-runs",
            "1",
            "--json-out",
            str(out),
            "--plot",
            str(png),
        ]
        proc = await asyncio.create_subprocess_exec(
            *cmd, stdout=subprocess.PIPE, preexec_fn=child_preexec()
        )
        stdout, _ = await proc.communicate()
        assert proc.returncode == 0
        table = stdout.decode()
        assert a.url in table and b.url in table and "last completion p50 ms" in table
        data = json.loads(out.read_text())
        assert [d["url"] for d in data] == [a.url, b.url]
        assert (
            data[0]["generations"] == len(a.generations) - 4
            and data[1]["generations"] == len(b.generations) - 4
        )
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tokens_for_nobody_skips_the_tasks_that_served_a_client() -> None:
    poller = SlotsPoller(None, "", 0.01)  # type: ignore[arg-type]  # no polling here
    poller.decoded = {(0, 1): 3, (0, 2): 10, (0, 3): 2, (0, 4): 10}
    poller.last_seen = {(0, 1): 1.0, (0, 2): 2.0, (0, 3): 2.5, (0, 4): 4.0}
    # responses read to the end at 2.1 (task 2) and 4.2 (task 4): tasks 1 and 3 were for nobody
    assert poller.unmatched_tokens([2.1, 4.2]) == 5
    assert poller.unmatched_tokens([]) == 25


@pytest.mark.parametrize("type_through", ["on", "off"])
async def test_a_follow_typist_runs_one_generation_per_burst_with_type_through(
    type_through: str,
) -> None:
    """``--typist follow`` asks for a suggestion, then types it a character per keystroke:
    through a proxy with type-through the backend runs the suggestion's generation only."""
    async with (
        FakeUpstream(slots=1, script=SCRIPT, metrics_endpoint=True) as fake,
        run_proxy(fake.url, type_through=type_through) as px,
    ):
        settings = _settings(profile="llama-vim", typist="follow", bursts=2)
        s = (await run_target(px.url, settings)).summary()
        bursts = 2
        typed = bursts * KEYS  # the suggestions are longer than KEYS characters
        assert (s["requests"], s["completed"], s["errors"]) == (bursts + typed, bursts + typed, 0)
        after_baseline = [g for g in fake.generations if g.path == "/infill"][4:]
        assert len(after_baseline) == (bursts if type_through == "on" else bursts + typed)
        assert s["generations"] == len(after_baseline)
        # /metrics, read through the proxy: llama.vim reads every answer, so each generation
        # decoded its 10 tokens
        assert s["tokens_decoded_exact"] and s["tokens_decoded"] == 10 * len(after_baseline)
        px.flush_log()  # metrics are observed as the request log is written
        reused = px.app[METRICS].requests.labels(outcome="reused", route="/infill")._value.get()
        assert reused == (typed if type_through == "on" else 0)


def test_metrics_pages_are_read_as_llama_server_writes_them() -> None:
    page = (
        "# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed, excluding cached\n"
        "# TYPE llamacpp:prompt_tokens_total counter\n"
        "llamacpp:prompt_tokens_total 1.23457e+06\n"
        "llamacpp:prompt_tokens_cached_total 17\n"
        "llamacpp:tokens_predicted_total 4321\n"
    )
    assert counters.parse(page) == {"prompt_tokens": 1234570.0, "tokens_predicted": 4321.0}
    assert counters.parse("llamacpp:tokens_predicted_total 5\n") == {}  # one is missing
    assert counters.spent(None, {"prompt_tokens": 1.0, "tokens_predicted": 2.0}) == {}
    assert counters.spent(
        {"prompt_tokens": 10.0, "tokens_predicted": 2.0},
        {"prompt_tokens": 25.0, "tokens_predicted": 9.0},
    ) == {"prompt_tokens": 15, "tokens_predicted": 7}


async def test_a_follow_typist_types_nothing_after_an_empty_suggestion() -> None:
    empty = lambda _p, _b: Script(tokens=0)  # noqa: E731
    async with FakeUpstream(slots=1, script=empty) as fake:
        settings = _settings(profile="llama-vim", typist="follow", bursts=2)
        result = await run_target(fake.url, settings)
    s = result.summary()
    assert (s["empty_suggestions"], s["failed_bursts"], s["errors"]) == (2, 0, 0)
    assert s["requests"] == 2  # the two suggestions, no keystroke
    assert "empty suggestions, not typed" in format_table([result], follow=True)
