"""llmproxy.proxy: the gating reverse proxy (console script ``llmproxy``)."""
