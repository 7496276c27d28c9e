"""Multi-LoRA: adapters read from PEFT checkpoints, a host-memory pool, device slots, and the
per-row deltas the model's linear layers add (many adapters and the base model in one batch)."""
