"""The result rows of ``llmproxy bench overhead`` and the table that judges them.

A ``Case`` holds one mode x concurrency x upstream pace, measured direct, through the
TCP relay ("raw"), the floor forwarder and the proxy. ``format_table`` prints one row per
case with the added latency, throughput ratio, CPU per request, the two references'
figures and the goals (judged on paced rows only; see run.py for why the instant rows are
not).
"""

from __future__ import annotations

from dataclasses import dataclass

from llmproxy.bench.loadgen import LoadResult

GOAL_ADDED_P50_MS = 1.0
GOAL_ADDED_P99_MS = 3.0
GOAL_THROUGHPUT_RATIO = 0.5


@dataclass(frozen=True)
class Case:
    mode: str
    concurrency: int
    direct: LoadResult
    proxied: LoadResult | None
    token_delay_ms: float = 0.0
    floor: LoadResult | None = None  # the featureless aiohttp forwarder, same load
    raw: LoadResult | None = None  # the TCP byte relay, same load

    @property
    def judged(self) -> bool:
        """Goals apply to paced upstreams; the instant profile is a CPU stress (see module doc)."""
        return self.token_delay_ms > 0

    @property
    def name(self) -> str:
        pace = f"{self.token_delay_ms:g}ms/tok" if self.token_delay_ms > 0 else "instant"
        return f"{pace} {self.mode} c={self.concurrency}"


def _added(direct: LoadResult, other: LoadResult) -> tuple[float, float, float]:
    """What ``other`` adds over ``direct``: p50 and p99 (ms), and its throughput ratio."""
    ratio = other.rps / direct.rps if direct.rps else float("nan")
    return (
        other.percentile_ms(50) - direct.percentile_ms(50),
        other.percentile_ms(99) - direct.percentile_ms(99),
        ratio,
    )


def _missed(added: tuple[float, float, float]) -> list[str]:
    """The goals (p50, p99, thr) that an ``_added`` result misses."""
    add50, add99, ratio = added
    return [
        name
        for name, ok in (
            ("p50", add50 <= GOAL_ADDED_P50_MS),
            ("p99", add99 <= GOAL_ADDED_P99_MS),
            ("thr", ratio >= GOAL_THROUGHPUT_RATIO),
        )
        if not ok
    ]


def _goals(case: Case) -> tuple[float, float, float, list[str]]:
    d, p = case.direct, case.proxied
    if p is None:
        return float("nan"), float("nan"), float("nan"), ["n/a"]
    add50, add99, ratio = added = _added(d, p)
    missed = _missed(added)
    marks = [f"{goal} {'FAIL' if goal in missed else 'PASS'}" for goal in ("p50", "p99", "thr")]
    if d.errors or p.errors:
        marks.append(f"ERRORS {d.errors}/{p.errors}")
    for name, ref in (("raw", case.raw), ("floor", case.floor)):
        if ref is not None and ref.errors:  # its columns count only the requests that succeeded
            marks.append(f"{name} ERRORS {ref.errors}")
    return add50, add99, ratio, marks


def _references_missing(case: Case) -> list[str]:
    """What the two references miss of the goals themselves, e.g. ``["floor misses p99"]``:
    a goal that even the bare stack (or the byte relay) misses is out of any proxy's reach
    on this machine under this load."""
    return [
        f"{name} misses {' '.join(missed)}"
        for name, ref in (("floor", case.floor), ("raw", case.raw))
        if ref is not None and (missed := _missed(_added(case.direct, ref)))
    ]


def _reference(direct: LoadResult, ref: LoadResult | None) -> tuple[float, float, float]:
    """A reference target's added p50, added p99 (ms) and CPU us/req; NaN when not measured."""
    if ref is None:
        return float("nan"), float("nan"), float("nan")
    add50, add99, _ratio = _added(direct, ref)
    return add50, add99, ref.cpu_us_per_request(1)


