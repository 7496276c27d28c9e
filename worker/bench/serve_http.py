"""``headrace bench serve --api openai``: the same load through the router's OpenAI door.

Each request is a streamed ``POST /v1/completions`` with the workload's token ids as the
prompt, greedy, ``ignore_eos`` (a headrace extension) and ``stream_options.include_usage``,
over keep-alive connections opened before the clock starts (as the gRPC load opens its
stream first). TTFT is the time to the first event that carries a choice, ITL the time
between such events, and the tokens are the usage the last event reports, so the figures
mean what the gRPC load's mean.

The client is a minimal HTTP/1.1 one on asyncio streams (`_Connection`: one request at a
time per connection, a chunked body split into SSE events). The SDK's gRPC client does its
work in C; a general Python HTTP client (httpx costs about 0.2 ms of CPU per event) would
measure itself, on the same few cores as the server, rather than the door.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable

from headrace.worker.bench.common import Report, Workload
from headrace.worker.bench.serve import Timings, arrival_offsets, timings_report

DATA = b"data: "
DONE = b"data: [DONE]"
#: The usage, in the last event (with a choice of its own in some servers: llama.cpp's).
USAGE = b'"usage":{'
CHOICELESS = b'"choices":[]'


class _Connection:
    """One keep-alive HTTP/1.1 connection to the door (opened again where the server closed
    it between requests: llama.cpp's server does after each streamed answer)."""

    def __init__(
        self, host: str, port: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.host, self.port, self.reader, self.writer = host, port, reader, writer

    @classmethod
    async def open(cls, host: str, port: int) -> _Connection:
        return cls(host, port, *await asyncio.open_connection(host, port))

    def close(self) -> None:
        self.writer.close()

    async def _send(self, request: bytes) -> bytes:
        """Write the request; the answer's status line (empty: the server had closed)."""
        if self.reader.at_eof():
            self.close()
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        self.writer.write(request)
        return await self.reader.readline()

    async def events(self, path: str, body: bytes) -> AsyncIterator[bytes]:
        """POST ``body``; the SSE events of the answer (a 200 with a chunked body)."""
        head = f"POST {path} HTTP/1.1\r\nhost: door\r\ncontent-type: application/json\r\n"
        request = f"{head}content-length: {len(body)}\r\n\r\n".encode() + body
        status = await self._send(request)
        if not status:  # closed while the request went out: once more, on a new connection
            status = await self._send(request)
        if not status:
            raise RuntimeError("the server closed the connection without answering")
        if b" 200 " not in status:
            raise RuntimeError(f"the door answered {status.decode().strip()!r}")
        while await self.reader.readline() != b"\r\n":
            pass  # headers: the door's SSE answers are always chunked
        pending = b""
        while size := int(await self.reader.readline(), 16):
            pending += (await self.reader.readexactly(size + 2))[:-2]
            *events, pending = pending.split(b"\n\n")
            for event in events:
                yield event
        await self.reader.readline()  # the empty trailer


def _body(prompt: list[int], max_tokens: int) -> dict[str, object]:
    return {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def _one(
    connection: _Connection, prompt: list[int], max_tokens: int, keep_text: bool = False
) -> Timings:
    """One streamed completion; with ``keep_text``, its text too (each event parsed: CPU
    the load client otherwise spares the server's cores)."""
    timings = Timings()
    last = sent = time.perf_counter()
    body = json.dumps(_body(prompt, max_tokens)).encode()
    async for event in connection.events("/v1/completions", body):
        if not event.startswith(DATA) or event == DONE:
            continue
        now = time.perf_counter()
        if USAGE in event:
            timings.num_tokens = json.loads(event[len(DATA) :])["usage"]["completion_tokens"]
        if CHOICELESS in event:  # the usage alone
            continue
        if timings.ttft_s is None:
            timings.ttft_s = now - sent
        else:
            timings.itl_s.append(now - last)
        if keep_text:
            timings.text += "".join(c["text"] for c in json.loads(event[len(DATA) :])["choices"])
        last = now
    return timings


async def run_http_load(
    target: str,
    workload: Workload,
    args: argparse.Namespace,
    name: str = "load",
    keep_text: bool = False,
    at_start: Callable[[], object] | None = None,
) -> Report:
    """Send the workload to the OpenAI door at ``target`` (HOST:PORT); with ``keep_text`` the
    report keeps each request's completion text (`Report.texts`). ``at_start`` runs when the
    connections are warm, right before the load starts (`serve_metrics` reads the servers'
    metrics there)."""
    offsets = arrival_offsets(len(workload.prompts), args.request_rate, args.seed)
    host, _, port = target.rpartition(":")
    num_connections = min(args.max_concurrency or len(workload.prompts), len(workload.prompts))
    idle: asyncio.Queue[_Connection] = asyncio.Queue()
    for _ in range(num_connections):
        idle.put_nowait(await _Connection.open(host, int(port)))

    async def one(i: int, start: float) -> Timings:
        await asyncio.sleep(max(0.0, start + offsets[i] - time.perf_counter()))
        connection = await idle.get()
        try:
            return await _one(connection, workload.prompts[i], workload.max_tokens[i], keep_text)
        finally:
            idle.put_nowait(connection)

    # Warm every connection up with a one-token request, as the gRPC load opens its stream.
    await asyncio.gather(*(one_token(idle) for _ in range(num_connections)))
    if at_start is not None:
        at_start()
    start = time.perf_counter()
    results = await asyncio.gather(*(one(i, start) for i in range(len(offsets))))
    report = timings_report(name, start, results)
    while not idle.empty():
        idle.get_nowait().close()
    return report


async def one_token(idle: asyncio.Queue[_Connection]) -> None:
    connection = await idle.get()
    await _one(connection, [100, 101], 1)
    idle.put_nowait(connection)
