"""Several models across upstreams (pool/models.py): a request goes only to the upstreams
that serve its model, an unknown one is a 404 naming the known ones, a request without a
model goes to its route's default, and a reload's new lists apply. Fake llama-servers on
loopback behind the real proxy, and the rules on real members without sockets."""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import structlog

from llmproxy.bench.fake.upstream import FakeUpstream, Script
from llmproxy.proxy.errors import UnknownModel
from llmproxy.proxy.gating.gate import Gate
from llmproxy.proxy.http.picture import picture
from llmproxy.proxy.pool.member import Member
from llmproxy.proxy.pool.models import asked, serving
from llmproxy.proxy.settings import ProxySettings
from llmproxy.proxy.state import RELOAD
from llmproxy.proxy.status_cmd import render
from llmproxy.proxy.upstream.adapters.base import Adapter
from llmproxy.proxy.upstreams import UpstreamSpec
from tests.helpers.llama_fakes import LoadingFake
from tests.helpers.net import wait_until
from tests.helpers.proxy import RunningProxy, request_events, run_proxy

CHAT = "/v1/chat/completions"


def quick(_path: str, _body: dict[str, Any]) -> Script:
    return Script(tokens=3, token_delay_s=0.002)


@contextlib.asynccontextmanager
async def fronted(
    tables: list[dict[str, Any]], slots: int = 1, **overrides: Any
) -> AsyncIterator[tuple[list[FakeUpstream], RunningProxy]]:
    """One fake llama-server per table (its ``reports``: what its /v1/models lists), behind
    one proxy whose ``[[upstreams]]`` are the tables' other keys (url filled in)."""
    async with contextlib.AsyncExitStack() as stack:
        fakes = []
        specs = []
        for i, table in enumerate(tables):
            table = dict(table)
            reports = table.pop("reports", ("fake",))
            script = table.pop("script", quick)
            fake = FakeUpstream(slots=slots, models=reports, script=script)
            fakes.append(await stack.enter_async_context(fake))
            specs.append({"url": fake.url, "name": f"u{i}", **table})
        px = await stack.enter_async_context(run_proxy(None, upstreams=specs, **overrides))
        yield fakes, px


async def post(
    http: aiohttp.ClientSession,
    px: RunningProxy,
    path: str,
    model: str | None,
    rid: str,
    text: str = "",
) -> tuple[int, Any]:
    """One request with id and session ``rid``; its prompt ``rid`` + ``text``."""
    prompt = rid + text
    body: dict[str, Any] = (
        {"messages": [{"role": "user", "content": prompt}]} if path == CHAT else {"prompt": prompt}
    )
    if model is not None:
        body["model"] = model
    headers = {"X-LLMProxy-Session": rid, "X-Request-Id": rid}  # nothing superseded
    async with http.post(px.url + path, json=body, headers=headers) as r:
        return r.status, await r.json(content_type=None)


def models_at(fake: FakeUpstream) -> list[str | None]:
    """The ``model`` of every generation that reached ``fake`` (None: the body had none)."""
    return [r.body.get("model") if r.body else None for r in fake.generations]


# -- the rules, on real members (no sockets) ---------------------------------------------


def member(session: aiohttp.ClientSession, i: int, stated: Any, reports: tuple[str, ...]) -> Member:
    spec = UpstreamSpec(url=f"http://127.0.0.1:{9000 + i}", name=f"u{i}", models=stated)
    settings = ProxySettings()
    adapter = Adapter(spec.url, session, settings)
    adapter.models = reports
    return Member(spec, settings, session, adapter, Gate(1))


