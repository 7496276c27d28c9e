"""The SDK's generation-control calls (RLHF): pause and resume, weight updates, sleep.

`AsyncControlCalls` and `ControlCalls` are mixed into `AsyncClient` and `Client`, so the calls
sit beside `generate`:

    with Client("router:50051", api_key=ADMIN_KEY) as client:
        client.pause(mode="keep")
        client.update_weights(path="/ckpt/step-100", version="step-100")
        client.resume()

A worker and a router answer alike: a router fans each call out to all its workers (all or
nothing) and its `ControlReport` has one entry per worker. Every call needs an admin key
where API keys are on; a failed call raises its typed error (`InvalidArgumentError` naming
the tensor for a bad update). ``timeout`` (seconds) is the call's gRPC deadline; None waits
as long as the call takes (an update of a big model, a WAIT pause), except for streamed
tensors: an upload always has a deadline, by default one that grows with its bytes
(`upload_timeout`), so an upload that stalls fails rather than hangs.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from typing import Any, TypeVar

import grpc
import grpc.aio
from headrace.protos import control_pb2 as cpb
from headrace.protos import control_pb2_grpc
from headrace.sdk import status
from headrace.sdk.credentials import Metadata
from headrace.sdk.status import duration
from headrace.sdk.weights import (
    DEFAULT_CHUNK_BYTES,
    ControlReport,
    PauseMode,
    end_upload,
    pause_mode,
    pause_mode_to_wire,
    tensor_bytes,
    tensor_chunks,
    upload_answer,
    upload_timeout,
    write_chunk,
)

T = TypeVar("T")
#: (name, dtype, shape) of a tensor a trainer broadcasts; dtype a torch dtype or its name.
TensorSpec = tuple[str, Any, Sequence[int]]


async def _report(call: Callable[[], Awaitable[cpb.ControlResponse]]) -> ControlReport:
    try:
        return ControlReport.from_wire(await call())
    except grpc.RpcError as rpc_error:
        raise status.from_rpc_error(rpc_error) from None


async def _upload(
    call: grpc.aio.StreamUnaryCall, chunks: Iterable[cpb.WeightsChunk]
) -> cpb.ControlResponse:
    """Write every chunk and half-close, then the server's answer. A server that answered
    early (a deadline; headrace's servers read a refused upload to its end, see
    `read_to_end`) stops the writing, and its status is the answer; a chunk that
    cannot be made (a tensor of another dtype) cancels the call and raises its own error."""
    try:
        for chunk in chunks:
            if not await write_chunk(call, chunk):
                break
        await end_upload(call)
    except BaseException:
        call.cancel()
        raise
    return await upload_answer(call)


def tensor_specs(tensors: Iterable[TensorSpec]) -> list[cpb.TensorSpec]:
    return [
        cpb.TensorSpec(name=name, dtype=str(dtype).removeprefix("torch."), shape=list(shape))
        for name, dtype, shape in tensors
    ]


class AsyncControlCalls:
    """The control calls of `AsyncClient` (which provides the channel and metadata)."""

    _channel: grpc.aio.Channel
    _metadata: Metadata

    @property
    def _control(self) -> control_pb2_grpc.GenerationControlStub:
        return control_pb2_grpc.GenerationControlStub(self._channel)

    def _call(self, method: str, request: Any, timeout: float | None) -> Awaitable[ControlReport]:
        rpc = getattr(self._control, method)
        return _report(lambda: rpc(request, timeout=timeout, metadata=self._metadata))

    async def pause(
        self, mode: str | PauseMode = PauseMode.ABORT, *, timeout: float | None = None
    ) -> ControlReport:
        """Pause generation: "abort" ends requests in flight (finish reason abort), "wait"
        returns once they finished, "keep" freezes them with their KV cache. New requests
        queue until `resume`."""
        request = cpb.PauseGenerationRequest(mode=pause_mode_to_wire(pause_mode(mode)))
        return await self._call("PauseGeneration", request, timeout)

    async def resume(self, *, timeout: float | None = None) -> ControlReport:
        return await self._call("ResumeGeneration", cpb.ResumeGenerationRequest(), timeout)

    async def update_weights(
        self,
        path: str,
        version: str,
        *,
        validate_only: bool = False,
        timeout: float | None = None,
    ) -> ControlReport:
        """Load a safetensors checkpoint folder on the workers' disk (the same path on each)."""
        request = cpb.UpdateWeightsRequest(version=version, path=path, validate_only=validate_only)
        return await self._call("UpdateWeights", request, timeout)

    async def update_weights_from_tensors(
        self,
        named_tensors: Iterable[tuple[str, Any]],
        version: str,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        timeout: float | None = None,
    ) -> ControlReport:
        """Stream (name, torch tensor) pairs, named as in the checkpoint, to the server.

        ``timeout`` None means `upload_timeout` of the tensors' bytes: 60 s plus 1 s per 60 MB
        (for a one-shot iterator, whose bytes are not counted ahead, that of 140 GB)."""
        if timeout is None:
            timeout = upload_timeout(tensor_bytes(named_tensors))
        chunks = tensor_chunks(named_tensors, version, chunk_bytes=chunk_bytes)
        call = self._control.UpdateWeightsFromTensors(timeout=timeout, metadata=self._metadata)
        return await _report(lambda: _upload(call, chunks))

    async def init_weights_group(
        self,
        host: str,
        port: int,
        world_size: int,
        rank_offset: int = 1,
        backend: str = "gloo",
        *,
        group_timeout: float = 600.0,
        timeout: float | None = None,
    ) -> ControlReport:
        """Have every rank of every worker join the trainer's group at host:port (the trainer
        is rank 0 and must join at the same time); returns once all have joined."""
        request = cpb.InitWeightsGroupRequest(
            host=host,
            port=port,
            world_size=world_size,
            rank_offset=rank_offset,
            backend=backend,
            timeout=duration(group_timeout),
        )
        return await self._call("InitWeightsGroup", request, timeout)

    async def update_weights_from_group(
        self,
        tensors: Iterable[TensorSpec],
        version: str,
        *,
        validate_only: bool = False,
        timeout: float | None = None,
    ) -> ControlReport:
        """Receive the tensors the trainer broadcasts over the group, in this order."""
        request = cpb.UpdateWeightsFromGroupRequest(
            version=version, tensors=tensor_specs(tensors), validate_only=validate_only
        )
        return await self._call("UpdateWeightsFromGroup", request, timeout)

    async def sleep(
        self, offload_weights: bool = False, *, timeout: float | None = None
    ) -> ControlReport:
        """Release the KV cache (and optionally move weights to host memory); requests in
        flight end (abort) and new ones fail with UNAVAILABLE until `wake_up`."""
        request = cpb.SleepRequest(offload_weights=offload_weights)
        return await self._call("Sleep", request, timeout)

    async def wake_up(self, *, timeout: float | None = None) -> ControlReport:
        return await self._call("WakeUp", cpb.WakeUpRequest(), timeout)

    async def control_state(self, *, timeout: float | None = 30.0) -> ControlReport:
        """Every worker's weight version, state and ranks."""
        return await self._call("GetWeightVersion", cpb.GetWeightVersionRequest(), timeout)

    async def weight_version(self, *, timeout: float | None = 30.0) -> str:
        """The version every worker serves (`FailedPreconditionError` if they differ)."""
        return (await self.control_state(timeout=timeout)).weight_version

    async def load_lora_adapter(
        self, name: str, path: str, *, timeout: float | None = None
    ) -> ControlReport:
        """Load the PEFT adapter folder ``path`` (on the workers' disk) as ``name`` on every
        worker; requests then pass ``adapter=name``."""
        request = cpb.LoadLoraAdapterRequest(name=name, path=str(path))
        return await self._call("LoadLoraAdapter", request, timeout)

    async def unload_lora_adapter(
        self, name: str, *, timeout: float | None = None
    ) -> ControlReport:
        """Unload it everywhere; refused (`FailedPreconditionError`) while requests use it."""
        request = cpb.UnloadLoraAdapterRequest(name=name)
        return await self._call("UnloadLoraAdapter", request, timeout)

    async def list_lora_adapters(self, *, timeout: float | None = 30.0) -> ControlReport:
        """Every worker's loaded adapters (`WorkerState.lora_adapters`)."""
        return await self._call("ListLoraAdapters", cpb.ListLoraAdaptersRequest(), timeout)


