"""Results of ``llmproxy bench burst``: what each request and burst saw, the summary, the table."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Req:
    editor: int
    burst: int
    keystroke: int
    t_sent: float
    t_done: float | None = None
    status: int | None = None
    outcome: str = "pending"  # ok | aborted | error
    tokens: int = 0
    # as the profile's client reads it (profiles.Seen): a suggestion shown, a cut one (from
    # a stream that ended in an error event), an error shown to the user
    shown: bool = False
    cut: bool = False
    error_shown: bool = False


@dataclass
class Burst:
    editor: int
    burst: int
    t_last_key: float
    latency_s: float | None = None  # None: the final completion failed


@dataclass
class TargetResult:
    url: str
    profile: str
    baseline_s: float
    t0: float
    reqs: list[Req] = field(default_factory=list)
    bursts: list[Burst] = field(default_factory=list)
    slots: dict[str, Any] | None = None  # SlotsPoller.summary(), None when /slots is unavailable
    counters: dict[str, Any] = field(default_factory=dict)  # counters.spent(); {}: no /metrics
    empty_suggestions: int = 0  # --typist follow: bursts with no suggestion to type

    def pct_ms(self, q: float) -> float:
        lat = sorted(b.latency_s for b in self.bursts if b.latency_s is not None)
        return lat[max(1, math.ceil(q / 100 * len(lat))) - 1] * 1000 if lat else math.nan

    def keystroke_ms(self, q: float) -> float:
        """Percentile of the keystrokes' own completion times (request sent to answer read);
        ``--typist follow`` only counts the typed keystrokes, not the suggestion."""
        lat = sorted(
            r.t_done - r.t_sent
            for r in self.reqs
            if r.outcome == "ok" and r.t_done is not None and r.keystroke > 0
        )
        return lat[max(1, math.ceil(q / 100 * len(lat))) - 1] * 1000 if lat else math.nan

    def summary(self) -> dict[str, Any]:
        delivered = sum(r.tokens for r in self.reqs if r.outcome == "ok")
        slots = self.slots or {}
        exact = "tokens_predicted" in self.counters
        generated = self.counters["tokens_predicted"] if exact else slots.get("tokens_decoded")
        return {
            "url": self.url,
            "profile": self.profile,
            "requests": len(self.reqs),
            "completed": sum(r.outcome == "ok" for r in self.reqs),
            "aborted": sum(r.outcome == "aborted" for r in self.reqs),
            "errors": sum(r.outcome == "error" for r in self.reqs),
            "failed_bursts": sum(b.latency_s is None for b in self.bursts),
            "suggestions_shown": sum(r.shown for r in self.reqs),
            "cut_suggestions_shown": sum(r.cut for r in self.reqs),
            "errors_shown": sum(r.error_shown for r in self.reqs),
            "empty_suggestions": self.empty_suggestions,
            "baseline_ms": self.baseline_s * 1000,
            "last_p50_ms": self.pct_ms(50),
            "last_p95_ms": self.pct_ms(95),
            "ratio_p50": self.pct_ms(50) / (self.baseline_s * 1000)
            if self.baseline_s
            else math.nan,
            "keystroke_p50_ms": self.keystroke_ms(50),
            "keystroke_p95_ms": self.keystroke_ms(95),
            "generations": slots.get("generations"),
            "generations_per_burst": (
                slots["generations"] / len(self.bursts)
                if slots.get("generations") is not None and self.bursts
                else None
            ),
            "max_running": slots.get("max_running"),
            "tokens_decoded": generated,
            "tokens_decoded_exact": exact,  # from /metrics; else a lower bound from /slots
            "prompt_tokens_evaluated": self.counters.get("prompt_tokens"),
            "tokens_delivered": delivered,
            "tokens_for_nobody": slots.get("tokens_for_nobody"),
        }


def follow_goals(sums: list[dict[str, Any]]) -> list[str]:
    """``--typist follow``: the first target has type-through on, the second off."""
    on, off = sums[0], sums[1]
    per_burst, p50 = on["generations_per_burst"], on["keystroke_p50_ms"]
    ratio = _share(on["tokens_decoded"], off["tokens_decoded"])
    checks = [
        ("generations per burst <= 1.2", per_burst, per_burst is not None and per_burst <= 1.2),
        ("keystroke p50 <= 20 ms", p50, not math.isnan(p50) and p50 <= 20),
        ("tokens decoded <= 1/5 of the second target's", ratio, ratio is not None and ratio <= 0.2),
    ]
    lines = []
    for name, value, ok in checks:
        shown = "n/a" if value is None else format(value, ".2f")
        lines.append(f"goal: {name:<46} {shown:>8}  {'PASS' if ok else 'FAIL'}")
    prompt = _share(on["prompt_tokens_evaluated"], off["prompt_tokens_evaluated"])
    if prompt is not None:
        lines.append(f"      {'prompt tokens evaluated, share of the second':<46} {prompt:>8.2f}")
    return lines


def _share(a: int | None, b: int | None) -> float | None:
    return a / b if a is not None and b else None


def format_table(results: list[TargetResult], follow: bool = False) -> str:
    """Side-by-side table, one column per target."""
    sums = [r.summary() for r in results]

    def num(v: Any, fmt: str) -> str:
        return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)

    rows = [
        ("target", lambda s: s["url"]),
        ("profile", lambda s: s["profile"]),
        ("requests sent", lambda s: str(s["requests"])),
        (
            "  completed / aborted / errors",
            lambda s: f"{s['completed']} / {s['aborted']} / {s['errors']}",
        ),
        ("uncontended generation ms", lambda s: num(s["baseline_ms"], ".0f")),
        ("last completion p50 ms", lambda s: num(s["last_p50_ms"], ".0f")),
        ("last completion p95 ms", lambda s: num(s["last_p95_ms"], ".0f")),
        ("p50 / uncontended", lambda s: num(s["ratio_p50"], ".2f") + "x"),
        ("failed bursts", lambda s: str(s["failed_bursts"])),
        (
            "client: shown / cut / errors",
            lambda s: (
                f"{s['suggestions_shown']} / {s['cut_suggestions_shown']} / {s['errors_shown']}"
            ),
        ),
        *(
            [("  empty suggestions, not typed", lambda s: str(s["empty_suggestions"]))]
            if follow
            else []
        ),
        ("keystroke p50 ms", lambda s: num(s["keystroke_p50_ms"], ".1f")),
        ("keystroke p95 ms", lambda s: num(s["keystroke_p95_ms"], ".1f")),
        ("backend generations", lambda s: num(s["generations"], "d")),
        ("  per burst", lambda s: num(s["generations_per_burst"], ".2f")),
        ("backend max at once", lambda s: num(s["max_running"], "d")),
        ("prompt tokens evaluated", lambda s: num(s["prompt_tokens_evaluated"], "d")),
        (
            "tokens decoded",
            lambda s: ("" if s["tokens_decoded_exact"] else ">=") + num(s["tokens_decoded"], "d"),
        ),
        ("tokens delivered", lambda s: num(s["tokens_delivered"], "d")),
        ("tokens for nobody (>=)", lambda s: num(s["tokens_for_nobody"], "d")),
    ]
    width = max(28, *(len(s["url"]) + 2 for s in sums))
    lines = [f"{name:<32}" + "".join(f"{get(s):>{width}}" for s in sums) for name, get in rows]
    lines.append("")
    lines.append(
        "last completion = from the burst's last keystroke to the end of the final completion; "
        "keystroke = a typed keystroke's request to its answer; "
        "client = what the emulated client makes of the answers it read to the end "
        "(suggestions it shows, those cut short by an error event, errors it shows the user); "
        "backend counts from GET /slots polling (n/a: not available), prompt tokens and "
        "tokens decoded exactly from GET /metrics where the backend serves it "
        "(>=: a lower bound from /slots)"
    )
    if follow and len(sums) >= 2:
        lines.extend(follow_goals(sums))
    return "\n".join(lines) + "\n"
