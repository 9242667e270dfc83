"""``llmproxy bench pool``: routing policies across several upstreams."""
