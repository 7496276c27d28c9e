"""`GenerationControl`: whether the engine generates, and with which weights.

Design note. Four things decide what the engine may run, and this class owns them all:

- a pause (`PauseMode`): with WAIT, requests admitted before the pause run on and new ones
  are deferred (`_deferred`, never given to the scheduler) until `resume`; with KEEP nothing is
  scheduled at all, so every request keeps its KV blocks and continues on resume; ABORT
  ends every request (the engine does that) and then holds new ones like WAIT;
- sleep: the KV cache (and optionally the weights) released on every rank; nothing runs and
  new requests are refused with UNAVAILABLE;
- the weight version, which every output carries;
- incomplete weights: an update that failed after copying began leaves the worker frozen
  (nothing scheduled, new requests refused) until an update succeeds, so it never serves
  half-updated weights.

The flow-control hold of one request (`Scheduler.hold`, its reader fell behind) is a
different mechanism on purpose: a KEEP pause never touches per-request state, so neither
kind can release the other.

Every update is checked whole on rank 0 (`WeightChecker`) before any rank copies anything,
and every update flushes the prefix cache (a new epoch: see `BlockManager`).
"""

from __future__ import annotations

import logging
import time

from headrace.sdk.errors import FailedPreconditionError, InternalError, UnavailableError
from headrace.sdk.weights import GenerationState, PauseMode, check_version
from headrace.worker.distributed.rank_control import (
    JoinWeightGroup,
    LoadWeights,
    RankCommandError,
    ReleaseMemory,
    RestoreMemory,
)
from headrace.worker.distributed.weight_sync import FromGroup, WeightGroupSpec, WeightSource
from headrace.worker.engine.model_spec import ModelSpec
from headrace.worker.execution.interface import Executor
from headrace.worker.models.weight_check import WeightChecker
from headrace.worker.scheduling.block_manager import BlockManager
from headrace.worker.scheduling.scheduler import Scheduler
from headrace.worker.sequence import Sequence

logger = logging.getLogger(__name__)

#: What UNAVAILABLE during sleep (or with incomplete weights) tells clients to wait.
RETRY_AFTER_S = 1.0


class GenerationControl:
    def __init__(
        self,
        spec: ModelSpec,
        executor: Executor,
        block_manager: BlockManager,
        weight_version: str,
    ) -> None:
        self.executor = executor
        self.block_manager = block_manager
        self.checker = WeightChecker.for_model(spec.path, spec.hf_config, spec.dtype)
        self.weight_version = check_version(weight_version)
        self.pause_mode: PauseMode | None = None
        self.asleep = False
        #: Why the weights are not whole (an update failed after copying began), or None.
        self.incomplete: str | None = None
        #: Requests that arrived during a pause: request id -> the sequence to schedule.
        self._deferred: dict[str, Sequence] = {}
        #: The group rank of this worker's rank 0 in a trainer's weights group (0: none).
        self.rank_offset = 0

    @property
    def state(self) -> GenerationState:
        if self.asleep:
            return GenerationState.ASLEEP
        if self.incomplete is not None:
            return GenerationState.WEIGHTS_INCOMPLETE
        return GenerationState.PAUSED if self.pause_mode is not None else GenerationState.SERVING

    @property
    def may_schedule(self) -> bool:
        """Whether steps may run (a WAIT or ABORT pause still runs the requests it let in)."""
        return not self.asleep and self.incomplete is None and self.pause_mode != PauseMode.KEEP

    # --- requests -------------------------------------------------------------------------

    def check_admission(self) -> None:
        """Refuse a new request while asleep or with incomplete weights."""
        if self.asleep:
            raise UnavailableError(
                "the worker is asleep (its KV cache is released); retry after it wakes up",
                RETRY_AFTER_S,
            )
        if self.incomplete is not None:
            raise UnavailableError(
                f"the worker's weights are incomplete ({self.incomplete}); retry after a "
                "successful update",
                RETRY_AFTER_S,
            )

    def admit(self, request_id: str, seq: Sequence, scheduler: Scheduler) -> None:
        """Schedule a new request's first sequence, or hold it until `resume`."""
        if self.pause_mode is None:
            scheduler.add(seq)
        else:
            self._deferred[request_id] = seq

    def withdraw(self, request_id: str) -> None:
        """Forget a deferred request (it was aborted before the pause ended)."""
        self._deferred.pop(request_id, None)

    @property
    def num_deferred(self) -> int:
        """Requests waiting for the pause to end."""
        return len(self._deferred)

    # --- pause ---------------------------------------------------------------------------

    def pause(self, mode: PauseMode) -> None:
        self.pause_mode = mode
        logger.info("generation paused (mode %s)", mode.value)

    def resume(self, scheduler: Scheduler) -> None:
        if self.pause_mode is None:
            return
        self.pause_mode = None
        for seq in self._deferred.values():
            scheduler.add(seq)
        self._deferred.clear()
        logger.info("generation resumed")

    # --- weights -------------------------------------------------------------------------

    def check_update(self, source: WeightSource, version: str) -> None:
        """Refuse (INVALID_ARGUMENT naming the tensor) an update that does not fit."""
        check_version(version)
        if isinstance(source, FromGroup) and not self.rank_offset:
            raise FailedPreconditionError("no weights group joined: init the group first")
        self.checker.check_update(source.metas())

    def update(self, source: WeightSource, version: str) -> None:
        """Check the update whole, then copy it on every rank; no step may be in flight."""
        self.check_update(source, version)
        start = time.perf_counter()
        try:
            self.executor.control(LoadWeights(source))
        except RankCommandError as error:
            self.incomplete = f"the update to {version!r} failed after copying began: {error}"
            logger.error("weights incomplete: %s", self.incomplete)
            raise InternalError(self.incomplete) from error
        finally:
            self.block_manager.reset_prefix_cache()
        self.weight_version = version
        self.incomplete = None
        logger.info("weights updated to version %r in %.3f s", version, time.perf_counter() - start)

    def join_weight_group(self, spec: WeightGroupSpec) -> None:
        try:
            self.executor.control(JoinWeightGroup(spec))
        except RankCommandError as error:
            self.rank_offset = 0
            raise UnavailableError(
                f"could not join the weights group at {spec.host}:{spec.port}: {error}"
            ) from error
        self.rank_offset = spec.rank_offset

    # --- memory --------------------------------------------------------------------------

    def sleep(self, offload_weights: bool) -> None:
        """Release the KV cache (and the weights, to host memory); requests must be gone."""
        if self.asleep:
            return
        self._run_memory_command(ReleaseMemory(offload_weights))
        self.block_manager.reset_prefix_cache()  # the cached blocks' contents are gone
        self.asleep = True
        logger.info("asleep (offload_weights=%s)", offload_weights)

    def wake_up(self) -> None:
        if not self.asleep:
            return
        self._run_memory_command(RestoreMemory())
        self.asleep = False
        logger.info("awake")

    def _run_memory_command(self, command: ReleaseMemory | RestoreMemory) -> None:
        try:
            self.executor.control(command)
        except RankCommandError as error:
            raise InternalError(f"{type(command).__name__} failed: {error}") from error
