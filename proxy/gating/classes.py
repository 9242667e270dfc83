"""Request classes: which gated requests go first when they wait.

- ``complete``: an editor's completion (the keystroke routes of proxy/routes.py);
- ``chat``: chat and messages routes (Continue's chat, aider, an SDK script);
- ``bulk``: embeddings and reranking.

The scheduler (pool/pool.py) serves a waiting ``complete`` before a ``chat`` before a
``bulk``, FIFO within a class; a request that waited its class's ``class_max_wait_s`` is
served as the class above (aging: nothing starves). A request's class is its route's,
lowered by the ``X-LLMProxy-Class`` header or by its caller's key (``[[keys]]``
``classes``: the classes the key may use; its best one is a ceiling), never raised.
Pure functions of their arguments.
"""

from __future__ import annotations

from typing import Literal, get_args

from llmproxy.proxy.errors import BadRequest
from llmproxy.proxy.routes import ROUTES

Class = Literal["complete", "chat", "bulk"]
CLASSES: tuple[Class, ...] = get_args(Class)
#: lower ranks are served first
RANK: dict[str, int] = {c: i for i, c in enumerate(CLASSES)}
HEADER = "X-LLMProxy-Class"


def route_class(path: str) -> Class:
    """The class of a request on ``path`` before any lowering."""
    route = ROUTES.get(path)
    if route is None or route.keystroke:
        return "complete" if route is not None else "chat"
    return "chat" if route.prompt is not None else "bulk"


def request_class(path: str, asked: str | None, allowed: tuple[str, ...] | None) -> Class:
    """``path``'s class, lowered to ``asked`` (the header's value, if any) and to the best
    of ``allowed`` (the caller's key's classes, if it names any). BadRequest for a header
    value that is no class."""
    rank = RANK[route_class(path)]
    if asked is not None:
        asked = asked.strip().lower()
        if asked not in RANK:
            raise BadRequest(f"{HEADER} must be one of {', '.join(CLASSES)}, not {asked!r}")
        rank = max(rank, RANK[asked])
    if allowed:
        rank = max(rank, min(RANK[c] for c in allowed))
    return CLASSES[rank]
