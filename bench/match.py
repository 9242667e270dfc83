"""``llmproxy bench match``: the type-through matcher's cost on hostile prompt pairs.

Two pairs per size N, as a client could send them to one session:
- ``8,000 'a's -> N 'a's``: an insertion of N - 8,000 characters into a run of one letter,
  where every place in the run is a cursor that fits (quadratic before the bound; now
  refused at once past ``MAX_TYPED``);
- ``N 'a's -> N + MAX_TYPED 'a's``: the longest insertion still matched, into N
  characters: the common prefix and suffix are found over all of them.
Time per call should grow no faster than N (the ``us/kB`` column stays flat). Nothing is
started: the matcher alone, in this process.
"""

from __future__ import annotations

import argparse
import time

from llmproxy.proxy.reuse.match import MAX_TYPED, typed


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("match", help="Type-through matcher: time on hostile prompt pairs")
    p.add_argument(
        "--sizes", default="100000,1000000,4000000,8000000", help="Prompt sizes, comma-separated"
    )
    p.add_argument("--repeat", type=int, default=3, help="Best of this many calls")
    p.set_defaults(func=main)


def _best(repeat: int, old: dict[str, object], new: dict[str, object]) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        typed("/completion", old, new)
        best = min(best, time.perf_counter() - t0)
    return best


def main(args: argparse.Namespace) -> int:
    print(f"MAX_TYPED {MAX_TYPED} characters; best of {args.repeat}")
    print(f"{'N':>9} {'8k->N ms':>10} {'N->N+max ms':>12} {'us/kB':>7}")
    for n in (int(s) for s in args.sizes.split(",")):
        short = {"prompt": "a" * 8000, "n_predict": 8}
        grown = {"prompt": "a" * n, "n_predict": 8}
        longest = {"prompt": "a" * (n + MAX_TYPED), "n_predict": 8}
        t_hostile = _best(args.repeat, short, grown)
        t_longest = _best(args.repeat, grown, longest)
        print(
            f"{n:>9} {t_hostile * 1000:>10.3f} {t_longest * 1000:>12.3f} "
            f"{t_longest * 1e6 / (n / 1000):>7.2f}"
        )
    return 0
