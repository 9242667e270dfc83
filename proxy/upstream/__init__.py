"""Talking to the upstream: the pooled client, one exchange (forward), the job that owns a
permit, the responder, adapters, detection and the embedded backend."""
