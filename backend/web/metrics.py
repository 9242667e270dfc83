"""GET /metrics: llama-server's Prometheus counters (``--metrics``; 501 without it).

Names, help texts and types are llama-server's (``llamacpp:`` prefix), so a dashboard or a
benchmark that reads one reads the other. The counters are the dispatcher's
(runtime/counters.py): every generation that ended, a cancelled one as far as it got. The
gauges are read when asked. Read-only.
"""

from __future__ import annotations

from aiohttp import web

from llmproxy.backend.web.context import DISPATCHER, SETTINGS
from llmproxy.backend.web.errors import error_response


async def metrics(request: web.Request) -> web.Response:
    if not request.app[SETTINGS].metrics:
        return error_response(
            501, "This server does not support metrics endpoint. Start it with `--metrics`"
        )
    d = request.app[DISPATCHER]
    c = d.counters
    counters = [
        ("prompt_tokens_total", "Number of prompt tokens processed, excluding cached tokens",
         c.prompt_tokens),
        ("prompt_tokens_cached_total", "Number of prompt tokens reused from the cache",
         c.prompt_tokens_cached),
        ("prompt_seconds_total", "Total time spent processing prompts", c.prompt_seconds),
        ("tokens_predicted_total", "Number of generation tokens processed", c.tokens_predicted),
        ("tokens_predicted_seconds_total", "Total time spent generating tokens",
         c.tokens_predicted_seconds),
    ]  # fmt: skip
    gauges = [
        ("prompt_tokens_seconds", "Average prompt throughput in tokens/s",
         c.prompt_tokens / c.prompt_seconds if c.prompt_seconds else 0.0),
        ("predicted_tokens_seconds", "Average generation throughput in tokens/s",
         c.tokens_predicted / c.tokens_predicted_seconds if c.tokens_predicted_seconds else 0.0),
        ("requests_processing", "Number of requests processing",
         sum(s.request is not None for s in d.slots)),
        # waiting for a slot, or tokenized before they take one
        ("requests_deferred", "Number of requests deferred", d.deferred + d.tokenizer.active),
    ]  # fmt: skip
    lines: list[str] = []
    for kind, items in (("counter", counters), ("gauge", gauges)):
        for name, help_, value in items:
            lines += [
                f"# HELP llamacpp:{name} {help_}",
                f"# TYPE llamacpp:{name} {kind}",
                f"llamacpp:{name} {value}",  # exact (llama-server: 6 digits)
            ]
    return web.Response(text="\n".join(lines) + "\n", content_type="text/plain", charset="utf-8")
