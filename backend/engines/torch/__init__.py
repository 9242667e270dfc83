"""The torch (transformers) engine: continuous batching over a pre-allocated KV store."""
