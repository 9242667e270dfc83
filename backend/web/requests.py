"""Request parsing for the web layer: JSON bodies into ``Prompt`` and ``SamplingParams``.

Every function here raises ``BadRequest`` (answered as a 400/404 envelope by the
middleware) on a malformed field; nothing here touches the dispatcher beyond reading
its slot count.
"""

from __future__ import annotations

import json
import math
from typing import Any

from aiohttp import web

from llmproxy.backend.protocol import Prompt, SamplingParams
from llmproxy.backend.runtime.dispatch import Dispatcher
from llmproxy.backend.web.context import model_names
from llmproxy.backend.web.errors import BadRequest


async def read_body(request: web.Request) -> dict[str, Any]:
    try:
        raw = await request.read()
        body = json.loads(raw or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
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


def _finite(v: Any) -> bool:
    """A JSON number the engines can take: not a bool, NaN, inf (Python's json reads NaN and
    1e400) or an integer too large for a float (it reads 400 digits as an int)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def _num(body: dict[str, Any], key: str, default: Any, kind: type) -> Any:
    v = body.get(key, default)
    if v is None:
        return default
    if not _finite(v):
        raise BadRequest(f"'{key}' must be a finite number")
    return kind(v)


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(s for s in stop if s)
    raise BadRequest("'stop' must be a string or a list of strings")


def sampling_params(body: dict[str, Any], openai: bool = False) -> SamplingParams:
    d = SamplingParams()
    n_predict = body.get("n_predict")
    if openai:
        n_predict = body.get("max_completion_tokens", body.get("max_tokens", n_predict))
    if n_predict is None:
        n_predict = -1
    if isinstance(n_predict, bool) or not isinstance(n_predict, int):
        raise BadRequest("'n_predict' / 'max_tokens' must be an integer")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise BadRequest("'seed' must be an integer")
    tmax = body.get("t_max_predict_ms")
    if tmax is not None and not _finite(tmax):
        raise BadRequest("'t_max_predict_ms' must be a finite number")
    n_indent = body.get("n_indent")
    if n_indent is None:
        n_indent = 0
    if isinstance(n_indent, bool) or not isinstance(n_indent, int):
        raise BadRequest("'n_indent' must be an integer")
    return SamplingParams(
        n_predict=max(-1, n_predict),
        temperature=_num(body, "temperature", d.temperature, float),
        top_k=_num(body, "top_k", d.top_k, int),
        top_p=_num(body, "top_p", d.top_p, float),
        min_p=_num(body, "min_p", d.min_p, float),
        seed=None if seed is None or seed < 0 else seed % 2**32,  # llama-server's seed is a uint32
        stop=_stop(body),
        t_max_predict_ms=int(tmax) if tmax else None,
        n_indent=max(0, n_indent),
        ignore_eos=bool(body.get("ignore_eos", False)),
    )


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
    model = body.get("model")
    if model is None or model == "":
        return
    if not isinstance(model, str) or model not in model_names(request.app):
        raise BadRequest(f"model '{model}' not found", 404, "not_found_error")


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


def chat_prompt(body: dict[str, Any]) -> Prompt:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list")
    msgs: list[tuple[str, str]] = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest("each message needs a 'role' and a 'content'")
        msgs.append((m["role"], _content_text(m.get("content"))))
    return Prompt(kind="chat", messages=tuple(msgs))
