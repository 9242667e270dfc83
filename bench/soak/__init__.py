"""``llmproxy bench soak``: mixed editors against ``llmproxy serve`` for a while.

``rss_kb`` is also imported from here (tests/proxy/test_load.py).
"""

from llmproxy.bench.soak.result import rss_kb

__all__ = ["rss_kb"]
