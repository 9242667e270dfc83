"""The proxy's HTTP face: middleware, gated and passthrough handlers, admin endpoints,
request bodies, API keys."""
