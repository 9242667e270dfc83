"""The torch (transformers) engine: one worker process, ``max_batch_size`` slots, batched.

Concurrency contract: a plain synchronous class used from the worker loop's single
thread (``backend/runtime/worker.py``), which calls ``admit``/``cancel`` between ``step``s.
Each ``step`` is bounded: at most ``prefill_chunk`` prompt tokens of prefill plus one
decode token for every running sequence. Nothing here blocks except the model itself
(and, in static mode, a wait of at most ``max_batch_wait_ms`` for a batch to fill).

Request life: ``admit`` tokenizes and validates (too long -> ``Failed(400)``) and queues
the request (*waiting*). The scheduler moves it to *prefilling* (its own KV slot, one
chunk per step, interleaved with the batch's decode steps: stall-free) and, once its
prompt is in, samples its first token and joins it to the running *batch*
(``batch.Batch``). A finished or cancelled sequence leaves the batch at once.

Batching (``settings.batching``):
* ``continuous`` (default): a waiting request starts prefilling at the next step, as
  long as the batch has a free row (and, on GPU, the KV budget allows it).
* ``static``: requests are grouped: a group is flushed when ``max_batch_size`` are
  waiting or the oldest waited ``max_batch_wait_ms``; later requests wait until the
  whole group has finished.

``sleep`` frees the model (and GPU memory); the next ``admit`` reloads it.
"""

from __future__ import annotations

import gc
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmproxy.backend.engines.base import Engine
from llmproxy.backend.engines.sequence import Seq
from llmproxy.backend.engines.torch.loader import require_torch
from llmproxy.backend.protocol import EngineInfo, Event, Failed, Submit

if TYPE_CHECKING:
    from llmproxy.backend.engines.torch.batch import Batch
    from llmproxy.backend.engines.torch.sampling import Sampler
    from llmproxy.backend.engines.torch.text import PromptBuilder
    from llmproxy.backend.settings import BackendSettings


@dataclass(eq=False)
class TorchSeq(Seq):
    """A request of the torch engine: its sampler, its KV slot (``batch.Batch``) while
    prefilling or decoding, and the token its next decode step feeds."""

    sampler: Sampler
    slot: int = -1
    next_token: int = -1


def create_engine(settings: BackendSettings, worker_index: int = 0) -> TorchEngine:
    """Factory used by ``backend.engines.create_engine`` (resolves the default model)."""
    from llmproxy.backend.model_path import resolve_model

    return TorchEngine(settings, resolve_model(settings.model))


