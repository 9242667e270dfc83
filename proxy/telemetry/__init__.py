"""What requests did: the request record, the canonical request log and the Prometheus metrics."""
