"""examples/: the Python clients run against a live ``llmproxy serve``; client configs point at it.

The code examples run as real subprocesses against a real ``llmproxy serve`` process
(upstream: the fake, so the test is quick; one slow test uses the embedded backend and
the real model). The editor configs are parsed and must name the proxy's address and a
route it gates.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from llmproxy.bench.fake.upstream import FakeUpstream, Script
from llmproxy.common.children import child_preexec
from llmproxy.proxy.reference import sample_toml
from llmproxy.proxy.settings import COMPLETION_ROUTES, ProxySettings
from tests.helpers.serve import serve

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
PROXY = "http://127.0.0.1:8080"  # `llmproxy serve`'s default address


async def run_example(name: str, url: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(EXAMPLES / name),
        url,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        preexec_fn=child_preexec(),
    )
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, err.decode()[-3000:]
    return out.decode()


async def test_python_examples_through_proxy(tmp_path: Path) -> None:
    script = lambda _p, _b: Script(tokens=6, token_delay_s=0.01)  # noqa: E731
    async with (
        FakeUpstream(slots=1, script=script) as fake,
        serve(tmp_path, "--upstream", fake.url) as (_p, url),
    ):
        out = await run_example("openai_stream.py", url)
        assert out == "t0 t1 t2 t3 t4 t5 \n"  # the fake's tokens, streamed through the proxy
        streamed = [g for g in fake.generations if g.path == "/v1/completions"]
        assert (
            len(streamed) == 1
            and streamed[0].body["stream"] is True
            and streamed[0].body["model"] == "fake"
        )

        before = len(fake.generations)
        out = await run_example("aiohttp_client.py", url)
        assert out.startswith(
            "def fibonacci(n):\n    return fibt0 t1 t2 t3 t4 t5 \n-- last completion in "
        )
        # keystrokes every 30 ms, each generation takes 60 ms: the proxy dropped superseded ones
        assert len(fake.generations) - before < len("return fib")
        assert fake.generations[-1].body["prompt"].endswith("return fib")


@pytest.mark.slow
async def test_python_examples_against_embedded_backend(tmp_path: Path) -> None:
    async with serve(tmp_path, "--parallel", "1") as (_p, url):
        out = await run_example("openai_stream.py", url)
        assert out.strip()
        out = await run_example("aiohttp_client.py", url)
        assert "-- last completion in " in out


def _proxy_urls(text: str) -> list[str]:
    return re.findall(r"http://127\.0\.0\.1:8080[^\s\"',]*", text)


# file -> the setting that must be there (the client appends its route where noted)
CONFIGS = {
    "llama.vim.vim": "'endpoint_fim': 'http://127.0.0.1:8080/infill',",
    "llama.vscode.settings.jsonc": '"llama-vscode.endpoint": "http://127.0.0.1:8080",',  # + /infill
    "continue.config.yaml": "apiBase: http://127.0.0.1:8080/",  # + completion
    "llm.nvim.lua": 'url = "http://127.0.0.1:8080",',  # llm-ls appends /v1/completions
    "lsp-ai.languages.toml": 'completions_endpoint = "http://127.0.0.1:8080/v1/completions"',
    "tabby.config.toml": 'api_endpoint = "http://127.0.0.1:8080"',  # + /completion
    "minuet.lua": 'end_point = "http://127.0.0.1:8080/v1/completions",',
}
# every URL in them (comments included) is the proxy's, on a route it serves
ROUTES = {"", "/", "/v1", "/v1/", "/v1/models", *COMPLETION_ROUTES}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_client_configs_point_at_the_proxy(name: str) -> None:
    text = (EXAMPLES / name).read_text()
    paths = {u.removeprefix(PROXY) for u in _proxy_urls(text)}
    assert CONFIGS[name] in text
    assert paths and paths <= ROUTES, paths
    assert "http://" not in re.sub(r"http://127\.0\.0\.1:(8080|11434)", "", text)
    if name.endswith(".toml"):
        tomllib.loads(text)
    elif name.endswith(".yaml"):
        cfg = yaml.safe_load(text)
        assert (
            cfg["models"][0]["apiBase"] == PROXY + "/"
            and "autocomplete" in cfg["models"][0]["roles"]
        )
    elif name.endswith(".jsonc"):
        cfg = json.loads(
            "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("//"))
        )
        assert cfg["llama-vscode.endpoint"] == PROXY


def test_examples_readme_links_every_example() -> None:
    readme = (EXAMPLES / "README.md").read_text()
    for path in EXAMPLES.iterdir():
        if path.name != "README.md":
            assert f"]({path.name})" in readme, path.name


def test_sample_config_is_current_and_valid(tmp_path: Path) -> None:
    text = (EXAMPLES / "llmproxy.toml").read_text()
    assert text == sample_toml()
    # uncomment every option that has a value: the file must still load as ProxySettings
    lines = [
        ln[2:]
        for ln in text.splitlines()
        if re.match(r"# [a-z_]+ = ", ln) and "unset by default" not in ln
    ]
    with_value = [
        n
        for n, f in ProxySettings.model_fields.items()
        if ProxySettings().model_dump()[n] is not None
    ]
    assert len(lines) == len(with_value)  # every option with a default value is present
    cfg = tmp_path / "all.toml"
    cfg.write_text("\n".join(lines) + "\n")
    target = type(
        "S", (ProxySettings,), {"model_config": {**ProxySettings.model_config, "toml_file": cfg}}
    )
    assert target().model_dump() == ProxySettings().model_dump()
