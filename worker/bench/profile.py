"""Where an engine step's time goes: ``headrace bench engine --profile``.

`StepProfile` wraps the engine's parts for the length of a run (nothing is timed, and
nothing wrapped, otherwise) and adds up the wall time each phase takes in decode steps:

- schedule: the scheduler picks the step's chunks and allocates their blocks;
- prepare: the runner builds the flattened batch (ids, positions, block tables, slots);
- forward: the model's layers (embedding to final norm);
- LM head: the logits of the rows that sample, or, when every row is plain greedy, the
  greedy head (logits a vocabulary slice at a time with a running argmax);
- one call: a step of plain greedy one-row decodes run whole in one call of the model's
  (`decode_greedy_runs`: the layers, the LM head and the argmax, on the CPU's one-call
  stack); forward and LM head then take nothing;
- sample: the sampler (penalties, warpers, draws, logprobs); absent with the greedy head;
- detokenize: incremental detokenizing of each sampled token (stop strings included);
- update: `Scheduler.update_from_output` (computed tokens, prefix-cache blocks, appending
  each token, stop checks, finishing);
- output: the step's deltas and `RequestOutput`s;
- other: the rest of the step (the engine's own loop).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from headrace.worker.engine.engine import Engine

PHASES = (
    "schedule",
    "prepare",
    "forward",
    "LM head",
    "one call",
    "sample",
    "detokenize",
    "update",
    "output",
)


class StepProfile:
    def __init__(self) -> None:
        #: Seconds per phase over the decode steps so far.
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.num_steps = 0
        self.step_seconds = 0.0
        self._current = dict.fromkeys(PHASES, 0.0)
        self._restore: list[tuple[Any, str, Any]] = []

    def attach(self, engine: Engine) -> None:
        """Wrap the engine's parts (undone by `detach`)."""
        model = engine.runner.model
        for owner, name, phase in (
            (engine.scheduler, "schedule", "schedule"),
            (engine.runner, "prepare", "prepare"),
            (model, "forward", "forward"),
            (model, "compute_logits", "LM head"),
            (model, "compute_greedy", "LM head"),
            (model, "decode_greedy_runs", "one call"),
            (engine, "sampler", "sample"),
            (engine, "_detokenize", "detokenize"),
            (engine.scheduler, "update_from_output", "update"),
            (engine, "_report_tokens", "output"),
            (engine, "_report", "output"),
        ):
            self._wrap(owner, name, phase)

    def detach(self) -> None:
        for owner, name, original in reversed(self._restore):
            if original is None:  # the class's method: drop the instance's wrapper
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._restore.clear()

    def _wrap(self, owner: Any, name: str, phase: str) -> None:
        inner: Callable[..., Any] = getattr(owner, name)
        current = self._current

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                current[phase] += time.perf_counter() - start

        self._restore.append((owner, name, vars(owner).get(name)))
        setattr(owner, name, timed)

    def start_step(self) -> None:
        for phase in self._current:
            self._current[phase] = 0.0

    def end_step(self, seconds: float, is_decode: bool) -> None:
        """Count the step's phases if it was a decode step."""
        if not is_decode:
            return
        self.num_steps += 1
        self.step_seconds += seconds
        for phase, value in self._current.items():
            self.totals[phase] += value

    def describe(self) -> str:
        if not self.num_steps:
            return "profile: no decode steps"
        per_step = {phase: value / self.num_steps for phase, value in self.totals.items()}
        step = self.step_seconds / self.num_steps
        lines = [f"profile: mean of {self.num_steps} decode steps, {step * 1e3:.2f} ms each"]
        for phase, value in [*per_step.items(), ("other", step - sum(per_step.values()))]:
            lines.append(f"  {phase:<20} {value * 1e3:8.3f} ms  {value / step:6.1%}")
        return "\n".join(lines)

    def summary(self) -> dict[str, float]:
        if not self.num_steps:
            return {}
        key = {phase: phase.replace(" + ", "_").replace(" ", "_").lower() for phase in PHASES}
        return {
            f"profile_{key[phase]}_ms": round(value / self.num_steps * 1e3, 3)
            for phase, value in self.totals.items()
        }
