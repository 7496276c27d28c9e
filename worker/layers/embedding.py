"""Vocab-parallel token embedding and LM head.

The vocabulary is split into equal contiguous ranges, one per rank (padded at the end so it
divides evenly; padding rows are zero and never reach a caller). The embedding looks up the
ids in its range, zeroes the rest, and all-reduces; the LM head computes logits for its range
and all-gathers them.

The table may be held quantized (`headrace.worker.layers.quantizable`): the embedding then
dequantizes the rows it looks up, and the LM head multiplies with the kernel set's
`quantized_linear`; a tied head shares the embedding's quantized table.
"""

from __future__ import annotations

import torch
from headrace.kernels import KernelSet, quantized
from headrace.kernels.argmax import RunningArgmax
from headrace.kernels.precision import linear
from headrace.worker.distributed.parallel import ParallelConfig, all_gather, all_reduce
from headrace.worker.layers.linear import matmul_of, quantized_matmul_of
from headrace.worker.layers.quantizable import Quantizable
from headrace.worker.layers.weights import (
    LoadedTensor,
    LoadTarget,
    ShardId,
    check_shape,
    load_into,
    new_parameter,
)


class VocabParallelEmbedding(Quantizable):
    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        parallel: ParallelConfig,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        size = parallel.tensor_parallel_size
        self.num_embeddings_per_rank = -(-num_embeddings // size)
        self.vocab_start = parallel.tensor_parallel_rank * self.num_embeddings_per_rank
        # A trailing rank may hold only padding when the vocab is tiny.
        self.vocab_end = max(
            min(self.vocab_start + self.num_embeddings_per_rank, num_embeddings), self.vocab_start
        )
        shape = (self.num_embeddings_per_rank, embedding_dim)
        self.weight = new_parameter(shape, dtype, self.weight_loader)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        if self.parallel.is_single:
            return self._look_up(input_ids)
        in_range = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(in_range, input_ids - self.vocab_start, 0)
        embeddings = self._look_up(local_ids) * in_range.unsqueeze(-1)
        return all_reduce(embeddings, self.parallel)

    def lookup_table(self) -> torch.Tensor | None:  # [vocabulary, hidden]
        """The table the embedding copies its rows from as they are (one rank, not
        quantized), or None."""
        return self.weight if self.parallel.is_single and self.quantized is None else None

    def _look_up(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        if self.quantized is None:
            return torch.embedding(self.weight, ids)  # (F.embedding's op, without its checks)
        rows = quantized.dequantize(self.quantized.gather(ids))
        return rows.to(self.weight.dtype)

    def weight_loader(self, param: LoadTarget, loaded: LoadedTensor, shard_id: ShardId) -> None:
        """Copy this rank's vocab rows; padding rows past the true vocab stay zero."""
        assert shard_id is None, f"unexpected shard {shard_id!r}"
        check_shape(loaded, (self.num_embeddings, self.embedding_dim))
        num_rows = self.vocab_end - self.vocab_start
        param.zero_()
        load_into(param.narrow(0, 0, num_rows), loaded.narrow(0, self.vocab_start, num_rows))


#: Logits per call of the greedy head: 16 MiB of float32 (85 rows of a 49k vocabulary), so
#: a call's buffer comes back from the heap step after step (`host_memory` keeps blocks below
#: 32 MiB there; whole logits, 50 MB at 256 rows, would be fresh pages every step), and few
#: calls, each a parallel matmul whose thread start-up shows when the cores are shared. Each
#: call takes whole rows against the whole weight, so the weight is the parameter itself,
#: which `kernels.prepacked` packs once (a slice of it would be a new tensor every step).
GREEDY_BLOCK_FLOATS = 1 << 22


class ParallelLMHead(VocabParallelEmbedding):
    """Hidden states to logits over the true vocabulary; its weight may be the embedding's."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        parallel: ParallelConfig,
        dtype: torch.dtype | None = None,
        kernels: KernelSet | None = None,
    ) -> None:
        super().__init__(num_embeddings, embedding_dim, parallel=parallel, dtype=dtype)
        #: The greedy head's matmul (the backend's: on a CPU, the C kernel for few rows).
        self.matmul = matmul_of(kernels)
        self.quantized_matmul = quantized_matmul_of(kernels)
        #: The backend whose running argmax the greedy head keeps (None: torch's).
        self.kernels = kernels
        #: The embedding whose table this head shares (tie_word_embeddings), if any.
        self.tied: VocabParallelEmbedding | None = None

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        """Share the embedding's weight (tie_word_embeddings): one tensor, loaded once."""
        self.weight = embedding.weight
        self.tied = embedding

    def quantize(self, bits: int, group_size: int | None, int8_activations: bool = False) -> None:
        if self.tied is None:
            return super().quantize(bits, group_size, int8_activations)
        self.tied.quantize(bits, group_size, int8_activations)
        self.weight, self.quantized = self.tied.weight, self.tied.quantized

    def forward(  # [N, hidden] -> [N, vocab]
        self, hidden: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """float32 logits; into ``out`` ([N, vocab] float32) where it can (one rank, float32)."""
        float32 = hidden.dtype == self.weight.dtype == torch.float32
        if out is not None and self.parallel.is_single and float32 and self.quantized is None:
            return torch.mm(hidden, self.weight[: self.num_embeddings].t(), out=out)
        if self.parallel.is_single:  # the greedy head's matmul: its float32 logits, unrounded
            return self._multiply(hidden)
        if self.quantized is None:
            logits = linear(hidden, self.weight)  # [N, num_embeddings_per_rank]
        else:
            logits = self.quantized_matmul(hidden, self.quantized)
        logits = all_gather(logits, self.parallel)  # [N, padded vocab]
        return logits[:, : self.num_embeddings].float()

    def _multiply(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, V] float32
        if self.quantized is None:
            return self.matmul(hidden, self.weight, None, torch.float32)
        return self.quantized_matmul(hidden, self.quantized, None, torch.float32)

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N] int64
        """Each row's argmax over its logits, a few rows at a time (one rank only): the same
        tokens as an argmax of `forward`'s logits, which never exist whole."""
        assert self.parallel.is_single, "the greedy head needs the whole vocabulary"
        rows_per_call = self._greedy_rows_per_call()
        if hidden.shape[0] <= rows_per_call:  # (no slice: every small op counts in a step)
            return self._greedy_rows(hidden)
        calls = range(0, hidden.shape[0], rows_per_call)
        return torch.cat([self._greedy_rows(hidden[i : i + rows_per_call]) for i in calls])

    def greedy_weight(self, num_rows: int) -> torch.Tensor | None:  # [N, hidden]
        """The weight `greedy` multiplies ``num_rows`` rows by in one matmul of the backend's
        into float32 logits, then one running argmax over them all (one rank, not
        quantized), or None."""
        one_call = num_rows <= self._greedy_rows_per_call()
        return self.weight if one_call and self.lookup_table() is not None else None

    def _greedy_rows_per_call(self) -> int:
        return max(1, GREEDY_BLOCK_FLOATS // self.num_embeddings)

    def _greedy_rows(self, rows: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N] int64
        running = RunningArgmax(rows.shape[0], rows.device, self.kernels)
        running.update(self._multiply(rows), 0)
        return running.index
