"""Wire formats of the fake LLM upstream (upstream.py): llama-server, OpenAI and Ollama JSON.

``Shape`` is one generation route's format: its stream framing (SSE ``data:`` events or
Ollama's NDJSON lines), when a body asks to stream, and the chunk / closing pieces /
whole body carrying the deterministic tokens (token i is ``f"t{i} "``). ``ROUTES`` maps
each generation path to its shapes and the kinds that serve each (``shape_for`` picks
one kind's); ``info_routes`` gives the fixed GET bodies (/v1/models, /health, /props,
Ollama's /api/version and /api/tags).
Pure functions and frozen data only: no state, no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from aiohttp import web


def dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


def error_body(message: str, type_: str, code: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "code": code}}


def text(n: int, first: int = 0) -> str:
    """Tokens ``first`` .. ``first + n - 1``."""
    return "".join(f"t{i} " for i in range(first, first + n))


@dataclass(frozen=True)
class Shape:
    """One generation route's wire format: llama-server native, OpenAI text/chat, Ollama."""

    fmt: Literal[
        "llama",
        "oai_text",
        "oai_chat",
        "oai_embed",
        "llama_embed",
        "rerank",
        "anthropic",
        "ollama_generate",
        "ollama_chat",
    ]
    kinds: frozenset[str]

    @property
    def ndjson(self) -> bool:
        return self.fmt.startswith("ollama")

    @property
    def stream_type(self) -> str:
        return "application/x-ndjson" if self.ndjson else "text/event-stream"

    @property
    def per_input(self) -> bool:
        """One task per input (embeddings) or per document (rerank), each on any idle slot."""
        return self.fmt in ("oai_embed", "llama_embed", "rerank")

    def wants_stream(self, body: dict[str, Any]) -> bool:
        if self.per_input:
            return False  # embeddings and reranking are never streamed
        return body.get("stream") is not False if self.ndjson else body.get("stream") is True

    def frame(self, obj: Any) -> bytes:
        if self.ndjson:
            return (dumps(obj) + "\n").encode()
        if self.fmt == "anthropic":  # Anthropic's SSE names each event
            return f"event: {obj['type']}\ndata: {dumps(obj)}\n\n".encode()
        return f"data: {obj if isinstance(obj, str) else dumps(obj)}\n\n".encode()

    def _piece(self, text: str, rid: int, slot: int, done: bool, n: int) -> dict[str, Any]:
        if self.fmt == "llama":
            obj: dict[str, Any] = {"index": 0, "content": text, "id_slot": slot, "stop": done}
            if done:
                obj.update(
                    model="fake",
                    tokens_predicted=n,
                    tokens_evaluated=1,
                    stop_type="limit",
                    truncated=False,
                )
            return obj
        if self.ndjson:
            key = "message" if self.fmt == "ollama_chat" else "response"
            obj = {
                "model": "fake",
                "created_at": "2026-01-01T00:00:00Z",
                key: {"role": "assistant", "content": text} if key == "message" else text,
                "done": done,
            }
            if done:
                obj.update(done_reason="length", eval_count=n, prompt_eval_count=1)
            return obj
        return {}

    def _oai(self, text: str | None, rid: int, finish: str | None, chunk: bool) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
        if self.fmt == "oai_text":
            choice.update(text=text or "", logprobs=None)
            obj_type = "text_completion"
        elif chunk:
            choice["delta"] = {} if text is None else {"role": "assistant", "content": text}
            obj_type = "chat.completion.chunk"
        else:
            choice["message"] = {"role": "assistant", "content": text}
            obj_type = "chat.completion"
        return {
            "id": f"cmpl-{rid}",
            "object": obj_type,
            "created": 1767225600,
            "model": "fake",
            "choices": [choice],
        }

    def chunk(self, i: int, rid: int, slot: int) -> dict[str, Any]:
        """Stream piece carrying token ``i``."""
        if self.fmt == "anthropic":
            return {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "text_delta", "text": f"t{i} "},
            }
        if self.fmt.startswith("oai"):
            return self._oai(f"t{i} ", rid, None, chunk=True)
        return self._piece(f"t{i} ", rid, slot, False, i + 1)

    def final(self, n: int, rid: int, slots: tuple[int, ...]) -> list[Any]:
        """The closing stream pieces: a stop/finish_reason/done piece per completion (one per
        slot; then [DONE] for OpenAI)."""
        if self.fmt == "anthropic":
            return [
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": "max_tokens"},
                    "usage": {"output_tokens": n},
                },
                {"type": "message_stop"},
            ]
        if self.fmt.startswith("oai"):
            lasts = [
                indexed(self._oai(None, rid, "length", chunk=True), j) for j in range(len(slots))
            ]
            tokens = n * len(slots)
            lasts[-1]["usage"] = {
                "prompt_tokens": 1,
                "completion_tokens": tokens,
                "total_tokens": tokens + 1,
            }
            return [*lasts, "[DONE]"]
        return [indexed(self._piece("", rid, s, True, n), j) for j, s in enumerate(slots)]

    def whole(self, n: int, rid: int, slot: int, first: int = 0) -> dict[str, Any]:
        """Non-streamed body with all ``n`` tokens from token ``first`` on (embeddings: a
        vector of ``n`` numbers)."""
        if self.fmt == "oai_embed":
            return {
                "object": "list",
                "model": "fake",
                "usage": {"prompt_tokens": 1, "total_tokens": 1},
                "data": [
                    {"object": "embedding", "index": 0, "embedding": [i / 8 for i in range(n)]}
                ],
            }
        if self.fmt == "anthropic":
            return {
                "id": f"msg-{rid}",
                "type": "message",
                "role": "assistant",
                "model": "fake",
                "content": [{"type": "text", "text": text(n, first)}],
                "stop_reason": "max_tokens",
                "usage": {"input_tokens": 1, "output_tokens": n},
            }
        if self.fmt.startswith("oai"):
            obj = self._oai(text(n, first), rid, "length", chunk=False)
            obj["usage"] = {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}
            return obj
        return self._piece(text(n, first), rid, slot, True, n)

    def whole_all(
        self, n: int, rid: int, slots: tuple[int, ...], inputs: int = 1, first: int = 0
    ) -> Any:
        """``whole`` for one completion per slot (llama-server's ``n_cmpl``): one body for a
        single slot, else a JSON array (native routes) or one body with a choice each (OpenAI).
        Embeddings: one vector per input, whatever slots they ran on (llama-server's native
        routes: a list of ``{"index", "embedding": [vector]}``); rerank: one score per document."""
        if self.fmt == "llama_embed":
            return [{"index": i, "embedding": [[j / 8 for j in range(n)]]} for i in range(inputs)]
        if self.fmt == "rerank":
            return {
                "model": "fake",
                "object": "list",
                "usage": {"prompt_tokens": 1, "total_tokens": 1},
                "results": [{"index": i, "relevance_score": 1 / (i + 1)} for i in range(inputs)],
            }
        if self.fmt == "oai_embed":
            body = self.whole(n, rid, slots[0])
            body["data"] = [{**body["data"][0], "index": i} for i in range(inputs)]
            return body
        if len(slots) == 1:
            return self.whole(n, rid, slots[0], first)
        bodies = [indexed(self.whole(n, rid, s, first), j) for j, s in enumerate(slots)]
        if not self.fmt.startswith("oai"):
            return bodies
        merged = bodies[0]
        merged["choices"] = [b["choices"][0] for b in bodies]
        return merged


