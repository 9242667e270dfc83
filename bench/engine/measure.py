"""The measurements of ``llmproxy bench engine`` (llama-cpp engine), bare and server in turn.

``measure(args, bare, ref, server)`` runs everything in one aiohttp session, one sample at
a time (the bare side blocks the event loop while it runs, so nothing overlaps):

* warm-up: one short generation on every side;
* ``--rounds`` passes over ``PROMPTS``, each prompt bare, then server (then bare at
  llama-cpp-python's default ``n_batch``, ``ref``, when ``--n-batch`` differs): TTFT,
  decode tok/s, ms per token, and the server's own timings;
* ``--ttft-rounds`` first-token-only passes whose bare / server pairs are ~0.3 s apart,
  the order alternating;
* ``--cancels`` cancellation samples (``Server.cancel_latency``);
* the ``n_batch`` section: prefill speed and the longest chunk of a ``LONG_TOKENS``-token
  prompt at both ``n_batch`` values (interleaved, best of two), then ten cancels a quarter
  of the way into that prompt, each with a distinct first token (no prompt-cache reuse).

It returns the raw samples by name (lists in measurement order).
"""

from __future__ import annotations

import argparse

from llmproxy.bench.engine.bare import Bare
from llmproxy.bench.engine.server import PROMPTS, Server
from llmproxy.bench.progress import Steps

LONG_TOKENS = 512  # the long prompt of the n_batch section


async def measure(
    args: argparse.Namespace, bare: Bare, ref: Bare | None, server: Server
) -> dict[str, list[float]]:
    """Bare / server (/ bare at the default n_batch) per prompt, then the cancel samples."""

    res: dict[str, list[float]] = {
        k: []
        for k in (
            "bare_ttft",
            "bare_tps",
            "bare_ms_tok",
            "srv_ttft",
            "srv_tps",
            "srv_tps_internal",
            "srv_prompt_ms",
            "srv_prompt_n",
            "ref_ttft",
            "cancel_ms",
            "cancel_prompt_ms",
        )
    }
    phases = 4  # the server's start, the rounds, first tokens and cancels, the long prompt
    with Steps(phases, "bench engine") as steps:  # on stderr, with the time left
        return await _measure(args, bare, ref, server, res, steps)


async def _measure(
    args: argparse.Namespace,
    bare: Bare,
    ref: Bare | None,
    server: Server,
    res: dict[str, list[float]],
    steps: Steps,
) -> dict[str, list[float]]:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        steps.step("the server loads")
        await server.wait_ready(session)
        # warm all sides (page cache, first-call costs)
        for b in (bare, ref):
            if b is not None:
                b.run(PROMPTS[-1], 8)
        await server.run(session, PROMPTS[-1], 8)
        steps.step(f"{args.rounds} rounds of {len(PROMPTS)} prompts")
        for _ in range(args.rounds):
            for prompt in PROMPTS:
                ttft, tps, ms_tok = bare.run(prompt, args.n_predict)
                res["bare_ttft"].append(ttft)
                res["bare_tps"].append(tps)
                res["bare_ms_tok"].append(ms_tok)
                ttft, tps, itps = await server.run(session, prompt, args.n_predict)
                res["srv_ttft"].append(ttft)
                res["srv_tps"].append(tps)
                res["srv_tps_internal"].append(itps)
                res["srv_prompt_ms"].append(server.last_prompt_ms)
                res["srv_prompt_n"].append(server.last_prompt_n)
                if ref is not None:
                    res["ref_ttft"].append(ref.ttft(prompt))
        steps.step(f"{args.ttft_rounds} first-token rounds, {args.cancels} cancels")
        for r in range(args.ttft_rounds):  # tight pairs: ~0.3 s apart, the order alternating
            for prompt in PROMPTS:
                if r % 2:
                    ttft, _tps, _itps = await server.run(session, prompt, 1)
                    res["bare_ttft"].append(bare.ttft(prompt))
                else:
                    res["bare_ttft"].append(bare.ttft(prompt))
                    ttft, _tps, _itps = await server.run(session, prompt, 1)
                res["srv_ttft"].append(ttft)
                res["srv_prompt_ms"].append(server.last_prompt_ms)
                res["srv_prompt_n"].append(server.last_prompt_n)
                if ref is not None:
                    res["ref_ttft"].append(ref.ttft(prompt))
        for _ in range(args.cancels):
            res["cancel_ms"].append(await server.cancel_latency(session))
        # the n_batch section: a long prompt, evaluated from scratch
        steps.step(f"a {LONG_TOKENS}-token prompt, bare and cancelled")
        text = "\n".join(PROMPTS)
        while len(bare.llm.tokenize(text.encode(), add_bos=False, special=True)) < LONG_TOKENS:
            text += "\n" + text
        toks = bare.llm.tokenize(text.encode(), add_bos=False, special=True)[:LONG_TOKENS]
        for key in ("long_tps", "long_chunk_ms", "ref_long_tps", "ref_long_chunk_ms"):
            res[key] = []
        # interleaved, best of two: the machine's noise only ever slows a side down
        for _ in range(2):
            for b, key in ((bare, "long"), (ref, "ref_long")):
                if b is not None:
                    tps, chunk_ms = b.prefill(toks)
                    res[key + "_tps"].append(tps)
                    res[key + "_chunk_ms"].append(chunk_ms)
        after_s = 0.25 * LONG_TOKENS / max(res["long_tps"])  # a quarter of the way into the prompt
        for i in range(10):  # a distinct first token each time: no prompt-cache reuse
            res["cancel_prompt_ms"].append(
                await server.cancel_in_prompt(session, f"{i}: {text}", after_s)
            )
    return res
