"""Request parsing for the web layer: JSON bodies into ``Prompt`` (``SamplingParams`` are
params.py's).

Every function here raises ``BadRequest`` (answered as a 400/408 envelope by the
middleware) on a malformed field; nothing here touches the dispatcher beyond reading
its slot count. ``read_body`` is the only one that waits (for the body, with a deadline).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from llmproxy.backend.protocol import Prompt
from llmproxy.backend.runtime.dispatch import Dispatcher
from llmproxy.backend.web.context import SETTINGS
from llmproxy.backend.web.errors import BadRequest

MAX_MODEL_CHARS = 256  # the name is echoed in every chunk of an OpenAI stream


async def read_body(request: web.Request) -> dict[str, Any]:
    """The JSON object of the body, read within ``body_read_timeout_s`` (else a 408 that
    closes the connection). The bytes must be strict UTF-8: ``json.loads`` on bytes would
    let surrogates through (it decodes with ``surrogatepass``), which no engine can take."""
    timeout_s = request.app[SETTINGS].body_read_timeout_s
    try:
        async with asyncio.timeout(timeout_s):
            raw = await request.read()
    except TimeoutError:
        raise BadRequest(
            f"the request body was not received within {timeout_s:g} s", 408, close=True
        ) from None
    try:
        body = json.loads(raw.decode("utf-8") if raw else "{}")
    except UnicodeDecodeError as exc:
        raise BadRequest(f"the request body is not valid UTF-8: {exc.reason}") from None
    except json.JSONDecodeError as exc:
        raise BadRequest(f"malformed JSON body: {exc}") from None
    except RecursionError:
        raise BadRequest("malformed JSON body: nested too deeply") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if b"\\u" in raw:  # only an escape can carry a lone surrogate (raw bytes are valid UTF-8)
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:  # as llama-server's parser: an unpaired \\uD8xx is malformed
            raise BadRequest(
                "malformed JSON body: a \\u escape is an unpaired UTF-16 surrogate"
            ) from None
    return body


def response_fields(body: dict[str, Any]) -> tuple[str, ...]:
    """The ``response_fields`` of a /completion or /infill request: "/"-separated paths
    into the final answer (``llama.select_fields``); empty when absent."""
    v = body.get("response_fields")
    if v is None:
        return ()
    if isinstance(v, list) and all(isinstance(path, str) for path in v):
        return tuple(v)
    raise BadRequest("'response_fields' must be a list of strings")


def id_slot(body: dict[str, Any], dispatcher: Dispatcher) -> int:
    v = body.get("id_slot", -1)
    if v is None:
        return -1
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest("'id_slot' must be an integer")
    if v >= len(dispatcher.slots):
        raise BadRequest(f"id_slot {v} does not exist (total_slots={len(dispatcher.slots)})")
    return v if v >= 0 else -1


def n_cmpl(body: dict[str, Any], dispatcher: Dispatcher) -> int:
    """Completions wanted for the prompt: 1 to the slot count, as llama-server allows.

    ``n`` is its alias (OpenAI's name; llama-server reads ``n_cmpl`` first, then ``n``)."""
    key = "n_cmpl" if body.get("n_cmpl") is not None else "n"
    v = body.get(key)
    v = 1 if v is None else v
    total = len(dispatcher.slots)
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= total:
        raise BadRequest(f"'{key}' must be an integer from 1 to {total} (total_slots)")
    return v


def check_model(request: web.Request, body: dict[str, Any]) -> None:
    """One model is loaded, so its name is not checked (llama-server's rule: clients such as
    minuet-ai.nvim send ``"PLACEHOLDER"``); it must be a string of a sane length."""
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or len(model) > MAX_MODEL_CHARS):
        raise BadRequest(f"'model' must be a string of at most {MAX_MODEL_CHARS} characters")


def prompt_field(value: Any, key: str = "prompt") -> Prompt:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        return Prompt(kind="completion", text=value)
    if (
        isinstance(value, list)
        and value
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    ):
        return Prompt(kind="completion", tokens=tuple(value))
    raise BadRequest(f"'{key}' must be a string or a list of token ids")


async def read_completion(request: web.Request) -> tuple[dict[str, Any], Prompt]:
    """The body and prompt of a /completion or /v1/completions request (model checked)."""
    body = await read_body(request)
    check_model(request, body)
    if "prompt" not in body:
        raise BadRequest("'prompt' is required")
    return body, prompt_field(body["prompt"])


def infill_prompt(body: dict[str, Any]) -> Prompt:
    def _str(key: str) -> str:
        v = body.get(key, "")
        if v is None:
            return ""
        if not isinstance(v, str):
            raise BadRequest(f"'{key}' must be a string")
        return v

    extra_raw = body.get("input_extra") or []
    if not isinstance(extra_raw, list):
        raise BadRequest("'input_extra' must be a list of {filename, text} objects")
    extra: list[tuple[str, str]] = []
    for chunk in extra_raw:
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text", ""), str):
            raise BadRequest("'input_extra' must be a list of {filename, text} objects")
        extra.append((str(chunk.get("filename", "")), chunk.get("text", "")))
    return Prompt(
        kind="infill",
        text=_str("prompt"),
        prefix=_str("input_prefix"),
        suffix=_str("input_suffix"),
        extra=tuple(extra),
    )


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if (
                isinstance(part, dict)
                and part.get("type") == "text"
                and isinstance(part.get("text"), str)
            ):
                parts.append(part["text"])
            else:
                raise BadRequest("only text content parts are supported")
        return "".join(parts)
    raise BadRequest("message 'content' must be a string or a list of text parts")


def chat_prompt(body: dict[str, Any], n_ctx: int) -> Prompt:
    """The chat's messages; more messages than tokens of context cannot fit (each renders
    to at least one token), so they are refused before the template renders them all."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list")
    if len(messages) >= n_ctx:
        raise BadRequest(
            "the request exceeds the available context size: "
            f"{len(messages)} messages, the context is {n_ctx} tokens",
            400,
            "exceed_context_size_error",
        )
    msgs: list[tuple[str, str]] = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest("each message needs a 'role' and a 'content'")
        msgs.append((m["role"], _content_text(m.get("content"))))
    return Prompt(kind="chat", messages=tuple(msgs))
