"""The request head UpstreamClient writes: the target under the base URL's path, Basic
auth from credentials in the base URL, and only http(s) URLs with a host.
"""

from __future__ import annotations

import aiohttp
import pytest
from yarl import URL

from tests.helpers.upstreams import client, fetch, recorder


async def test_base_path_prefixes_the_target() -> None:
    async with recorder() as (rec, url):
        c = client(url + "/llama/")
        assert (await fetch(c, "POST", "/infill?x=1", b"{}"))[0] == 200
        c.close()
    assert rec.seen[0]["line"] == "POST /llama/infill?x=1"


async def test_credentials_in_the_base_url_become_basic_auth() -> None:
    async with recorder() as (rec, url):
        c = client(url.replace("http://", "http://user:s%20cret@"))
        assert (await fetch(c, "POST", "/x", b"{}", {"Authorization": "Bearer client"}))[0] == 200
        c.close()
    assert rec.seen[0]["headers"]["Authorization"] == aiohttp.encode_basic_auth("user", "s cret")
    assert rec.seen[0]["headers"]["Host"] == URL(url).host_port_subcomponent


def test_only_http_urls_with_a_host() -> None:
    for bad in ("ftp://h/", "unix:///tmp/s", "http:///x"):
        with pytest.raises(ValueError, match="http:// or https://"):
            client(bad)