def format_table(cases: list[Case], loop: str) -> str:
    """The result table (one row per case) followed by the goals and an overall verdict.

    ``loop``: the event loop the proxy and both floors ran on (their ``--loop``).
    """
    head = (
        f"{'case':<26}{'n':>6}{'direct p50':>11}{'p99':>8}{'proxied p50':>12}{'p99':>8}"
        f"{'added p50':>10}{'p99':>8}{'rps direct':>11}{'proxied':>9}{'ratio':>7}"
        f"{'CPU us/req proxy':>17}{'fake':>6}{'floor +p50':>11}{'+p99':>7}{'CPU':>6}"
        f"{'raw +p50':>9}{'+p99':>7}{'CPU':>5}  goals"
    )
    lines = [head, "-" * len(head)]
    all_pass = True
    beyond: list[str] = []  # judged rows where a reference misses a goal too
    for case in cases:
        add50, add99, ratio, marks = _goals(case)
        if case.judged:
            all_pass = all_pass and all(m.endswith("PASS") for m in marks)
            if case.proxied is not None and (refs := _references_missing(case)):
                marks.append(f"({'; '.join(refs)})")
                beyond.append(case.name)
        else:
            marks = [*marks, "(not judged)"]
        d, p = case.direct, case.proxied
        n = f"{d.ok}" + ("*" if d.capped or (p is not None and p.capped) else "")
        proxy_cpu = p.cpu_us_per_request(1) if p else float("nan")
        floor50, floor99, floor_cpu = _reference(d, case.floor)
        raw50, raw99, raw_cpu = _reference(d, case.raw)
        p50, p99, p_rps = (
            (p.percentile_ms(50), p.percentile_ms(99), p.rps) if p else (float("nan"),) * 3
        )
        lines.append(
            f"{case.name:<26}{n:>6}"
            f"{d.percentile_ms(50):>11.2f}{d.percentile_ms(99):>8.2f}{p50:>12.2f}{p99:>8.2f}"
            f"{add50:>10.2f}{add99:>8.2f}{d.rps:>11.0f}{p_rps:>9.0f}{ratio:>7.2f}"
            f"{proxy_cpu:>17.0f}{d.cpu_us_per_request(0):>6.0f}"
            f"{floor50:>11.2f}{floor99:>7.2f}{floor_cpu:>6.0f}"
            f"{raw50:>9.2f}{raw99:>7.2f}{raw_cpu:>5.0f}  " + ", ".join(marks)
        )
    lines.append("")
    lines.append(
        f"latencies in ms; goals: added p50 <= {GOAL_ADDED_P50_MS} ms, "
        f"added p99 <= {GOAL_ADDED_P99_MS} ms, "
        f"proxied throughput >= {GOAL_THROUGHPUT_RATIO:.0%} of direct; "
        "* = stopped by the duration cap"
    )
    lines.append(
        "CPU us/req: user+system CPU per request of the proxy (proxied run) "
        "and of the fake (direct run); "
        "instant-upstream rows are a CPU stress, not judged "
        "(see `llmproxy bench overhead --help`)"
    )
    lines.append(
        "floor: the same load through a featureless aiohttp forwarder "
        "(bench/overhead/forwarder.py): the latency it adds "
        "over direct and its CPU us/req, i.e. what a hop through the proxy's HTTP stack "
        "(aiohttp server, upstream client) costs here before any proxy logic"
    )
    lines.append(
        "raw: the same load through a TCP byte relay (bench/overhead/splice.py): "
        "the loopback hop and one more process "
        "with no HTTP stack, the least any proxy on this loop could add"
    )
    lines.append(f"event loop of the proxy and the floors: {loop}")
    judged = [c for c in cases if c.judged and c.proxied is not None]
    verdict = (
        ("PASS" if all_pass else "FAIL")
        if judged
        else "n/a (no paced rows measured through the proxy)"
    )
    lines.append(f"overall (paced upstream rows): {verdict}")
    if beyond:
        lines.append(
            f"rows where a reference misses a goal too, in the same run: {', '.join(beyond)} "
            "('floor misses': no proxy built on this HTTP stack meets it "
            "on this machine under this load; "
            "'raw misses': not even a bare byte relay does)"
        )
    return "\n".join(lines) + "\n"
