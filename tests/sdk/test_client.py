"""The SDK's clients against a scripted in-process server: one multiplexed stream for all
calls, a Cancel for every call left early, and chunks routed to the right caller."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import grpc
import grpc.aio
import pytest
from headrace.protos import generation_pb2 as pb
from headrace.protos import generation_pb2_grpc
from headrace.sdk import AsyncClient, Client, GenerationConfig, UnavailableError


class _Counting(generation_pb2_grpc.GenerationServicer):
    """Answers each request with `max_tokens` chunks of one token each (token = its index),
    one every 5 ms, interleaving requests; records streams opened, requests and cancels
    received."""

    def __init__(self) -> None:
        self.num_streams = 0
        self.requests: list[pb.Request] = []
        self.cancelled: list[str] = []

    async def Generate(
        self, request_iterator: AsyncIterator[pb.GenerateRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        self.num_streams += 1
        progress: dict[str, tuple[int, int]] = {}  # request id -> (sent, budget)
        input_done = asyncio.Event()

        async def read() -> None:
            async for message in request_iterator:
                if message.WhichOneof("kind") == "request":
                    request = message.request
                    self.requests.append(request)
                    progress[request.request_id] = (0, request.config.max_tokens)
                else:
                    self.cancelled.append(message.cancel.request_id)
                    progress.pop(message.cancel.request_id, None)
            input_done.set()

        reader = asyncio.create_task(read())
        while not (input_done.is_set() and not progress):
            await asyncio.sleep(0.005)
            response = pb.GenerateResponse()
            for request_id, (sent, budget) in list(progress.items()):
                done = sent + 1 == budget
                response.chunks.append(
                    pb.Chunk(
                        request_id=request_id,
                        token_ids=[sent],
                        text=f"{sent} ",
                        finished=done,
                        finish_reason=pb.FINISH_REASON_LENGTH if done else 0,
                    )
                )
                progress[request_id] = (sent + 1, budget)
                if done:
                    del progress[request_id]
            if response.chunks:
                yield response
        await reader


async def _serve(servicer: _Counting) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def test_concurrent_calls_share_one_stream_and_get_their_own_tokens() -> None:
    async def run() -> None:
        servicer = _Counting()
        server, target = await _serve(servicer)
        async with AsyncClient(target) as client:
            budgets = [3 + i % 11 for i in range(50)]
            results = await asyncio.gather(
                *(client.generate("x", GenerationConfig(max_tokens=b)) for b in budgets)
            )
        await server.stop(None)
        assert [r.token_ids for r in results] == [list(range(b)) for b in budgets]
        assert results[0].text == "0 1 2 "
        assert servicer.num_streams == 1
        assert servicer.cancelled == []

    asyncio.run(run())


def test_leaving_a_stream_early_sends_cancel() -> None:
    async def run() -> None:
        servicer = _Counting()
        server, target = await _serve(servicer)
        async with AsyncClient(target) as client:
            stream = client.stream("x", GenerationConfig(max_tokens=1000))
            async for chunk in stream:
                if chunk.token_ids == [2]:
                    break
            await stream.aclose()
            other = await client.generate("y", GenerationConfig(max_tokens=3))
            for _ in range(100):
                if servicer.cancelled:
                    break
                await asyncio.sleep(0.01)
        await server.stop(None)
        assert servicer.cancelled == ["0"]  # the first request's id
        assert other.token_ids == [0, 1, 2]

    asyncio.run(run())


def test_cancelled_task_sends_cancel() -> None:
    async def run() -> None:
        servicer = _Counting()
        server, target = await _serve(servicer)
        async with AsyncClient(target) as client:
            task = asyncio.create_task(client.generate("x", GenerationConfig(max_tokens=1000)))
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(100):
                if servicer.cancelled:
                    break
                await asyncio.sleep(0.01)
        await server.stop(None)
        assert servicer.cancelled == ["0"]

    asyncio.run(run())


def test_blocking_client_stream_closed_early_sends_cancel() -> None:
    servicer = _Counting()
    loop = asyncio.new_event_loop()
    server, target = loop.run_until_complete(_serve(servicer))
    try:
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        with Client(target) as client:
            stream = client.stream("x", GenerationConfig(max_tokens=1000))
            assert next(stream).token_ids == [0]
            stream.close()
            assert client.generate("y", GenerationConfig(max_tokens=2)).token_ids == [0, 1]
        asyncio.run_coroutine_threadsafe(server.stop(None), loop).result()
        assert servicer.cancelled == ["0"]
    finally:
        loop.call_soon_threadsafe(loop.stop)


def test_server_gone_is_unavailable_and_the_next_call_reconnects() -> None:
    async def run() -> None:
        servicer = _Counting()
        server, target = await _serve(servicer)
        port = int(target.rsplit(":", 1)[1])
        async with AsyncClient(target) as client:
            task = asyncio.create_task(client.generate("x", GenerationConfig(max_tokens=1000)))
            await asyncio.sleep(0.1)
            await server.stop(None)
            with pytest.raises(UnavailableError):
                await task
            # A new server on the same port: the client opens a fresh stream for it.
            revived = grpc.aio.server()
            generation_pb2_grpc.add_GenerationServicer_to_server(servicer, revived)
            revived.add_insecure_port(f"127.0.0.1:{port}")
            await revived.start()
            result = await client.generate("y", GenerationConfig(max_tokens=2))
            await revived.stop(None)
        assert result.token_ids == [0, 1]
        assert servicer.num_streams == 2

    asyncio.run(run())


def test_every_call_sends_its_priority_timeout_and_adapter() -> None:
    servicer = _Counting()
    loop = asyncio.new_event_loop()
    server, target = loop.run_until_complete(_serve(servicer))
    try:
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        config = GenerationConfig(max_tokens=2)
        options = {"priority": 3, "timeout": 5.0, "adapter": "sql"}
        chat = [{"role": "user", "content": "hi"}]
        with Client(target) as client:
            client.generate("x", config, priority=3, timeout=5.0, adapter="sql")
            client.chat(chat, config, priority=3, timeout=5.0, adapter="sql")
            list(client.stream("x", config, priority=3, timeout=5.0, adapter="sql"))
            list(client.stream_chat(chat, config, priority=3, timeout=5.0, adapter="sql"))
        asyncio.run_coroutine_threadsafe(server.stop(None), loop).result()
    finally:
        loop.call_soon_threadsafe(loop.stop)
    sent = [
        {"priority": r.priority, "timeout": r.timeout.ToNanoseconds() / 1e9, "adapter": r.adapter}
        for r in servicer.requests
    ]
    assert sent == [options] * 4
    assert [r.WhichOneof("prompt") for r in servicer.requests] == ["text", "chat"] * 2
