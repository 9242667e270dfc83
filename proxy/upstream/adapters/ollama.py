"""Ollama backends: NDJSON streaming; no per-request stop confirmation (default finish)."""

from __future__ import annotations

from llmproxy.proxy.upstream.adapters.base import Adapter


class OllamaAdapter(Adapter):
    kind = "ollama"
