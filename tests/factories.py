"""Tiny Hugging Face checkpoints, a tokenizer, and the transformers oracle, for tests.

Everything is built on the fly (no hub): a byte-level BPE tokenizer trained in milliseconds on
a built-in corpus, random weights for one of the Llama-family model classes, and
`hf_greedy`, which runs transformers itself on the same checkpoint as the source of truth.

Two ways to get a checkpoint:

- ``build_checkpoint(tmp_path_factory.mktemp("llama"), family="llama")`` in a fixture, or
- ``cached_checkpoint(family="llama", ...)``: same arguments without the path; each distinct
  set is built once per test session under a temporary directory removed at exit.
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any, Literal

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GenerationConfig,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

Family = Literal[
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "gemma2",
    "gemma3_text",
    "phi3",
    "gpt_oss",
]

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
TOKENIZER_VOCAB_SIZE = 512

CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps in the warm afternoon sun, "
    "and the fox runs back into the forest before the farmer wakes up.",
    "Once upon a time there was a little town by the sea. Every morning the fishermen went "
    "out in their boats, and every evening they came home with nets full of silver fish.",
    "A serving engine batches requests from many users. It schedules prompts and decodes, "
    "keeps keys and values in a paged cache, and streams tokens back as soon as they exist.",
    "Numbers and symbols appear too: 0 1 2 3 4 5 6 7 8 9, 42, 3.14, 100%, (a + b) * c = d; "
    "email me at someone@example.com or visit https://example.org/path?query=1.",
    "She said, \"I don't think it's going to rain today.\" He replied, 'Let's hope not!' "
    "They walked to the market, bought bread, cheese, apples and tea, then went home.",
    "In the café, a naïve poet ordered a crème brûlée and wrote about the façade of the old "
    "théâtre. Über alles, señor, the piñata was jalapeño flavoured.",
    "日本語のテキストも少し含めます。東京は大きな都市です。今日は良い天気ですね。",
    "Emoji make multi-byte tokens: 🙂 😀 🚀 🎉 ❤️ 👍 — and some Greek: αβγ δέλτα, "
    "and Cyrillic: привет мир, and Arabic: مرحبا.",
    "def greet(name):\n    return f'Hello, {name}!'\n\nfor i in range(3):\n    print(greet(i))\n",
]

# (config class, model class); Any because transformers' own annotations do not type-check.
_HF_CLASSES: dict[str, tuple[Any, Any]] = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "mixtral": (MixtralConfig, MixtralForCausalLM),
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    "gemma2": (Gemma2Config, Gemma2ForCausalLM),
    "gemma3_text": (Gemma3TextConfig, Gemma3ForCausalLM),
    "phi3": (Phi3Config, Phi3ForCausalLM),
    "gpt_oss": (GptOssConfig, GptOssForCausalLM),
}

#: Random-weight scale. Larger than a trained init (0.02) so logits are peaked: greedy
#: output varies from token to token, and near-ties (where two implementations could
#: legitimately pick different argmaxes) are rare.
WEIGHT_STD = 0.15


#: A ChatML template, as Qwen's and SmolLM2's; `build_tokenizer(chat_template=True)` adds it
#: and its two markers as special tokens.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHAT_MARKERS = ["<|im_start|>", "<|im_end|>"]

#: ChatML with tools, Hermes style (as Qwen2.5's): the tools' JSON in the system turn, an
#: assistant's calls as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, tool
#: results in a user turn as ``<tool_response>``. `build_tokenizer(chat_template=
#: TOOLS_CHAT_TEMPLATE)` adds it; a worker reads its format as "hermes".
TOOLS_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "You may call functions. Their signatures are within <tools></tools>:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    "Call one as <tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    "<|im_end|>\n"
    "{% elif messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{% elif not (loop.first and message.role == 'system') %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}"
    "{% for call in message.tool_calls or [] %}"
    '<tool_call>\n{"name": "{{ call.function.name }}", "arguments": '
    "{{ call.function.arguments | tojson }}}\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(path: str | Path, chat_template: bool | str = False) -> PreTrainedTokenizerFast:
    """Train a deterministic byte-level BPE tokenizer on CORPUS and save it into ``path``
    (with a chat template if asked: True for ChatML, or the template's text, which uses
    ChatML's markers)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=[EOS_TOKEN, PAD_TOKEN, *(CHAT_MARKERS if chat_template else [])],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
    )
    if chat_template:
        wrapped.chat_template = chat_template if isinstance(chat_template, str) else CHAT_TEMPLATE
    wrapped.save_pretrained(str(path))
    return wrapped


