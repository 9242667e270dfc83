"""Settings: flags > LLMPROXY_* env > TOML (--config) > defaults; --help documents all."""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from llmproxy.common.children import child_preexec
from llmproxy.common.config import add_settings_arguments, settings_from_args
from llmproxy.proxy.cli import build_parser
from llmproxy.proxy.gating.sessions import is_warmup, session_key
from llmproxy.proxy.settings import ProxySettings


def load(argv: list[str]) -> ProxySettings:
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser, ProxySettings)
    return settings_from_args(ProxySettings, parser.parse_args(argv))


def test_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "llmproxy.toml"
    cfg.write_text(
        'max_queue = 7\nqueue_timeout_s = 9.5\nport = 1111\nsupersede_routes = ["/infill"]\n'
    )
    monkeypatch.setenv("LLMPROXY_QUEUE_TIMEOUT_S", "4")
    monkeypatch.setenv("LLMPROXY_PORT", "2222")
    s = load(["--config", str(cfg), "--port", "3333"])
    assert s.max_queue == 7  # TOML over default
    assert s.queue_timeout_s == 4  # env over TOML
    assert s.port == 3333  # flag over env
    assert s.supersede_routes == ["/infill"]
    assert s.host == "127.0.0.1"  # loopback by default
    with pytest.raises(ValidationError, match="frozen"):
        s.port = 1


def test_list_and_bool_flags() -> None:
    s = load(["--session-parts", "peer,model", "--no-supersede", "--api-key", "s3cr3t-key"])
    assert s.session_parts == ["peer", "model"] and s.supersede is False
    assert s.api_key is not None and s.api_key.get_secret_value() == "s3cr3t-key"
    assert "s3cr3t-key" not in repr(s)


