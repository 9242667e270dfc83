"""Torch engine: per-request token sampling (llama.cpp's default sampler order).

Each request has its own ``Sampler`` (its own seeded ``torch.Generator``), so requests in
one batch never share randomness and a seeded request reproduces alone or batched.
Order as llama.cpp: top_k -> top_p -> min_p -> temperature -> draw. ``temperature <= 0``
is greedy (argmax). Runs on CPU float32 logits of one row (the batch's logits are copied
to the host once per step); ``sample_rows`` picks the greedy rows of a batch with one
argmax over all of them.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from llmproxy.backend.protocol import SamplingParams


class Sampler:
    def __init__(self, params: SamplingParams) -> None:
        self.p = params
        self.greedy = params.temperature <= 0
        seed = (
            params.seed if params.seed is not None and params.seed >= 0 else random.getrandbits(63)
        )
        self.gen: Any = None if self.greedy else torch.Generator().manual_seed(int(seed))

    def __call__(self, logits: torch.Tensor) -> int:
        """Pick the next token from a 1-D float32 CPU logits row."""
        if self.greedy:
            return int(torch.argmax(logits))
        p = self.p
        vocab = logits.shape[-1]
        k = p.top_k if 0 < p.top_k < vocab else vocab
        vals, idx = torch.topk(logits, k)  # sorted, descending
        if p.top_p < 1.0:
            probs = torch.softmax(vals, dim=-1)
            cum = torch.cumsum(probs, dim=-1)
            # keep the smallest prefix whose mass reaches top_p (at least one token)
            n = int(torch.searchsorted(cum, torch.tensor([p.top_p], dtype=cum.dtype))[0]) + 1
            vals, idx = vals[: max(1, n)], idx[: max(1, n)]
        if p.min_p > 0.0 and vals.numel() > 1:
            probs = torch.softmax(vals, dim=-1)
            keep = probs >= p.min_p * probs[0]
            keep[0] = True  # the likeliest always stays (llama.cpp's min_keep), even for min_p > 1
            vals, idx = vals[keep], idx[keep]
        probs = torch.softmax(vals / p.temperature, dim=-1)
        choice = torch.multinomial(probs, 1, generator=self.gen)
        return int(idx[choice])


def sample_rows(samplers: list[Sampler], logits: torch.Tensor) -> list[int]:
    """Next token of every row of (B, vocab) ``logits``, row i drawn by ``samplers[i]``."""
    greedy = [i for i, s in enumerate(samplers) if s.greedy]
    out = [0] * len(samplers)
    if greedy:
        picked = (
            (logits if len(greedy) == len(samplers) else logits[greedy]).argmax(dim=-1).tolist()
        )
        for i, tok in zip(greedy, picked, strict=True):
            out[i] = tok
    for i, s in enumerate(samplers):
        if not s.greedy:
            out[i] = s(logits[i])
    return out
