"""Fuzzing gated routes (hypothesis) and keeping secrets out of logs and /llmproxy/status.

The fuzz target is a proxy + fake upstream running in a background thread with its own
event loop (hypothesis drives a synchronous test; http.client sends what it generates).
Every answer must be either the upstream's, relayed (the fake saw the request), or one of
the proxy's documented errors in the envelope; afterwards the proxy is healthy and every
permit is back.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import structlog
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from llmproxy.bench.fake.upstream import FakeUpstream, Script
from llmproxy.proxy.gating.routes import GATED_ROUTES
from tests.helpers.proxy import RunningProxy, run_proxy
from tests.helpers.serve import serve

KEY = "k3y-fuzz"
DOCUMENTED = {400, 401, 403, 413, 429, 499, 502, 503, 504}


class LiveProxy:
    """Fake upstream + proxy served from a thread; ``stop()`` ends both."""

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self.loop.run_until_complete, args=(self._main(),), daemon=True
        )
        self._stop: asyncio.Event | None = None
        self.px: RunningProxy | None = None
        self.fake: FakeUpstream | None = None
        self.logs: list[dict[str, Any]] = []

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        script = lambda _p, _b: Script(tokens=3, token_delay_s=0.001)  # noqa: E731
        async with (
            FakeUpstream(kind="llamacpp", slots=1, script=script, abort_linger_s=0.01) as fake,
            run_proxy(
                fake.url, api_key=KEY, max_body_bytes=4096, max_queue=4, queue_timeout_s=2
            ) as px,
        ):
            self.fake, self.px = fake, px
            self.ready.set()
            await self._stop.wait()

    def start(self) -> None:
        self.thread.start()
        assert self.ready.wait(10)

    def stop(self) -> None:
        assert self._stop is not None
        self.loop.call_soon_threadsafe(self._stop.set)
        self.thread.join(10)
        self.loop.close()

    def call(
        self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
    ) -> tuple[int, bytes]:
        assert self.px is not None
        host, port = self.px.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=20)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()


@pytest.fixture(scope="module")
def live() -> Iterator[LiveProxy]:
    with structlog.testing.capture_logs() as logs:  # the proxy's thread logs here too
        lp = LiveProxy()
        lp.logs = logs
        lp.start()
        yield lp
        lp.stop()


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63)
    | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)
KEYS = st.sampled_from(
    [
        "prompt",
        "input_prefix",
        "input_suffix",
        "messages",
        "stream",
        "n_predict",
        "max_tokens",
        "id_slot",
        "model",
        "options",
        "cache_prompt",
    ]
)
json_bodies = st.dictionaries(KEYS | st.text(max_size=6), json_values, max_size=6).map(
    lambda d: json.dumps(d).encode()
)
bodies = st.one_of(
    json_bodies,
    json_bodies,
    json_bodies,
    st.binary(max_size=200),
    st.binary(min_size=4097, max_size=6000),
)
header_value = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40).map(
    str.strip
)
header_names = st.sampled_from(
    [
        "Content-Type",
        "X-LLMProxy-Session",
        "X-Request-Id",
        "User-Agent",
        "Accept",
        "Accept-Encoding",
        "Connection",
        "X-Forwarded-For",
    ]
) | st.from_regex(r"\AX-[A-Za-z0-9-]{1,12}\Z")
# what a browser adds: a rebinding page's name in Host, a page's Origin (refused: 403)
browser = st.fixed_dictionaries(
    {},
    optional={
        "Host": st.sampled_from(
            ["rebind.attacker.example", "localhost", "127.0.0.1:1", "[::1]", "a.localhost", "x y"]
        )
        | header_value,
        "Origin": st.sampled_from(
            ["https://evil.example", "null", "http://127.0.0.1", "file://", "http://localhost:1"]
        )
        | header_value,
    },
)
GOOD = [{"Authorization": f"Bearer {KEY}"}, {"api-key": KEY}]
auth = st.sampled_from(GOOD * 4 + [{}, {"Authorization": "Bearer nope"}, {"api-key": KEY + "x"}])


@settings(
    max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    path=st.sampled_from(sorted(GATED_ROUTES)),
    body=bodies,
    extra=st.dictionaries(header_names, header_value, max_size=5),
    creds=auth,
    web=browser,
)
def test_fuzz_gated_routes(
    live: LiveProxy,
    path: str,
    body: bytes,
    extra: dict[str, str],
    creds: dict[str, str],
    web: dict[str, str],
) -> None:
    assert live.fake is not None
    before = len(live.fake.received)
    status, data = live.call("POST", path, body, {**extra, **creds, **web})
    event(f"status {status}")
    try:
        parsed: Any = json.loads(data)
    except ValueError:
        parsed = None
    err = parsed.get("error") if isinstance(parsed, dict) else None
    if isinstance(err, dict) and err.get("src") == "llmproxy":
        assert status in DOCUMENTED, (status, data)
        assert set(err) == {"message", "type", "code", "src"} and err["code"] == status
        assert isinstance(err["message"], str) and isinstance(err["type"], str)
        if status in (401, 403):  # refused before any upstream work
            assert len(live.fake.received) == before, (status, data)
    else:  # relayed: it reached the upstream
        assert len(live.fake.received) > before, (status, data)


def test_after_fuzzing_healthy_and_permits_back(live: LiveProxy) -> None:
    assert live.px is not None
    status, _ = live.call("GET", "/llmproxy/health")
    assert status == 200
    for _ in range(500):
        code, data = live.call("GET", "/llmproxy/status", headers={"api-key": KEY})
        st_ = json.loads(data)
        if st_["permits"]["free"] == 1 and st_["queue"]["depth"] == 0 and st_["jobs"] == 0:
            break
    assert code == 200 and st_["permits"] == {"total": 1, "free": 1, "held": 0}
    status, _ = live.call("POST", "/completion", b'{"prompt":"x"}', {"api-key": KEY})
    assert status == 200
    # no traceback, no error of the proxy's own: hostile input is the client's mistake
    assert any(e.get("event") == "upstream adapter ready" for e in live.logs)  # captured
    assert not [e for e in live.logs if e.get("log_level") in ("error", "critical")], [
        e for e in live.logs if e.get("log_level") in ("error", "critical")
    ][:3]
    assert not [e for e in live.logs if "exc_info" in e or "exception" in e][:3]


SECRET = "hf_SECRETtokenDoNotLog1234567890"
SECRET2 = "sk-ANOTHERsecretValue0987654321"


async def test_secrets_never_reach_logs_or_status(
    fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    async with run_proxy(fake.url, api_key=SECRET) as px:
        with structlog.testing.capture_logs() as logs:
            for hdrs in (
                {"Authorization": f"Bearer {SECRET}"},
                {"api-key": SECRET},
                {"Authorization": f"Bearer {SECRET2}"},
                {"api-key": SECRET2, "X-LLMProxy-Session": SECRET2},
            ):
                async with http.post(
                    px.url + "/completion", json={"prompt": "x"}, headers=hdrs
                ) as r:
                    assert r.status in (200, 401)
            async with http.get(px.url + "/llmproxy/status", headers={"api-key": SECRET}) as r:
                status_text = await r.text()
            px.flush_log()
        assert any(e.get("event") == "request" for e in logs), "no request line captured"
        dumped = "\n".join(repr(e) for e in logs)
        assert SECRET not in dumped and SECRET2 not in dumped
        assert SECRET not in status_text and SECRET2 not in status_text
    async with run_proxy(
        fake.url
    ) as px:  # no key configured: Authorization is the upstream's business
        fake.script = lambda _p, _b: Script(tokens=500, token_delay_s=0.01)
        with structlog.testing.capture_logs() as logs:
            task = asyncio.create_task(
                http.post(
                    px.url + "/completion",
                    json={"prompt": "x"},
                    headers={"Authorization": f"Bearer {SECRET}", "User-Agent": SECRET2},
                )
            )
            await fake.wait_for(lambda f: f.slot_busy == [True])
            async with http.get(px.url + "/llmproxy/status") as r:
                status_text = await r.text()
            # the request is visible, its material is not
            assert json.loads(status_text)["inflight"], status_text
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await asyncio.wait_for(px.state.pool.wait_quiescent(), 5)
            px.flush_log()
        assert any(e.get("event") == "request" for e in logs), "no request line captured"
        dumped = "\n".join(repr(e) for e in logs)
        assert SECRET not in dumped and SECRET2 not in dumped
        assert SECRET not in status_text and SECRET2 not in status_text


async def test_secrets_not_in_serve_stderr(tmp_path: Path, fake: FakeUpstream) -> None:
    async with serve(
        tmp_path, "--upstream", fake.url, "--api-key", SECRET, "--log-level", "debug"
    ) as (proc, url):
        async with aiohttp.ClientSession() as http:
            for hdrs in (
                {"Authorization": f"Bearer {SECRET}"},
                {"api-key": SECRET2},
                {"Authorization": SECRET2},
            ):
                async with http.post(url + "/completion", json={"prompt": "x"}, headers=hdrs) as r:
                    await r.read()
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 10)
        err = (await proc.stderr.read()).decode()
    assert '"event": "request"' in err or '"event":"request"' in err
    assert SECRET not in err and SECRET2 not in err