def build_checkpoint(
    path: str | Path,
    family: Family = "llama",
    *,
    dtype: torch.dtype = torch.float32,
    tie_word_embeddings: bool = False,
    sharded: bool = False,
    rope_scaling: dict[str, Any] | None = None,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int = 128,
    max_position_embeddings: int = 512,
    seed: int = 0,
    chat_template: bool | str = False,
    sliding_window: int | None = None,
) -> Path:
    """A tiny random checkpoint of ``family`` with a tokenizer, saved into ``path``; with a
    ``sliding_window``, attention within it where the family's config puts it."""
    path = Path(path)
    tokenizer = build_tokenizer(path, chat_template)
    config_class, model_class = _HF_CLASSES[family]
    config = config_class(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim or hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        rope_parameters=_rope_parameters(family, rope_scaling),
        # (the window's keys override the family's defaults)
        **{
            **_family_kwargs(family, num_layers),
            **_window_kwargs(family, sliding_window),
            **_original_context(family, rope_scaling),
        },
    )
    torch.manual_seed(seed)
    model = model_class(config)
    _randomize(model, norm_center=0.0 if family.startswith("gemma") else 1.0)
    model.to(dtype)  # save_pretrained records the dtype in config.json
    model.save_pretrained(str(path), max_shard_size=_shard_size(model) if sharded else "50GB")
    _generation_config(tokenizer).save_pretrained(str(path))
    return path


def _family_kwargs(family: Family, num_layers: int) -> dict[str, Any]:
    """Each family's own switches; the mixtures' experts are small and several, so routing
    picks different experts per token (Qwen3-MoE with a dense layer, Qwen2-MoE with its
    shared expert and unnormalised top-k weights). Gemma's layers alternate sliding-window
    (8, shorter than most test prompts) and full attention, its scores scale by head_dim as
    in the real checkpoints (query_pre_attn_scalar = head_dim), and Gemma 2's caps are
    small enough to act on the tiny model's scores and logits."""
    if family == "gpt_oss":
        kinds = ["sliding_attention", "full_attention"]
        return {
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "swiglu_limit": 1.0,  # (low enough that the clamps act)
            "sliding_window": 8,
            "layer_types": [kinds[i % 2] for i in range(num_layers)],
        }
    if family in ("gemma2", "gemma3_text"):
        kinds = ["sliding_attention", "full_attention"]
        gemma = {
            "sliding_window": 8,
            "layer_types": [kinds[i % 2] for i in range(num_layers)],
            "query_pre_attn_scalar": 16,
        }
        if family == "gemma2":
            gemma.update(attn_logit_softcapping=1.0, final_logit_softcapping=5.0)
        return gemma
    if family == "mistral":
        return {"sliding_window": None}  # (the config's default window is 4096)
    if family == "qwen3":
        return {"attention_bias": False}
    if family == "mixtral":
        return {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}
    if family == "qwen2_moe":
        return {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 64,
            "norm_topk_prob": False,
        }
    if family == "qwen3_moe":
        return {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "mlp_only_layers": [1],
            "attention_bias": False,
        }
    return {}


def _original_context(family: Family, rope_scaling: dict[str, Any] | None) -> dict[str, Any]:
    """Phi-3's config keeps its own top-level original_max_position_embeddings (4096 by
    default), which wins over the rope dict's."""
    if (
        family != "phi3"
        or not rope_scaling
        or "original_max_position_embeddings" not in rope_scaling
    ):
        return {}
    return {"original_max_position_embeddings": rope_scaling["original_max_position_embeddings"]}


