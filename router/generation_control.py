"""The router's `GenerationControl`: each call fanned out to all its workers, all or nothing.

Design note. A router's workers serve one model, and a client controlling generation (an RLHF
driver) means all of them: one call pauses, updates or puts to sleep every worker, and the
answer has one `WorkerState` per worker (workers in address order). A call fails if any
worker is down or refuses it; its status is the first refusal's, and its message says how
each worker answered.

"All or nothing" is kept where it matters, in weight updates: an update is first checked on
every worker (`validate_only`) and committed only once all accept it, so a bad update leaves
every worker on the weights it had. Streamed tensors are forwarded to every worker as they
arrive (never buffered whole here), staged there (`stage_only`), and committed on all, or
dropped on all. Each forward carries the client's deadline (`upload_timeout` for a client
that set none) and ends half-closed or cancelled, never left open: a worker left waiting for
more chunks would leave the router and the client waiting too.

Pause, resume, sleep and wake need no second phase: they are idempotent, so a call that
failed on one worker is simply made again.

LoRA adapters are loaded on every worker or on none: a load one worker refuses is unloaded
again from those that took it. Unload and list are plain fan-outs.

A trainer's weights group spans every rank of every worker: `InitWeightsGroup` gives each
worker its own rank offset, from the rank counts their load reports carry.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import grpc.aio
from headrace.protos import control_pb2 as cpb
from headrace.protos import control_pb2_grpc
from headrace.router.router import Router
from headrace.router.workers import WorkerLink
from headrace.sdk import status
from headrace.sdk.errors import (
    DeadlineExceededError,
    HeadraceError,
    InvalidArgumentError,
    UnavailableError,
    error_for_code,
)
from headrace.sdk.streams import Undecodable
from headrace.sdk.weights import (
    end_upload,
    read_to_end,
    upload_answer,
    upload_timeout,
    write_chunk,
)

#: What one worker answered: its response or its error.
Outcome = cpb.ControlResponse | HeadraceError


class RouterControlService(control_pb2_grpc.GenerationControlServicer):
    def __init__(self, router: Router) -> None:
        self.router = router

    # --- fan-out ----------------------------------------------------------------------------

    def _links(self) -> list[WorkerLink]:
        links = sorted(self.router.pool.links.values(), key=lambda link: link.target)
        if not links:
            raise UnavailableError("the router has no workers")
        return links

    async def _on_all(
        self, call: Callable[[WorkerLink], Awaitable[cpb.ControlResponse]]
    ) -> cpb.ControlResponse:
        """``call`` on every worker at once; their states, or the combined refusal."""
        links = self._links()
        outcomes = list(await asyncio.gather(*(_outcome(link, call) for link in links)))
        self._note_states(links, outcomes)
        return _combine(links, outcomes)

    def _note_states(self, links: list[WorkerLink], outcomes: list[Outcome]) -> None:
        """What the workers answered is newer than their last load reports: act on it now
        (a request right after `wake_up` finds them awake)."""
        for link, outcome in zip(links, outcomes, strict=True):
            if isinstance(outcome, cpb.ControlResponse) and outcome.workers:
                link.note_state(outcome.workers[0])
        self.router.on_change()

    async def _unary(self, method: str, request: Any) -> cpb.ControlResponse:
        def call(link: WorkerLink) -> Awaitable[cpb.ControlResponse]:
            rpc = getattr(link.generation_control, method)
            result: Awaitable[cpb.ControlResponse] = rpc(request, metadata=link.metadata)
            return result

        return await self._on_all(call)

    async def _answer(
        self, context: grpc.aio.ServicerContext, call: Callable[[], Awaitable[cpb.ControlResponse]]
    ) -> cpb.ControlResponse:
        try:
            return await call()
        except Exception as error:
            await status.abort(context, error)

    # --- the calls ----------------------------------------------------------------------------

    async def PauseGeneration(
        self, request: cpb.PauseGenerationRequest, context: grpc.aio.ServicerContext
    ) -> cpb.ControlResponse:
        return await self._answer(context, lambda: self._unary("PauseGeneration", request))

    async def ResumeGeneration(
        self, request: cpb.ResumeGenerationRequest, context: grpc.aio.ServicerContext
    ) -> cpb.ControlResponse:
        return await self._answer(context, lambda: self._unary("ResumeGeneration", request))

    async def Sleep(
        self, request: cpb.SleepRequest, context: grpc.aio.ServicerContext
    ) -> cpb.ControlResponse:
        return await self._answer(context, lambda: self._unary("Sleep", request))

    async def WakeUp(
        self, request: cpb.WakeUpRequest, context: grpc.aio.ServicerContext
    ) -> cpb.ControlResponse:
        return await self._answer(context, lambda: self._unary("WakeUp", request))

    async def GetWeightVersion(
        self, request: cpb.GetWeightVersionRequest, context: grpc.aio.ServicerContext
    ) -> cpb.ControlResponse:
        return await self._answer(context, lambda: self._unary("GetWeightVersion", request))

    async def DropStagedWeights(
        self, request: cpb.DropStagedWeightsRequest, context: grpc.aio.ServicerContext
    ) -> cpb.ControlResponse:
        return await self._answer(context, lambda: self._unary("DropStagedWeights", request))

    async def LoadLoraAdapter(
        self, request: cpb.LoadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> cpb.ControlResponse:
        return await self._answer(context, lambda: self._load_lora(request))

    async def UnloadLoraAdapter(
        self, request: cpb.UnloadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> cpb.ControlResponse:
        return await self._answer(context, lambda: self._unary("UnloadLoraAdapter", request))

    async def ListLoraAdapters(
        self, request: cpb.ListLoraAdaptersRequest, context: grpc.aio.ServicerContext
    ) -> cpb.ControlResponse:
        return await self._answer(context, lambda: self._unary("ListLoraAdapters", request))

    async def _load_lora(self, request: cpb.LoadLoraAdapterRequest) -> cpb.ControlResponse:
        """Load on every worker; if any refuses, unload it again where it loaded."""
        links = self._links()

        def load(link: WorkerLink) -> Awaitable[cpb.ControlResponse]:
            result: Awaitable[cpb.ControlResponse]
            result = link.generation_control.LoadLoraAdapter(request, metadata=link.metadata)
            return result

        def unload(link: WorkerLink) -> Awaitable[cpb.ControlResponse]:
            undo = cpb.UnloadLoraAdapterRequest(name=request.name)
            result: Awaitable[cpb.ControlResponse]
            result = link.generation_control.UnloadLoraAdapter(undo, metadata=link.metadata)
            return result

        outcomes = list(await asyncio.gather(*(_outcome(link, load) for link in links)))
        if not all(_ok(outcome) for outcome in outcomes):
            loaded = [link for link, o in zip(links, outcomes, strict=True) if _ok(o)]
            await asyncio.gather(*(_outcome(link, unload) for link in loaded))
        return _combine(links, outcomes)

    async def UpdateWeights(
        self, request: cpb.UpdateWeightsRequest, context: grpc.aio.ServicerContext
    ) -> cpb.ControlResponse:
        return await self._answer(context, lambda: self._two_phase("UpdateWeights", request))

    async def UpdateWeightsFromGroup(
        self, request: cpb.UpdateWeightsFromGroupRequest, context: grpc.aio.ServicerContext
    ) -> cpb.ControlResponse:
        return await self._answer(
            context, lambda: self._two_phase("UpdateWeightsFromGroup", request)
        )

    async def _two_phase(
        self, method: str, request: cpb.UpdateWeightsRequest | cpb.UpdateWeightsFromGroupRequest
    ) -> cpb.ControlResponse:
        """Check on every worker; only if all accept, commit on every worker."""
        check = type(request)()
        check.CopyFrom(request)
        check.validate_only = True
        checked = await self._unary(method, check)
        if request.validate_only:
            return checked
        return await self._unary(method, request)

    async def InitWeightsGroup(
        self, request: cpb.InitWeightsGroupRequest, context: grpc.aio.ServicerContext
    ) -> cpb.ControlResponse:
        return await self._answer(context, lambda: self._init_group(request))

    async def _init_group(self, request: cpb.InitWeightsGroupRequest) -> cpb.ControlResponse:
        """Every worker joins at once, each at its own offset: worker i's first rank follows
        the ranks of workers 0..i-1."""
        links = self._links()
        offsets, offset = {}, request.rank_offset
        for link in links:
            offsets[link.target] = offset
            offset += link.report.num_ranks if link.report is not None else 1
        if offset != request.world_size:
            raise InvalidArgumentError(
                "world_size",
                f"must be {offset} (rank_offset {request.rank_offset} plus the "
                f"{offset - request.rank_offset} ranks of this router's workers), "
                f"got {request.world_size}",
            )

        def join(link: WorkerLink) -> Awaitable[cpb.ControlResponse]:
            own = cpb.InitWeightsGroupRequest()
            own.CopyFrom(request)
            own.rank_offset = offsets[link.target]
            result: Awaitable[cpb.ControlResponse] = link.generation_control.InitWeightsGroup(
                own, metadata=link.metadata
            )
            return result

        return await self._on_all(join)

    async def UpdateWeightsFromTensors(
        self, request_iterator: AsyncIterator[cpb.WeightsChunk], context: grpc.aio.ServicerContext
    ) -> cpb.ControlResponse:
        remaining = context.time_remaining()  # the client's deadline, if it set one
        timeout = upload_timeout(None) if remaining is None else remaining
        return await self._answer(
            context, lambda: self._update_from_stream(request_iterator, timeout)
        )

    async def _update_from_stream(
        self, chunks: AsyncIterator[cpb.WeightsChunk | Undecodable], timeout: float
    ) -> cpb.ControlResponse:
        """Stage the stream on every worker, then commit it on all (or drop it on all)."""
        links = self._links()
        down = [link.target for link in links if not link.healthy]
        if down:
            raise UnavailableError(f"workers down: {', '.join(down)}")
        header, outcomes = await _stage_on_all(links, chunks, timeout)
        self._note_states(links, outcomes)
        try:
            staged = _combine(links, outcomes)
        except HeadraceError:
            with contextlib.suppress(HeadraceError):  # (a worker down refused it already)
                await self._unary("DropStagedWeights", cpb.DropStagedWeightsRequest())
            raise
        if header is None or header.stage_only:
            return staged
        commit = cpb.UpdateWeightsRequest(version=header.version, staged=True)
        return await self._unary("UpdateWeights", commit)


async def _stage_on_all(
    links: list[WorkerLink], chunks: AsyncIterator[cpb.WeightsChunk | Undecodable], timeout: float
) -> tuple[cpb.WeightsChunk | None, list[Outcome]]:
    """Forward the client's chunks to every worker, stage_only: the client's header (its
    version and stage_only) and each worker's answer, within ``timeout`` seconds."""
    forwards = [_Forward(link, timeout) for link in links]
    try:
        async with asyncio.timeout(timeout):
            header = await _send_to_all(forwards, chunks)
            outcomes = await asyncio.gather(*(forward.finish() for forward in forwards))
    except TimeoutError:
        raise DeadlineExceededError(f"the upload did not end within {timeout:.1f} s") from None
    finally:
        for forward in forwards:  # ended, or else cancelled: never left open
            forward.call.cancel()
    return header, list(outcomes)


