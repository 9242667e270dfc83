"""llama-server's generation routes through a real server and model: /completion and
/infill, streamed and not, stop words, ``response_fields``, warm-ups, the context limit."""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers.backend.api import envelope, post_stream, sse_events

PROMPT = "def fibonacci(n):\n"
GREEDY = {"temperature": 0, "seed": 1}


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
        envelope(status, body, 400)
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
    status, body = backend.post("/completion", exact)  # exactly the room left: not truncated
    assert status == 200 and body["stop_type"] == "limit" and body["truncated"] is False, body
    status, body = backend.post(
        "/completion", {"prompt": "hello", "n_predict": 3, "ignore_eos": True, **GREEDY}
    )
    assert status == 200 and body["stop_type"] == "limit" and body["truncated"] is False
