"""Torch engine: the running batch's shared KV cache and the model forward passes.

Layout: one ``DynamicCache`` for the whole running batch, shape ``(B, heads, L, dim)``
per layer, every row *right-aligned* (left-padded): row ``i`` holds its ``lens[i]``
tokens in columns ``L - lens[i] .. L-1`` and zeros before them, masked out by the
attention mask. Position ids are each row's real positions, so a sequence computes the
same thing batched as alone (up to float rounding of different matmul shapes).

* ``prefill_chunk`` runs one prompt chunk of a *single* sequence on its private cache
  (``logits_to_keep=1``: only the last position's logits are computed).
* ``join`` pads the prefilled private cache (or the batch) on the left to the common
  length and concatenates it as a new row: a copy once per join, not per step.
* ``leave`` drops rows (index_select) and trims columns that became padding for all.
* ``decode`` runs one token for every row: inputs come from pre-allocated buffers
  (``Buffers``; pinned host staging + device tensors on CUDA), the mask is computed into
  a pre-allocated buffer.

Single-threaded: owned by the engine, used only from the worker loop's thread.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache


class Buffers:
    """Pre-allocated input tensors for the decode hot path (no per-step allocation)."""

    def __init__(self, max_batch: int, n_ctx: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.device = device
        self.host = torch.zeros((2, max_batch), dtype=torch.long, pin_memory=pin)  # tokens, positions
        self.dev = torch.zeros((2, max_batch), dtype=torch.long, device=device)
        self.mask = torch.zeros(max_batch * (n_ctx + 1), dtype=torch.bool, device=device)
        self.arange = torch.arange(n_ctx + 1, dtype=torch.long, device=device)

    def inputs(self, tokens: list[int], lens: list[int], width: int) -> tuple[torch.Tensor, ...]:
        b = len(tokens)
        self.host[0, :b] = torch.as_tensor(tokens, dtype=torch.long)
        self.host[1, :b] = torch.as_tensor(lens, dtype=torch.long)
        self.dev[:, :b].copy_(self.host[:, :b], non_blocking=True)
        ids, pos = self.dev[0, :b].unsqueeze(1), self.dev[1, :b].unsqueeze(1)
        mask = self.mask[: b * width].view(b, width)
        # row i attends to its last lens[i] + 1 columns (its cache plus the new token)
        torch.ge(self.arange[:width].unsqueeze(0), width - 1 - pos, out=mask)
        return ids, pos, mask


def _kv(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def _pad_left(t: torch.Tensor, n: int) -> torch.Tensor:
    if n == 0:
        return t
    pad = torch.zeros((*t.shape[:2], n, t.shape[3]), dtype=t.dtype, device=t.device)
    return torch.cat([pad, t], dim=2)


class Batch:
    """The running decode batch: rows (sequence objects), their cache lengths, one cache."""

    def __init__(self, model: Any, device: torch.device, max_batch: int, n_ctx: int) -> None:
        self.model = model
        self.device = device
        self.buffers = Buffers(max_batch, n_ctx, device)
        self.rows: list[Any] = []
        self.lens: list[int] = []
        self.cache: DynamicCache | None = None
        self.width = 0  # L: columns in the shared cache

    def __len__(self) -> int:
        return len(self.rows)

    @torch.inference_mode()
    def prefill_chunk(self, cache: DynamicCache, ids: list[int], start: int) -> torch.Tensor:
        """Feed ``ids`` (positions ``start..``) into a single sequence's ``cache``; last logits."""
        x = torch.as_tensor([ids], dtype=torch.long, device=self.device)
        pos = torch.arange(start, start + len(ids), device=self.device).unsqueeze(0)
        out = self.model(input_ids=x, position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1].float().cpu()

    def join(self, row: Any, cache: DynamicCache, length: int) -> None:
        """Add a prefilled sequence (its private cache holds ``length`` tokens) as a row."""
        new = _kv(cache)
        if self.cache is None or not self.rows:
            self.cache, self.width = DynamicCache(ddp_cache_data=new), length
        else:
            width = max(self.width, length)
            merged = []
            for (bk, bv), (k, v) in zip(_kv(self.cache), new, strict=True):
                dk, dn = width - self.width, width - length
                merged.append(
                    (torch.cat([_pad_left(bk, dk), _pad_left(k, dn)]), torch.cat([_pad_left(bv, dk), _pad_left(v, dn)]))
                )
            self.cache, self.width = DynamicCache(ddp_cache_data=merged), width
        self.rows.append(row)
        self.lens.append(length)

    def leave(self, rows: list[Any]) -> None:
        """Remove ``rows`` from the batch (finished or cancelled), keeping the others."""
        gone = {id(r) for r in rows}
        keep = [i for i, r in enumerate(self.rows) if id(r) not in gone]
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in keep]
        self.lens = [self.lens[i] for i in keep]
        if not keep:
            self.cache, self.width = None, 0
            return
        width = max(self.lens)
        cut = self.width - width
        index = torch.as_tensor(keep, dtype=torch.long, device=self.device)
        for layer in self.cache.layers:  # type: ignore[union-attr]
            layer.keys = layer.keys.index_select(0, index)[:, :, cut:]
            layer.values = layer.values.index_select(0, index)[:, :, cut:]
        self.width = width

    @torch.inference_mode()
    def decode(self, tokens: list[int]) -> torch.Tensor:
        """One step for every row (``tokens[i]`` is row i's next input); (B, vocab) CPU logits."""
        width = self.width + 1
        ids, pos, mask = self.buffers.inputs(tokens, self.lens, width)
        out = self.model(
            input_ids=ids, position_ids=pos, attention_mask=mask, past_key_values=self.cache, use_cache=True,
            logits_to_keep=1,
        )  # fmt: skip
        self.width = width
        self.lens = [n + 1 for n in self.lens]
        return out.logits[:, -1].float().cpu()
