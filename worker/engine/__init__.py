"""The engine: the step loop, request intake, the output types, and the in-process APIs
(`LLM` for offline batches, `AsyncEngine` for servers)."""