async def _send_to_all(
    forwards: list[_Forward], chunks: AsyncIterator[cpb.WeightsChunk | Undecodable]
) -> cpb.WeightsChunk | None:
    """Each chunk to every worker as it arrives (never buffered whole here); the header. Once
    a worker refused it the others need no more, and the rest is read to its end unsent
    (`read_to_end`), as it is before a chunk that cannot be decoded is refused."""
    header: cpb.WeightsChunk | None = None
    async for chunk in chunks:
        if isinstance(chunk, Undecodable):
            await read_to_end(chunks)
            raise chunk.fault()
        if header is None:
            header = cpb.WeightsChunk(version=chunk.version, stage_only=chunk.stage_only)
            chunk.stage_only = True
        sent = await asyncio.gather(*(forward.send(chunk) for forward in forwards))
        if not all(sent):
            await read_to_end(chunks)
            break
    return header


class _Forward:
    """One worker's stage_only upload, written chunk by chunk: gRPC's flow control holds a
    write back while the worker reads nothing, and so holds back the client's upload."""

    def __init__(self, link: WorkerLink, timeout: float) -> None:
        self.call: grpc.aio.StreamUnaryCall = link.generation_control.UpdateWeightsFromTensors(
            timeout=timeout, metadata=link.metadata
        )

    async def send(self, chunk: cpb.WeightsChunk) -> bool:
        """Write a chunk; False once the worker's call has ended (it refused the upload)."""
        return await write_chunk(self.call, chunk)

    async def finish(self) -> Outcome:
        """End the upload (every one not cancelled ends here) and the worker's answer."""
        await end_upload(self.call)
        try:
            return await upload_answer(self.call)
        except HeadraceError as error:
            return error


