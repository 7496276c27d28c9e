"""Runs a peer engine (vLLM's CPU backend or llama.cpp) for ``headrace bench engine``.

This file runs in the peer's own venv, not headrace's: it imports only the standard library
and the peer's packages (vllm, llama_cpp), never headrace. `headrace.worker.bench.peers`
starts it as ``PEER_PYTHON peer_driver.py`` and speaks JSON lines with it:

    stdin  {"peer": "vllm" | "llama.cpp", "model": PATH, "dtype": ..., "cpus": [0, 1], ...}
    stdout {"ready": true, "version": ..., "mode": ..., "load_s": ...}
    stdin  {"prompts": [[token ids], ...], "max_tokens": [n, ...]}          (one per run)
    stdout {"seconds": ..., "token_ids": [[...], ...], "ttft_s": [...] | null}
    ...    (end of stdin: exit)

Every request is greedy and runs to its ``max_tokens`` (ignore_eos); ``seconds`` is the run's
wall time, from handing the peer all requests to its last token. A failure answers
``{"error": "..."}`` and exits non-zero. The peers print their logs on stdout too, so file
descriptor 1 is pointed at stderr first and the answers go to a private copy of stdout.
"""

from __future__ import annotations

import os
import sys

# Run as a script, this file's folder leads sys.path, and its neighbours (profile.py) would
# shadow the standard library's modules of the same name.
_HERE = os.path.dirname(os.path.realpath(__file__))
sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != _HERE]

import json  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterable  # noqa: E402
from typing import Any, TextIO  # noqa: E402


def main() -> int:
    answers = _private_stdout()
    setup = json.loads(sys.stdin.readline())
    try:
        os.sched_setaffinity(0, setup["cpus"])
        start = time.perf_counter()
        peer = PEERS[setup["peer"]](setup)
        _answer(answers, {**peer.describe(), "ready": True, "load_s": time.perf_counter() - start})
        for line in sys.stdin:
            if line.strip():
                job = json.loads(line)
                _answer(answers, peer.run(job["prompts"], job["max_tokens"]))
    except Exception as error:  # reported to the bench, which shows the peer's log
        _answer(answers, {"error": f"{type(error).__name__}: {error}"})
        return 1
    return 0


def _private_stdout() -> TextIO:
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return answers


def _answer(out: TextIO, message: dict[str, Any]) -> None:
    out.write(json.dumps(message) + "\n")
    out.flush()


