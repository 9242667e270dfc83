"""The editors of ``llmproxy bench pool``: each types in a file of its own.

``file_text(editor, chars)`` is an editor's file before the cursor: deterministic
Python-like text, different for every editor from its first line on, so no two editors'
prompts share more than a few characters. ``editor_profile`` is ``bench burst``'s client
profile with that text put in front of the profile's own text before the cursor (in
``prompt`` for ``/completion``, ``input_prefix`` for ``/infill``), so the whole of it is
in the prompt the proxy's cache routing and the upstream's prompt cache see.

``PoolClient`` is ``bench burst``'s ``Client`` (one connection pool, one session header,
the same abandoning) that also reads the prompt counts of each answer it read to the end:
llama-server's ``timings.prompt_n`` (evaluated) and ``timings.cache_n`` (cached); where
``cache_n`` is missing, as from ``llmproxy backend``, cached is ``tokens_evaluated -
prompt_n``, or ``tokens_cached - predicted_n - prompt_n`` when ``response_fields`` left
only those. Answers of abandoned requests are never read, so these count the completed
requests only.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from llmproxy.bench.burst.editor import Client
from llmproxy.bench.burst.profiles import PREFIX, PROFILES, Profile, response_objects
from llmproxy.bench.burst.report import Req
from llmproxy.bench.burst.settings import BurstSettings

VERBS = ("load", "parse", "merge", "split", "check", "render", "store", "fetch", "scale", "sort")
NOUNS = ("frame", "token", "chunk", "record", "vector", "index", "buffer", "window", "batch")


def file_text(editor: int, chars: int) -> str:
    """``chars`` characters of editor ``editor``'s file (the same on every call)."""
    rng = random.Random(f"llmproxy-bench-pool-{editor}")
    parts = [f"# editor {editor}: module_{editor}.py\nimport math\n\n"]
    size, i = len(parts[0]), 0
    while size < chars:
        verb, noun, op = rng.choice(VERBS), rng.choice(NOUNS), rng.choice("+-*")
        a, b = rng.randint(2, 999), rng.randint(2, 999)
        part = (
            f"def {verb}_{noun}_{editor}_{i}(x, y):\n"
            f'    """{verb.capitalize()} the {noun} of x and y."""\n'
            f"    return math.floor(x {op} y * {a}) % {b}\n\n\n"
        )
        parts.append(part)
        size, i = size + len(part), i + 1
    return "".join(parts)[:chars]


def editor_profile(name: str, head: str) -> Profile:
    """Profile ``name`` whose text before the cursor starts with ``head``."""
    base = PROFILES[name]

    def body(typed: str, n: int, model: str) -> dict[str, Any]:
        obj = base.body(typed, n, model)
        for key in ("prompt", "input_prefix"):
            value = obj.get(key)
            if isinstance(value, str) and PREFIX in value:
                obj[key] = value.replace(PREFIX, head + PREFIX, 1)
                return obj
        raise ValueError(f"profile {name} sends no {PREFIX!r}")

    return dataclasses.replace(base, body=body)


def prompt_counts(body: bytes) -> tuple[int, int] | None:
    """(evaluated, cached) from an answer's last ``timings``; None if it reports none."""
    for obj in reversed(response_objects(body)):
        timings = obj.get("timings") if isinstance(obj, dict) else None
        if not isinstance(timings, dict) or not isinstance(timings.get("prompt_n"), int):
            continue
        evaluated = timings["prompt_n"]
        if isinstance(timings.get("cache_n"), int):
            return evaluated, timings["cache_n"]
        if isinstance(obj.get("tokens_evaluated"), int):
            return evaluated, obj["tokens_evaluated"] - evaluated
        predicted = timings.get("predicted_n")
        if isinstance(obj.get("tokens_cached"), int) and isinstance(predicted, int):
            return evaluated, obj["tokens_cached"] - predicted - evaluated
        return evaluated, 0
    return None


class PoolClient(Client):
    """``Client`` that adds up the prompt counts of the answers it read (see the module)."""

    def __init__(self, url: str, profile: Profile, settings: BurstSettings, editor: int) -> None:
        super().__init__(url, profile, settings, editor)
        self.evaluated = self.cached = 0
        self.answers = 0  # completed answers that reported counts

    async def send(self, req: Req, keystroke: int, typed: str | None = None) -> bytes:
        data = await super().send(req, keystroke, typed)
        counts = prompt_counts(data) if data else None
        if counts is not None:
            self.evaluated += counts[0]
            self.cached += counts[1]
            self.answers += 1
        return data
