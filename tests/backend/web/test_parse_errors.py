"""Requests aiohttp's HTTP parser rejects before any middleware (bad framing, a bare CR in
a header, huge headers) get llama-server's JSON envelope from the real backend process,
as every other error, with the connection closed; the backend logs one warning line, no
traceback, and keeps serving."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.helpers.net import raw_exchange

BODY = b'{"prompt":"x","n_predict":1}'
CASES = [
    pytest.param(
        b"POST /completion HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 5\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        id="conflicting-framing",
    ),
    pytest.param(
        b"POST /completion HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n"
        b'5\r\n{"pro\r\nZZ-not-a-size\r\n\r\n',
        id="broken-chunk-size",
    ),
    pytest.param(
        b"POST /completion HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Evil: a\rInjected: 1\r\n"
        b"Content-Length: %d\r\n\r\n" % len(BODY) + BODY,
        id="bare-cr-in-header",
    ),
    pytest.param(
        b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n",
        id="huge-header",
    ),
    pytest.param(b"NOT A REQUEST LINE\r\n\r\n", id="bad-request-line"),
]


@pytest.mark.slow
@pytest.mark.parametrize("raw", CASES)
async def test_parser_errors_are_in_the_envelope(backend: Any, raw: bytes) -> None:
    resp = await raw_exchange(backend.url, raw)  # returns once the server closed it
    head, _, body = resp.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    assert 400 <= status < 500, resp[:300]
    assert b"application/json" in head.lower(), head
    err = json.loads(body)["error"]
    assert err["code"] == status and err["message"], err
    assert err["type"] == "invalid_request_error", err
    assert "Traceback" not in backend.log_path.read_text(errors="replace")
    assert backend.post("/completion", json.loads(BODY))[0] == 200
