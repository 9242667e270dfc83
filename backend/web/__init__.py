"""The backend's HTTP layer: llama-server and OpenAI routes over the dispatcher."""
