"""`AsyncEngine`: the streaming API for servers.

The engine's step loop runs on a thread of its own, so model work never blocks the event
loop. Callers talk to it through a command queue (add, abort) and get results back through
`OutputStream`s: after each step, every stream receives ONE list holding the outputs of all
its requests that progressed in that step, so a server multiplexing many requests on one
connection sends one message per step.

Bad input arrives in-band: the request's only output is finished, with `error` set.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from headrace.sdk.config import GenerationConfig
from headrace.sdk.errors import HeadraceError, InternalError
from headrace.sdk.outputs import FinishReason, SampleDelta
from headrace.sdk.prompts import Prompt
from headrace.worker.config import EngineConfig
from headrace.worker.engine.engine import Engine
from headrace.worker.engine.outputs import EngineLoad, RequestOutput

logger = logging.getLogger(__name__)


class OutputStream:
    """Per-step batches of outputs, delivered onto one asyncio loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._queue: asyncio.Queue[list[RequestOutput]] = asyncio.Queue()

    def put(self, outputs: list[RequestOutput]) -> None:
        """Called from the engine thread."""
        self._loop.call_soon_threadsafe(self._queue.put_nowait, outputs)

    async def get(self) -> list[RequestOutput]:
        return await self._queue.get()


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: Prompt
    config: GenerationConfig
    priority: int
    stream: OutputStream


@dataclass(slots=True)
class _Abort:
    request_id: str
    error: HeadraceError | None


_STOP = object()
#: How stale `AsyncEngine.load` may get while the engine is busy (load reports go out every
#: 50 ms by default).
LOAD_PERIOD_S = 0.01


class AsyncEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.engine = Engine(config)
        self._commands: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._streams: dict[str, OutputStream] = {}  # owned by the engine thread
        #: Replaced (never mutated) by the engine thread, so any thread may read it: at most
        #: every LOAD_PERIOD_S while busy (it walks every request), and whenever it goes idle.
        self.load: EngineLoad = self.engine.load()
        self._load_time_s = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="headrace-engine", daemon=True)
        self._thread.start()

    # --- caller side (any thread) --------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        config: GenerationConfig,
        stream: OutputStream,
        priority: int = 0,
    ) -> None:
        self._commands.put(_Add(request_id, prompt, config, priority, stream))

    def abort(self, request_id: str, error: HeadraceError | None = None) -> None:
        """Stop a request within one step; with ``error`` it ends failed, else cancelled."""
        self._commands.put(_Abort(request_id, error))

    async def generate(
        self,
        request_id: str,
        prompt: Prompt,
        config: GenerationConfig | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's deltas; leaving early aborts it. Bad input raises."""
        stream = OutputStream()
        self.add_request(request_id, prompt, config or GenerationConfig(), stream, priority)
        finished = False
        try:
            while not finished:
                for output in await stream.get():
                    if output.error is not None:
                        finished = True
                        raise output.error
                    finished = output.finished
                    yield output
        finally:
            if not finished:
                self.abort(request_id)

    def on_fatal(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(reason)`` (from another thread) just before a fault the worker
        cannot survive ends the process: a rank of a parallel worker died."""
        self.engine.on_fatal(callback)

    def shutdown(self) -> None:
        self._commands.put(_STOP)
        self._thread.join()
        self.engine.close()

    # --- engine thread ---------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            block = not self.engine.has_unfinished_requests()
            if not self._drain_commands(block):
                return
            try:
                outputs = self.engine.step()
            except Exception:  # Engine.step contains model faults; this is a bug
                logger.exception("engine loop failed")
                self._fail_everything()
                continue
            self._deliver(outputs)
            self._publish_load()

    def _publish_load(self) -> None:
        now = time.monotonic()
        if now - self._load_time_s >= LOAD_PERIOD_S or not self.engine.has_unfinished_requests():
            self.load = self.engine.load()
            self._load_time_s = now

    def _drain_commands(self, block: bool) -> bool:
        """Apply queued commands (waiting for one if block); False once told to stop."""
        try:
            command = self._commands.get() if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if command is _STOP:
                return False
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, command: object) -> None:
        if isinstance(command, _Add):
            try:
                self.engine.add_request(
                    command.request_id, command.prompt, command.config, command.priority
                )
            except HeadraceError as exc:
                command.stream.put([_failed(command.request_id, exc)])
                return
            self._streams[command.request_id] = command.stream
        elif isinstance(command, _Abort):
            output = self.engine.abort_request(command.request_id, command.error)
            if output is not None:
                self._deliver([output])

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        batches: dict[int, tuple[OutputStream, list[RequestOutput]]] = {}
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
            batches.setdefault(id(stream), (stream, []))[1].append(output)
        for stream, batch in batches.values():
            stream.put(batch)

    def _fail_everything(self) -> None:
        error = InternalError("the engine loop failed; see the worker's log")
        for request_id, stream in list(self._streams.items()):
            self.engine.abort_request(request_id)
            stream.put([_failed(request_id, error)])
        self._streams.clear()


def _failed(request_id: str, error: HeadraceError) -> RequestOutput:
    return RequestOutput(
        request_id,
        samples=[SampleDelta(0, [], "", [], FinishReason.ERROR)],
        finished=True,
        error=error,
    )
