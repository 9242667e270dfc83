"""Settings: flags > LLMPROXY_* env > TOML (--config) > defaults; --help documents all."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from llmproxy.proxy.cli import build_parser
from llmproxy.proxy.config import add_settings_arguments, settings_from_args
from llmproxy.proxy.sessions import is_warmup, session_key
from llmproxy.proxy.settings import ProxySettings


def load(argv: list[str]) -> ProxySettings:
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser, ProxySettings)
    return settings_from_args(ProxySettings, parser.parse_args(argv))


def test_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "llmproxy.toml"
    cfg.write_text('max_queue = 7\nqueue_timeout_s = 9.5\nport = 1111\nsupersede_routes = ["/infill"]\n')
    monkeypatch.setenv("LLMPROXY_QUEUE_TIMEOUT_S", "4")
    monkeypatch.setenv("LLMPROXY_PORT", "2222")
    s = load(["--config", str(cfg), "--port", "3333"])
    assert s.max_queue == 7  # TOML over default
    assert s.queue_timeout_s == 4  # env over TOML
    assert s.port == 3333  # flag over env
    assert s.supersede_routes == ["/infill"]
    assert s.host == "127.0.0.1"  # loopback by default
    with pytest.raises(Exception):
        s.port = 1  # frozen


def test_list_and_bool_flags() -> None:
    s = load(["--session-parts", "peer,model", "--no-supersede", "--api-key", "s3cr3t-key"])
    assert s.session_parts == ["peer", "model"] and s.supersede is False
    assert s.api_key is not None and s.api_key.get_secret_value() == "s3cr3t-key"
    assert "s3cr3t-key" not in repr(s)


def test_invalid_values_are_rejected(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A bad value ends the command with one readable line naming where it can be set, not a traceback."""
    with pytest.raises(SystemExit, match=r"--max-queue \(env LLMPROXY_MAX_QUEUE, config max_queue\): .*greater than or equal to 0; got '-1'"):
        load(["--max-queue", "-1"])
    monkeypatch.setenv("LLMPROXY_QUEUE_TIMEOUT_S", "soon")
    with pytest.raises(SystemExit, match=r"--queue-timeout-s .*valid number.*; got 'soon'"):
        load([])
    monkeypatch.delenv("LLMPROXY_QUEUE_TIMEOUT_S")
    with pytest.raises(SystemExit):
        load(["--supersede-inflight", "sometimes"])
    with pytest.raises(SystemExit, match="unknown session part.*usr_agent"):  # else every request would 500
        load(["--session-parts", "peer,usr_agent"])
    with pytest.raises(SystemExit, match=r"invalid settings:\n  confirm_poll_max_s must be >= confirm_poll_min_s"):
        load(["--confirm-poll-min-s", "0.5", "--confirm-poll-max-s", "0.1"])
    for bad in ("127.0.0.1:8012", "ftp://h/", "http://h/v1?x=1"):  # the proxy relays to http(s) origins only
        with pytest.raises(SystemExit, match=r"--upstream \(env LLMPROXY_UPSTREAM.*(http:// or https://|without a query)"):
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
    for name, field in ProxySettings.model_fields.items():
        assert "--" + name.replace("_", "-") in text, name
        assert f"LLMPROXY_{name.upper()}" in text, name


def test_session_key_parts_and_override() -> None:
    base = dict(parts=["peer", "user_agent", "authorization", "route_family", "model"],
                header_name="X-LLMProxy-Session", peer="127.0.0.1", path="/infill", body={"model": "m"})
    a = session_key(headers={"User-Agent": "curl/8"}, **base)
    assert a == session_key(headers={"User-Agent": "curl/8"}, **base)
    assert a != session_key(headers={"User-Agent": "axios/1"}, **base)
    assert a != session_key(headers={"User-Agent": "curl/8", "Authorization": "Bearer x"}, **base)
    assert a != session_key(headers={"User-Agent": "curl/8"}, **{**base, "path": "/v1/chat/completions"})
    # /completion and /v1/completions are one family: the same editor switching routes
    assert session_key(headers={}, **{**base, "path": "/completion"}) == session_key(
        headers={}, **{**base, "path": "/v1/completions"})
    explicit = session_key(headers={"X-LLMProxy-Session": "doc-1", "User-Agent": "a"}, **base)
    assert explicit == session_key(headers={"X-LLMProxy-Session": "doc-1", "User-Agent": "b"}, **base)
    only_peer = dict(base, parts=["peer"])
    assert session_key(headers={"User-Agent": "a"}, **only_peer) == session_key(headers={"User-Agent": "b"}, **only_peer)
    assert "Bearer" not in a


def test_warmup_detection() -> None:
    assert is_warmup({"n_predict": 0}) and is_warmup({"max_tokens": 0})
    assert not is_warmup({"n_predict": 1}) and not is_warmup({}) and not is_warmup({"n_predict": False})
