"""Generation control's shared types: pause modes, a worker's state, and the per-worker
report every control call returns (through a router, one entry per worker).

Also the wire form of streamed weights: `tensor_chunks` cuts named tensors into
`WeightsChunk` messages no larger than a gRPC message may be. It needs torch, imported when
called (a caller with tensors to send has it); this module itself does not.

Design note on uploads (SDK to router, router to worker). Every upload ends in one of two
ways: its last chunk is written and the stream half-closed (`end_upload`), or the call is
cancelled; never by leaving the stream open, which leaves the server waiting for more. The
writes go straight to the call (`write_chunk`), so gRPC's flow control is the back-pressure
and a server that answered early stops the writing. And every upload has a deadline:
``upload_timeout`` of its bytes by default, derived from the measured rate, so an upload that
stalls fails with DEADLINE_EXCEEDED instead of hanging.

A server that refuses an upload (a bad tensor, a worker's refusal) reads the rest of it before
it answers (`read_to_end`): when an aio client's write fails because the server answered
first, grpcio reports INTERNAL ("Internal error from Core") in place of the server's status
(grpc/grpc#36066, open in 1.85), so an early refusal reached our own SDK and router as
INTERNAL about one time in several. The rest is read and dropped, within the deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Collection, Iterable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import grpc
import grpc.aio
from headrace.protos import control_pb2 as cpb
from headrace.sdk import status
from headrace.sdk.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    HeadraceError,
    InvalidArgumentError,
)

#: Bytes of tensor data per streamed message (under the servers' 16 MiB default limit).
DEFAULT_CHUNK_BYTES = 4 * 2**20
#: The rate an upload's default deadline allows for: a tenth of the 0.6 GB/s measured on a
#: 2-core CPU for the whole call (SmolLM2-135M's 513 MiB streamed and committed in 0.84 s,
#: `headrace bench weights`), so a slower machine or link still finishes in time and only an
#: upload that stalls runs out.
UPLOAD_MIN_BYTES_PER_S = 60 * 10**6
#: What an upload's default deadline allows on top of its bytes: connecting, and checking,
#: staging and committing the update on every worker.
UPLOAD_SETUP_S = 60.0
#: The bytes assumed where they cannot be counted ahead (tensors from a one-shot iterator, a
#: client that sent no deadline): a 70B model in bfloat16, about the largest worth streaming
#: over gRPC rather than broadcasting from a trainer's group: 2,393 s with the setup.
UNCOUNTED_UPLOAD_BYTES = 140 * 10**9
#: Dtypes that travel on the wire, by their wire names.
WIRE_DTYPES = ("float32", "bfloat16", "float16")
#: Longest version string accepted.
MAX_VERSION_CHARS = 256


class PauseMode(StrEnum):
    """What `pause` does to the requests in flight (new ones queue until `resume`)."""

    #: End them now, finish reason "abort", with the tokens they streamed so far.
    ABORT = "abort"
    #: Let them finish; `pause` returns once they have.
    WAIT = "wait"
    #: Freeze them, KV cache kept; they continue where they stopped on `resume`.
    KEEP = "keep"


class GenerationState(StrEnum):
    SERVING = "serving"
    #: Paused: new requests queue (a router holds them in its own queue).
    PAUSED = "paused"
    #: Asleep: KV cache released; new requests are refused with UNAVAILABLE.
    ASLEEP = "asleep"
    #: An update failed after copying began: nothing runs until an update succeeds.
    WEIGHTS_INCOMPLETE = "weights_incomplete"


_STATES_TO_WIRE = {
    GenerationState.SERVING: cpb.GENERATION_STATE_SERVING,
    GenerationState.PAUSED: cpb.GENERATION_STATE_PAUSED,
    GenerationState.ASLEEP: cpb.GENERATION_STATE_ASLEEP,
    GenerationState.WEIGHTS_INCOMPLETE: cpb.GENERATION_STATE_WEIGHTS_INCOMPLETE,
}
_STATES_FROM_WIRE = {wire: state for state, wire in _STATES_TO_WIRE.items()}
_MODES_TO_WIRE = {
    PauseMode.ABORT: cpb.PAUSE_MODE_ABORT,
    PauseMode.WAIT: cpb.PAUSE_MODE_WAIT,
    PauseMode.KEEP: cpb.PAUSE_MODE_KEEP,
}
_MODES_FROM_WIRE = {wire: mode for mode, wire in _MODES_TO_WIRE.items()}


def state_to_wire(state: GenerationState) -> cpb.GenerationState:
    return _STATES_TO_WIRE[state]


def state_from_wire(state: cpb.GenerationState) -> GenerationState:
    return _STATES_FROM_WIRE.get(state, GenerationState.SERVING)


def pause_mode(mode: str | PauseMode) -> PauseMode:
    try:
        return PauseMode(mode)
    except ValueError:
        modes = ", ".join(m.value for m in PauseMode)
        raise InvalidArgumentError("mode", f"must be one of {modes}, got {mode!r}") from None


def pause_mode_to_wire(mode: PauseMode) -> cpb.PauseMode:
    return _MODES_TO_WIRE[mode]


def pause_mode_from_wire(mode: cpb.PauseMode) -> PauseMode:
    found = _MODES_FROM_WIRE.get(mode)
    if found is None:
        raise InvalidArgumentError("mode", "set mode to PAUSE_MODE_ABORT, _WAIT or _KEEP")
    return found


def check_version(version: str) -> str:
    if not isinstance(version, str) or not version:
        raise InvalidArgumentError("version", "must be a non-empty string")
    if len(version) > MAX_VERSION_CHARS:
        raise InvalidArgumentError("version", f"must be at most {MAX_VERSION_CHARS} characters")
    return version


@dataclass(frozen=True, slots=True)
class LoraAdapterInfo:
    """A LoRA adapter a worker has loaded."""

    name: str
    path: str
    rank: int

    @classmethod
    def from_wire(cls, wire: cpb.LoraAdapter) -> LoraAdapterInfo:
        return cls(wire.name, wire.path, wire.rank)

    def to_wire(self) -> cpb.LoraAdapter:
        return cpb.LoraAdapter(name=self.name, path=self.path, rank=self.rank)


@dataclass(frozen=True, slots=True)
class WorkerState:
    """One worker after a control call."""

    #: The worker's address as the router knows it ("" when a worker answers for itself).
    worker: str
    weight_version: str
    state: GenerationState
    #: Its processes (tensor x pipeline parallel ranks): its share of a weights group.
    num_ranks: int = 1
    #: Its first rank in the weights group (after `init_weights_group`).
    rank_offset: int = 0
    #: The LoRA adapters it has loaded.
    lora_adapters: tuple[LoraAdapterInfo, ...] = ()

    @classmethod
    def from_wire(cls, wire: cpb.WorkerState) -> WorkerState:
        return cls(
            wire.worker,
            wire.weight_version,
            state_from_wire(wire.state),
            wire.num_ranks,
            wire.rank_offset,
            tuple(LoraAdapterInfo.from_wire(a) for a in wire.lora_adapters),
        )

    def to_wire(self) -> cpb.WorkerState:
        return cpb.WorkerState(
            worker=self.worker,
            weight_version=self.weight_version,
            state=state_to_wire(self.state),
            num_ranks=self.num_ranks,
            rank_offset=self.rank_offset,
            lora_adapters=[a.to_wire() for a in self.lora_adapters],
        )


@dataclass(frozen=True, slots=True)
class ControlReport:
    """What a control call left behind: every worker's state."""

    workers: list[WorkerState] = field(default_factory=list)

    @classmethod
    def from_wire(cls, wire: cpb.ControlResponse) -> ControlReport:
        return cls([WorkerState.from_wire(w) for w in wire.workers])

    @property
    def weight_version(self) -> str:
        """The version every worker serves; raises if they differ."""
        versions = {w.weight_version for w in self.workers}
        if len(versions) != 1:
            each = ", ".join(f"{w.worker or 'worker'}: {w.weight_version!r}" for w in self.workers)
            raise FailedPreconditionError(f"the workers serve different weight versions ({each})")
        return versions.pop()

    @property
    def num_ranks(self) -> int:
        """Ranks over all workers: what a weights group needs besides the trainer."""
        return sum(w.num_ranks for w in self.workers)