def pick_fields(obj: Any, fields: Any) -> Any:
    """llama-server's ``response_fields`` on a native final object (a whole body, or the
    closing stream piece): only the named fields, nested ones by ``a/b`` path under that flat
    key, absent ones left out. ``obj`` may be a list of such objects (each filtered; strings
    such as ``[DONE]`` kept); a ``fields`` that is not a non-empty list of strings changes
    nothing."""
    if not (isinstance(fields, list) and fields and all(isinstance(f, str) for f in fields)):
        return obj
    if isinstance(obj, list):
        return [pick_fields(o, fields) for o in obj]
    if not isinstance(obj, dict):
        return obj
    out: dict[str, Any] = {}
    for path in fields:
        value: Any = obj
        for part in path.split("/"):
            if not isinstance(value, dict) or part not in value:
                break
            value = value[part]
        else:
            out[path] = value
    return out


def indexed(obj: Any, j: int) -> Any:
    """Completion ``j``'s copy of a piece: its ``index`` (OpenAI: its choice's) set to ``j``."""
    if isinstance(obj, dict):
        target = obj["choices"][0] if obj.get("choices") else obj
        if "index" in target:
            target["index"] = j
    return obj


_LLAMA = frozenset({"llamacpp"})
_OAI = frozenset({"llamacpp", "openai", "ollama"})
_OLLAMA = frozenset({"ollama"})
ROUTES: dict[str, tuple[Shape, ...]] = {
    "/completion": (Shape("llama", _LLAMA),),
    "/completions": (Shape("llama", _LLAMA),),
    "/infill": (Shape("llama", _LLAMA),),
    "/v1/completions": (Shape("oai_text", _OAI),),
    "/v1/chat/completions": (Shape("oai_chat", _OAI),),
    "/chat/completions": (Shape("oai_chat", _LLAMA),),
    "/v1/embeddings": (Shape("oai_embed", _OAI),),  # llama-server: on any free slot, no id_slot
    "/embedding": (Shape("llama_embed", _LLAMA),),
    "/embeddings": (Shape("llama_embed", _LLAMA),),
    "/rerank": (Shape("rerank", _LLAMA),),
    "/reranking": (Shape("rerank", _LLAMA),),
    "/v1/rerank": (Shape("rerank", _LLAMA),),
    "/v1/reranking": (Shape("rerank", _LLAMA),),
    # Anthropic-style chat: on id_slot's slot, like chat
    "/v1/messages": (Shape("anthropic", _LLAMA),),
    "/api/generate": (Shape("ollama_generate", _OLLAMA),),
    # llama-server serves Ollama's chat path with its chat-completions handler
    "/api/chat": (Shape("ollama_chat", _OLLAMA), Shape("oai_chat", _LLAMA)),
}


