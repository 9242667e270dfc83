"""Hostile and wrong-typed bodies through a real server: strict UTF-8, typed parameters,
int32 ranges, unsupported fields refused by name; every answer in the error envelope and
``/slots`` unharmed by what one request carried."""

from __future__ import annotations

from typing import Any

from tests.helpers.backend.api import envelope

SURROGATE = b"\xed\xa0\x80"  # UTF-8's encoding of U+D800: not valid UTF-8


def raw(fields: bytes) -> bytes:
    return b'{"n_predict": 2, ' + fields + b"}"


def test_bytes_that_are_not_utf8_get_400(backend: Any) -> None:
    for path, fields in [
        ("/completion", b'"prompt": "a' + SURROGATE + b'b"'),
        ("/completion", b'"prompt": "a\xffb"'),
        ("/infill", b'"input_prefix": "x' + SURROGATE + b'", "input_suffix": ""'),
        ("/v1/completions", b'"prompt": "x", "model": "m' + SURROGATE + b'"'),
        ("/completion", b'"prompt": "x", "stop": ["s' + SURROGATE + b'"]'),
        (
            "/v1/chat/completions",
            b'"messages": [{"role": "user", "content": "' + SURROGATE + b'"}]',
        ),
    ]:
        status, body = backend.post(path, raw(fields))
        envelope(status, body, 400)
        assert "UTF-8" in body["error"]["message"], body
        assert backend.get("/slots")[0] == 200
    status, body = backend.post("/completion", {"prompt": "smile 😀", "n_predict": 1})
    assert status == 200, body  # real UTF-8 of a character outside the BMP is fine


def test_wrong_types_get_400(backend: Any) -> None:
    for path, body in [
        ("/completion", {"prompt": "x", "stream": "false"}),
        ("/v1/completions", {"prompt": "x", "stream": 1}),
        ("/completion", {"prompt": "x", "ignore_eos": "false"}),
        ("/completion", {"prompt": "x", "top_k": 2**32 + 1}),  # would wrap to 1 in a C int
        ("/completion", {"prompt": "x", "n_predict": 2**31}),
        ("/completion", {"prompt": "x", "n_indent": -(2**31) - 1}),
        ("/completion", {"prompt": "x", "top_k": 4.5}),
        ("/v1/completions", {"prompt": "x", "model": 7}),
        ("/v1/completions", {"prompt": "x", "model": "m" * 1000}),
        ("/completion", {"prompt": "x", "stop": ["s"] * 65}),
        ("/completion", {"prompt": "x", "stop": ["s" * 513]}),
    ]:
        status, answer = backend.post(path, body)
        envelope(status, answer, 400)
        key = next(k for k in body if k != "prompt")
        assert f"'{key}'" in answer["error"]["message"], (body, answer)
    status, answer = backend.post("/completion", {"prompt": "x", "n_predict": 2, "stream": None})
    assert status == 200 and isinstance(answer, dict), answer  # null is the default


def test_unsupported_fields_are_refused_by_name(backend: Any) -> None:
    for path, key, value in [
        ("/completion", "n_probs", 5),
        ("/v1/completions", "logprobs", 3),
        ("/v1/chat/completions", "logprobs", True),
        ("/v1/chat/completions", "top_logprobs", 2),
        ("/completion", "logit_bias", {"15": 5.0}),
        ("/completion", "logit_bias", [[15, -1.0]]),
    ]:
        body: dict[str, Any] = {key: value, "n_predict": 2}
        body.update(
            {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "x"}
        )
        status, answer = backend.post(path, body)
        envelope(status, answer, 400)
        assert (
            f"'{key}'" in answer["error"]["message"]
            and "not supported" in answer["error"]["message"]
        )
    for key, value in [("n_probs", 0), ("logprobs", None), ("logprobs", False), ("logit_bias", {})]:
        status, answer = backend.post(
            "/v1/completions", {"prompt": "x", "max_tokens": 2, key: value}
        )
        assert status == 200, (key, value, answer)


def test_more_messages_than_context_refused_before_rendering(backend: Any) -> None:
    messages = [{"role": "user", "content": "hi"}] * 50_000
    status, body = backend.post("/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    envelope(status, body, 400)
    assert body["error"]["type"] == "exceed_context_size_error", body
    assert "50000 messages" in body["error"]["message"], body  # counted, not rendered
