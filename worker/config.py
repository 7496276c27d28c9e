"""`EngineConfig`: how one engine is built. Built once, validated, passed down."""

from __future__ import annotations

import argparse
import math
import warnings
from dataclasses import InitVar, dataclass, field

import torch
from headrace.kernels.backend import (
    BACKEND_NAMES,
    cpu_kernels_error,
    triton_device_error,
    triton_interpreted,
)
from headrace.kernels.kv_layout import KV_CACHE_DTYPES
from headrace.kernels.precision import compute_dtype
from headrace.sdk.errors import InvalidArgumentError
from headrace.sdk.weights import check_version
from headrace.worker.distributed.nodes import NodeConfig
from headrace.worker.distributed.parallel import check_parallel_sizes
from headrace.worker.execution.cpu_threads import parse_cpu_list

#: Every spelling users reach for (torch's, NumPy's and the usual short ones).
_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}

#: The values of EngineConfig.quantization / ``--quantization``.
QUANTIZATIONS = ("auto", "none", "int8", "int4", "gguf")

#: The values of EngineConfig.scheduling_policy / ``--scheduling-policy``.
SCHEDULING_POLICIES = ("fcfs", "shortest-first")

#: A step's token budget when none is given, by device. A CPU's prefill step is long (2048
#: prompt tokens of SmolLM2-135M take about a second on two cores), and in a burst of
#: arrivals a prompt's first token waits for the end of the step its last chunk runs in: half
#: the budget shortens that wait (a burst's TTFT p50 0.84-0.87x in process, 0.94x served),
#: while the step's fixed cost (the weights read once, the host's work) stays about 1% of a
#: 1024-token step. On CUDA a step takes milliseconds and that fixed cost weighs more.
#: Measured in docs/decisions.md ("A CPU step holds 1024 tokens").
CPU_STEP_TOKENS = 1024
STEP_TOKENS = 2048


