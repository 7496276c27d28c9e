"""From logits to text: the batched sampler, incremental detokenization and stop checks."""
