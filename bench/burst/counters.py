"""Exact backend work for ``llmproxy bench burst``, from the backend's ``GET /metrics``.

llama-server started with ``--metrics`` and ``llmproxy backend --metrics`` serve
Prometheus counters of the prompt tokens they evaluated (``llamacpp:prompt_tokens_total``,
cached ones not counted) and the tokens they generated (``llamacpp:tokens_predicted_total``),
a cancelled generation's included as far as it got. The proxy passes ``/metrics``
through, so the same read works on a proxy URL. Read once before a target's bursts and once
after the backend went idle, the difference is exactly what those bursts cost the backend,
where /slots polling (slots.py) only gives lower bounds. llama-server prints 6 significant
digits, so counts above a million are rounded.
"""

from __future__ import annotations

from typing import Any

import aiohttp

NAMES = {"prompt_tokens_total": "prompt_tokens", "tokens_predicted_total": "tokens_predicted"}


def parse(text: str) -> dict[str, float]:
    """The counters we use from a Prometheus text page; empty when they are not there."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        key = NAMES.get(name.removeprefix("llamacpp:"))
        if key is not None and name.startswith("llamacpp:"):
            try:
                out[key] = float(value)
            except ValueError:
                return {}
    return out if len(out) == len(NAMES) else {}


async def read(http: aiohttp.ClientSession, url: str) -> dict[str, float] | None:
    """The counters now, or None when the target does not serve them."""
    try:
        async with http.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as resp:
            if resp.status != 200:
                return None
            return parse(await resp.text()) or None
    except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
        return None


def spent(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, Any]:
    """What the backend computed between two reads (empty if either is missing)."""
    if before is None or after is None:
        return {}
    return {k: int(round(after[k] - before[k])) for k in NAMES.values()}