# (each upstream: (stated models or None, what its /v1/models reported)), name -> who serves
RULES: list[tuple[list[tuple[Any, tuple[str, ...]]], str | None, list[int] | str]] = [
    # nothing stated, single-model servers: any name, a name one reports goes only there
    ([(None, ()), (None, ())], "anything", [0, 1]),
    ([(None, ("a.gguf",)), (None, ("b.gguf",))], "b.gguf", [1]),
    ([(None, ("a.gguf",)), (None, ("b.gguf",))], "gpt-4", [0, 1]),
    ([(None, ("a.gguf",)), (None, ("b.gguf",))], None, [0, 1]),
    # stated lists: exactly those; an open single-model server takes the other names
    ([(["fim"], ()), (["chat"], ())], "fim", [0]),
    ([(["fim"], ()), (["chat", "fim"], ())], "fim", [0, 1]),
    ([(["fim"], ()), (None, ("big.gguf",))], "fim", [0]),
    ([(["fim"], ()), (None, ("big.gguf",))], "gpt-4", [1]),
    ([(["fim"], ("x",)), (["chat"], ())], "x", "unknown"),  # stated wins over reported
    ([(["fim"], ()), (["chat"], ())], "gpt-4", "unknown"),
    # several reported (Ollama, a router): exactly those
    ([(None, ("a", "b"))], "c", "unknown"),
    ([(None, ("a", "b")), (None, ("c",))], "z", [1]),
]


@pytest.mark.parametrize(("upstreams", "name", "expected"), RULES)
async def test_which_upstreams_serve_a_name(
    http: aiohttp.ClientSession,
    upstreams: list[tuple[Any, tuple[str, ...]]],
    name: str | None,
    expected: list[int] | str,
) -> None:
    members = [member(http, i, stated, reports) for i, (stated, reports) in enumerate(upstreams)]
    if expected == "unknown":
        with pytest.raises(UnknownModel) as err:
            serving(members, name)
        listed = sorted({m for u in members for m in u.models})
        assert err.value.status == 404 and err.value.message.endswith(", ".join(listed))
    else:
        assert [members.index(m) for m in serving(members, name)] == expected


async def test_draining_upstreams_serve_nothing(http: aiohttp.ClientSession) -> None:
    fim, chat = member(http, 0, ["fim"], ()), member(http, 1, ["chat"], ())
    chat.draining = True
    with pytest.raises(UnknownModel):
        serving([fim, chat], "chat")
    assert asked("/completion", {}, {}, [chat, fim]) == "fim"  # chat's is first, but leaving


async def test_the_model_a_request_asks_for(http: aiohttp.ClientSession) -> None:
    plain = [member(http, 0, None, ("a.gguf",))]
    stated = [member(http, 0, None, ("a.gguf",)), member(http, 1, ["fim", "x"], ())]
    defaults = {"chat": "big"}
    assert asked("/completion", {"model": "m"}, defaults, stated) == "m"  # the body's
    assert asked(CHAT, {}, defaults, stated) == "big"  # its route class's default
    assert asked(CHAT, {"model": ""}, defaults, stated) == "big"
    assert asked("/infill", {}, defaults, stated) == "fim"  # the first stated model
    assert asked("/infill", {}, defaults, plain) is None  # none stated: any upstream


# -- through the proxy --------------------------------------------------------------------

STRESS = [
    {"models": ["fim"]},
    {"models": ["chat"]},
    {"models": ["chat", "fim"]},
]
SERVES = [{"fim"}, {"chat"}, {"chat", "fim"}]


@pytest.mark.parametrize("route", ["cache", "session", "least-busy", "round-robin"])
async def test_every_request_lands_on_an_upstream_serving_its_model(
    http: aiohttp.ClientSession, route: str
) -> None:
    """Random programs of editors and chats over three upstreams, two with one model each
    and one with both: every generation reaches an upstream that serves its model (no
    model: the first stated, fim), an unknown name reaches none, and each upstream runs at
    most its slots at once."""
    rng = random.Random(f"models-{route}")

    def varied(_path: str, _body: dict[str, Any]) -> Script:
        return Script(tokens=rng.randint(1, 4), token_delay_s=rng.choice([0.0, 0.002, 0.01]))

    tables = [{**t, "script": varied} for t in STRESS]
    async with fronted(tables, slots=2, route=route, classes=rng.choice(["on", "off"])) as (
        fakes,
        px,
    ):
        asked_for: dict[str, str | None] = {}

        async def client(k: int) -> list[tuple[str, int, Any]]:
            results = []
            for i in range(12):
                path = rng.choice(["/completion", "/infill", CHAT])
                model = rng.choice(["fim", "chat", None, "fim", "chat", "gpt-4"])
                rid = f"c{k}-{i}"
                asked_for[rid] = model
                text = rng.choice(["", "x" * 100, "y" * 300])  # cache: prompt blocks
                status, body = await post(http, px, path, model, rid, text)
                results.append((rid, status, body))
            return results

        with structlog.testing.capture_logs() as logs:
            runs = await asyncio.gather(*(client(k) for k in range(6)))
            px.flush_log()
        outcomes = [r for run in runs for r in run]
        for rid, status, body in outcomes:
            if asked_for[rid] == "gpt-4":
                assert status == 404, (rid, body)
                assert body["error"]["message"].endswith("models: chat, fim")
            else:
                assert status == 200, (rid, body)
        for fake, serves in zip(fakes, SERVES, strict=True):
            assert fake.max_concurrent <= 2
            for model in models_at(fake):
                assert (model or "fim") in serves, (model, serves)
        reached = sum(len(f.generations) for f in fakes)
        assert reached == sum(1 for rid in asked_for if asked_for[rid] != "gpt-4")
        lines = request_events(logs)
        for rid, model in asked_for.items():
            assert lines[rid]["model"] == (model or "fim")
        pool = px.state.pool
        await pool.wait_quiescent()
        assert all(m.gate.free == m.gate.total for m in pool.members)


