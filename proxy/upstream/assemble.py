"""Which requests the proxy sends as a stream for a client that asked for none, so that a
dropped client stops its generation (llama-server's completion and chat routes).

llama-server notices a dropped client of a streaming request at its next token, but a
dropped client of a non-streaming one only when another completion request arrives: a
cancelled non-streaming generation would run to its end while the proxy holds its permit.
So on its completion and chat routes the proxy asks for a stream (``stream: true``) and
answers a client that did not ask for one with the JSON body llama-server would have sent,
assembled from the stream's events (relay/assemble.py).

Requests whose streamed form carries different data are not converted (``assembles``):
per-token probabilities (``n_probs``, ``logprobs``), ``return_tokens`` (a stream leaves out
the tokens of a held-back stop word), ``verbose``, chat requests with tools or
log-probabilities, and ``n_cmpl`` > 1 together with ``response_fields`` (the final events
may then lack the ``index`` that orders them).
"""

from __future__ import annotations

from typing import Any

from llmproxy.proxy.relay.assemble import CHAT_ROUTES, NATIVE_ROUTES, OAI_ROUTES
from llmproxy.proxy.request import Body

ROUTES = NATIVE_ROUTES | OAI_ROUTES | CHAT_ROUTES
#: chat requests whose streamed answer carries more than text (tool calls' pieces), or
#: per-token data: sent as the client asked
_CHAT_APART = ("tools", "functions", "logprobs", "top_logprobs")


def _number(body: dict[str, Any], key: str) -> float:
    value = body.get(key)
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else 0


def assembles(path: str, body: Body) -> bool:
    """Would llama-server answer ``body`` on ``path`` without streaming, and can that answer be
    rendered exactly from its stream? (``stream`` is on only when it is exactly ``true``, as
    llama-server reads it.)"""
    if path not in ROUTES or not isinstance(body, dict) or body.get("stream") is True:
        return False
    if (
        _number(body, "n_probs") > 0
        or body.get("return_tokens") is True
        or body.get("verbose") is True
    ):
        return False
    if path in OAI_ROUTES and body.get("logprobs") not in (None, False, 0):
        return False
    if path in CHAT_ROUTES and any(body.get(k) not in (None, False, 0, []) for k in _CHAT_APART):
        return False
    several = _number(body, "n_cmpl") > 1 or _number(body, "n") > 1
    return not (several and body.get("response_fields"))