@dataclass(slots=True)
class EngineConfig:
    #: A local Hugging Face checkpoint directory, or a known short name (see `headrace models`).
    model: str
    #: "auto" (the checkpoint's float dtype; float32 on a CPU without native bf16 / fp16
    #: math), "float32" / "fp32", "bfloat16" / "bf16" or "float16" / "fp16".
    dtype: str = "auto"
    #: "auto" (CUDA when available, else CPU), "cpu", "cuda" or "cuda:N".
    device: str = "auto"
    #: How linear layers hold their weights (`QUANTIZATIONS`): "none" (the dtype above),
    #: "int8" (per output channel) or "int4" (groups of 32) quantized as they load, or "gguf"
    #: (the model's GGUF file as shipped: Q8_0 / Q4_0 / Q4_1 tensors kept in those layouts);
    #: "auto": "gguf" for a .gguf file, a compressed-tensors checkpoint's W4A16 / W8A16
    #: layers as stored, "none" for a float checkpoint.
    quantization: str = "auto"
    #: Quantized layers (int8, int4, a quantized GGUF, a compressed-tensors checkpoint) and a
    #: quantized LM head multiply activations quantized to int8 per block of 32 (llama.cpp's
    #: scheme, DashInfer's A8W8), by VNNI int8 dot products on the CPU: faster, and exact only
    #: to the activations' rounding (the float oracle's tokens may differ). CPU and reference
    #: kernels.
    int8_activations: bool = False
    #: How the KV cache stores K and V (`KV_CACHE_DTYPES`): "auto" in the dtype above, "int8"
    #: as int8 with a float32 scale per token and head (a quarter of float32's bytes, about
    #: half of bf16's; `headrace.kernels.kv_layout`).
    kv_cache_dtype: str = "auto"
    #: Tokens per KV block.
    block_size: int = 16
    #: KV blocks in the pool; None sizes it from the memory budget below.
    num_kv_blocks: int | None = None
    #: On CUDA: fraction of the device's free memory (after weights) given to the KV cache.
    gpu_memory_utilization: float = 0.9
    #: On CPU: GiB given to the KV cache.
    cpu_kv_cache_gib: float = 2.0
    #: Token budget of one engine step (prefill chunks + decodes); 0 takes the device's:
    #: `CPU_STEP_TOKENS` (1024) on a CPU, else `STEP_TOKENS` (2048).
    max_num_batched_tokens: int = 0
    #: Most sequences running at once.
    max_num_seqs: int = 256
    #: Longest sequence (prompt + output); None takes the model's max_position_embeddings.
    max_model_len: int | None = None
    #: Cut long prompts into chunks that share steps with decodes.
    enable_chunked_prefill: bool = True
    #: Reuse KV blocks of identical prompt prefixes across requests.
    enable_prefix_caching: bool = True
    #: The order waiting requests of one priority are admitted in (`SCHEDULING_POLICIES`):
    #: "shortest-first", those with the fewest tokens to compute first, but none ahead of a
    #: request that arrived more than shortest_first_window_s earlier (a request of n tokens
    #: counts as arriving window * n / max_model_len later; `scheduling/scheduler.py`): a
    #: burst of mixed lengths gets its median first token sooner for the same work
    #: (docs/decisions.md, "Waiting requests: first come first served, or shortest first");
    #: "fcfs", by arrival.
    scheduling_policy: str = "shortest-first"
    shortest_first_window_s: float = 10.0
    #: Seed of the engine's generator for requests that set no seed of their own.
    seed: int = 0
    #: The kernel set every part of the model and the sampler runs (attention, KV-cache
    #: writes, matmuls, RMSNorm, rotary, LoRA, the greedy head's argmax, the sampler's draw
    #: and grammar masks): "auto" (Triton on CUDA; on a CPU the C kernels, or the torch
    #: references where no C compiler builds them; the references elsewhere), "triton",
    #: "cpu" or "reference".
    kernel_backend: str = "auto"
    #: Ranks that split every layer's heads and MLP columns (one process each).
    tensor_parallel_size: int = 1
    #: Stages that split the layers into contiguous ranges (tensor_parallel_size ranks each).
    pipeline_parallel_size: int = 1
    #: Mixture-of-experts layers spread their experts over the tensor-parallel ranks (each
    #: holds num_experts / tensor_parallel_size whole experts) instead of a slice of every
    #: expert's intermediate dimension; attention stays split by heads (`layers/moe.py`).
    enable_expert_parallel: bool = False
    #: The nodes the ranks run on (one by default; `distributed/nodes.py`).
    nodes: NodeConfig = field(default_factory=NodeConfig)
    #: Micro-batches each step is cut into, so stages also overlap within a step. 1 by
    #: default: on CPU (measured) a half batch costs a stage nearly a whole one.
    pipeline_micro_batches: int = 1
    #: Steps submitted before the oldest is collected, each over different sequences, so
    #: stage 0 runs step k + 1 while later stages run step k; None: one per stage (two with
    #: overlap_steps).
    pipeline_steps_in_flight: int | None = None
    #: One rank only: run each step's device work (forward, LM head) on a device thread,
    #: two steps in flight over different halves of the sequences, so the host schedules,
    #: samples and detokenizes one half while the device computes the other. Off by default:
    #: on a 2-core CPU, where host and "device" share the cores, it cost 5-33% of tok/s in
    #: seven paired runs of the tiny bench. On CUDA the batch's host-to-device copies still
    #: wait for the running step (one stream); hiding them too needs pinned buffers and a
    #: copy stream. Not with LoRA yet (building a step may refill an adapter's device slot).
    overlap_steps: bool = False
    #: Speculative decoding: tokens proposed per step for each speculating sequence (0: off).
    #: Proposals come from prompt lookup (the n-gram proposer, `scheduling/proposals.py`): the
    #: last n tokens (n from speculative_ngram_max down to speculative_ngram_min) matched
    #: earlier in the prompt and output, and the tokens that followed there. A step verifies
    #: them as one chunk and keeps the longest prefix the model agrees with, plus its own
    #: next token. Greedy and plain sampled requests speculate (`sequence.is_plain`; others
    #: decode one token a step); docs/speculative.md.
    num_speculative_tokens: int = 0
    speculative_ngram_min: int = 1
    speculative_ngram_max: int = 4
    #: Speculate only in steps with at most this many decoding sequences: past a few rows a
    #: step is no longer bound by reading the weights, and verifying proposals costs compute.
    speculative_max_seqs: int = 4
    #: A draft model proposes instead of prompt lookup: a checkpoint folder, known name or
    #: .gguf file with the same tokenizer (a smaller model, or this one quantized), run by
    #: this worker on a KV pool of its own (`engine/draft.py`); None: prompt lookup.
    speculative_model: str | None = None
    #: How the draft model holds its weights (`quantization`'s values): "gguf" with this
    #: model's name drafts with its shipped 4-bit file.
    speculative_quantization: str = "auto"
    #: Multi-step decode: tokens a step decodes for each sequence when every running one is a
    #: plain greedy decode and nothing waits (1: off). The runner feeds each row's greedy
    #: token back as its next input in one call (`ModelRunner.run`), so the scheduling,
    #: batch building and reporting around a step are paid once per that many tokens; a
    #: stream's tokens then arrive that many at a time, and a request that arrives mid-step
    #: waits for the whole step. One rank, no speculation.
    num_decode_steps: int = 1
    #: On a CPU: threads computing each step (torch's and the C kernels' one OpenMP pool).
    #: 0 adapts: at most the CPUs the process may use (its affinity, within a cgroup CPU
    #: quota), one fewer for each core other processes keep busy (execution/cpu_threads.py).
    #: One rank only; the ranks of a parallel worker split the CPUs evenly.
    cpu_threads: int = 0
    #: On a CPU: the CPUs to pin the worker to, as Linux lists them ("0-3,8"); "" keeps the
    #: affinity it was started with.
    cpu_bind: str = ""
    #: Longest text prompt in UTF-8 bytes; None: as long as could fit the context (the
    #: context times the longest token's bytes). Longer prompts are refused untokenized.
    max_prompt_bytes: int | None = None
    #: The version the weights loaded at start are known by (every output carries the
    #: version that produced it; weight updates set a new one).
    weight_version: str = "default"
    #: Serve LoRA adapters (loaded at start from ``lora_modules`` or by control calls).
    enable_lora: bool = False
    #: Adapters loaded at start: (name, PEFT adapter directory) pairs; sets enable_lora.
    lora_modules: tuple[tuple[str, str], ...] = ()
    #: Distinct adapters one step may hold (their device slots).
    max_loras: int = 4
    #: Highest adapter rank accepted (slots are sized for it).
    max_lora_rank: int = 16
    #: Adapters kept in host memory, least recently used evicted (read again from disk when
    #: needed); None: 4 x max_loras.
    max_cpu_loras: int | None = None
    #: Deprecated spelling of kernel_backend (it chooses more than attention): still taken,
    #: with a DeprecationWarning; not kept on the config.
    attention_backend: InitVar[str | None] = None

    def __post_init__(self, attention_backend: str | None) -> None:
        if attention_backend is not None:
            warnings.warn(
                "EngineConfig(attention_backend=...) is deprecated: use kernel_backend",
                DeprecationWarning,
                stacklevel=3,  # the caller of EngineConfig(...)
            )
            if self.kernel_backend not in ("auto", attention_backend):
                raise InvalidArgumentError(
                    "attention_backend", "is the old name of kernel_backend: give only that"
                )
            self.kernel_backend = attention_backend
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise InvalidArgumentError(
                "dtype", f"must be auto or one of {sorted(_DTYPES)}, got {self.dtype!r}"
            )
        if self.quantization not in QUANTIZATIONS:
            raise InvalidArgumentError(
                "quantization",
                f"must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}",
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidArgumentError(
                "kv_cache_dtype",
                f"must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}",
            )
        for name in ("block_size", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise InvalidArgumentError(name, f"must be >= 1, got {getattr(self, name)}")
        if self.max_num_batched_tokens < 0:
            raise InvalidArgumentError(
                "max_num_batched_tokens",
                f"must be >= 0 (0: the device's), got {self.max_num_batched_tokens}",
            )
        if not self.max_num_batched_tokens:
            on_cpu = self.torch_device().type == "cpu"
            self.max_num_batched_tokens = CPU_STEP_TOKENS if on_cpu else STEP_TOKENS
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise InvalidArgumentError(
                "scheduling_policy",
                f"must be one of {', '.join(SCHEDULING_POLICIES)}, got {self.scheduling_policy!r}",
            )
        if not 0 < self.shortest_first_window_s < math.inf:
            raise InvalidArgumentError(
                "shortest_first_window_s",
                f"must be a finite number > 0, got {self.shortest_first_window_s}",
            )
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise InvalidArgumentError("num_kv_blocks", f"must be >= 1, got {self.num_kv_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise InvalidArgumentError("gpu_memory_utilization", "must be in (0, 1]")
        if self.cpu_kv_cache_gib <= 0:
            raise InvalidArgumentError("cpu_kv_cache_gib", "must be > 0")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise InvalidArgumentError("max_model_len", "must be >= 2")
        check_parallel_sizes(self.tensor_parallel_size, self.pipeline_parallel_size)
        self.nodes.local_size(self.world_size)  # the ranks must fill every node
        if self.pipeline_micro_batches < 1:
            raise InvalidArgumentError(
                "pipeline_micro_batches", f"must be >= 1, got {self.pipeline_micro_batches}"
            )
        if self.pipeline_steps_in_flight is not None and self.pipeline_steps_in_flight < 1:
            raise InvalidArgumentError(
                "pipeline_steps_in_flight", f"must be >= 1, got {self.pipeline_steps_in_flight}"
            )
        if self.overlap_steps and self.world_size > 1:
            raise InvalidArgumentError(
                "overlap_steps",
                "is for one rank; with several, submitted steps already run on the other ranks",
            )
        if self.overlap_steps and (self.enable_lora or self.lora_modules):
            raise InvalidArgumentError(
                "overlap_steps",
                "cannot be combined with LoRA yet: building a step may refill an adapter slot "
                "the step on the device thread still reads",
            )
        if self.num_speculative_tokens < 0:
            raise InvalidArgumentError(
                "num_speculative_tokens", f"must be >= 0, got {self.num_speculative_tokens}"
            )
        if not 1 <= self.speculative_ngram_min <= self.speculative_ngram_max:
            raise InvalidArgumentError(
                "speculative_ngram_min",
                f"must be >= 1 and <= speculative_ngram_max ({self.speculative_ngram_max}), "
                f"got {self.speculative_ngram_min}",
            )
        if self.speculative_quantization not in QUANTIZATIONS:
            raise InvalidArgumentError(
                "speculative_quantization",
                f"must be one of {', '.join(QUANTIZATIONS)}, got {self.speculative_quantization!r}",
            )
        if self.speculative_model is not None and not self.num_speculative_tokens:
            raise InvalidArgumentError(
                "speculative_model", "needs num_speculative_tokens > 0 (the tokens it proposes)"
            )
        self._check_decode_steps()
        if self.speculative_max_seqs < 1:
            raise InvalidArgumentError(
                "speculative_max_seqs", f"must be >= 1, got {self.speculative_max_seqs}"
            )
        if self.cpu_threads < 0:
            raise InvalidArgumentError("cpu_threads", f"must be >= 0, got {self.cpu_threads}")
        if self.cpu_bind:
            try:
                parse_cpu_list(self.cpu_bind)
            except ValueError as error:
                raise InvalidArgumentError("cpu_bind", str(error)) from None
        if self.max_prompt_bytes is not None and self.max_prompt_bytes < 1:
            raise InvalidArgumentError(
                "max_prompt_bytes", f"must be >= 1, got {self.max_prompt_bytes}"
            )
        check_version(self.weight_version)
        self._check_lora()
        self._check_kernel_backend()

    def _check_kernel_backend(self) -> None:
        if self.kernel_backend not in BACKEND_NAMES:
            raise InvalidArgumentError(
                "kernel_backend",
                f"must be one of {', '.join(BACKEND_NAMES)}, got {self.kernel_backend!r}",
            )
        if self.kernel_backend == "triton":
            device = self.torch_device()
            if device.type != "cuda" and not triton_interpreted():
                raise InvalidArgumentError("kernel_backend", triton_device_error(device))
        if self.kernel_backend == "cpu":
            error = cpu_kernels_error(self.torch_device())
            if error is not None:
                raise InvalidArgumentError("kernel_backend", error)

    def _check_lora(self) -> None:
        self.lora_modules = tuple((str(name), str(path)) for name, path in self.lora_modules)
        if self.lora_modules:
            self.enable_lora = True
        names = [name for name, _ in self.lora_modules]
        if len(set(names)) != len(names) or not all(names):
            raise InvalidArgumentError(
                "lora_modules", f"names must be unique and non-empty: {names}"
            )
        for name in ("max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise InvalidArgumentError(name, f"must be >= 1, got {getattr(self, name)}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise InvalidArgumentError(
                "max_cpu_loras",
                f"must be >= max_loras ({self.max_loras}), got {self.max_cpu_loras}",
            )
        if self.enable_lora and self.pipeline_parallel_size > 1:
            raise InvalidArgumentError(
                "enable_lora", "LoRA adapters are not supported with pipeline parallelism yet"
            )

    @property
    def lora_cpu_capacity(self) -> int:
        """Adapters the host-memory pool holds."""
        return self.max_cpu_loras or 4 * self.max_loras

    def _check_decode_steps(self) -> None:
        if self.num_decode_steps < 1:
            raise InvalidArgumentError(
                "num_decode_steps", f"must be >= 1, got {self.num_decode_steps}"
            )
        if self.num_decode_steps > 1 and self.world_size > 1:
            raise InvalidArgumentError(
                "num_decode_steps", "is for one rank: the ranks run a step's plan as it was sent"
            )
        if self.num_decode_steps > 1 and self.num_speculative_tokens:
            raise InvalidArgumentError(
                "num_decode_steps", "cannot be combined with num_speculative_tokens: choose one"
            )

    @property
    def world_size(self) -> int:
        """Processes (ranks) the worker runs: tensor_parallel_size x pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def steps_in_flight(self) -> int:
        """Steps submitted before the oldest is collected."""
        if self.pipeline_steps_in_flight is not None:
            return self.pipeline_steps_in_flight
        return 2 if self.overlap_steps else self.pipeline_parallel_size

    def torch_dtype(self, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
        """The dtype to run in. "auto" takes the checkpoint's, except on a CPU without native
        bf16 / fp16 matrix instructions, where float32 is several times faster."""
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        if checkpoint_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return torch.float32
        device = self.torch_device()
        if device.type == "cpu" and compute_dtype(checkpoint_dtype, device) == torch.float32:
            return torch.float32
        return checkpoint_dtype

    def kv_cache_torch_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The KV cache's dtype beside a model running in dtype."""
        return torch.int8 if self.kv_cache_dtype == "int8" else dtype

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


def worker_engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine a `headrace worker` with these parsed flags (`headrace.sdk.cli`) runs."""
    nodes = NodeConfig(
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        dist_init_addr=args.dist_init_addr,
        ranks_per_node=args.ranks_per_node,
        node_timeout_s=args.node_timeout,
    )
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        quantization=args.quantization,
        int8_activations=args.int8_activations,
        kv_cache_dtype=args.kv_cache_dtype,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization,
        cpu_kv_cache_gib=args.kv_cache_gib,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        scheduling_policy=args.scheduling_policy,
        shortest_first_window_s=args.shortest_first_window,
        seed=args.seed,
        kernel_backend=args.kernel_backend,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
        nodes=nodes,
        pipeline_micro_batches=args.pipeline_micro_batches,
        overlap_steps=args.overlap_steps,
        cpu_threads=args.cpu_threads,
        cpu_bind=args.cpu_bind,
        max_prompt_bytes=args.max_prompt_bytes,
        weight_version=args.weight_version,
        enable_lora=args.enable_lora,
        lora_modules=tuple(args.lora),
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
        num_speculative_tokens=args.num_speculative_tokens,
        speculative_ngram_min=args.speculative_ngram_min,
        speculative_ngram_max=args.speculative_ngram_max,
        speculative_max_seqs=args.speculative_max_seqs,
        speculative_model=args.speculative_model,
        speculative_quantization=args.speculative_quantization,
        num_decode_steps=args.num_decode_steps,
    )
