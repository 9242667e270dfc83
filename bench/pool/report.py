"""Results of ``llmproxy bench pool``: one ``PoolTarget`` per proxy run, the table, the goals.

A target is one routing policy (``cache``, ``session``, ``least-busy``, ``round-robin``)
in front of the whole pool, or ``single``: a proxy in front of the first upstream alone.
Prompt counts are the fakes' own (characters, every generation that reached them) or,
with real backends, the completed answers' ``timings`` (tokens; abandoned generations
report nothing). Goals, judged on the same run: ``cache`` evaluates at most a quarter of
the prompt ``round-robin`` evaluates, its last-completion p50 is at most 0.7 x
``round-robin``'s, no upstream ever ran more generations at once than its slots (fakes
only: a real backend queues them itself and shows nothing), and no request failed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from llmproxy.bench.burst.report import TargetResult


@dataclass
class PoolTarget:
    name: str  # a --route policy, or "single"
    slots: int  # per upstream
    result: TargetResult
    counters: dict[str, Any]  # Upstreams.counters()
    answers: dict[str, int]  # prompt counts read from the completed answers
    routed: list[int] | None = None  # per upstream, from /llmproxy/status
    hit_estimate: list[float | None] | None = None  # the proxy's own, per upstream
    decisions: dict[str, int] = field(default_factory=dict)  # route_decision -> requests

    def summary(self) -> dict[str, Any]:
        s = self.result.summary()
        c, fakes = self.counters, self.counters.get("evaluated") is not None
        evaluated = c["evaluated"] if fakes else self.answers["evaluated"]
        cached = c["cached"] if fakes else self.answers["cached"]
        total = evaluated + cached
        peaks = c.get("max_concurrent")
        return {
            "target": self.name,
            "requests": s["requests"],
            "completed": s["completed"],
            "aborted": s["aborted"],
            "errors": s["errors"] + s["failed_bursts"],
            "last_p50_ms": s["last_p50_ms"],
            "last_p95_ms": s["last_p95_ms"],
            "prompt_unit": "chars" if fakes else "tokens",
            "prompt_evaluated": evaluated,
            "prompt_cached": cached,
            "evaluated_share": evaluated / total if total else math.nan,
            "prompt_sent": c.get("sent"),
            "generations": c.get("generations"),
            "answers_evaluated": self.answers["evaluated"],
            "answers_cached": self.answers["cached"],
            "answers": self.answers["answers"],
            "max_concurrent": peaks,
            "slots": self.slots,
            "oversubscribed": None if peaks is None else sum(p > self.slots for p in peaks),
            "routed": self.routed,
            "hit_estimate": self.hit_estimate,
            "decisions": self.decisions,
        }


def _le(value: float | None, limit: float) -> bool | None:
    return None if value is None else value <= limit


def goals(sums: list[dict[str, Any]]) -> list[tuple[str, float | None, bool | None]]:
    """(goal, measured value, passed; None: it cannot be judged on these targets)."""
    by = {s["target"]: s for s in sums}
    cache, rr = by.get("cache"), by.get("round-robin")
    share = p50 = None
    if cache is not None and rr is not None:
        if rr["prompt_evaluated"]:
            share = cache["prompt_evaluated"] / rr["prompt_evaluated"]
        if rr["last_p50_ms"] and not math.isnan(rr["last_p50_ms"]):
            p50 = cache["last_p50_ms"] / rr["last_p50_ms"]
    over = [s["oversubscribed"] for s in sums if s["oversubscribed"] is not None]
    over_total = float(sum(over)) if over else None  # None: real backends show nothing
    errors = float(sum(s["errors"] for s in sums))
    return [
        ("cache evaluates <= 0.25 x round-robin's prompt", share, _le(share, 0.25)),
        ("cache last p50 <= 0.7 x round-robin's", p50, _le(p50, 0.7)),
        ("no upstream above its slots", over_total, _le(over_total, 0)),
        ("no errors", errors, errors == 0),
    ]


def _num(v: Any, fmt: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return format(v, fmt)


def _per_upstream(values: list[Any] | None, fmt: str = "d") -> str:
    return " / ".join(_num(v, fmt) for v in values) if values else "n/a"


def format_table(sums: list[dict[str, Any]]) -> str:
    """The markdown table, a legend, then one line per goal."""
    unit = sums[0]["prompt_unit"] if sums else "chars"
    lines = [
        f"| target | last p50 ms | last p95 ms | prompt {unit} evaluated | cached | evaluated "
        "share | max at once per upstream | routed per upstream | route decisions | requests "
        "(completed / aborted) | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in sums:
        decisions = ", ".join(f"{k} {v}" for k, v in sorted(s["decisions"].items())) or "n/a"
        lines.append(
            f"| {s['target']} | {_num(s['last_p50_ms'], '.0f')} | {_num(s['last_p95_ms'], '.0f')} "
            f"| {s['prompt_evaluated']} | {s['prompt_cached']} "
            f"| {_num(s['evaluated_share'], '.2f')} | {_per_upstream(s['max_concurrent'])} "
            f"| {_per_upstream(s['routed'])} | {decisions} "
            f"| {s['requests']} ({s['completed']} / {s['aborted']}) | {s['errors']} |"
        )
    lines.append("")
    lines.append(
        "last = from a burst's last keystroke to the end of its final completion; prompt "
        + (
            "chars counted by the fakes (every generation that reached one)"
            if unit == "chars"
            else "tokens from the completed answers' timings (abandoned generations not counted)"
        )
        + "; routed and decisions from the proxy (/llmproxy/status, /llmproxy/metrics)"
    )
    for name, value, ok in goals(sums):
        verdict = "n/a" if ok is None else "PASS" if ok else "FAIL"
        lines.append(f"goal: {name:<48} {_num(value, '.2f'):>8}  {verdict}")
    return "\n".join(lines) + "\n"
