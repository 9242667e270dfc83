"""Monitoring routes through a real server: /health, /props, /slots, /v1/models, and the
model names a request may give."""

from __future__ import annotations

from typing import Any


def test_health_props_models(backend: Any) -> None:
    assert backend.get("/health") == (200, {"status": "ok"})
    status, props = backend.get("/props")
    assert status == 200
    assert props["total_slots"] == 1
    assert props["model_path"].endswith(".gguf") or props["model_path"]
    assert props["default_generation_settings"]["n_ctx"] == 2048
    assert props["engine"]["name"] == backend.engine
    status, models = backend.get("/v1/models")
    assert status == 200 and models["object"] == "list"
    assert models["data"][0]["id"] == props["model_alias"]
    slots = backend.slots()
    assert [s["id"] for s in slots] == [0]
    assert slots[0]["is_processing"] is False


def test_model_names_accepted(backend: Any) -> None:
    _, props = backend.get("/props")
    for name in (props["model_alias"], props["model_path"]):
        status, body = backend.post(
            "/v1/completions", {"prompt": "x", "max_tokens": 1, "model": name}
        )
        assert status == 200, body


def test_any_model_name_answers_as_llama_server(backend: Any) -> None:
    """One model is loaded: the name is not checked (minuet-ai.nvim sends "PLACEHOLDER")
    and is echoed back; /v1/models still lists the real one."""
    status, body = backend.post(
        "/v1/completions", {"prompt": "x", "max_tokens": 1, "model": "PLACEHOLDER"}
    )
    assert status == 200 and body["model"] == "PLACEHOLDER", body
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    status, body = backend.post("/v1/chat/completions", {**chat, "model": "PLACEHOLDER"})
    assert status == 200 and body["model"] == "PLACEHOLDER", body
    _, props = backend.get("/props")
    _, models = backend.get("/v1/models")
    assert [m["id"] for m in models["data"]] == [props["model_alias"]]
