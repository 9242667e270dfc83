"""Torch engine: one scheduler step (admission policy, chunked prefill, batched decode).

``run_step(engine)`` is ``TorchEngine.step``: same single-thread contract (called by the
worker loop between inbound drains; bounded work per call):

1. schedule: move waiting requests to prefilling (continuous: whenever the batch has a
   free row and the KV budget allows; static: flush a group of up to ``max_batch_size``
   once the batch is empty and the group is full or its oldest member waited
   ``max_batch_wait_ms``);
2. prefill at most ``prefill_chunk`` prompt tokens (FIFO over prefilling sequences), the
   chunks of several sequences in one forward when padding them to one length wastes
   little (``_groups``); a sequence whose prompt is complete samples its first token and
   joins the batch;
3. one decode step for every row of the batch (greedy rows sampled with one argmax);
   rows that finish leave at once.

Each sampled token goes through ``Seq.accept`` (``engines/sequence.py``, shared with the
llama-cpp engine): EOS (unless ``ignore_eos``), stop words and ``n_indent``, the
``n_predict``/context limit, and ``t_max_predict_ms``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from llmproxy.backend.engines.torch.sampling import sample_rows
from llmproxy.backend.protocol import Event

if TYPE_CHECKING:
    from llmproxy.backend.engines.torch.engine import TorchEngine, TorchSeq

Part = tuple["TorchSeq", list[int]]  # a sequence and the prompt chunk it prefills

PAD_SLACK = 1.5  # prefill chunks share one forward while padded tokens <= 1.5 x real tokens


def _reserve(seq: TorchSeq) -> int:
    return len(seq.tokens) + seq.n_predict


def _kv_fits(engine: TorchEngine, seq: TorchSeq) -> bool:
    """The KV store (kv.py) always has ``max_batch`` slots of equal width: admitting
    ``seq`` may widen it to its longest reservation, by doubling; that must fit the budget."""
    if engine.kv_budget is None:
        return True
    batch = engine.batch
    assert batch is not None
    running = [*batch.rows, *engine.prefilling]
    if not running:
        return True  # always let one sequence run
    kv = batch.kv
    longest = max(_reserve(s) for s in [*running, seq]) + 1
    width = kv.cap if longest <= kv.cap else max(longest, min(2 * kv.cap, kv.max_cap or longest))
    return engine.max_batch * width <= engine.kv_budget


def _start(engine: TorchEngine, seq: TorchSeq) -> None:
    assert engine.batch is not None
    engine.batch.reserve(seq)
    seq.t_start = time.perf_counter()
    engine.prefilling.append(seq)


def schedule(engine: TorchEngine) -> None:
    waiting, batch = engine.waiting, engine.batch
    assert batch is not None
    if engine.static:
        if len(batch) or engine.prefilling or not waiting:
            return
        full = len(waiting) >= engine.max_batch
        if not full and time.perf_counter() - waiting[0].t_admit < engine.wait_s:
            return
        n = 0
        while waiting and n < engine.max_batch and _kv_fits(engine, waiting[0]):
            _start(engine, waiting.popleft())
            n += 1
        return
    while (
        waiting
        and len(batch) + len(engine.prefilling) < engine.max_batch
        and _kv_fits(engine, waiting[0])
    ):
        _start(engine, waiting.popleft())


def run_step(engine: TorchEngine) -> list[Event]:
    schedule(engine)
    batch = engine.batch
    assert batch is not None
    out: list[Event] = []
    if not engine.prefilling and not len(batch):
        if engine.waiting:  # static mode, group not due yet: wait (bounded) for it to fill
            due = engine.waiting[0].t_admit + engine.wait_s - time.perf_counter()
            time.sleep(min(max(due, 0.0), engine.wait_s))
        return out
    parts: list[Part] = []
    budget = engine.chunk
    for seq in engine.prefilling:
        if budget <= 0:
            break
        n = min(budget, len(seq.tokens) - seq.pos)
        parts.append((seq, seq.tokens[seq.pos : seq.pos + n]))
        budget -= n
    for group in _groups(parts):
        logits = batch.prefill(group)
        done_rows = []
        for i, (seq, ids) in enumerate(group):
            seq.pos += len(ids)
            if seq.pos == len(seq.tokens):
                done_rows.append(i)
        # only sequences whose prompt is complete draw a token (a seeded sampler's stream
        # must not depend on how its prompt was chunked)
        firsts = (
            sample_rows([group[i][0].sampler for i in done_rows], logits[done_rows])
            if done_rows
            else []
        )
        for i, first in zip(done_rows, firsts, strict=True):
            seq = group[i][0]
            engine.prefilling.remove(seq)
            if accept(engine, seq, first, out):
                batch.release(seq)
            else:
                batch.join(seq)
    if len(batch):
        logits = batch.decode([s.next_token for s in batch.rows])
        toks = sample_rows([s.sampler for s in batch.rows], logits)
        done = [s for s, tok in zip(batch.rows, toks, strict=True) if accept(engine, s, tok, out)]
        batch.leave(done)
    return out


def _groups(parts: list[Part]) -> list[list[Part]]:
    """Split this step's prefill chunks (FIFO) into forwards whose left padding stays small."""
    groups: list[list[Part]] = []
    cur: list[Part] = []
    longest = real = 0
    for part in parts:
        k = len(part[1])
        if cur and (len(cur) + 1) * max(longest, k) > PAD_SLACK * (real + k):
            groups.append(cur)
            cur, longest, real = [], 0, 0
        cur.append(part)
        longest, real = max(longest, k), real + k
    if cur:
        groups.append(cur)
    return groups


def accept(engine: TorchEngine, seq: TorchSeq, tok: int, out: list[Event]) -> bool:
    """Handle one sampled token (``Seq.accept``): emit text, decide whether ``seq`` is
    finished (True)."""
    assert engine.prompts is not None
    events, finished = seq.accept(
        tok, tok in engine.prompts.eog, len(seq.tokens) + seq.n_decoded, engine.n_ctx
    )
    seq.next_token = tok
    out.extend(events)
    return finished
