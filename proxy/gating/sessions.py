"""Session keys: which editor session a gated request belongs to.

No editor sends a session id (see docs/clients.md), so the default key is peer address +
User-Agent + a hash of Authorization + route family + model; ``X-LLMProxy-Session`` (the
configured header) wins when present. Keys are hashed: the raw Authorization value never
leaves this module and ``/llmproxy/status`` shows only a short digest.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

from llmproxy.proxy.gating.routes import family


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()


def session_key(
    *,
    parts: Sequence[str],
    header_name: str,
    headers: Mapping[str, str],
    peer: str | None,
    path: str,
    body: Mapping[str, Any] | None,
) -> str:
    """Return a short opaque key (hex digest) identifying the editor session."""
    explicit = headers.get(header_name)
    if explicit:
        return _digest("explicit\0" + explicit)
    values: list[str] = []
    for part in parts:
        if part == "peer":
            values.append(peer or "")
        elif part == "user_agent":
            values.append(headers.get("User-Agent", ""))
        elif part == "authorization":
            values.append(_digest(headers.get("Authorization", "")))
        elif part == "route_family":
            values.append(family(path))
        elif part == "model":
            model = body.get("model") if isinstance(body, Mapping) else None
            values.append(model if isinstance(model, str) else "")
        else:
            raise ValueError(f"unknown session part {part!r}")
    return _digest("\0".join(values))


def is_warmup(body: Mapping[str, Any] | None) -> bool:
    """llama.vim / llama.vscode prompt-cache warm-ups send n_predict: 0 (never superseded)."""
    if not isinstance(body, Mapping):
        return False
    n = body.get("n_predict", body.get("max_tokens"))
    return n == 0 and not isinstance(n, bool)