def _window_kwargs(family: Family, sliding_window: int | None) -> dict[str, Any]:
    """Mistral, Mixtral, Qwen3-MoE and Phi-3 window every layer; the other Qwens window the
    layers their ``max_window_layers`` picks (from it on in Qwen2/3, before it in Qwen2-MoE),
    so with 1 their layers alternate full and windowed attention; Gemma's and GPT-OSS's
    ``layer_types`` (`_family_kwargs`) alternate already."""
    if sliding_window is None:
        return {}
    if family in ("mistral", "mixtral", "qwen3_moe", "phi3"):
        return {"sliding_window": sliding_window, "use_sliding_window": True}
    if family in ("qwen2", "qwen3", "qwen2_moe"):
        return {
            "sliding_window": sliding_window,
            "use_sliding_window": True,
            "max_window_layers": 1,
        }
    if family in ("gemma2", "gemma3_text", "gpt_oss"):
        return {"sliding_window": sliding_window}
    raise ValueError(f"{family} has no sliding window")


def _rope_parameters(family: Family, rope_scaling: dict[str, Any] | None) -> dict[str, Any]:
    """transformers 5 keeps rope_theta inside rope_parameters with the scaling keys; Gemma 3
    keeps one such dict per layer type, the sliding-window layers' unscaled."""
    parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": 10000.0}
    parameters.update(rope_scaling or {})
    if family == "gpt_oss" and not rope_scaling:  # YaRN over a 128-token original context
        yarn = {"factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
        return {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "original_max_position_embeddings": 128,
            **yarn,
        }
    if family == "gemma3_text":
        local = {"rope_type": "default", "rope_theta": 10000.0}
        return {"full_attention": {**parameters, "rope_theta": 1e6}, "sliding_attention": local}
    return parameters


def _randomize(model: torch.nn.Module, norm_center: float) -> None:
    """Overwrite every parameter so each one matters: matrices and biases with noise, norm
    weights near norm_center (1, or 0 where the norm multiplies by 1 + w), not at it (so a
    loader that skipped one would be caught)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(norm_center + 0.2 * torch.randn_like(param))
            elif param.dim() == 1:
                param.copy_(0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, WEIGHT_STD)


def _shard_size(model: torch.nn.Module) -> int:
    """Bytes per shard so the checkpoint splits into several files."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return max(total // 3, 1)


def _generation_config(tokenizer: PreTrainedTokenizerFast) -> GenerationConfig:
    return GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


_CACHE: dict[str, Path] = {}


def cached_checkpoint(family: Family = "llama", **kwargs: Any) -> Path:
    """``build_checkpoint`` memoised per session: same arguments, same directory."""
    key = json.dumps({"family": family, **kwargs}, sort_keys=True, default=str)
    if key not in _CACHE:
        root = Path(tempfile.mkdtemp(prefix="headrace-ckpt-"))
        atexit.register(shutil.rmtree, root, ignore_errors=True)
        _CACHE[key] = build_checkpoint(root, family, **kwargs)
    return _CACHE[key]


def checkpoint_dtype(path: str | Path) -> torch.dtype:
    dtype = AutoConfig.from_pretrained(str(path)).dtype
    return getattr(torch, dtype) if isinstance(dtype, str) else (dtype or torch.float32)


def load_hf_model(path: str | Path, dtype: torch.dtype | None = None) -> Any:
    """The checkpoint in transformers, eager attention, in eval mode."""
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=dtype or checkpoint_dtype(path), attn_implementation="eager"
    )
    return model.eval()


def hf_greedy(
    path: str | Path,
    prompts_token_ids: list[list[int]],
    max_new_tokens: int,
    *,
    ignore_eos: bool = True,
) -> list[list[int]]:
    """The oracle: transformers' greedy generation, one prompt at a time (no padding).

    Returns only the new tokens. With ``ignore_eos`` every prompt runs the full
    ``max_new_tokens`` (EOS may still be generated, it just does not stop anything);
    otherwise generation stops after the checkpoint's EOS, which is included.
    """
    model = load_hf_model(path)
    if ignore_eos:
        # generate() fills every None in the config it is given from model.generation_config,
        # so passing eos_token_id=None alone would still stop at the checkpoint's EOS.
        model.generation_config.eos_token_id = None
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=model.generation_config.eos_token_id,
        pad_token_id=model.generation_config.pad_token_id,
    )
    outputs = []
    with torch.inference_mode():
        for prompt in prompts_token_ids:
            input_ids = torch.tensor([prompt], dtype=torch.long)
            generated = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                generation_config=config,
            )
            outputs.append(generated[0, len(prompt) :].tolist())
    return outputs