async def test_a_model_waits_only_for_its_own_upstreams(http: aiohttp.ClientSession) -> None:
    """A completion for fim behind a queued one for chat (whose upstream is busy) is granted
    at once on fim's upstream: the queue is FIFO among the waiters that want the same
    upstreams, not across models."""
    release = asyncio.Event()

    def held(_path: str, body: dict[str, Any]) -> Script:
        return Script(tokens=2, hold=release if body.get("prompt") == "long" else None)

    tables = [{"models": ["fim"], "script": held}, {"models": ["chat"], "script": held}]
    async with fronted(tables, classes="off") as ([fim, chat], px):
        pool = px.state.pool
        running = asyncio.create_task(post(http, px, "/completion", "chat", "long"))
        await chat.wait_for(lambda f: len(f.generations) == 1)
        queued = asyncio.create_task(post(http, px, "/completion", "chat", "next"))
        await wait_until(lambda: len(pool.queue) == 1, what="the second chat queued")
        # a prompt of whole blocks: --route cache looks it up among the upstreams left
        behind = asyncio.create_task(post(http, px, "/completion", "chat", "then", "x" * 600))
        await wait_until(lambda: len(pool.queue) == 2, what="the third chat queued")
        status, _ = await post(http, px, "/completion", "fim", "other model")
        assert status == 200 and models_at(fim) == ["fim"]
        assert not queued.done() and len(pool.queue) == 2  # still waiting for chat's slot
        release.set()
        assert (await running)[0] == 200 and (await queued)[0] == 200
        assert (await behind)[0] == 200
        assert models_at(chat) == ["chat", "chat", "chat"]


async def test_an_unknown_model_is_a_404_naming_the_known_ones(
    http: aiohttp.ClientSession,
) -> None:
    async with fronted([{"models": ["fim"]}, {"models": ["chat", "embed"]}]) as (fakes, px):
        status, body = await post(http, px, "/completion", "gpt-4", "u1")
        assert status == 404
        assert body == {
            "error": {
                "message": "model 'gpt-4' is not served here; models: chat, embed, fim",
                "type": "not_found_error",
                "code": 404,
                "src": "llmproxy",
            }
        }
        assert all(not f.generations for f in fakes)
        async with http.get(px.url + "/llmproxy/metrics") as r:
            metrics = await r.text()
        assert 'llmproxy_model_requests_total{model="other",outcome="rejected"} 1.0' in metrics


async def test_a_single_model_server_that_states_nothing_takes_any_name(
    http: aiohttp.ClientSession,
) -> None:
    """Its learnt id steers the requests that name it, but no name is refused."""
    tables = [{"models": ["fim"]}, {"reports": ["big.gguf"]}]
    async with fronted(tables) as ([fim, big], px):
        for i, model in enumerate(["fim", "gpt-4", "big.gguf", "fim", "anything"]):
            assert (await post(http, px, "/completion", model, f"r{i}"))[0] == 200
        assert models_at(fim) == ["fim", "fim"]
        assert models_at(big) == ["gpt-4", "big.gguf", "anything"]
        async with http.get(px.url + "/llmproxy/status") as r:
            ups = (await r.json())["upstreams"]
        assert [(u["models"], u["models_from"], u["any_model"]) for u in ups] == [
            (["fim"], "config", False),
            (["big.gguf"], "upstream", True),
        ]
        text = render(picture(px.state), px.url)  # ``llmproxy status``
        assert "upstream u0 (llamacpp, models fim, 1/1 permits free)" in text
        assert "upstream u1 (llamacpp, 1/1 permits free)" in text


