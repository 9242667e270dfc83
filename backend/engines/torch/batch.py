"""Torch engine: the running batch, its KV slots and the model forward passes.

Every sequence that is prefilling or decoding owns one slot of the pre-allocated KV
store (``kv.SlotCache``), tokens left-aligned. The *decode rows* are always slots
``0 .. B-1`` (row i in slot i), so a decode step's attention reads a view of the store;
a prefilling sequence takes the highest free slot. Position ids are each row's real
positions and the 4-D attention mask hides every column past a row's own position, so a
sequence computes the same thing batched as alone (up to float rounding of different
matmul shapes).

* ``prefill`` runs one prompt chunk for each of several sequences in *one* forward
  (inputs left-padded to the longest chunk so that the last input is every row's last
  real token; ``logits_to_keep=1``). Padding tokens are written past their row's end,
  where nothing reads them before real tokens overwrite them.
* ``join`` moves a prefilled sequence's slot to slot ``B`` (one row copy; swapped with a
  prefilling sequence that sat there) and makes it a decode row.
* ``leave`` drops rows; the last row moves into each gap (one row copy).
* ``decode`` runs one token for every row: inputs and the mask come from pre-allocated
  buffers (``Buffers``; pinned host staging + device tensors on CUDA); the new keys and
  values are written in place (no per-step copy of the cache).

Single-threaded: owned by the engine, used only from the worker loop's thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from llmproxy.backend.engines.torch.kv import SlotCache, cache_keyword

if TYPE_CHECKING:
    from llmproxy.backend.engines.torch.engine import TorchSeq

INITIAL_COLUMNS = 256  # KV columns per slot before the first growth


class Buffers:
    """Pre-allocated input tensors for the decode hot path (no per-step allocation)."""

    def __init__(self, max_batch: int, n_ctx: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.device = device
        # row 0: tokens, row 1: positions
        self.host = torch.zeros((2, max_batch), dtype=torch.long, pin_memory=pin)
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
        # row i attends to its columns 0 .. lens[i] (its cache plus the new token)
        torch.le(self.arange[:width].unsqueeze(0), pos, out=mask)
        return ids, pos, mask.view(b, 1, 1, width)


class Batch:
    """The running decode batch (``rows``, their cache lengths ``lens``) and all KV slots."""

    def __init__(self, model: Any, device: torch.device, max_batch: int, n_ctx: int) -> None:
        self.model = model
        self.cache_keyword = cache_keyword(model)  # past_key_values | cache (by release)
        self.device = device
        self.buffers = Buffers(max_batch, n_ctx, device)
        dtype = next(model.parameters()).dtype
        self.kv = SlotCache(
            model, max_batch, device, dtype, cap=min(INITIAL_COLUMNS, n_ctx + 1), max_cap=n_ctx + 1
        )
        self.slots = torch.arange(max_batch, dtype=torch.long, device=device)
        # slot -> sequence (row or prefilling)
        self.owner: list[TorchSeq | None] = [None] * max_batch
        self.fill = [0] * max_batch  # slot -> columns holding that sequence's tokens
        self.rows: list[TorchSeq] = []
        self.lens: list[int] = []

    def __len__(self) -> int:
        return len(self.rows)

    def reserve(self, seq: TorchSeq) -> None:
        """Give a sequence that starts prefilling the highest free slot (``seq.slot``)."""
        s = max(i for i, o in enumerate(self.owner) if o is None)
        self.owner[s], self.fill[s], seq.slot = seq, 0, s

    def release(self, seq: TorchSeq) -> None:
        """A prefilling sequence is gone (cancelled): free its slot."""
        if 0 <= seq.slot < len(self.owner) and self.owner[seq.slot] is seq:
            self.owner[seq.slot] = None
        seq.slot = -1

    @torch.inference_mode()
    def prefill(self, parts: list[tuple[TorchSeq, list[int]]]) -> torch.Tensor:
        """Feed each ``(seq, ids)`` chunk after its ``fill`` columns, all in one forward;
        returns the (n, vocab) logits of each chunk's last token."""
        n, t = len(parts), max(len(ids) for _, ids in parts)
        ids_rows, cols, slots = [], [], []
        for seq, ids in parts:
            start, k = self.fill[seq.slot], len(ids)
            pad = t - k  # left padding: written past the row's end (start + k ..), never read
            ids_rows.append([0] * pad + ids)
            cols.append([start + k + j for j in range(pad)] + list(range(start, start + k)))
            slots.append(seq.slot)
            self.fill[seq.slot] = start + k
        width = max(max(c) for c in cols) + 1
        dev = self.device
        x = torch.as_tensor(ids_rows, dtype=torch.long, device=dev)
        pos = torch.as_tensor(cols, dtype=torch.long, device=dev)
        mask = (self.buffers.arange[:width].view(1, 1, width) <= pos.unsqueeze(2)).unsqueeze(1)
        slot_t = torch.as_tensor(slots, dtype=torch.long, device=dev)
        self.kv.plan(slot_t, pos, width, contiguous=slots == list(range(n)))
        out = self.model(
            input_ids=x,
            position_ids=pos,
            attention_mask=mask,
            use_cache=True,
            **{self.cache_keyword: self.kv},
            logits_to_keep=1,
        )
        return out.logits[:, -1].float().cpu()

    def join(self, seq: TorchSeq) -> None:
        """Make a fully prefilled sequence a decode row (moved to slot ``len(rows)``)."""
        b, s = len(self.rows), seq.slot
        if s != b:
            other = self.owner[b]
            if other is not None:  # a prefilling sequence sits there: exchange the slots
                self.kv.swap(b, s, max(self.fill[b], self.fill[s]))
                other.slot = s
            else:
                self.kv.move(b, s, self.fill[s])
            self.owner[s], self.owner[b] = other, seq
            self.fill[s], self.fill[b] = (self.fill[b] if other is not None else 0), self.fill[s]
        seq.slot = b
        self.rows.append(seq)
        self.lens.append(self.fill[b])

    def leave(self, rows: list[TorchSeq]) -> None:
        """Remove ``rows`` from the batch (finished or cancelled), keeping the others."""
        gone = {id(r) for r in rows}
        for i in reversed([i for i, r in enumerate(self.rows) if id(r) in gone]):
            last = len(self.rows) - 1
            if i != last:
                self.kv.move(i, last, self.lens[last])
                self.rows[i], self.lens[i] = self.rows[last], self.lens[last]
                self.rows[i].slot, self.owner[i], self.fill[i] = i, self.rows[i], self.lens[last]
            self.rows.pop()
            self.lens.pop()
            self.owner[last], self.fill[last] = None, 0

    @torch.inference_mode()
    def decode(self, tokens: list[int]) -> torch.Tensor:
        """One step for every row (``tokens[i]`` is row i's next input); (B, vocab) CPU logits."""
        b = len(tokens)
        width = max(self.lens) + 1
        ids, pos, mask = self.buffers.inputs(tokens, self.lens, width)
        self.kv.plan(self.slots[:b], pos, width, contiguous=True)
        out = self.model(
            input_ids=ids,
            position_ids=pos,
            attention_mask=mask,
            use_cache=True,
            **{self.cache_keyword: self.kv},
            logits_to_keep=1,
        )
        self.lens = [n + 1 for n in self.lens]
        self.fill[:b] = self.lens
        return out.logits[:, -1].float().cpu()