def shape_for(path: str, kind: str) -> Shape | None:
    """The shape of generation route ``path`` on an upstream of ``kind`` (None: not served)."""
    return next((s for s in ROUTES.get(path, ()) if kind in s.kinds), None)


def token_count(tokens: int, body: dict[str, Any]) -> int:
    """``tokens``, capped by the request's own limit (n_predict, max_tokens,
    options.num_predict) if >= 0."""
    options = body.get("options")
    for limit in (
        body.get("n_predict"),
        body.get("max_tokens"),
        options.get("num_predict") if isinstance(options, dict) else None,
    ):
        if isinstance(limit, int) and limit >= 0:
            return min(tokens, limit)
    return tokens


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(text=dumps(obj), status=status, content_type="application/json")


def info_routes(
    kind: str, n_slots: int, models: Sequence[str] = ("fake",)
) -> dict[str, Callable[[], web.Response]]:
    """The fixed GET routes of a ``kind`` with ``n_slots`` slots (/slots is the fake's own);
    ``/v1/models`` lists ``models``."""
    listed = [{"id": m, "object": "model", "owned_by": "llmproxy"} for m in models]
    routes: dict[str, Callable[[], web.Response]] = {
        "/v1/models": lambda: json_response({"object": "list", "data": listed}),
    }
    if kind == "llamacpp":
        routes["/health"] = lambda: json_response({"status": "ok"})
        routes["/props"] = lambda: json_response(
            {
                "total_slots": n_slots,
                "model_path": "fake.gguf",
                "build_info": "fake",
                "default_generation_settings": {"n_ctx": 4096, "n_predict": -1},
            }
        )
    elif kind == "ollama":
        routes["/api/version"] = lambda: json_response({"version": "0.5.7"})
        routes["/api/tags"] = lambda: json_response(
            {"models": [{"name": "fake:latest", "model": "fake:latest", "size": 1}]}
        )
    return routes