async def test_learnt_ids_route_the_names_they_report(http: aiohttp.ClientSession) -> None:
    tables = [{"reports": ["small.gguf"]}, {"reports": ["large.gguf"]}]
    async with fronted(tables, route="round-robin") as ([small, large], px):
        for i in range(4):
            assert (await post(http, px, "/completion", "large.gguf", f"l{i}"))[0] == 200
        assert models_at(large) == ["large.gguf"] * 4 and not small.generations
        for i in range(4):  # no model, or one nobody reports: any upstream, by turns, so
            model = None if i % 2 else "gpt-4"  # small catches up with large's four
            assert (await post(http, px, "/completion", model, f"a{i}"))[0] == 200
        assert models_at(small) == ["gpt-4", None, "gpt-4", None]
        assert len(large.generations) == 4


async def test_a_request_without_a_model_goes_to_its_routes_default(
    http: aiohttp.ClientSession,
) -> None:
    tables = [{"models": ["fim"]}, {"models": ["chat"]}]
    async with fronted(tables, default_model={"chat": "chat"}) as ([fim, chat], px):
        with structlog.testing.capture_logs() as logs:
            assert (await post(http, px, CHAT, None, "c"))[0] == 200  # chat's default
            assert (await post(http, px, "/infill", None, "i"))[0] == 200  # the first stated
            assert (await post(http, px, "/completion", None, "p"))[0] == 200
            px.flush_log()
        assert models_at(chat) == [None] and models_at(fim) == [None, None]
        lines = request_events(logs)
        assert [lines[r]["model"] for r in "cip"] == ["chat", "fim", "fim"]
        async with http.get(px.url + "/llmproxy/metrics") as r:
            metrics = await r.text()
        assert 'llmproxy_model_requests_total{model="fim",outcome="completed"} 2.0' in metrics


