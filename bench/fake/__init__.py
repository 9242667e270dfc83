"""The fake upstream: a test double of llama-server, OpenAI and Ollama backends, and the
fake router (router.py): llama-server's router mode, each model a fake upstream.

Used by the tests and the benchmarks only; never by the product.
"""
