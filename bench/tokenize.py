"""``llmproxy bench tokenize``: what a special-token flood costs llama.cpp's tokenizer,
and what the backend's bounds (``backend/engines/llamacpp/bounds.py``) cost instead.

For each count N, a prompt of N ``--token`` strings (default ``<|im_end|>``) is tokenized
with special tokens parsed, as the backend tokenizes a completion or chat prompt (bare
llama-cpp-python, vocabulary only, in this process), and checked by ``TokenBounds`` (the
two linear scans the backend runs first; past ``n_ctx`` matches it refuses the prompt).
The tokenizer's time grows with the square of N (the ratio column: time / N^2, scaled to
the first row, stays near 1); the bounds' time grows linearly and stops at ``n_ctx``.
Nothing is started; one process, one thread of llama.cpp.

``--ttft`` measures instead what a flood does to a real backend: another request's time to
first token right after a flood's client left (``tokenize_ttft.py``).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from llmproxy.backend.engines.prompts import PromptTooLong


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tokenize", help="Special-token flood: tokenizer time vs the bounds")
    p.add_argument("--model", type=Path, default=None, help="GGUF (default: SmolLM2)")
    p.add_argument("--token", default="<|im_end|>", help="The string repeated")
    p.add_argument(
        "--counts", default="5000,10000,20000,40000", help="Repetitions, comma-separated"
    )
    p.add_argument("--n-ctx", type=int, default=2048, help="Context the bounds check against")
    p.add_argument(
        "--ttft",
        action="store_true",
        help="Time to first token of a short request after a flood, on a real backend",
    )
    p.add_argument(
        "--ttft-n-ctx", type=int, default=16384, help="--ttft: the started backend's n_ctx"
    )
    p.add_argument("--url", default=None, help="--ttft: a running backend (with --metrics) instead")
    p.set_defaults(func=main)


def _timed(fn: object, *args: object) -> tuple[float, object]:
    t0 = time.perf_counter()
    try:
        out = fn(*args)  # type: ignore[operator]
    except PromptTooLong as exc:
        out = exc
    return time.perf_counter() - t0, out


def main(args: argparse.Namespace) -> int:
    if args.ttft:
        import asyncio

        from llmproxy.bench.tokenize_ttft import run

        return asyncio.run(run(args, [int(c) for c in args.counts.split(",")]))
    import llama_cpp

    from llmproxy.backend.engines.llamacpp.bounds import TokenBounds
    from llmproxy.backend.model_path import resolve_model

    model = resolve_model(args.model)
    llm = llama_cpp.Llama(model_path=str(model), vocab_only=True, verbose=False)
    bounds = TokenBounds(llm._model.vocab, args.n_ctx)
    print(
        f"model {model.name}  token {args.token!r}  longest token "
        f"{bounds.longest_token_bytes} bytes  n_ctx {args.n_ctx}"
    )
    print(f"{'N':>8} {'bytes':>9} {'tokenize s':>11} {'s/N^2 (rel)':>12} {'bounds ms':>10}  bounds")
    base = None
    for n in (int(c) for c in args.counts.split(",")):
        data = (args.token * n).encode()
        t_tok, toks = _timed(llm.tokenize, data, False, True)
        t_chk, res = _timed(bounds.check, data, True)
        rel = t_tok / n**2
        base = base or rel
        verdict = "refused" if isinstance(res, PromptTooLong) else "passed"
        n_toks = len(toks) if isinstance(toks, list) else 0
        print(
            f"{n:>8} {len(data):>9} {t_tok:>11.3f} {rel / base:>12.2f} "
            f"{t_chk * 1000:>10.2f}  {verdict} ({n_toks} tokens)"
        )
    return 0
