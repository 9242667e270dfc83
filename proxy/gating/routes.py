"""Which routes are gated, their family (for session keys) and their stream format.

``GATED_ROUTES`` are gated on every upstream; ``LLAMACPP_GATED_ROUTES`` too on a llama-server
(``Adapter.gated_routes``): its own routes that run on its slots. Embeddings and reranking
run one task per input (document) on any idle slots and cannot be pinned; ``/v1/messages``
(Anthropic-style chat) is served by its chat-completions handler and takes ``id_slot``."""

from __future__ import annotations

GATED_ROUTES = frozenset(
    {
        "/infill",
        "/completion",
        "/completions",
        "/v1/completions",
        "/chat/completions",
        "/v1/chat/completions",
        "/v1/embeddings",
        "/api/generate",
        "/api/chat",
    }
)

EMBEDDING_ROUTES = frozenset({"/v1/embeddings", "/embedding", "/embeddings"})
RERANK_ROUTES = frozenset({"/rerank", "/reranking", "/v1/rerank", "/v1/reranking"})
LLAMACPP_GATED_ROUTES = frozenset({"/embedding", "/embeddings", "/v1/messages"}) | RERANK_ROUTES

_FAMILY = {
    "/infill": "infill",
    "/completion": "completion",
    "/completions": "completion",
    "/v1/completions": "completion",
    "/api/generate": "completion",
    "/chat/completions": "chat",
    "/v1/chat/completions": "chat",
    "/api/chat": "chat",
    "/v1/embeddings": "embeddings",
    "/embedding": "embeddings",
    "/embeddings": "embeddings",
    "/v1/messages": "chat",
    **{route: "rerank" for route in RERANK_ROUTES},
}

# Routes whose request body may carry llama-server's id_slot (the llamacpp adapter injects it).
# llama-server answers /api/chat (Ollama style) and /v1/messages (Anthropic style) with its
# chat-completions handler.
SLOT_ROUTES = frozenset(
    {
        "/infill",
        "/completion",
        "/completions",
        "/v1/completions",
        "/chat/completions",
        "/v1/chat/completions",
        "/api/chat",
        "/v1/messages",
    }
)


def is_gated(method: str, path: str) -> bool:
    """Gated on every upstream (see ``Adapter.gated_routes`` for the upstream in use)."""
    return method == "POST" and path in GATED_ROUTES


def family(path: str) -> str:
    return _FAMILY.get(path, "other")


def is_safe_path(raw_path: str) -> bool:
    """Only origin-form targets with no dot segments (no open proxy, no path tricks)."""
    if not raw_path.startswith("/") or raw_path.startswith("//"):
        return False
    if "." not in raw_path and "%" not in raw_path and "\\" not in raw_path:
        return True  # the common case, decided by three scans in C: no dot segment, nothing encoded
    path = raw_path.split("?", 1)[0]
    lowered = path.lower()
    if "%2e" in lowered or "%2f" in lowered or "%5c" in lowered or "\\" in path:
        return False
    return all(seg not in (".", "..") for seg in path.split("/"))
