"""The bare side of ``llmproxy bench engine``: llama-cpp-python in this process, no server.

``Bare`` loads the model once with the same context, threads and ``n_batch`` as the
server side and times, with ``time.perf_counter`` around ``Llama.generate`` / ``Llama.eval``,
what the server side times through HTTP: the first token, decode speed, and a long
prompt's prefill in ``n_batch`` chunks. Every call blocks this thread.
"""

from __future__ import annotations

import time
from pathlib import Path

DEFAULT_N_BATCH = 512  # llama-cpp-python's Llama(n_batch=...) default


class Bare:
    def __init__(self, model: Path, n_ctx: int, n_threads: int, n_batch: int) -> None:
        import llama_cpp

        self.llm = llama_cpp.Llama(
            model_path=str(model),
            n_ctx=n_ctx,
            n_batch=n_batch,
            n_threads=n_threads,
            n_threads_batch=n_threads,
            verbose=False,
        )
        self.n_batch = n_batch

    def ttft(self, prompt: str) -> float:
        """ms from the text to the first sampled token (as ``run``; nothing decoded after it)."""
        return self.run(prompt, 1)[0]

    def prefill(self, tokens: list[int]) -> tuple[float, float]:
        """Evaluate ``tokens`` from an empty cache in ``n_batch`` chunks: (tok/s, longest
        chunk ms)."""
        llm = self.llm
        llm.reset()
        chunks: list[float] = []
        for i in range(0, len(tokens), self.n_batch):
            t0 = time.perf_counter()
            llm.eval(tokens[i : i + self.n_batch])
            chunks.append(time.perf_counter() - t0)
        llm.reset()
        return len(tokens) / sum(chunks), max(chunks) * 1000.0

    def run(self, prompt: str, n_predict: int) -> tuple[float, float, float]:
        """(ttft_ms, decode tok/s, ms per token)."""
        llm = self.llm
        t0 = time.perf_counter()
        toks = llm.tokenize(prompt.encode(), add_bos=llm._model.add_bos_token(), special=True)
        llm.set_seed(1)
        n = 0
        t_first = 0.0
        for tok in llm.generate(
            toks, temp=0.0, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0
        ):
            llm.detokenize([tok])
            n += 1
            if n == 1:
                t_first = time.perf_counter()
            if n >= n_predict:
                break
        t_end = time.perf_counter()
        dec = (t_end - t_first) / max(1, n - 1)
        return (t_first - t0) * 1000.0, 1.0 / dec if dec > 0 else float("nan"), dec * 1000.0