class VllmPeer:
    """vLLM's offline ``LLM`` on the CPU: all requests handed to one ``generate`` call,
    which batches them continuously."""

    def __init__(self, setup: dict[str, Any]) -> None:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(setup["kv_cache_gib"])
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_ranges(setup["cpus"])
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import vllm

        self._vllm = vllm
        self._llm = vllm.LLM(
            model=setup["model"],
            dtype=setup["dtype"],
            max_num_seqs=setup["max_num_seqs"],
            max_num_batched_tokens=setup["max_num_batched_tokens"],
            max_model_len=setup["max_model_len"],
            seed=0,
            # Per-request stats carry each request's first-token time.
            disable_log_stats=False,
        )

    def describe(self) -> dict[str, Any]:
        return {"version": f"vLLM {self._vllm.__version__}", "mode": "LLM.generate"}

    def run(self, prompts: list[list[int]], max_tokens: list[int]) -> dict[str, Any]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = [
            SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens
        ]
        inputs = [TokensPrompt(prompt_token_ids=prompt) for prompt in prompts]
        wall_start, start = time.time(), time.perf_counter()
        outputs = self._llm.generate(inputs, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        return {
            "seconds": seconds,
            "token_ids": [list(out.outputs[0].token_ids) for out in outputs],
            "ttft_s": _vllm_ttfts(outputs, wall_start),
        }


def _vllm_ttfts(outputs: list[Any], wall_start: float) -> list[float] | None:
    """Each request's first token, from the run's start: its arrival (wall clock) plus its
    first-token latency, as vLLM's per-request stats record them."""
    stats = [out.metrics for out in outputs]
    if any(s is None or not s.first_token_latency for s in stats):
        return None
    return [s.arrival_time - wall_start + s.first_token_latency for s in stats]


def cpu_ranges(cpus: Iterable[int]) -> str:
    """[0, 1, 2, 5] as "0-2,5" (VLLM_CPU_OMP_THREADS_BIND's form; the served bench's too)."""
    ranges: list[list[int]] = []
    for cpu in sorted(cpus):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


class LlamaCppPeer:
    """llama.cpp through llama-cpp-python's C API: one ``llama_decode`` batch holds every
    sequence (the prompts in chunks of ``n_batch`` tokens, then one token per sequence per
    step), each sequence with its own slice of the KV cache; greedy picks with llama.cpp's
    own greedy sampler. This is what llama.cpp's ``batched`` example and its server's
    parallel slots do, without the server's HTTP."""

    def __init__(self, setup: dict[str, Any]) -> None:
        import llama_cpp as lc

        self._lc = lc
        self._version = getattr(lc, "__version__", "?")
        lc.llama_backend_init()
        model_params = lc.llama_model_default_params()
        self._model = lc.llama_model_load_from_file(setup["model"].encode(), model_params)
        if not self._model:
            raise RuntimeError(f"llama.cpp could not load {setup['model']}")
        num_seqs = setup["max_num_seqs"]
        self._n_batch = setup["max_num_batched_tokens"]
        params = lc.llama_context_default_params()
        params.n_seq_max = num_seqs
        # Each sequence gets n_ctx / n_seq_max cells of its own.
        params.n_ctx = num_seqs * _round_up(setup["max_model_len"], 256)
        params.n_batch = self._n_batch
        params.n_threads = params.n_threads_batch = len(setup["cpus"])
        params.kv_unified = False
        self._ctx = lc.llama_init_from_model(self._model, params)
        if not self._ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self._sampler = lc.llama_sampler_init_greedy()
        self._batch = lc.llama_batch_init(max(self._n_batch, num_seqs), 0, 1)

    def describe(self) -> dict[str, Any]:
        return {
            "version": f"llama-cpp-python {self._version}",
            "mode": "llama_decode batches, one KV sequence per request",
        }

    def run(self, prompts: list[list[int]], max_tokens: list[int]) -> dict[str, Any]:
        lc = self._lc
        lc.llama_memory_clear(lc.llama_get_memory(self._ctx), True)
        token_ids: list[list[int]] = [[] for _ in prompts]
        ttft_s = [0.0] * len(prompts)
        start = time.perf_counter()
        for chunk in _prefill_chunks(prompts, self._n_batch):
            for seq_id, index in self._decode(chunk):
                token_ids[seq_id].append(self._sample(index))
                ttft_s[seq_id] = time.perf_counter() - start
        while active := [s for s, n in enumerate(max_tokens) if len(token_ids[s]) < n]:
            step = [
                (s, len(prompts[s]) + len(token_ids[s]) - 1, token_ids[s][-1], True) for s in active
            ]
            for seq_id, index in self._decode(step):
                token_ids[seq_id].append(self._sample(index))
        return {"seconds": time.perf_counter() - start, "token_ids": token_ids, "ttft_s": ttft_s}

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> list[tuple[int, int]]:
        """One ``llama_decode`` of (seq id, position, token, wants logits) entries; returns
        (seq id, batch index) of each entry that wants logits."""
        batch = self._batch
        batch.n_tokens = len(entries)
        for i, (seq_id, pos, token, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.logits[i] = token, pos, logits
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq_id
        if (status := self._lc.llama_decode(self._ctx, batch)) != 0:
            raise RuntimeError(f"llama_decode returned {status}")
        return [(entry[0], i) for i, entry in enumerate(entries) if entry[3]]

    def _sample(self, index: int) -> int:
        return int(self._lc.llama_sampler_sample(self._sampler, self._ctx, index))


def _prefill_chunks(
    prompts: list[list[int]], n_batch: int
) -> list[list[tuple[int, int, int, bool]]]:
    """The prompts' tokens as (seq id, position, token, wants logits), cut into batches of at
    most ``n_batch``; only a prompt's last token wants logits."""
    entries = [
        (seq_id, pos, token, pos == len(prompt) - 1)
        for seq_id, prompt in enumerate(prompts)
        for pos, token in enumerate(prompt)
    ]
    return [entries[i : i + n_batch] for i in range(0, len(entries), n_batch)]


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


PEERS: dict[str, type[VllmPeer | LlamaCppPeer]] = {"vllm": VllmPeer, "llama.cpp": LlamaCppPeer}

if __name__ == "__main__":
    sys.exit(main())
