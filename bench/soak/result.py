"""What ``llmproxy bench soak`` saw, the invariants it checks and the table it prints.

``SoakResult`` gathers the client-side counts, the proxy's own counts by outcome (from
``/llmproxy/metrics``), the most generations the backend ran at once, the proxy's RSS and
its free permits; ``failures()`` lists the invariants that do not hold.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families


@dataclass
class SoakResult:
    capacity: int
    seconds: float = 0.0
    client: Counter[str] = field(default_factory=Counter)  # client-side: status code or 'aborted'
    outcomes: dict[str, float] = field(default_factory=dict)  # proxy metrics: outcome -> count
    max_concurrency: int = 0
    rss_start_kb: int = 0
    rss_end_kb: int = 0
    permits_free: int = -1
    # the proxy's log lines about failed requests
    error_lines: list[str] = field(default_factory=list)

    def failures(self) -> list[str]:
        bad = []
        if self.max_concurrency != self.capacity:
            bad.append(f"max upstream concurrency {self.max_concurrency} != N={self.capacity}")
        if self.permits_free != self.capacity:
            bad.append(f"permits free at the end {self.permits_free} != N={self.capacity}")
        if self.rss_end_kb >= self.rss_start_kb * 1.10:
            bad.append(f"proxy RSS grew {self.rss_start_kb} -> {self.rss_end_kb} kB (>= 10%)")
        sent, counted = sum(self.client.values()), sum(self.outcomes.values())
        if counted != sent:
            bad.append(
                f"proxy counted {counted:g} requests, clients sent {sent}: "
                "some were lost or double-counted"
            )
        if self.outcomes.get("error", 0):
            bad.append(f"{self.outcomes['error']:g} requests ended in error")
        return bad


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def outcomes_from_metrics(text: str) -> dict[str, float]:
    """Sum ``llmproxy_requests_total`` over routes, by outcome."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "llmproxy_requests_total":
                outcome = sample.labels["outcome"]
                out[outcome] = out.get(outcome, 0) + sample.value
    return out


def error_lines(log_path: Path, most: int = 10) -> list[str]:
    """The proxy child's warning/error log lines and canonical lines with outcome error."""
    keep = [
        ln
        for ln in log_path.read_text(errors="replace").splitlines()
        if '"outcome": "error"' in ln or '"level": "error"' in ln or '"level": "warning"' in ln
    ]
    return keep[:most]


def format_table(r: SoakResult) -> str:
    rows = [("duration (s)", f"{r.seconds:.1f}"), ("N (capacity)", str(r.capacity))]
    rows += [(f"proxy outcome {k}", f"{v:g}") for k, v in sorted(r.outcomes.items())]
    rows.append(("proxy requests counted", f"{sum(r.outcomes.values()):g}"))
    rows.append(("client requests sent", str(sum(r.client.values()))))
    rows += [(f"client saw {k}", str(v)) for k, v in sorted(r.client.items())]
    rows += [
        ("max upstream concurrency", str(r.max_concurrency)),
        ("permits free at end", str(r.permits_free)),
        ("proxy RSS start (kB)", str(r.rss_start_kb)),
        ("proxy RSS end (kB)", str(r.rss_end_kb)),
        (
            "proxy RSS growth",
            f"{(r.rss_end_kb / r.rss_start_kb - 1) * 100:+.1f}%" if r.rss_start_kb else "n/a",
        ),
    ]
    lines = [f"{k:<32}{v:>14}" for k, v in rows]
    bad = r.failures()
    lines.append("")
    lines += [f"FAIL: {b}" for b in bad] or ["all invariants hold"]
    if r.error_lines:
        lines += ["", "proxy log (warnings and errors, first 10):", *r.error_lines]
    return "\n".join(lines) + "\n"
