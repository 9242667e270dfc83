"""Helpers for the backend tests: server processes (``server``), the HTTP API's response
shapes (``api``) and in-process engine drivers (``engine``)."""
