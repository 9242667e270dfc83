"""Worker processes and the bridge to them: dispatcher (event loop side), supervisor, worker loop."""
