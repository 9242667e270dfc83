"""The route table: every route the proxy treats as more than bytes, and what it is.

One row per route; every other module reads its sets from here (the gate's gated routes,
the default supersede routes, the stream assembler's, type-through's, the prompt-cache
router's and the fake upstream's), so a route is added or changed in one place, and
``eligible`` says which bodies on them type-through may continue (read by the llamacpp
adapter and by reuse/). Ground: imports nothing of the proxy. Pure functions.

Columns:
- ``family``: the session key's route part (``infill``, ``completion``, ``chat``,
  ``embeddings``, ``rerank``).
- ``gated``: ``all`` (gated on every upstream) or ``llamacpp`` (only on a llama-server,
  whose slots run it: ``Dialect.gated_routes``).
- ``slot``: the body may carry llama-server's ``id_slot`` (the llamacpp dialect sets it).
- ``keystroke``: an editor's completion route: superseded by default, a request class of
  its own (``complete``).
- ``prompt``: where the prompt's text is: ``infill`` (``input_extra`` + ``input_prefix`` +
  ``prompt``, then ``input_suffix``), ``text`` (``prompt``), ``chat`` (``messages``), or
  None (embeddings, reranking: no generation).
- ``answer``: the shape of a generation's answer: ``native`` (llama-server's own),
  ``oai`` (OpenAI's completions), None (any other).
- ``assembled``: a non-streaming request the llamacpp dialect sends as a stream and answers
  whole (upstream/assemble.py), and that type-through can continue (reuse/match.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class Route:
    path: str
    family: str
    gated: Literal["all", "llamacpp"]
    slot: bool = False
    keystroke: bool = False
    prompt: Literal["infill", "text", "chat"] | None = None
    answer: Literal["native", "oai"] | None = None
    assembled: bool = False


def _keystroke(path: str, family: str, prompt: Literal["infill", "text"], answer: str) -> Route:
    """An editor's completion route llama-server serves (``id_slot``, sent as a stream)."""
    shape: Literal["native", "oai"] = "oai" if answer == "oai" else "native"
    return Route(path, family, "all", True, True, prompt, shape, assembled=True)


TABLE: tuple[Route, ...] = (
    _keystroke("/infill", "infill", "infill", "native"),
    _keystroke("/completion", "completion", "text", "native"),
    _keystroke("/v1/completions", "completion", "text", "oai"),
    _keystroke("/completions", "completion", "text", "native"),
    Route("/api/generate", "completion", "all", keystroke=True, prompt="text"),
    Route("/chat/completions", "chat", "all", slot=True, prompt="chat"),
    Route("/v1/chat/completions", "chat", "all", slot=True, prompt="chat"),
    Route("/api/chat", "chat", "all", slot=True, prompt="chat"),
    Route("/v1/messages", "chat", "llamacpp", slot=True, prompt="chat"),
    Route("/v1/embeddings", "embeddings", "all"),
    Route("/embedding", "embeddings", "llamacpp"),
    Route("/embeddings", "embeddings", "llamacpp"),
    Route("/rerank", "rerank", "llamacpp"),
    Route("/reranking", "rerank", "llamacpp"),
    Route("/v1/rerank", "rerank", "llamacpp"),
    Route("/v1/reranking", "rerank", "llamacpp"),
)
ROUTES: dict[str, Route] = {r.path: r for r in TABLE}


def paths(**where: object) -> frozenset[str]:
    """The paths of the routes whose columns equal ``where`` (e.g. ``gated="all"``)."""
    return frozenset(r.path for r in TABLE if all(getattr(r, k) == v for k, v in where.items()))


#: the default supersede routes, in the table's order (a setting's default)
KEYSTROKE_ROUTES: tuple[str, ...] = tuple(r.path for r in TABLE if r.keystroke)

_CONTINUABLE = paths(assembled=True)


def _positive(body: dict[str, Any], key: str) -> bool:
    value = body.get(key)
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def eligible(route: str, body: Any) -> bool:
    """Can a request with ``body`` on ``route`` be continued, or continue another (type-through,
    reuse/match.py)? An ``assembled`` route, a body that asks for one plain text: no warm-up,
    no per-token probabilities, no several completions, a string prompt."""
    if route not in _CONTINUABLE or not isinstance(body, dict):
        return False
    for key in ("n_predict", "max_tokens"):
        n = body.get(key)
        if n == 0 and not isinstance(n, bool):
            return False  # a warm-up: it wants no text
    if _positive(body, "n_probs") or _positive(body, "n_cmpl") and body["n_cmpl"] > 1:
        return False
    if _positive(body, "n") and body["n"] > 1:
        return False
    if body.get("logprobs") not in (None, False, 0):
        return False
    return all(isinstance(body.get(k, ""), str) for k in ("prompt", "input_prefix"))
