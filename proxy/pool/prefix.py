"""Estimating how much of a prompt an upstream holds in its prompt cache.

A prompt is cut into blocks of ``BLOCK_CHARS`` characters; block i's hash chains block i's
text onto block i - 1's hash, so a hash stands for the whole prefix up to its block (as
llm-d's prefix scorer does with token blocks). Each upstream keeps a ``PrefixIndex`` of the
hashes of the prompts it was sent, at most ``max_blocks`` (least recently used out): the
leading hashes of a new prompt found there tell how many characters of it that upstream
has seen lately. It is an estimate: the server may have evicted them, and only whole blocks
count.

Pure bookkeeping, no I/O; event loop thread only.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from typing import Any

from llmproxy.proxy.routes import ROUTES

BLOCK_CHARS = 64
MAX_BLOCKS = 8192  # per prompt: longer prompts count their first MAX_BLOCKS blocks


def prompt_text(route: str, body: Any) -> str:
    """The text a request's prompt cache entry starts with: ``/infill``'s ``input_extra``
    (its chunks' names and texts) + ``input_prefix`` + ``prompt``; a completion's ``prompt``;
    a chat's messages (serialized); "" for anything else."""
    if not isinstance(body, dict):
        return ""
    shape = ROUTES.get(route)
    if shape is not None and shape.prompt == "infill":
        extra = body.get("input_extra")
        parts = []
        if isinstance(extra, list):
            for chunk in extra:
                if isinstance(chunk, dict):
                    parts += [str(chunk.get("filename", "")), str(chunk.get("text", ""))]
        return "".join(parts) + _text(body.get("input_prefix")) + _text(body.get("prompt"))
    if "messages" in body:
        return json.dumps(body["messages"], sort_keys=True, ensure_ascii=False)
    return _text(body.get("prompt"))


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(v for v in value if isinstance(v, str))
    return ""


def block_hashes(text: str) -> list[bytes]:
    """The chained hashes of ``text``'s whole blocks (a partial last block is left out)."""
    hashes: list[bytes] = []
    previous = b""
    for start in range(0, min(len(text), BLOCK_CHARS * MAX_BLOCKS) - BLOCK_CHARS + 1, BLOCK_CHARS):
        block = text[start : start + BLOCK_CHARS].encode("utf-8", "surrogatepass")
        previous = hashlib.blake2b(previous + block, digest_size=8).digest()
        hashes.append(previous)
    return hashes


class PrefixIndex:
    """The block hashes one upstream was sent lately (LRU, at most ``max_blocks``)."""

    def __init__(self, max_blocks: int = 65536) -> None:
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, hashes: list[bytes]) -> int:
        """How many of ``hashes``' leading blocks are held (characters: x ``BLOCK_CHARS``)."""
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    def clear(self) -> None:
        """The upstream lost its prompt caches (a router unloaded the model)."""
        self._blocks.clear()

    def add(self, hashes: list[bytes]) -> None:
        """``hashes`` were sent to this upstream: most recently used now."""
        for h in hashes:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)
