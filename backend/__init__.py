"""llmproxy.backend: the local model server (llama.cpp server API subset)."""
