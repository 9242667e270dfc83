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

Token handling (``accept``) follows the llama-cpp engine (``stops``): EOS (unless ``ignore_eos``),
stop words with held-back partial matches, ``n_indent`` (text after a newline held until
its indentation is decided; an under-indented line is cut and ends the generation),
``n_predict``/context limit, and ``t_max_predict_ms`` (past it, stop on the next token
that has a newline).
"""

from __future__ import annotations

import time
from typing import Any

from llmproxy.backend.engines.stops import take_piece, time_up
from llmproxy.backend.engines.torch.sampling import sample_rows
from llmproxy.backend.protocol import Event

PAD_SLACK = 1.5  # prefill chunks share one forward while padded tokens <= 1.5 x real tokens


def _reserve(seq: Any) -> int:
    return len(seq.tokens) + seq.n_predict


def _kv_fits(engine: Any, seq: Any) -> bool:
    """The KV store (torch_kv.py) always has ``max_batch`` slots of equal width: admitting
    ``seq`` may widen it to its longest reservation, by doubling; that must fit the budget."""
    if engine.kv_budget is None:
        return True
    running = [*engine.batch.rows, *engine.prefilling]
    if not running:
        return True  # always let one sequence run
    kv = engine.batch.kv
    longest = max(_reserve(s) for s in [*running, seq]) + 1
    width = kv.cap if longest <= kv.cap else max(longest, min(2 * kv.cap, kv.max_cap or longest))
    return engine.max_batch * width <= engine.kv_budget


def _start(engine: Any, seq: Any) -> None:
    engine.batch.reserve(seq)
    seq.t_start = time.perf_counter()
    engine.prefilling.append(seq)


def schedule(engine: Any) -> None:
    waiting, batch = engine.waiting, engine.batch
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


def run_step(engine: Any) -> list[Event]:
    schedule(engine)
    batch = engine.batch
    out: list[Event] = []
    if not engine.prefilling and not len(batch):
        if engine.waiting:  # static mode, group not due yet: wait (bounded) for it to fill
            due = engine.waiting[0].t_admit + engine.wait_s - time.perf_counter()
            time.sleep(min(max(due, 0.0), engine.wait_s))
        return out
    parts: list[tuple[Any, list[int]]] = []
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


def _groups(parts: list[tuple[Any, list[int]]]) -> list[list[tuple[Any, list[int]]]]:
    """Split this step's prefill chunks (FIFO) into forwards whose left padding stays small."""
    groups: list[list[tuple[Any, list[int]]]] = []
    cur: list[tuple[Any, list[int]]] = []
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


def accept(engine: Any, seq: Any, tok: int, out: list[Event]) -> bool:
    """Handle one sampled token: emit text, decide whether ``seq`` is finished (True)."""
    now = time.perf_counter()
    if seq.n_decoded == 0 and not seq.t_first:
        seq.t_first = now
    p = seq.submit.params
    if tok in engine.prompts.eog and not p.ignore_eos:
        out.extend(engine._finish(seq, "eos"))
        return True
    seq.n_decoded += 1
    seq.next_token = tok
    piece = seq.detok.push(tok)
    events, stop, word = take_piece(seq, piece)
    out.extend(events)
    if stop is not None:  # a stop word, or a line indented less than n_indent (cut there)
        out.extend(engine._finish(seq, stop, emit_held=False, stopping_word=word))
        return True
    reason = None
    if seq.n_decoded >= seq.n_predict or len(seq.tokens) + seq.n_decoded >= engine.n_ctx:
        reason = "limit"
    elif time_up(piece, seq.t_first, now, p.t_max_predict_ms):
        reason = "time"  # only on a token with a newline: the answer ends on a line boundary
    if reason is None:
        return False
    out.extend(engine._finish(seq, reason))
    return True
