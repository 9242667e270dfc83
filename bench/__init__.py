"""Benchmarks (``llmproxy bench ...``): ratios measured side by side in one run."""
