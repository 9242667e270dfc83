"""Stream a completion through llmproxy with the official OpenAI Python SDK.

    python examples/openai_stream.py [BASE_URL] [PROMPT]

BASE_URL defaults to $LLMPROXY_URL or http://127.0.0.1:8080 (``llmproxy serve``'s
default). The SDK talks to ``BASE_URL/v1/completions``; llmproxy gates it and relays the
server-sent events chunk by chunk. Any API key works unless the proxy was started with
``--api-key``. Prints the text as it arrives; exits 1 if nothing came back.
"""

from __future__ import annotations

import os
import sys

from openai import OpenAI


def main(argv: list[str]) -> int:
    base = (
        argv[1] if len(argv) > 1 else os.environ.get("LLMPROXY_URL", "http://127.0.0.1:8080")
    ).rstrip("/")
    prompt = argv[2] if len(argv) > 2 else "def fibonacci(n):\n"
    client = OpenAI(
        base_url=base + "/v1", api_key=os.environ.get("LLMPROXY_API_KEY", "none"), max_retries=0
    )
    model = client.models.list().data[0].id  # the backend's model name
    pieces = 0
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=32, stream=True):
        if chunk.choices and chunk.choices[0].text:
            sys.stdout.write(chunk.choices[0].text)
            sys.stdout.flush()
            pieces += 1
    sys.stdout.write("\n")
    return 0 if pieces else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
