"""The llama-cpp-python engine: one sequence per worker process, with prompt caching."""