def tensor_chunks(
    named_tensors: Iterable[tuple[str, Any]],
    version: str,
    *,
    stage_only: bool = False,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Iterator[cpb.WeightsChunk]:
    """The messages of an `UpdateWeightsFromTensors` stream: each tensor (torch, in a dtype of
    `WIRE_DTYPES`) as consecutive chunks of at most ``chunk_bytes`` raw bytes, row-major,
    little-endian. The first message carries the version (and ``stage_only``)."""
    import torch  # the caller has tensors, so it has torch

    first = True
    for name, tensor in named_tensors:
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in WIRE_DTYPES:
            raise InvalidArgumentError(
                "named_tensors", f"{name}: dtype {dtype} cannot be sent (use {WIRE_DTYPES})"
            )
        flat = tensor.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy()
        shape = list(tensor.shape)
        for offset in range(0, max(len(flat), 1), chunk_bytes):
            chunk = cpb.WeightsChunk(
                name=name,
                dtype=dtype,
                shape=shape,
                offset=offset,
                data=flat[offset : offset + chunk_bytes].tobytes(),
            )
            if first:
                chunk.version, chunk.stage_only, first = version, stage_only, False
            yield chunk
    if first:  # no tensors: still one message, so the server learns the version
        yield cpb.WeightsChunk(version=version, stage_only=stage_only)


def tensor_bytes(named_tensors: Iterable[tuple[str, Any]]) -> int | None:
    """Bytes of the tensors' data; None for a one-shot iterator (counting would consume it)."""
    if not isinstance(named_tensors, Collection):
        return None
    return sum(tensor.numel() * tensor.element_size() for _, tensor in named_tensors)


def upload_timeout(num_bytes: int | None) -> float:
    """The default deadline (seconds) of an upload of ``num_bytes`` (None: not known)."""
    if num_bytes is None:
        num_bytes = UNCOUNTED_UPLOAD_BYTES
    return UPLOAD_SETUP_S + num_bytes / UPLOAD_MIN_BYTES_PER_S


async def read_to_end(chunks: AsyncIterator[object]) -> None:
    """Read and drop the rest of a refused upload, so that the refusal is answered after the
    client half-closed (see the design note above)."""
    async for _ in chunks:
        pass


async def write_chunk(call: grpc.aio.StreamUnaryCall, chunk: cpb.WeightsChunk) -> bool:
    """Write one chunk of an upload: done once gRPC took it, which its flow control holds back
    while the server reads nothing. False once the call has ended (the server answered early,
    or the deadline passed): awaiting the call then gives its answer."""
    try:
        await call.write(chunk)
    except (grpc.RpcError, asyncio.InvalidStateError):
        return False
    return True


async def upload_answer(call: grpc.aio.StreamUnaryCall) -> cpb.ControlResponse:
    """The answer to an ended upload, or its typed error. gRPC's aio client marks a call
    INTERNAL ("Internal error from Core") when a write fails because the call ended at its
    deadline before the deadline's own status reached it (a deadline is best effort over
    HTTP/2, gRPC says): a call that failed INTERNAL past its deadline ran out of time, and
    says DEADLINE_EXCEEDED."""
    try:
        response: cpb.ControlResponse = await call
    except grpc.RpcError as error:
        raise _upload_error(call, error) from None
    return response


def _upload_error(call: grpc.aio.StreamUnaryCall, error: grpc.RpcError) -> HeadraceError:
    remaining = call.time_remaining()
    if error.code() == grpc.StatusCode.INTERNAL and remaining is not None and remaining <= 0:
        return DeadlineExceededError("the upload did not end within its deadline")
    return status.from_rpc_error(error)


async def end_upload(call: grpc.aio.StreamUnaryCall) -> None:
    """Half-close an upload: the server now knows it has every chunk. A call that ended
    meanwhile needs no end (gRPC then raises its `InternalError`, not the call's status:
    awaiting the call gives that)."""
    with contextlib.suppress(grpc.aio.InternalError):
        await call.done_writing()
