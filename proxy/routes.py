"""Which routes are gated, their family (for session keys) and their stream format."""

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
}

# Routes whose request body may carry llama-server's id_slot (the llamacpp adapter injects it).
# llama-server answers /api/chat (Ollama style) with its chat-completions handler.
SLOT_ROUTES = frozenset(
    {
        "/infill", "/completion", "/completions", "/v1/completions",
        "/chat/completions", "/v1/chat/completions", "/api/chat",
    }
)


def is_gated(method: str, path: str) -> bool:
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
