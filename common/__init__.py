"""Plumbing shared by every llmproxy process: layered settings, logging, event loops, port
file, child processes and the server lifecycle.

Imports nothing from the proxy, the backend or the benches.
"""
