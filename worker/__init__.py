"""The worker: engine, scheduler, KV cache, sampling, models."""
