"""The fake upstream: a labelled test double of llama-server, OpenAI and Ollama backends (tests and benches only)."""
