"""Where a served load's time went, from the servers' own metrics.

`bench serve` starts its worker with a metrics port and reads it right before a load (after
the connections' warm-up requests) and right after. What the counters moved in between says:

- the engine's steps by kind (`StepSplit`): how many steps computed prompt tokens and how
  many decodes alone, their mean times, and the share of the load's wall time the engine
  computed. That share is near 1 whenever requests are in flight (a step follows the last);
  whether the engine keeps up shows in the queue time below and in the prompt steps' length
  (saturated, a new request waits for the step in progress, then shares its own step with
  the prompts that gathered meanwhile);
- the mean time to first token as the server saw it, split into queue (arrival until the
  request's first step) and prefill (first step until its first token) (`TtftSplit`). vLLM's
  server exports the same three histograms, so a peer's split comes out the same way, but
  its queue starts at its engine's intake, and its TTFT at its HTTP server.

The counters are the ones `docs/observability.md` describes; these are their means over one
load, not percentiles (a histogram's buckets are too coarse for those).
"""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass

from headrace.worker.bench.common import Summary
from prometheus_client.parser import text_string_to_metric_families

#: Every sample of a scrape: (name, sorted labels) -> value.
Snapshot = dict[tuple[str, tuple[tuple[str, str], ...]], float]

#: Metric name prefixes: the worker's and vLLM's OpenAI server's.
WORKER = "headrace_worker_"
VLLM = "vllm:"


def scrape(url: str, timeout_s: float = 10.0) -> Snapshot:
    """Every sample the Prometheus endpoint at ``url`` exports now."""
    with urllib.request.urlopen(url, timeout=timeout_s) as reply:
        text = reply.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def moved(before: Snapshot, after: Snapshot, name: str, **labels: str) -> float:
    """How far the series called ``name`` moved, summed over those with ``labels`` among
    theirs (a worker labels each by its model)."""

    def total(snapshot: Snapshot) -> float:
        return sum(
            value
            for (sample, sample_labels), value in snapshot.items()
            if sample == name and labels.items() <= dict(sample_labels).items()
        )

    return total(after) - total(before)


@dataclass(frozen=True, slots=True)
class StepSplit:
    """A worker's engine steps during one load."""

    wall_s: float
    num_prompt_steps: int
    #: Seconds the steps that computed prompt tokens took, all together.
    prompt_step_s: float
    num_decode_steps: int
    decode_step_s: float

    @classmethod
    def between(cls, before: Snapshot, after: Snapshot, wall_s: float) -> StepSplit | None:
        """The steps from the worker's step counters; None where the server has none (vLLM's)."""

        def of(name: str, kind: str) -> float:
            return moved(before, after, f"{WORKER}{name}_total", kind=kind)

        if not any(name == f"{WORKER}steps_total" for name, _ in after):
            return None
        return cls(
            wall_s,
            round(of("steps", "prompt")),
            of("step_seconds", "prompt"),
            round(of("steps", "decode")),
            of("step_seconds", "decode"),
        )

    @property
    def busy(self) -> float:
        """The share of the load's wall time the engine spent in steps."""
        return (self.prompt_step_s + self.decode_step_s) / self.wall_s

    def describe(self) -> str:
        def mean(seconds: float, count: int) -> str:
            return f" ({seconds / count * 1e3:.0f} ms mean)" if count else ""

        return (
            f"engine steps: {self.num_prompt_steps} with prompts"
            f"{mean(self.prompt_step_s, self.num_prompt_steps)}, "
            f"{self.num_decode_steps} decodes alone"
            f"{mean(self.decode_step_s, self.num_decode_steps)}; "
            f"busy {self.busy:.0%} of {self.wall_s:.1f} s"
        )

    def summary(self) -> Summary:
        return {
            "worker_prompt_steps": self.num_prompt_steps,
            "worker_decode_steps": self.num_decode_steps,
            "worker_prompt_step_s": round(self.prompt_step_s, 3),
            "worker_decode_step_s": round(self.decode_step_s, 3),
            "worker_busy": round(self.busy, 3),
        }


@dataclass(frozen=True, slots=True)
class TtftSplit:
    """The mean time to first token of one load's requests, as a server measured it, and
    its parts (seconds). What is neither queue nor prefill: on the worker, the first chunk's
    trip out; on vLLM's server, its HTTP server's part and the wait before its engine takes
    the request in (the engine reads new requests between steps, so that wait is the step
    in progress, which the worker counts as queue)."""

    num_requests: int
    ttft_s: float
    queue_s: float
    prefill_s: float

    @classmethod
    def between(cls, before: Snapshot, after: Snapshot, prefix: str) -> TtftSplit | None:
        """The split from the histograms under ``prefix`` (`WORKER`, `VLLM`); None where the
        server exports none or no request finished."""

        def mean(name: str) -> float:
            total = moved(before, after, f"{prefix}{name}_sum")
            return total / max(1.0, moved(before, after, f"{prefix}{name}_count"))

        num_requests = round(moved(before, after, f"{prefix}request_queue_time_seconds_count"))
        if not num_requests:
            return None
        return cls(
            num_requests,
            mean("time_to_first_token_seconds"),
            mean("request_queue_time_seconds"),
            mean("request_prefill_time_seconds"),
        )

    def describe(self) -> str:
        rest = self.ttft_s - self.queue_s - self.prefill_s
        return (
            f"server TTFT mean {self.ttft_s * 1e3:.0f} ms = queue {self.queue_s * 1e3:.0f} "
            f"+ prefill {self.prefill_s * 1e3:.0f} + the rest {rest * 1e3:.0f} "
            f"({self.num_requests} requests)"
        )

    def summary(self, key: str) -> Summary:
        return {
            f"{key}_server_requests": self.num_requests,
            f"{key}_server_ttft_mean_ms": round(self.ttft_s * 1e3, 3),
            f"{key}_queue_mean_ms": round(self.queue_s * 1e3, 3),
            f"{key}_prefill_mean_ms": round(self.prefill_s * 1e3, 3),
        }


@dataclass(frozen=True, slots=True)
class ServerSplit:
    """What one server's metrics say of one load: its steps where it exports them (the
    worker), and its TTFT split where it exports that."""

    steps: StepSplit | None
    ttft: TtftSplit | None

    def describe(self) -> str:
        parts = [part.describe() for part in (self.steps, self.ttft) if part is not None]
        return "\n".join(f"    {line}" for line in parts)

    def summary(self, key: str) -> Summary:
        out: Summary = {} if self.steps is None else self.steps.summary()
        if self.ttft is not None:
            out.update(self.ttft.summary(key))
        return out


class LoadMetrics:
    """A server's metrics endpoint, read when a load starts (`start`) and when it has
    finished (`finish`)."""

    def __init__(self, url: str, prefix: str) -> None:
        self.url = url
        self.prefix = prefix
        self._before: Snapshot | None = None

    def start(self) -> None:
        self._before = scrape(self.url)

    def finish(self, wall_s: float) -> ServerSplit:
        """The split of the load that started at the last `start` and ran ``wall_s``."""
        assert self._before is not None, "finish() without start()"
        before, after = self._before, scrape(self.url)
        self._before = None
        return ServerSplit(
            StepSplit.between(before, after, wall_s), TtftSplit.between(before, after, self.prefix)
        )
