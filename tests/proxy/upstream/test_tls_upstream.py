"""An https upstream: its certificate is verified, and a connection answered with an error
before its large body was all out is not pooled.
"""

from __future__ import annotations

import asyncio
import ssl
import subprocess
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from tests.helpers.upstreams import client, fetch


@pytest.fixture
def tls_cert(tmp_path: Path) -> tuple[Path, Path]:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


async def test_an_early_error_answer_over_tls_does_not_pool_the_connection(
    tls_cert: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over TLS the unsent part of a large body cannot be seen (the TLS transport does not
    count the TCP buffer under it): a connection answered with an error before its large body
    was read is not reused, so the next request does not queue behind that body."""
    cert, key = tls_cert
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    done = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")  # the head only, for now
            writer.write(b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 0\r\n\r\n")
            await writer.drain()
            await done.wait()
        finally:
            writer.transport.abort()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=ctx)
    c = client(f"https://localhost:{server.sockets[0].getsockname()[1]}")
    try:
        assert await asyncio.wait_for(fetch(c, "POST", "/completion", b"x" * (16 << 20)), 10) == (
            413,
            b"",
        )
        assert c.idle == 0
    finally:
        done.set()
        c.close()
        server.close()
        await server.wait_closed()


async def test_https_upstream_is_verified(
    tls_cert: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    cert, key = tls_cert

    async def health(_request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_get("/health", health)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ctx).start()
    url = f"https://localhost:{runner.addresses[0][1]}"
    try:
        with pytest.raises(aiohttp.ClientConnectorError):  # a certificate nobody trusts: refused
            await fetch(client(url), "GET", "/health")
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # trusted by the default context
        assert await fetch(client(url), "GET", "/health") == (200, b'{"status": "ok"}')
    finally:
        await runner.cleanup()
