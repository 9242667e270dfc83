"""Several upstreams behind one queue: specs, routing, health (see docs/design.md)."""
