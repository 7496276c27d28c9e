"""Tensor and pipeline parallelism: how ranks split the model, the rank processes, the
pipeline stages, and the step plans rank 0 sends the others."""
