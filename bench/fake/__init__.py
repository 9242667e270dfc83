"""The fake upstream: a test double of llama-server, OpenAI and Ollama backends.

Used by the tests and the benchmarks only; never by the product.
"""
