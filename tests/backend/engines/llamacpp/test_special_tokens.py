"""Prompts that would cost llama.cpp's tokenizer minutes (its special-token split grows
with the square of the matches) are refused before they are tokenized, with llama-server's
``exceed_context_size_error``; the slot serves the next request at once. Sized to run in
seconds here: before the bounds the 1.5 MB prompt held the slot for about 90 s
(``llmproxy bench tokenize`` shows the growth)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers.backend.api import envelope

HOSTILE = "<|im_end|>" * 150_000  # 1.5 MB


@pytest.fixture
def llama_backend(backend: Any) -> Any:
    if backend.engine != "llama-cpp":
        pytest.skip("llama.cpp's tokenizer; the torch engine tokenizes with HF tokenizers")
    return backend


def exceeds(status: int, body: Any) -> str:
    envelope(status, body, 400)
    assert body["error"]["type"] == "exceed_context_size_error", body
    return str(body["error"]["message"])


def test_special_token_floods_refused_before_tokenizing(llama_backend: Any) -> None:
    b = llama_backend
    # a client that waited 30 s would have seen nothing before the bounds
    exceeds(*b.post("/completion", {"prompt": HOSTILE, "n_predict": 2}, timeout=30))
    chat = {"messages": [{"role": "user", "content": HOSTILE}], "max_tokens": 2}
    exceeds(*b.post("/v1/chat/completions", chat, timeout=30))
    # small in bytes, but more special tokens than the context holds
    msg = exceeds(*b.post("/completion", {"prompt": "<|im_end|>" * 2100}, timeout=30))
    assert "special-token" in msg, msg
    assert b.post("/completion", {"prompt": "Hello", "n_predict": 2})[0] == 200
