"""The tables and the summary of ``llmproxy bench engine`` (llama-cpp engine).

``report(args, res)`` prints, from ``measure``'s samples: bare vs server decode tok/s,
TTFT (the overhead as the paired median of the first-token-only passes with its IQR, the
same for the decode passes' pairs, and the median over prompts of best server minus best
bare, since a busy machine only ever adds time), ms per token and cancel -> slot idle
p50 / p99 in tokens; where the time to the first token goes (the worker's own prompt time
vs HTTP + dispatch + queues); then ``n_batch`` vs llama-cpp-python's default. It returns
the summary (medians and ratios) that ``--json`` writes.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from llmproxy.bench.engine.bare import DEFAULT_N_BATCH
from llmproxy.bench.engine.measure import LONG_TOKENS
from llmproxy.bench.engine.server import PROMPTS


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))
    return xs[k]


def _diffs(a: list[float], b: list[float], n_dec: int) -> list[float]:
    """Paired a - b over the first-token-only passes (samples after ``n_dec``), else all."""
    pairs = list(zip(a, b, strict=True))
    return [x - y for x, y in (pairs[n_dec:] or pairs)]


def _best_diff(a: list[float], b: list[float]) -> float:
    """Median over prompts of (best of ``a`` - best of ``b``) for that prompt (samples cycle
    over PROMPTS)."""
    n = len(PROMPTS)
    return statistics.median(min(a[i::n]) - min(b[i::n]) for i in range(n))


def _paired(median_ms: float, best_of_ms: float) -> str:
    return f"{median_ms:+.2f} ms paired median, {best_of_ms:+.2f} best-of"


def _table(rows: list[tuple[str, str, str, str]], head: tuple[str, str]) -> None:
    w0 = max(len(r[0]) for r in rows)
    print(f"{'metric':<{w0}}  {head[0]:>10}  {head[1]:>14}  ratio")
    for r in rows:
        print(f"{r[0]:<{w0}}  {r[1]:>10}  {r[2]:>14}  {r[3]}")


def report(args: argparse.Namespace, res: dict[str, list[float]]) -> dict[str, Any]:
    """Print the tables; the summary."""
    nb = args.n_batch
    med = statistics.median
    bare_tps, srv_tps = med(res["bare_tps"]), med(res["srv_tps"])
    n_dec = args.rounds * len(PROMPTS)  # TTFT samples of the decode passes come first
    ttft_over = _diffs(res["srv_ttft"], res["bare_ttft"], n_dec)
    ttft_loose = _diffs(res["srv_ttft"][:n_dec], res["bare_ttft"][:n_dec], n_dec)
    ms_tok = med(res["bare_ms_tok"])
    c50, c99 = _pct(res["cancel_ms"], 0.5), _pct(res["cancel_ms"], 0.99)
    _table(
        [
            (
                "decode tok/s (median)",
                f"{bare_tps:.1f}",
                f"{srv_tps:.1f}",
                f"{100 * srv_tps / bare_tps:.1f}% (goal >= 95%)",
            ),
            (
                "TTFT ms (median)",
                f"{med(res['bare_ttft']):.2f}",
                f"{med(res['srv_ttft']):.2f}",
                f"{med(ttft_over):+.2f} ms paired median "
                f"(IQR {_pct(ttft_over, 0.25):+.1f}..{_pct(ttft_over, 0.75):+.1f}),"
                f" {_best_diff(res['srv_ttft'], res['bare_ttft']):+.2f} best-of (goal <= 5)",
            ),
            (
                "  same, pairs of the decode passes",
                "",
                "",
                f"{med(ttft_loose):+.2f} ms paired median (IQR "
                f"{_pct(ttft_loose, 0.25):+.1f}..{_pct(ttft_loose, 0.75):+.1f}; "
                "~1.5 s apart, noisier)",
            ),
            ("ms/token (median)", f"{ms_tok:.2f}", f"{1000.0 / srv_tps:.2f}", ""),
            (
                "cancel -> slot idle ms p50 / p99",
                "",
                f"{c50:.2f} / {c99:.2f}",
                f"{c50 / ms_tok:.2f} / {c99 / ms_tok:.2f} tokens (goal <= 2)",
            ),
        ],
        ("bare", "server"),
    )
    transport = [t - p for t, p in zip(res["srv_ttft"], res["srv_prompt_ms"], strict=True)]
    worker_vs_bare = _diffs(res["srv_prompt_ms"], res["bare_ttft"], n_dec)
    print(
        f"(server-side decode tok/s from its own timings: {med(res['srv_tps_internal']):.1f}; "
        f"TTFT inside the worker {med(res['srv_prompt_ms']):.2f} ms "
        f"({med(worker_vs_bare):+.2f} ms vs bare, paired), so HTTP + dispatch + queues add "
        f"{med(transport):.2f} ms median; prompt tokens evaluated "
        f"{min(res['srv_prompt_n'])}-{max(res['srv_prompt_n'])})"
    )
    summary: dict[str, Any] = {
        "n_batch": nb,
        "bare_tps": bare_tps,
        "server_tps": srv_tps,
        "tps_ratio": srv_tps / bare_tps,
        "bare_ttft_ms": med(res["bare_ttft"]),
        "server_ttft_ms": med(res["srv_ttft"]),
        "ttft_overhead_ms": med(ttft_over),
        "ttft_overhead_decode_passes_ms": med(ttft_loose),
        "ttft_overhead_best_of_ms": _best_diff(res["srv_ttft"], res["bare_ttft"]),
        "worker_prompt_vs_bare_ttft_ms": med(worker_vs_bare),
        "ms_per_token": ms_tok,
        "cancel_p50_ms": c50,
        "cancel_p99_ms": c99,
        "cancel_in_prompt_p50_ms": _pct(res["cancel_prompt_ms"], 0.5),
        "cancel_in_prompt_p99_ms": _pct(res["cancel_prompt_ms"], 0.99),
    }
    summary |= {"long_tps": max(res["long_tps"]), "long_chunk_ms": min(res["long_chunk_ms"])}
    print(
        f"\nn_batch {nb} vs llama-cpp-python's default {DEFAULT_N_BATCH} "
        f"(an engine setting; bare, same prompts; "
        f"long prompt = {LONG_TOKENS} tokens; best of 2 for the long prompt)"
    )
    rows = [("prefill tok/s, long prompt", f"{summary['long_tps']:.1f}", "", "")]
    if res["ref_ttft"]:
        cost = _diffs(res["bare_ttft"], res["ref_ttft"], n_dec)
        srv_ref = _diffs(res["srv_ttft"], res["ref_ttft"], n_dec)
        summary |= {
            "ref_ttft_ms": med(res["ref_ttft"]),
            "n_batch_ttft_cost_ms": med(cost),
            "n_batch_ttft_cost_best_of_ms": _best_diff(res["bare_ttft"], res["ref_ttft"]),
            "server_vs_ref_ttft_ms": med(srv_ref),
            "server_vs_ref_ttft_best_of_ms": _best_diff(res["srv_ttft"], res["ref_ttft"]),
            "ref_long_tps": max(res["ref_long_tps"]),
            "ref_long_chunk_ms": min(res["ref_long_chunk_ms"]),
        }
        rows = [
            (
                "TTFT ms (median)",
                f"{med(res['bare_ttft']):.2f}",
                f"{med(res['ref_ttft']):.2f}",
                _paired(summary["n_batch_ttft_cost_ms"], summary["n_batch_ttft_cost_best_of_ms"]),
            ),
            (
                "server TTFT vs bare at n_batch 512",
                f"{med(res['srv_ttft']):.2f}",
                f"{med(res['ref_ttft']):.2f}",
                _paired(summary["server_vs_ref_ttft_ms"], summary["server_vs_ref_ttft_best_of_ms"]),
            ),
            (
                "prefill tok/s, long prompt",
                f"{summary['long_tps']:.1f}",
                f"{summary['ref_long_tps']:.1f}",
                f"{100 * summary['long_tps'] / summary['ref_long_tps']:.1f}%",
            ),
            (
                "longest prompt chunk ms",
                f"{summary['long_chunk_ms']:.1f}",
                f"{summary['ref_long_chunk_ms']:.1f}",
                "a cancel during a prompt waits up to one chunk",
            ),
        ]
    rows.append(
        (
            "server: cancel in a prompt -> idle ms",
            f"{summary['cancel_in_prompt_p50_ms']:.1f} / {summary['cancel_in_prompt_p99_ms']:.1f}",
            "",
            "p50 / p99 at n_batch " + str(nb),
        )
    )
    _table(rows, (f"n_batch {nb}", f"n_batch {DEFAULT_N_BATCH}"))
    return summary