async def _outcome(
    link: WorkerLink, call: Callable[[WorkerLink], Awaitable[cpb.ControlResponse]]
) -> Outcome:
    if not link.healthy:
        return UnavailableError(f"worker {link.target} is down")
    return await _settled(call(link))


async def _settled(answer: Awaitable[cpb.ControlResponse]) -> Outcome:
    """A worker's response, or its error."""
    try:
        return await answer
    except grpc.RpcError as error:
        return status.from_rpc_error(error)


def _combine(links: list[WorkerLink], outcomes: list[Outcome]) -> cpb.ControlResponse:
    """Every worker's state, named; or, if any refused, the first refusal with a word on each
    worker's outcome."""
    failed = [(link, o) for link, o in zip(links, outcomes, strict=True) if not _ok(o)]
    if failed:
        first = failed[0][1]
        assert isinstance(first, HeadraceError)
        each = "; ".join(
            f"{link.target}: {'ok' if _ok(o) else getattr(o, 'grpc_code', 'error')}"
            for link, o in zip(links, outcomes, strict=True)
        )
        message = f"{str(first).removeprefix(_field_prefix(first))} [workers: {each}]"
        raise error_for_code(first.grpc_code, message, getattr(first, "field", ""))
    response = cpb.ControlResponse()
    for link, outcome in zip(links, outcomes, strict=True):
        assert isinstance(outcome, cpb.ControlResponse)
        for state in outcome.workers:
            state.worker = link.target
            response.workers.append(state)
    return response


def _ok(outcome: Outcome) -> bool:
    return isinstance(outcome, cpb.ControlResponse)


def _field_prefix(error: HeadraceError) -> str:
    field = getattr(error, "field", "")
    return f"{field}: " if field else ""