class TorchEngine(Engine):
    def __init__(self, settings: BackendSettings, model_path: Path) -> None:
        require_torch()
        self.settings = settings
        self.model_path = Path(model_path)
        self.alias = settings.model_alias or self.model_path.stem
        self.n_ctx = int(settings.n_ctx)
        self.max_batch = int(settings.max_batch_size)
        self.chunk = int(settings.prefill_chunk)
        self.static = settings.batching == "static"
        self.wait_s = float(settings.max_batch_wait_ms) / 1000.0
        self.waiting: deque[TorchSeq] = deque()
        self.prefilling: list[TorchSeq] = []
        self.batch: Batch | None = None
        self.prompts: PromptBuilder | None = None
        self.tokenizer: Any = None  # a transformers tokenizer
        self.kv_budget: int | None = None
        self.info: EngineInfo | None = None
        self.load_count = 0
        self.last_load: dict[str, Any] = {}

    # --- Engine interface ---------------------------------------------------------------

    def load(self, progress: Callable[[float], None]) -> EngineInfo:
        import torch

        from llmproxy.backend.engines.torch.batch import Batch
        from llmproxy.backend.engines.torch.loader import choose_placement, load_model
        from llmproxy.backend.engines.torch.memory import plan_memory
        from llmproxy.backend.engines.torch.text import PromptBuilder

        t0 = time.perf_counter()
        threads = self.settings.threads_per_worker()
        if threads > 0:
            torch.set_num_threads(threads)
        place = choose_placement(self.settings.device, self.settings.dtype)
        progress(0.05)
        loaded = load_model(self.model_path, Path(self.settings.cache_dir), place, progress)
        self.tokenizer = loaded.tokenizer
        self.prompts = prompts = PromptBuilder(
            loaded.tokenizer, loaded.add_bos, self.n_ctx, int(self.settings.n_predict_max)
        )
        self.batch = Batch(loaded.model, place.device, self.max_batch, self.n_ctx)
        plan = plan_memory(
            loaded.model, place.device, place.dtype, self.max_batch, self.chunk, self.n_ctx
        )
        self.kv_budget = plan.kv_budget_tokens
        progress(0.9)
        if self.settings.warmup:
            self._warmup()
        self.load_count += 1
        self.last_load = {
            "converted": loaded.converted,
            "seconds": time.perf_counter() - t0,
            "dir": loaded.source_dir,
        }
        progress(1.0)
        self.info = EngineInfo(
            model_path=str(self.model_path),
            model_alias=self.alias,
            n_ctx=self.n_ctx,
            has_fim=prompts.fim is not None,
            n_slots=self.max_batch,
            extra=(
                ("engine", "torch"),
                ("device", str(place.device)),
                ("dtype", str(place.dtype).removeprefix("torch.")),
                ("batching", "static" if self.static else "continuous"),
                ("max_batch_size", str(self.max_batch)),
                ("prefill_chunk", str(self.chunk)),
                ("n_threads", str(torch.get_num_threads())),
                ("weights_dir", str(loaded.source_dir)),
                ("weights_from_cache", str(not loaded.converted).lower()),
                ("chat_template", prompts.chat_template),
                ("infill", "fim" if prompts.fim else "prefix-only fallback"),
                *plan.facts,
            ),
        )
        return self.info

    def capacity(self) -> int:
        return self.max_batch

    def active(self) -> int:
        return (
            len(self.waiting)
            + len(self.prefilling)
            + (len(self.batch) if self.batch is not None else 0)
        )

    def active_ids(self) -> list[str]:
        rows = self.batch.rows if self.batch is not None else []
        return [s.rid for s in [*rows, *self.prefilling, *self.waiting]]

    def admit(self, submit: Submit) -> list[Event]:
        from llmproxy.backend.engines.prompts import admit_tokens
        from llmproxy.backend.engines.torch.sampling import Sampler
        from llmproxy.backend.engines.torch.text import Detokenizer

        if self.batch is None:  # asleep: reload first
            self.load(lambda _p: None)
        prompts = self.prompts
        assert prompts is not None
        p = submit.params
        admitted = admit_tokens(
            submit.request_id,
            lambda: prompts.tokens(submit.prompt, p.n_predict),
            p.n_predict,
            self.n_ctx,
            int(self.settings.n_predict_max),
        )
        if isinstance(admitted, Failed):
            return [admitted]
        tokens, cap = admitted
        seq = TorchSeq(submit, tokens, cap, Detokenizer(self.tokenizer), Sampler(p))
        if seq.n_predict <= 0:
            return seq.finish("limit")
        self.waiting.append(seq)
        return []

    def cancel(self, request_id: str) -> list[Event]:
        for group in (self.waiting, self.prefilling):
            for seq in list(group):
                if seq.rid == request_id:
                    group.remove(seq)
                    if group is self.prefilling:
                        assert self.batch is not None
                        self.batch.release(seq)
                    return seq.finish("cancelled", emit_held=False)
        if self.batch is not None:
            for seq in list(self.batch.rows):
                if seq.rid == request_id:
                    self.batch.leave([seq])
                    return seq.finish("cancelled", emit_held=False)
        return []

    def step(self) -> list[Event]:
        from llmproxy.backend.engines.torch.steps import run_step

        return run_step(self)

    def sleep(self) -> None:
        """Free the model (and GPU memory) while idle; ``admit`` reloads it."""
        if self.active():
            return
        self._unload()

    def close(self) -> None:
        self.waiting.clear()
        self.prefilling.clear()
        self._unload()

    # --- internals ---------------------------------------------------------------------

    def _unload(self) -> None:
        if self.batch is None:
            return
        device = self.batch.device
        self.batch = None
        self.tokenizer = None
        gc.collect()
        if device.type == "cuda":
            import torch

            torch.cuda.empty_cache()

    def _warmup(self) -> None:
        """Two short generations side by side: first-call costs of prefill, join and decode."""
        from llmproxy.backend.protocol import Prompt, SamplingParams

        for i in range(2):
            self.admit(
                Submit(
                    f"__warmup{i}",
                    i,
                    Prompt(kind="completion", text="Hello"),
                    SamplingParams(n_predict=3),
                )
            )
        while self.active():
            self.step()
