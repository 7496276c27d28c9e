"""The model families headrace runs, by config.json ``model_type``, and what each lacks.

Kept free of torch so ``headrace models list`` can say it without loading the worker;
`registry.MODEL_REGISTRY` maps the same names to the model that runs them.
"""

from __future__ import annotations

#: model_type -> what headrace runs of the family, and what it lacks (`headrace models list`).
FAMILIES: dict[str, str] = {
    "llama": "Llama 1-3 (Llama 3 and linear rope scaling)",
    "mistral": "Mistral (sliding window)",
    "qwen2": "Qwen2 / Qwen2.5 (sliding-window layers)",
    "qwen3": "Qwen3 (q/k norms, sliding-window layers)",
    "mixtral": "Mixtral (mixture of experts, sliding window); no LoRA on the experts",
    "qwen2_moe": "Qwen2-MoE (shared expert); no LoRA on the experts",
    "qwen3_moe": "Qwen3-MoE; no LoRA on the experts",
    "gemma2": "Gemma 2 (soft-capped scores and logits, local/global layers)",
    "gemma3_text": "Gemma 3 text (q/k norms, local/global layers with their own ropes)",
    "phi3": "Phi-3 (fused q/k/v and gate/up, sliding window); longrope within its original context",
    "gpt_oss": "GPT-OSS (attention sinks, biased experts); no MXFP4, no LoRA on the experts",
}
#: Families people ask for that headrace does not run yet.
NOT_YET = "deepseek_v3, llama4, gemma3 (vision), gpt_oss as MXFP4"
