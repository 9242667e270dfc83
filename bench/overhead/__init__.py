"""``llmproxy bench overhead``: the proxy's own cost against a direct connection and a bare
forwarder."""
