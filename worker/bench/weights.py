"""``headrace bench weights``: how long a live weight update takes.

    headrace bench weights                     # SmolLM2-135M-Instruct, 3 rounds of each path

Each path loads the model's own checkpoint again as a new version, ``--rounds`` times,
alternating, and the best round counts (these machines are noisy):

- restart (the baseline): building the model and loading its weights from disk, in-process,
  which is what a restart costs at the least (a whole worker process's start is printed
  too);
- `LLM.update_weights(path)` and `LLM.update_weights(tensors)`: in-process, from disk and
  from tensors already in memory;
- a worker process updated over gRPC: ``update_weights(path)`` (it reads the disk) and
  ``update_weights_from_tensors`` (the tensors streamed in ``--chunk-mib`` messages).

Each update is checked whole before it is copied, flushes the prefix cache and bumps the
version; its time is the call's, as the caller sees it. ``ratio_*`` is the restart's time
over the path's.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from headrace.sdk.client import Client
from headrace.sdk.launch import start_worker
from headrace.worker.bench.common import Summary
from headrace.worker.config import EngineConfig
from headrace.worker.engine.llm import LLM
from headrace.worker.engine.model_spec import ModelSpec
from headrace.worker.models.loader import checkpoint_files
from headrace.worker.models.registry import load_model
from headrace.worker.models.store import resolve_model
from safetensors.torch import load_file

MIB = 2**20


def run(args: argparse.Namespace) -> Summary:
    path = resolve_model(args.model)
    spec = ModelSpec.load(EngineConfig(str(path), dtype=args.dtype, device="cpu"))
    tensors = _tensors(path)
    num_bytes = sum(t.numel() * t.element_size() for _, t in tensors)
    print(
        f"model {path.name}: {len(tensors)} tensors, {num_bytes / MIB:.0f} MiB on disk, "
        f"served as {str(spec.dtype).removeprefix('torch.')}; best of {args.rounds} rounds",
        flush=True,
    )
    times: dict[str, list[float]] = {}
    restart = lambda: load_model(path, spec.dtype, torch.device("cpu"))  # noqa: E731
    with LLM(str(path), dtype=args.dtype, device="cpu") as llm:
        versions = iter(range(10**6))
        paths: dict[str, Callable[[], object]] = {
            "restart (load the model)": restart,
            "in-process, from disk": lambda: llm.update_weights(path, f"v{next(versions)}"),
            "in-process, from tensors": lambda: llm.update_weights(tensors, f"v{next(versions)}"),
        }
        _time_rounds(paths, args.rounds, times)
    with tempfile.TemporaryDirectory() as logs:
        start = time.perf_counter()
        worker = start_worker(path, "--dtype", args.dtype, log_path=Path(logs) / "worker.log")
        started_s = time.perf_counter() - start
        print(f"(a worker process took {started_s:.1f} s to start listening)", flush=True)
        with worker, Client(worker.target) as client:
            stream = dict(chunk_bytes=args.chunk_mib * MIB)
            paths = {
                "gRPC, from disk": lambda: client.update_weights(str(path), f"v{next(versions)}"),
                "gRPC, streamed tensors": lambda: client.update_weights_from_tensors(
                    tensors, f"v{next(versions)}", **stream
                ),
            }
            _time_rounds(paths, args.rounds, times)
    return {**_report(times), "worker_start_ms": round(started_s * 1000, 1)}


def _tensors(path: Path) -> list[tuple[str, torch.Tensor]]:
    tensors: list[tuple[str, torch.Tensor]] = []
    for file in checkpoint_files(path):
        tensors.extend(load_file(str(file)).items())
    return tensors


def _time_rounds(
    paths: dict[str, Callable[[], object]], rounds: int, times: dict[str, list[float]]
) -> None:
    for _ in range(rounds):
        for name, call in paths.items():
            start = time.perf_counter()
            call()
            times.setdefault(name, []).append(time.perf_counter() - start)


def _report(times: dict[str, list[float]]) -> Summary:
    best = {name: min(values) for name, values in times.items()}
    baseline_name = next(iter(best))
    baseline = best[baseline_name]
    summary: Summary = {}
    for name, seconds in best.items():
        ratio = "" if name == baseline_name else f"  ({baseline / seconds:.2f}x the restart)"
        median_ms = _median(times[name]) * 1000
        print(f"{name:<28} best {seconds * 1000:8.1f} ms  median {median_ms:8.1f} ms{ratio}")
        key = name.split(" (")[0].replace(",", "").replace(" ", "_").replace("-", "_")
        summary[f"{key}_ms"] = round(seconds * 1000, 1)
        if name != baseline_name:
            summary[f"ratio_{key}"] = round(baseline / seconds, 3)
    return summary


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]