async def test_a_reload_applies_changed_model_lists(http: aiohttp.ClientSession) -> None:
    """Swapped lists route at once; a model dropped from every list is unknown, its queued
    requests included."""
    release = asyncio.Event()

    def held(_path: str, body: dict[str, Any]) -> Script:
        return Script(tokens=2, hold=release if body.get("prompt") == "long" else None)

    tables = [{"models": ["fim"], "script": held}, {"models": ["chat"], "script": held}]
    async with fronted(tables, classes="off") as ([a, b], px):
        pool = px.state.pool
        running = asyncio.create_task(post(http, px, "/completion", "fim", "long"))
        await a.wait_for(lambda f: len(f.generations) == 1)
        queued = asyncio.create_task(post(http, px, "/completion", "fim", "waits"))
        await wait_until(lambda: len(pool.queue) == 1, what="the second fim queued")

        specs = [{"url": a.url, "name": "u0", "models": ["old"]}]
        specs.append({"url": b.url, "name": "u1", "models": ["fim", "chat"]})
        px.app[RELOAD](ProxySettings(upstreams=specs))
        await wait_until(lambda: pool.members[0].models == ("old",), what="the reload")
        # the queued fim goes to b now, while a still runs the first one
        assert (await queued)[0] == 200 and models_at(b) == ["fim"]
        status, body = await post(http, px, "/completion", "gone", "g")
        assert status == 404 and body["error"]["message"].endswith("models: chat, fim, old")
        release.set()
        assert (await running)[0] == 200

        px.app[RELOAD](ProxySettings(upstreams=[{"url": a.url, "name": "u0"}, specs[1]]))
        await wait_until(lambda: pool.members[0].any_model, what="the second reload")
        assert (await post(http, px, "/completion", "old", "o"))[0] == 200  # a takes any
        assert models_at(a) == ["fim", "old"]
        async with http.get(px.url + "/llmproxy/status") as r:
            ups = (await r.json())["upstreams"]
        assert [u["models"] for u in ups] == [["fake"], ["fim", "chat"]]


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        ({"upstreams": [{"url": "http://127.0.0.1:1", "models": []}]}, "at least one model"),
        ({"upstreams": [{"url": "http://127.0.0.1:1", "models": [" "]}]}, "non-empty name"),
        ({"upstreams": [{"url": "http://127.0.0.1:1", "models": ["a", "a"]}]}, "a model twice"),
        ({"default_model": {"fim": "a"}}, "'complete', 'chat' or 'bulk' (not 'fim')"),
        ({"default_model": "chat="}, "an empty name"),
    ],
)
def test_model_settings_say_what_is_wrong(overrides: dict[str, Any], says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        ProxySettings(**overrides)


def test_default_model_reads_a_flag_value() -> None:
    settings = ProxySettings(default_model="complete=qwen-fim, chat=gpt-oss")
    assert settings.default_model == {"complete": "qwen-fim", "chat": "gpt-oss"}


async def test_a_llama_server_loading_at_start_reports_its_model_once_loaded(
    http: aiohttp.ClientSession,
) -> None:
    """Detection gave up while it loaded: it takes any name meanwhile (it reported none),
    and the id its /v1/models reports once it is up steers the requests naming it."""
    async with (
        LoadingFake(kind="llamacpp", models=["late.gguf"], script=quick) as late,
        FakeUpstream(models=["other.gguf"], script=quick) as other,
    ):
        specs = [{"url": late.url, "name": "late"}, {"url": other.url, "name": "other"}]
        async with run_proxy(None, upstreams=specs, route="least-busy") as px:
            member = px.state.pool.members[0]
            assert member.models == () and member.any_model
            late.ready.set()
            await asyncio.wait_for(member.adapter.known.wait(), 10)
            assert member.models == ("late.gguf",)
            for i in range(3):
                assert (await post(http, px, "/completion", "late.gguf", f"r{i}"))[0] == 200
            assert models_at(late) == ["late.gguf"] * 3 and not other.generations


async def test_a_queued_request_whose_model_a_reload_drops_gets_the_404(
    http: aiohttp.ClientSession,
) -> None:
    release = asyncio.Event()

    def held(_path: str, body: dict[str, Any]) -> Script:
        return Script(tokens=2, hold=release if body.get("prompt") == "long" else None)

    async with fronted([{"models": ["fim"], "script": held}], classes="off") as ([a], px):
        pool = px.state.pool
        running = asyncio.create_task(post(http, px, "/completion", "fim", "long"))
        await a.wait_for(lambda f: len(f.generations) == 1)
        queued = asyncio.create_task(post(http, px, "/completion", "fim", "waits"))
        await wait_until(lambda: len(pool.queue) == 1, what="the second fim queued")
        px.app[RELOAD](ProxySettings(upstreams=[{"url": a.url, "name": "u0", "models": ["x"]}]))
        status, body = await queued
        assert status == 404 and body["error"]["message"].endswith("models: x")
        assert not pool.queue and len(a.generations) == 1
        release.set()
        assert (await running)[0] == 200  # the one running there is left to finish


async def test_a_listed_model_is_counted_by_name_whatever_the_outcome(
    http: aiohttp.ClientSession,
) -> None:
    """A request for a listed model that never got a permit (a queue timeout) is counted
    under its model, not as 'other'."""
    release = asyncio.Event()

    def held(_path: str, body: dict[str, Any]) -> Script:
        return Script(tokens=2, hold=release if body.get("prompt") == "long" else None)

    tables = [{"models": ["fim"], "script": held}]
    async with fronted(tables, queue_timeout_s=0.2, log_flush_s=0) as ([a], px):
        running = asyncio.create_task(post(http, px, "/completion", "fim", "long"))
        await a.wait_for(lambda f: len(f.generations) == 1)
        assert (await post(http, px, "/completion", "fim", "late"))[0] == 503
        release.set()
        assert (await running)[0] == 200
        await px.state.pool.wait_quiescent()
        px.flush_log()
        async with http.get(px.url + "/llmproxy/metrics") as r:
            lines = (await r.text()).splitlines()
        counted = [ln for ln in lines if ln.startswith("llmproxy_model_requests_total{")]
        assert sorted(counted) == [
            'llmproxy_model_requests_total{model="fim",outcome="completed"} 1.0',
            'llmproxy_model_requests_total{model="fim",outcome="rejected"} 1.0',
        ]
