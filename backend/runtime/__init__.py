"""Worker processes and the bridge to them: dispatcher (event loop side), slot table,
supervisor, worker loop."""
