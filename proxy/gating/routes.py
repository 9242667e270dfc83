"""Which routes are gated, their family (for session keys) and their stream format: the
sets the gate uses, read from the one route table (proxy/routes.py).

``GATED_ROUTES`` are gated on every upstream; ``LLAMACPP_GATED_ROUTES`` too on a llama-server
(``Dialect.gated_routes``): its own routes that run on its slots. Embeddings and reranking
run one task per input (document) on any idle slots and cannot be pinned; ``/v1/messages``
(Anthropic-style chat) is served by its chat-completions handler and takes ``id_slot``."""

from __future__ import annotations

from llmproxy.proxy.routes import ROUTES, paths

GATED_ROUTES = paths(gated="all")
LLAMACPP_GATED_ROUTES = paths(gated="llamacpp")
EMBEDDING_ROUTES = paths(family="embeddings")
RERANK_ROUTES = paths(family="rerank")
# Routes whose request body may carry llama-server's id_slot (the llamacpp dialect injects it).
# llama-server answers /api/chat (Ollama style) and /v1/messages (Anthropic style) with its
# chat-completions handler.
SLOT_ROUTES = paths(slot=True)


def is_gated(method: str, path: str) -> bool:
    """Gated on every upstream (see ``Dialect.gated_routes`` for the upstream in use)."""
    return method == "POST" and path in GATED_ROUTES


def family(path: str) -> str:
    route = ROUTES.get(path)
    return "other" if route is None else route.family


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