def test_invalid_values_are_rejected(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A bad value ends the command with one readable line naming where it can be set, not a
    traceback."""
    with pytest.raises(
        SystemExit,
        match=r"--max-queue \(env LLMPROXY_MAX_QUEUE, config max_queue\): "
        r".*greater than or equal to 0; got '-1'",
    ):
        load(["--max-queue", "-1"])
    monkeypatch.setenv("LLMPROXY_QUEUE_TIMEOUT_S", "soon")
    with pytest.raises(SystemExit, match=r"--queue-timeout-s .*valid number.*; got 'soon'"):
        load([])
    monkeypatch.delenv("LLMPROXY_QUEUE_TIMEOUT_S")
    with pytest.raises(SystemExit):
        load(["--supersede-inflight", "sometimes"])
    # else every request would 500
    with pytest.raises(SystemExit, match="unknown session part.*usr_agent"):
        load(["--session-parts", "peer,usr_agent"])
    with pytest.raises(
        SystemExit, match=r"invalid settings:\n  confirm_poll_max_s must be >= confirm_poll_min_s"
    ):
        load(["--confirm-poll-min-s", "0.5", "--confirm-poll-max-s", "0.1"])
    # the proxy relays to http(s) origins only
    for bad in (
        "127.0.0.1:8012",
        "ftp://h/",
        "http://h/v1?x=1",
    ):
        with pytest.raises(
            SystemExit,
            match=r"--upstream \(env LLMPROXY_UPSTREAM.*(http:// or https://|without a query)",
        ):
            load(["--upstream", bad])
    assert load(["--upstream", "https://u:p@h:1/base"]).upstream == "https://u:p@h:1/base"
    cfg = tmp_path / "typo.toml"
    cfg.write_text("max_queu = 3\n")
    with pytest.raises(SystemExit, match="unknown setting 'max_queu' in the config file"):
        load(["--config", str(cfg)])


def test_help_documents_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = capsys.readouterr().out
    for name in ProxySettings.model_fields:
        assert "--" + name.replace("_", "-") in text, name
        assert f"LLMPROXY_{name.upper()}" in text, name


def test_session_key_parts_and_override() -> None:
    base = dict(
        parts=["peer", "user_agent", "authorization", "route_family", "model"],
        header_name="X-LLMProxy-Session",
        peer="127.0.0.1",
        path="/infill",
        body={"model": "m"},
    )
    a = session_key(headers={"User-Agent": "curl/8"}, **base)
    assert a == session_key(headers={"User-Agent": "curl/8"}, **base)
    assert a != session_key(headers={"User-Agent": "axios/1"}, **base)
    assert a != session_key(headers={"User-Agent": "curl/8", "Authorization": "Bearer x"}, **base)
    assert a != session_key(
        headers={"User-Agent": "curl/8"}, **{**base, "path": "/v1/chat/completions"}
    )
    # /completion and /v1/completions are one family: the same editor switching routes
    assert session_key(headers={}, **{**base, "path": "/completion"}) == session_key(
        headers={}, **{**base, "path": "/v1/completions"}
    )
    explicit = session_key(headers={"X-LLMProxy-Session": "doc-1", "User-Agent": "a"}, **base)
    assert explicit == session_key(
        headers={"X-LLMProxy-Session": "doc-1", "User-Agent": "b"}, **base
    )
    only_peer = dict(base, parts=["peer"])
    assert session_key(headers={"User-Agent": "a"}, **only_peer) == session_key(
        headers={"User-Agent": "b"}, **only_peer
    )
    assert "Bearer" not in a


def test_warmup_detection() -> None:
    assert is_warmup({"n_predict": 0}) and is_warmup({"max_tokens": 0})
    assert (
        not is_warmup({"n_predict": 1})
        and not is_warmup({})
        and not is_warmup({"n_predict": False})
    )


LLMPROXY = str(Path(sys.executable).with_name("llmproxy"))
BAD_TOML = "max_queue = 3\nport = \n"


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        (
            ["serve", "--config", "{bad}"],
            {},
            r"  --config: \S+bad\.toml is not valid TOML: Invalid value \(at line 2, column 8\)",
        ),
        (
            ["backend", "--config", "{bad}"],
            {},
            r"  --config: \S+bad\.toml is not valid TOML: Invalid value",
        ),
        (["bench", "soak", "--config", "{bad}"], {}, r"  --config: \S+bad\.toml is not valid TOML"),
        (["serve", "--config", "{missing}"], {}, r"  --config: file not found: \S+missing\.toml"),
        (
            ["serve", "--host", "127.0.0.1", "--host", "::1"],
            {},
            r"  --host is given more than once \(again as '::1'\); give it once",
        ),
        (
            ["backend", "--port", "0", "--port", "0"],
            {},
            r"  --port is given more than once \(again as '0'\); give it once",
        ),
        (
            ["serve", "--upstream", "http://127.0.0.1:9", "--log-json", "--no-log-json"],
            {},
            r"  --log-json is given more than once \(again as '--no-log-json'\)",
        ),
        (
            [
                "serve",
                "--upstream",
                "http://127.0.0.1:9",
                "--config",
                "{good}",
                "--config",
                "{good}",
            ],
            {},
            r"  --config is given more than once",
        ),
        (
            ["bench", "overhead", "--requests", "5", "--requests", "6"],
            {},
            r"  --requests is given more than once",
        ),
        (
            ["serve", "--upstream", "http://127.0.0.1:9"],
            {"LLMPROXY_SESSION_PARTS": "peer,model"},
            r"  env LLMPROXY_SESSION_PARTS: cannot parse 'peer,model' .*JSON",
        ),
        (
            ["serve", "--max-queue", "-1"],
            {},
            r"  --max-queue \(env LLMPROXY_MAX_QUEUE, config max_queue\): ",
        ),
        (
            ["backend", "--model", "{missing}"],
            {},
            r"llmproxy backend: model not found: \S+missing\.toml",
        ),
    ],
    ids=[
        "serve-toml",
        "backend-toml",
        "bench-toml",
        "no-config",
        "serve-twice",
        "backend-twice",
        "bool-twice",
        "config-twice",
        "bench-twice",
        "env-list",
        "bad-value",
        "backend-model",
    ],
)
async def test_startup_mistake_is_one_clear_line_and_status_2(
    tmp_path: Path, argv: list[str], env: dict[str, str], expected: str
) -> None:
    """Through the real CLI: every start-up mistake (a bad value, a flag given twice, a config
    file that is missing or not TOML, an env list that is not JSON) ends the command at once
    with status 2 and a line naming it; no traceback, nothing started."""
    (tmp_path / "bad.toml").write_text(BAD_TOML)
    (tmp_path / "good.toml").write_text("max_queue = 3\n")
    paths = {
        "bad": str(tmp_path / "bad.toml"),
        "good": str(tmp_path / "good.toml"),
        "missing": str(tmp_path / "missing.toml"),
    }
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LLMPROXY_")}
    proc = await asyncio.create_subprocess_exec(
        LLMPROXY,
        *(a.format(**paths) for a in argv),
        env={**clean, **env},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        preexec_fn=child_preexec(),
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        if proc.returncode is None:  # a server that started despite the mistake
            proc.kill()
            await proc.wait()
    text = err.decode()
    assert "Traceback" not in text, text
    assert (proc.returncode, out) == (2, b""), text
    assert re.match(expected, text.splitlines()[-1]), text
    if not expected.startswith("llmproxy backend:"):
        assert text.splitlines()[-2] == "llmproxy: invalid settings:", text


async def test_serve_embedded_backend_mistake_is_status_2(tmp_path: Path) -> None:
    """``llmproxy serve`` passes ``--model`` on to its embedded backend: a file that does not
    exist ends both with status 2 and the backend's line, no traceback from the proxy."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LLMPROXY_")}
    proc = await asyncio.create_subprocess_exec(
        LLMPROXY,
        "serve",
        "--port",
        "0",
        "--model",
        str(tmp_path / "none.gguf"),
        "--log-json",
        env=clean,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        preexec_fn=child_preexec(),
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 120)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    text = err.decode()
    assert "Traceback" not in text, text
    assert (proc.returncode, out) == (2, b""), text
    assert f"llmproxy backend: model not found: {tmp_path / 'none.gguf'}" in text.splitlines()
