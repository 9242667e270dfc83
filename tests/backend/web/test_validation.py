"""Malformed requests through a real server: each is answered with llama-server's error
envelope and the right status, and the server keeps serving."""

from __future__ import annotations

from typing import Any

from tests.helpers.backend.api import envelope


def test_bad_input(backend: Any) -> None:
    envelope(*backend.post("/completion", b"{not json"), 400)
    envelope(*backend.post("/completion", b"[1, 2]"), 400)
    deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    envelope(*backend.post("/completion", deep), 400)
    envelope(*backend.post("/completion", {"n_predict": 4}), 400)  # no prompt
    envelope(*backend.post("/completion", {"prompt": "x", "temperature": "hot"}), 400)
    envelope(*backend.post("/completion", {"prompt": "x", "id_slot": 7}), 400)
    envelope(*backend.post("/nope", {}), 404)
    envelope(*backend.get("/nope"), 404)
    envelope(*backend.post("/v1/chat/completions", {"messages": "hi"}), 400)
    # beyond the context (n_ctx 2048): a long prompt, and n_predict past the end
    status, body = backend.post("/completion", {"prompt": "hello " * 3000, "n_predict": 4})
    envelope(status, body, 400)
    assert "context" in body["error"]["message"]
    # what Python's json reads but the model cannot take: NaN / inf numbers, an unpaired
    # surrogate (an editor cutting its text inside an emoji), token ids outside the vocabulary
    envelope(*backend.post("/completion", b'{"prompt": "x", "temperature": NaN}'), 400)
    envelope(*backend.post("/infill", b'{"input_prefix": "x = ", "t_max_predict_ms": NaN}'), 400)
    envelope(*backend.post("/completion", b'{"prompt": "x", "top_p": 1e400}'), 400)
    envelope(
        *backend.post("/completion", b'{"prompt": "x", "temperature": 1' + b"0" * 400 + b"}"), 400
    )
    envelope(
        *backend.post(
            "/infill", b'{"input_prefix": "x", "t_max_predict_ms": 1' + b"0" * 400 + b"}"
        ),
        400,
    )
    status, body = backend.post("/completion", {"prompt": "x", "n_predict": 1, "seed": 2**64 + 7})
    # a uint32, as llama-server's
    assert status == 200 and body["generation_settings"]["seed"] == 7, body
    envelope(
        *backend.post("/infill", b'{"input_prefix": "# smile \\ud83d", "input_suffix": ""}'), 400
    )
    envelope(*backend.post("/completion", {"prompt": [1, 10**6], "n_predict": 2}), 400)
    envelope(*backend.post("/completion", {"prompt": [-5], "n_predict": 2}), 400)
    status, body = backend.post(
        "/completion", b'{"prompt": "smile \\ud83d\\ude00", "n_predict": 1}'
    )
    assert status == 200, body  # a surrogate pair is one character
    # streamed requests that fail before the first token get a plain JSON error too
    envelope(*backend.post("/completion", {"prompt": "hello " * 3000, "stream": True}), 400)
    # the server is fine afterwards
    status, body = backend.post("/completion", {"prompt": "hello", "n_predict": 2})
    assert status == 200, body