class ControlCalls:
    """The blocking twins, for `Client` (which runs its `AsyncClient` on a thread)."""

    _async: AsyncControlCalls

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        raise NotImplementedError

    def pause(
        self, mode: str | PauseMode = PauseMode.ABORT, *, timeout: float | None = None
    ) -> ControlReport:
        """See `AsyncControlCalls.pause`."""
        return self._run(self._async.pause(mode, timeout=timeout))

    def resume(self, *, timeout: float | None = None) -> ControlReport:
        return self._run(self._async.resume(timeout=timeout))

    def update_weights(
        self, path: str, version: str, *, validate_only: bool = False, timeout: float | None = None
    ) -> ControlReport:
        """See `AsyncControlCalls.update_weights`."""
        coroutine = self._async.update_weights(
            path, version, validate_only=validate_only, timeout=timeout
        )
        return self._run(coroutine)

    def update_weights_from_tensors(
        self,
        named_tensors: Iterable[tuple[str, Any]],
        version: str,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        timeout: float | None = None,
    ) -> ControlReport:
        """See `AsyncControlCalls.update_weights_from_tensors`."""
        coroutine = self._async.update_weights_from_tensors(
            named_tensors, version, chunk_bytes=chunk_bytes, timeout=timeout
        )
        return self._run(coroutine)

    def init_weights_group(
        self,
        host: str,
        port: int,
        world_size: int,
        rank_offset: int = 1,
        backend: str = "gloo",
        *,
        group_timeout: float = 600.0,
        timeout: float | None = None,
    ) -> ControlReport:
        """See `AsyncControlCalls.init_weights_group`."""
        coroutine = self._async.init_weights_group(
            host,
            port,
            world_size,
            rank_offset,
            backend,
            group_timeout=group_timeout,
            timeout=timeout,
        )
        return self._run(coroutine)

    def update_weights_from_group(
        self,
        tensors: Iterable[TensorSpec],
        version: str,
        *,
        validate_only: bool = False,
        timeout: float | None = None,
    ) -> ControlReport:
        """See `AsyncControlCalls.update_weights_from_group`."""
        coroutine = self._async.update_weights_from_group(
            tensors, version, validate_only=validate_only, timeout=timeout
        )
        return self._run(coroutine)

    def sleep(
        self, offload_weights: bool = False, *, timeout: float | None = None
    ) -> ControlReport:
        return self._run(self._async.sleep(offload_weights, timeout=timeout))

    def wake_up(self, *, timeout: float | None = None) -> ControlReport:
        return self._run(self._async.wake_up(timeout=timeout))

    def control_state(self, *, timeout: float | None = 30.0) -> ControlReport:
        return self._run(self._async.control_state(timeout=timeout))

    def weight_version(self, *, timeout: float | None = 30.0) -> str:
        return self._run(self._async.weight_version(timeout=timeout))

    def load_lora_adapter(
        self, name: str, path: str, *, timeout: float | None = None
    ) -> ControlReport:
        return self._run(self._async.load_lora_adapter(name, path, timeout=timeout))

    def unload_lora_adapter(self, name: str, *, timeout: float | None = None) -> ControlReport:
        return self._run(self._async.unload_lora_adapter(name, timeout=timeout))

    def list_lora_adapters(self, *, timeout: float | None = 30.0) -> ControlReport:
        return self._run(self._async.list_lora_adapters(timeout=timeout))
