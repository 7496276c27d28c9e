"""The worker's `GenerationControl` service: pause and resume, weight updates, sleep, LoRA
adapters (load, unload, list).

Each call becomes one `AsyncEngine` control command (run on the engine thread between
steps) and answers with the worker's state afterwards; a typed error becomes the call's
status (`sdk/status.py`). Streamed tensors are assembled and checked here, off the engine
thread (`TensorAssembler`); a `stage_only` upload is kept until `UpdateWeights` commits it
(`staged`) or `DropStagedWeights` drops it, which is how a router updates all its workers
or none. Every call here is admin-only where API keys are on (`sdk/auth.py`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc.aio
from headrace.protos import control_pb2 as cpb
from headrace.protos import control_pb2_grpc
from headrace.sdk import status
from headrace.sdk.errors import FailedPreconditionError, HeadraceError, InvalidArgumentError
from headrace.sdk.streams import Undecodable
from headrace.sdk.weights import (
    LoraAdapterInfo,
    WorkerState,
    check_version,
    pause_mode_from_wire,
    read_to_end,
)
from headrace.worker.distributed.weight_sync import (
    FromDisk,
    FromGroup,
    FromTensors,
    WeightGroupSpec,
    WeightSource,
)
from headrace.worker.engine.async_engine import AsyncEngine
from headrace.worker.models.weight_check import TensorMeta
from headrace.worker.serving.tensor_stream import TensorAssembler, torch_dtype

DEFAULT_GROUP_TIMEOUT_S = 600.0


@dataclass(frozen=True, slots=True)
class _Staged:
    version: str
    source: FromTensors


class GenerationControlService(control_pb2_grpc.GenerationControlServicer):
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self._staged: _Staged | None = None

    def state(self) -> cpb.ControlResponse:
        load = self.engine.load
        worker = WorkerState(
            worker="",
            weight_version=load.weight_version,
            state=load.state,
            num_ranks=self.engine.num_ranks,
            rank_offset=load.rank_offset,
            lora_adapters=tuple(
                LoraAdapterInfo(a.name, str(a.path), a.rank) for a in self.engine.lora_adapters()
            ),
        )
        return cpb.ControlResponse(workers=[worker.to_wire()])

    async def _answer(
        self, context: grpc.aio.ServicerContext, call: Callable[[], Awaitable[object]]
    ) -> cpb.ControlResponse:
        """Run ``call``; the worker's state, or the call's typed error as its status."""
        try:
            await call()
        except Exception as error:
            await status.abort(context, error)
        return self.state()

    async def PauseGeneration(
        self, request: cpb.PauseGenerationRequest, context: grpc.aio.ServicerContext
    ) -> cpb.ControlResponse:
        return await self._answer(
            context, lambda: self.engine.pause_generation(pause_mode_from_wire(request.mode))
        )

    async def ResumeGeneration(
        self, request: cpb.ResumeGenerationRequest, context: grpc.aio.ServicerContext
    ) -> cpb.ControlResponse:
        return await self._answer(context, self.engine.resume_generation)

    async def UpdateWeights(
        self, request: cpb.UpdateWeightsRequest, context: grpc.aio.ServicerContext
    ) -> cpb.ControlResponse:
        async def update() -> None:
            version = check_version(request.version)
            source = self._source(request)
            await self.engine.update_weights(source, version, request.validate_only)
            if isinstance(source, FromTensors) and not request.validate_only:
                self._staged = None

        return await self._answer(context, update)

    def _source(self, request: cpb.UpdateWeightsRequest) -> WeightSource:
        kind = request.WhichOneof("source")
        if kind == "path":
            return FromDisk(Path(request.path))
        if kind != "staged":
            raise InvalidArgumentError("source", "set path or staged")
        if self._staged is None or self._staged.version != request.version:
            raise FailedPreconditionError(
                f"no tensors are staged for version {request.version!r}: upload them first "
                "(UpdateWeightsFromTensors with stage_only)"
            )
        return self._staged.source

    async def UpdateWeightsFromTensors(
        self, request_iterator: AsyncIterator[cpb.WeightsChunk], context: grpc.aio.ServicerContext
    ) -> cpb.ControlResponse:
        async def update() -> None:
            version, stage_only, source = await self._receive(request_iterator)
            if stage_only:
                self._staged = _Staged(version, source)
            else:
                await self.engine.update_weights(source, version)

        return await self._answer(context, update)

    async def _receive(
        self, chunks: AsyncIterator[cpb.WeightsChunk | Undecodable]
    ) -> tuple[str, bool, FromTensors]:
        """(version, stage_only, the tensors) of a whole stream, checked; a refused one is
        read to its end before the refusal is raised (`read_to_end`)."""
        self._staged = None  # a new upload replaces what was staged, even if it fails
        assembler = TensorAssembler(self.engine.weight_checker)
        header: cpb.WeightsChunk | None = None
        try:
            async for chunk in chunks:
                if isinstance(chunk, Undecodable):
                    raise chunk.fault()
                if header is None:
                    header = chunk
                    check_version(chunk.version)
                if chunk.name or chunk.data:  # the first message may carry the version alone
                    assembler.add(chunk)
        except HeadraceError:
            await read_to_end(chunks)
            raise
        if header is None:
            raise InvalidArgumentError("version", "the stream carried no message")
        return header.version, header.stage_only, FromTensors(assembler.finish())

    async def DropStagedWeights(
        self, request: cpb.DropStagedWeightsRequest, context: grpc.aio.ServicerContext
    ) -> cpb.ControlResponse:
        self._staged = None
        return self.state()

    async def InitWeightsGroup(
        self, request: cpb.InitWeightsGroupRequest, context: grpc.aio.ServicerContext
    ) -> cpb.ControlResponse:
        async def join() -> None:
            timeout_s = DEFAULT_GROUP_TIMEOUT_S
            if request.HasField("timeout"):
                timeout_s = request.timeout.ToNanoseconds() / 1e9
            spec = WeightGroupSpec(
                request.host,
                request.port,
                request.world_size,
                request.rank_offset,
                request.backend or "gloo",
                timeout_s,
            )
            await self.engine.join_weight_group(spec)

        return await self._answer(context, join)

    async def UpdateWeightsFromGroup(
        self, request: cpb.UpdateWeightsFromGroupRequest, context: grpc.aio.ServicerContext
    ) -> cpb.ControlResponse:
        async def update() -> None:
            version = check_version(request.version)
            metas = tuple(
                TensorMeta(t.name, tuple(t.shape), torch_dtype(t.dtype, t.name))
                for t in request.tensors
            )
            await self.engine.update_weights(FromGroup(metas), version, request.validate_only)

        return await self._answer(context, update)

    async def Sleep(
        self, request: cpb.SleepRequest, context: grpc.aio.ServicerContext
    ) -> cpb.ControlResponse:
        return await self._answer(context, lambda: self.engine.sleep(request.offload_weights))

    async def WakeUp(
        self, request: cpb.WakeUpRequest, context: grpc.aio.ServicerContext
    ) -> cpb.ControlResponse:
        return await self._answer(context, self.engine.wake_up)

    async def GetWeightVersion(
        self, request: cpb.GetWeightVersionRequest, context: grpc.aio.ServicerContext
    ) -> cpb.ControlResponse:
        return self.state()

    async def LoadLoraAdapter(
        self, request: cpb.LoadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> cpb.ControlResponse:
        return await self._answer(
            context, lambda: self.engine.load_lora_adapter(request.name, request.path)
        )

    async def UnloadLoraAdapter(
        self, request: cpb.UnloadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> cpb.ControlResponse:
        return await self._answer(context, lambda: self.engine.unload_lora_adapter(request.name))

    async def ListLoraAdapters(
        self, request: cpb.ListLoraAdaptersRequest, context: grpc.aio.ServicerContext
    ) -> cpb.ControlResponse:
        return self.state()
