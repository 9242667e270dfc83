"""``llmproxy bench engine``: the backend's engines, through HTTP and bare."""
