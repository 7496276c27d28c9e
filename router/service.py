"""The router's `Generation` service: the same service a worker serves, in front of many
workers. One `RouterSession` per stream; the `Router` does the rest."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc.aio
from headrace.protos import generation_pb2 as pb
from headrace.protos import generation_pb2_grpc
from headrace.router.router import Router
from headrace.router.session import RouterSession
from headrace.sdk import status, streams
from headrace.sdk.errors import HeadraceError
from headrace.sdk.streams import FlowLimits

#: How long a worker may take to answer a forwarded unary call (it tokenizes on the thread
#: that tokenizes its requests' prompts, so it may queue behind them).
TIMEOUT_S = 30.0


class RouterService(generation_pb2_grpc.GenerationServicer):
    """The same `Generation` service a worker serves, in front of many workers."""

    def __init__(self, router: Router, flow: FlowLimits) -> None:
        self.router = router
        self.flow = flow

    def _session(self, context: grpc.aio.ServicerContext) -> RouterSession:
        return RouterSession(self.router, self.flow, tuple(context.invocation_metadata() or ()))

    # Stream-response handlers are coroutines that write with context.write (see streams).
    async def Generate(
        self,
        request_iterator: AsyncIterator[pb.GenerateRequest],
        context: grpc.aio.ServicerContext,
    ) -> None:
        await streams.serve_stream(self._session(context), request_iterator, context)

    async def GenerateOne(self, request: pb.Request, context: grpc.aio.ServicerContext) -> None:
        await streams.serve_one(self._session(context), request, context)

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        try:
            return await self.router.model_info()
        except HeadraceError as error:
            await status.abort(context, error)

    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        """Forwarded to a healthy worker: the router has no tokenizer."""
        try:
            return await self.router.ask_a_worker(
                lambda stub, metadata: stub.Tokenize(request, timeout=TIMEOUT_S, metadata=metadata)
            )
        except HeadraceError as error:
            await status.abort(context, error)

    async def Detokenize(
        self, request: pb.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.DetokenizeResponse:
        try:
            return await self.router.ask_a_worker(
                lambda stub, metadata: stub.Detokenize(
                    request, timeout=TIMEOUT_S, metadata=metadata
                )
            )
        except HeadraceError as error:
            await status.abort(context, error)
