"""The HTTP API through a real server and model: llama-server shapes, OpenAI shapes, errors."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

PROMPT = "def fibonacci(n):\n"
GREEDY = {"temperature": 0, "seed": 1}


def sse_events(raw: str) -> list[Any]:
    out = []
    for block in raw.split("\n\n"):
        block = block.strip()
        if not block:
            continue
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def post_stream(url: str, body: dict[str, Any]) -> tuple[int, str, str]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        return r.status, r.headers.get("Content-Type", ""), await r.text()


def test_health_props_models(backend: Any) -> None:
    assert backend.get("/health") == (200, {"status": "ok"})
    status, props = backend.get("/props")
    assert status == 200
    assert props["total_slots"] == 1
    assert props["model_path"].endswith(".gguf") or props["model_path"]
    assert props["default_generation_settings"]["n_ctx"] == 2048
    assert props["engine"]["name"] == backend.engine
    status, models = backend.get("/v1/models")
    assert status == 200 and models["object"] == "list"
    assert models["data"][0]["id"] == props["model_alias"]
    slots = backend.slots()
    assert [s["id"] for s in slots] == [0]
    assert slots[0]["is_processing"] is False


def test_completion(backend: Any) -> None:
    status, body = backend.post("/completion", {"prompt": PROMPT, "n_predict": 8, **GREEDY})
    assert status == 200, body
    assert isinstance(body["content"], str) and body["content"]
    assert body["stop"] is True
    assert 1 <= body["tokens_predicted"] <= 8
    assert body["tokens_evaluated"] > 0
    assert body["stop_type"] in ("eos", "limit")
    assert body["id_slot"] == 0
    t = body["timings"]
    assert t["predicted_n"] == body["tokens_predicted"] and t["predicted_ms"] > 0


async def test_completion_stream_matches(backend: Any) -> None:
    req = {"prompt": PROMPT, "n_predict": 12, **GREEDY}
    _, whole = backend.post("/completion", req)
    status, ctype, raw = await post_stream(backend.url + "/completion", {**req, "stream": True})
    assert status == 200 and ctype.startswith("text/event-stream")
    events = sse_events(raw)
    assert events[-1]["stop"] is True
    assert all(e["stop"] is False for e in events[:-1])
    assert "timings" in events[-1] and events[-1]["tokens_predicted"] == whole["tokens_predicted"]
    assert "".join(e["content"] for e in events) == whole["content"]


def test_stop_word(backend: Any) -> None:
    req = {"prompt": "1, 2, 3, 4, 5,", "n_predict": 16, **GREEDY}
    _, base = backend.post("/completion", req)
    text = base["content"]
    if len(text) < 6:
        pytest.skip(f"model output too short to pick a stop word: {text!r}")
    word = text[3:6]
    idx = text.find(word)
    status, body = backend.post("/completion", {**req, "stop": [word]})
    assert status == 200
    assert body["content"] == text[:idx]
    assert body["stop_type"] == "word" and body["stopping_word"] == word


async def test_stop_word_stream_never_leaks(backend: Any) -> None:
    req = {"prompt": "1, 2, 3, 4, 5,", "n_predict": 16, **GREEDY}
    _, base = backend.post("/completion", req)
    text = base["content"]
    if len(text) < 6:
        pytest.skip("model output too short")
    word = text[3:6]
    _, _, raw = await post_stream(
        backend.url + "/completion", {**req, "stop": [word], "stream": True}
    )
    events = sse_events(raw)
    assert "".join(e["content"] for e in events) == text[: text.find(word)]
    assert events[-1]["stop_type"] == "word"


@pytest.mark.parametrize("stream", [False, True])
async def test_infill(backend: Any, stream: bool) -> None:
    req = {
        "input_prefix": "def add(a, b):\n    ",
        "input_suffix": "\n\nprint(add(1, 2))\n",
        "input_extra": [{"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n"}],
        "prompt": "return",
        "n_predict": 8,
        "t_max_predict_ms": 2000,
        "stream": stream,
        **GREEDY,
    }
    if not stream:
        status, body = backend.post("/infill", req)
        assert status == 200, body
        assert isinstance(body["content"], str) and body["stop"] is True
        assert body["tokens_predicted"] <= 8
    else:
        status, _, raw = await post_stream(backend.url + "/infill", req)
        assert status == 200
        assert sse_events(raw)[-1]["stop"] is True


FIELDS_ASKED = [
    "timings/predicted_n",
    "content",
    "nope",
    "content/x",
    "timings/nope",
    "",
    "tokens_cached",
    "generation_settings/n_predict",
    "truncated",
    "timings/prompt_n",
    "content",
]
FIELDS_GIVEN = [
    "timings/predicted_n",
    "content",
    "tokens_cached",
    "generation_settings/n_predict",
    "truncated",
    "timings/prompt_n",
]


@pytest.mark.parametrize("route", ["/completion", "/infill"])
@pytest.mark.parametrize("stream", [False, True])
async def test_response_fields_narrow_the_final_answer(
    backend: Any, route: str, stream: bool
) -> None:
    """As llama-server (llama.vim sends ``response_fields``): the final object holds only the
    paths asked for that resolve, each under its whole "/"-separated path, in the order
    asked; the partial events of a stream stay whole; an empty list means everything."""
    req = {
        "prompt": PROMPT,
        "input_prefix": "def add(a, b):\n    ",
        "input_suffix": "\n",
        "n_predict": 4,
        "stream": stream,
        **GREEDY,
    }
    if stream:
        status, _, raw = await post_stream(
            backend.url + route, {**req, "response_fields": FIELDS_ASKED}
        )
        assert status == 200, raw
        *partial, final = sse_events(raw)
        assert partial and all(e["stop"] is False and e["id_slot"] == 0 for e in partial), partial
        status, _, raw = await post_stream(backend.url + route, {**req, "response_fields": []})
        full = sse_events(raw)[-1]
    else:
        status, final = backend.post(route, {**req, "response_fields": FIELDS_ASKED})
        assert status == 200, final
        status, full = backend.post(route, {**req, "response_fields": []})
    assert status == 200 and full["stop"] is True and "generation_settings" in full, full
    assert list(final) == FIELDS_GIVEN, final
    assert final == {
        "timings/predicted_n": full["timings"]["predicted_n"],
        "content": full["content"],
        "tokens_cached": full["tokens_cached"],
        "generation_settings/n_predict": 4,
        "truncated": full["truncated"],
        "timings/prompt_n": final["timings/prompt_n"],  # differs: the prompt cache
    }
    assert isinstance(final["timings/prompt_n"], int) and final["timings/prompt_n"] >= 0


def test_response_fields_bad_type_and_oai_routes(backend: Any) -> None:
    """A malformed ``response_fields`` is a 400, as any malformed field here; the OpenAI
    routes do not read it (as llama-server)."""
    for bad in ("content", ["content", 1], {"content": True}):
        status, body = backend.post(
            "/completion", {"prompt": PROMPT, "n_predict": 1, "response_fields": bad}
        )
        _envelope(status, body, 400)
        assert "response_fields" in body["error"]["message"]
    status, body = backend.post(
        "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "response_fields": ["content"]}
    )
    assert status == 200 and body["object"] == "text_completion" and "choices" in body, body


def test_infill_warmup_fills_the_prompt_cache(backend: Any) -> None:
    """llama.vim's warm-up: the context chunks with ``n_predict: 0`` answer at once with no
    tokens, and (llama-cpp) leave them in the cache: the next completion with the same
    chunks evaluates only its own part of the prompt."""
    extra = [
        {"filename": f"m{i}.py", "text": f"def helper_{i}(x):\n    return x * {i} + {i}\n" * 4}
        for i in range(3)
    ]
    status, warm = backend.post(
        "/infill",
        {
            "input_extra": extra,
            "input_prefix": "",
            "input_suffix": "",
            "prompt": "",
            "n_predict": 0,
            "cache_prompt": True,
            **GREEDY,
        },
    )
    assert status == 200, warm
    assert warm["content"] == "" and warm["tokens_predicted"] == 0 and warm["stop"] is True
    status, body = backend.post(
        "/infill",
        {
            "input_extra": extra,
            "input_prefix": "def main():\n    ",
            "input_suffix": "\n",
            "prompt": "print(",
            "n_predict": 4,
            "cache_prompt": True,
            **GREEDY,
        },
    )
    assert status == 200, body
    if backend.engine == "llama-cpp":  # the torch engine keeps no cache between requests
        assert (
            body["timings"]["prompt_n"] < body["tokens_evaluated"] - warm["tokens_evaluated"] // 2
        )


def test_v1_completions(backend: Any) -> None:
    status, body = backend.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 8, **GREEDY})
    assert status == 200, body
    assert body["object"] == "text_completion"
    choice = body["choices"][0]
    assert isinstance(choice["text"], str) and choice["finish_reason"] in ("stop", "length")
    assert body["usage"]["completion_tokens"] <= 8
    assert (
        body["usage"]["total_tokens"]
        == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
    )


async def test_v1_completions_stream(backend: Any) -> None:
    req = {"prompt": PROMPT, "max_tokens": 8, **GREEDY}
    _, whole = backend.post("/v1/completions", req)
    status, _, raw = await post_stream(backend.url + "/v1/completions", {**req, "stream": True})
    assert status == 200
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]


def test_chat(backend: Any) -> None:
    req = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, **GREEDY}
    status, body = backend.post("/v1/chat/completions", req)
    assert status == 200, body
    assert body["object"] == "chat.completion"
    msg = body["choices"][0]["message"]
    assert msg["role"] == "assistant" and isinstance(msg["content"], str)
    assert body["choices"][0]["finish_reason"] in ("stop", "length")


async def test_chat_stream(backend: Any) -> None:
    req = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, **GREEDY}
    _, whole = backend.post("/v1/chat/completions", req)
    status, _, raw = await post_stream(
        backend.url + "/v1/chat/completions", {**req, "stream": True}
    )
    assert status == 200
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[0]["choices"][0]["delta"].get("role") == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == whole["choices"][0]["message"]["content"]


def _envelope(status: int, body: Any, code: int) -> None:
    assert status == code, body
    assert body["error"]["code"] == code and body["error"]["message"] and body["error"]["type"]


def test_bad_input(backend: Any) -> None:
    _envelope(*backend.post("/completion", b"{not json"), 400)
    _envelope(*backend.post("/completion", b"[1, 2]"), 400)
    _envelope(
        *backend.post("/completion", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"), 400
    )  # deep nesting
    _envelope(*backend.post("/completion", {"n_predict": 4}), 400)  # no prompt
    _envelope(*backend.post("/completion", {"prompt": "x", "temperature": "hot"}), 400)
    _envelope(*backend.post("/completion", {"prompt": "x", "id_slot": 7}), 400)
    _envelope(*backend.post("/nope", {}), 404)
    _envelope(*backend.get("/nope"), 404)
    _envelope(*backend.post("/v1/completions", {"prompt": "x", "model": "no-such-model"}), 404)
    _envelope(*backend.post("/v1/chat/completions", {"messages": "hi"}), 400)
    # beyond the context (n_ctx 2048): a long prompt, and n_predict past the end
    status, body = backend.post("/completion", {"prompt": "hello " * 3000, "n_predict": 4})
    _envelope(status, body, 400)
    assert "context" in body["error"]["message"]
    # what Python's json reads but the model cannot take: NaN / inf numbers, an unpaired
    # surrogate (an editor cutting its text inside an emoji), token ids outside the vocabulary
    _envelope(*backend.post("/completion", b'{"prompt": "x", "temperature": NaN}'), 400)
    _envelope(*backend.post("/infill", b'{"input_prefix": "x = ", "t_max_predict_ms": NaN}'), 400)
    _envelope(*backend.post("/completion", b'{"prompt": "x", "top_p": 1e400}'), 400)
    _envelope(
        *backend.post("/completion", b'{"prompt": "x", "temperature": 1' + b"0" * 400 + b"}"), 400
    )
    _envelope(
        *backend.post(
            "/infill", b'{"input_prefix": "x", "t_max_predict_ms": 1' + b"0" * 400 + b"}"
        ),
        400,
    )
    status, body = backend.post("/completion", {"prompt": "x", "n_predict": 1, "seed": 2**64 + 7})
    assert status == 200 and body["generation_settings"]["seed"] == 7, (
        body
    )  # a uint32, as llama-server's
    _envelope(
        *backend.post("/infill", b'{"input_prefix": "# smile \\ud83d", "input_suffix": ""}'), 400
    )
    _envelope(*backend.post("/completion", {"prompt": [1, 10**6], "n_predict": 2}), 400)
    _envelope(*backend.post("/completion", {"prompt": [-5], "n_predict": 2}), 400)
    status, body = backend.post(
        "/completion", b'{"prompt": "smile \\ud83d\\ude00", "n_predict": 1}'
    )
    assert status == 200, body  # a surrogate pair is one character
    # streamed requests that fail before the first token get a plain JSON error too
    _envelope(*backend.post("/completion", {"prompt": "hello " * 3000, "stream": True}), 400)
    # the server is fine afterwards
    status, body = backend.post("/completion", {"prompt": "hello", "n_predict": 2})
    assert status == 200, body


def test_n_predict_beyond_the_context_generates_until_it_is_full(backend: Any) -> None:
    """As llama-server: not an error (Continue sends n_predict 4096 by default); the
    generation stops when the context (2048) is full: stop_type limit, truncated."""
    n_ctx = backend.get("/props")[1]["default_generation_settings"]["n_ctx"]

    def evaluated(k: int) -> int:
        status, body = backend.post(
            "/completion", {"prompt": "hello " * k, "n_predict": 1, **GREEDY}
        )
        assert status == 200, body
        return body["tokens_evaluated"]

    a, b = evaluated(100), evaluated(200)
    per, base = (b - a) / 100, a - 100 * (b - a) / 100
    k = int((n_ctx - 6 - base) / per)
    status, body = backend.post(
        "/completion", {"prompt": "hello " * k, "n_predict": 4096, "ignore_eos": True, **GREEDY}
    )
    assert status == 200, body
    assert body["stop_type"] == "limit" and body["truncated"] is True
    assert (
        body["tokens_evaluated"] + body["tokens_predicted"] == n_ctx
        and body["tokens_predicted"] > 0
    )
    exact = {
        "prompt": "hello " * k,
        "n_predict": body["tokens_predicted"],
        "ignore_eos": True,
        **GREEDY,
    }
    status, body = backend.post(
        "/completion", exact
    )  # asked for exactly the room left: not truncated
    assert status == 200 and body["stop_type"] == "limit" and body["truncated"] is False, body
    status, body = backend.post(
        "/completion", {"prompt": "hello", "n_predict": 3, "ignore_eos": True, **GREEDY}
    )
    assert status == 200 and body["stop_type"] == "limit" and body["truncated"] is False


def test_model_names_accepted(backend: Any) -> None:
    _, props = backend.get("/props")
    for name in (props["model_alias"], props["model_path"]):
        status, body = backend.post(
            "/v1/completions", {"prompt": "x", "max_tokens": 1, "model": name}
        )
        assert status == 200, body
