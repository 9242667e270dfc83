"""``llmproxy status``: the live page's picture as text, for a terminal without a browser.

Reads the first event of ``GET /llmproxy/events`` (the whole picture, the same the page
draws: proxy/http/picture.py), closes the stream and prints a table per upstream, the queue,
the requests of the last minutes by outcome, and what the proxy saved. ``--watch S`` prints
it again every S seconds until Ctrl-C. The key, where the proxy wants one, comes from
``--api-key-file`` or ``LLMPROXY_API_KEY`` (never from the command line, where other users
see it) and is sent in a header.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

DEFAULT_URL = "http://127.0.0.1:8080"
_ORDER = ("completed", "reused", "superseded", "cancelled", "error")


class StatusError(Exception):
    """The proxy could not be read: a line for the user, exit status 1."""


async def fetch_picture(url: str, key: str | None, timeout_s: float = 10.0) -> dict[str, Any]:
    """The proxy's picture: the first event of its event stream."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with (
            aiohttp.ClientSession(timeout=timeout) as http,
            http.get(url.rstrip("/") + "/llmproxy/events", headers=headers) as resp,
        ):
            if resp.status == 401:
                raise StatusError("the proxy wants a key: set LLMPROXY_API_KEY or --api-key-file")
            if resp.status != 200:
                raise StatusError(f"{url} answered {resp.status}: {(await resp.text())[:200]}")
            data = b""
            while not data.endswith(b"\n\n"):
                line = await resp.content.readline()
                if not line:
                    raise StatusError(f"{url} closed its event stream")
                data += line
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        raise StatusError(f"cannot read {url}: {exc or type(exc).__name__}") from None
    for text in data.decode().splitlines():
        if text.startswith("data: "):
            picture: dict[str, Any] = json.loads(text[len("data: ") :])
            return picture
    raise StatusError(f"{url} sent no picture")


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]


def _seconds(ms: float | None) -> str:
    return "" if ms is None else f"{ms / 1000:.1f} s"


def render(picture: dict[str, Any], url: str) -> str:
    """The picture as text (no colours, no cursor tricks: pipe it anywhere)."""
    out = [f"llmproxy at {url}"]
    for up in picture["upstreams"]:
        permits = up["permits"]
        health = "" if up["healthy"] else ", out of rotation"
        models = f"models {' '.join(up['models'])}, " if up.get("models") else ""
        if up.get("model_status"):  # a router's model: loaded, loading or unloaded
            models = f"model {up['models'][0]} {up['model_status']}, "
        out += ["", f"upstream {up['name']} ({up['kind']}, {models}"
                f"{permits['free']}/{permits['total']} permits free{health})"]  # fmt: skip
        rows = [["slot", "state", "session", "class", "route", "for", "tokens"]]
        for s in up["slots"]:
            tokens = s.get("tokens")
            rows.append([
                str(s["id"]), s["state"], s.get("session", ""), s.get("cls", ""),
                s.get("route", ""), _seconds(s.get("age_ms")),
                "" if tokens is None else str(tokens),
            ])  # fmt: skip
        out += _table(rows)
    places = picture["queue"]["places"]
    waiting = sum(p["kind"] == "waiting" for p in places)
    out += ["", f"queue: {waiting} waiting, {len(places) - waiting} held (at most "
            f"{picture['queue']['max']})"]  # fmt: skip
    if places:
        rows = [["#", "place", "session", "route", "waiting"]]
        for i, p in enumerate(places, 1):
            rows.append([str(i), p["kind"], p["session"], p.get("route", ""),
                         _seconds(p.get("age_ms"))])  # fmt: skip
        out += _table(rows)
    recent = Counter(row["outcome"] for row in picture["timeline"])
    if recent:
        kinds = ", ".join(f"{recent[k]} {k}" for k in _ORDER if recent[k])
        out += ["", f"last {len(picture['timeline'])} requests: {kinds}"]
    c = picture["counters"]
    lat = c["keystroke_ms"]
    latency = "-" if lat["p50"] is None else f"{lat['p50']} / {lat['p95']} ms (last {lat['n']})"
    outcomes = ", ".join(f"{c['outcomes'][k]} {k}" for k in _ORDER if c["outcomes"].get(k))
    out += ["", "what the proxy bought, since it started"]
    out += _table([
        ["generations never sent", str(c["never_sent"])],
        ["generations stopped early", str(c["stopped_early"])],
        ["tokens answered by type-through", f"{c['reused_tokens']} ({c['reused']} requests)"],
        ["keystroke latency p50 / p95", latency],
        ["requests", f"{c['requests']} ({outcomes})"],
    ])  # fmt: skip
    return "\n".join(out) + "\n"


def _key(args: argparse.Namespace) -> str | None:
    if args.api_key_file is not None:
        return Path(args.api_key_file).read_text().splitlines()[0].strip()
    return os.environ.get("LLMPROXY_API_KEY") or None


def run(args: argparse.Namespace) -> int:
    key = _key(args)
    try:
        while True:
            picture = asyncio.run(fetch_picture(args.url, key))
            text = render(picture, args.url)
            if args.watch:
                text = "\x1b[H\x1b[2J" + text if sys.stdout.isatty() else text + "\n"
            sys.stdout.write(text)
            sys.stdout.flush()
            if not args.watch:
                return 0
            time.sleep(args.watch)
    except StatusError as exc:
        sys.stderr.write(f"llmproxy status: {exc}\n")
        return 1
    except KeyboardInterrupt:
        return 0


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "status",
        help="Show a running proxy's slots, queue and counters (the live page, as text)",
        description="Show a running proxy's slots, queue, recent requests and what it saved: "
        "the picture /llmproxy/ draws, as text.",
    )
    parser.add_argument(
        "--url", default=os.environ.get("LLMPROXY_URL", DEFAULT_URL),
        help=f"the proxy's address (default: LLMPROXY_URL, else {DEFAULT_URL})",
    )  # fmt: skip
    parser.add_argument(
        "--api-key-file", type=Path, default=None,
        help="file whose first line is the proxy's key (default: LLMPROXY_API_KEY)",
    )  # fmt: skip
    parser.add_argument(
        "--watch", type=float, default=0, metavar="S", help="print it again every S seconds"
    )
    parser.set_defaults(func=run)
