"""`AsyncEngine`: the streaming API for servers.

The engine's step loop runs on a thread of its own, so model work never blocks the event
loop. Callers talk to it through a command queue (add, abort, pause, resume) and get results
back through `OutputStream`s: after each step, every stream receives ONE list holding the
outputs of all its requests that progressed in that step, so a server multiplexing many
requests on one connection sends one message per step.

Text and chat prompts are tokenized (chats rendered with the chat template) on a thread of
their own, never on the engine's: a long prompt costs its own request time, not every other
request's step. A request is announced to the
engine thread when it arrives (`_Pending`) and added once tokenized, so an abort that
overtakes the tokenizer still finds it.

Bad input arrives in-band: the request's only output is finished, with `error` set.

Generation control (pause, resume, new weights, sleep, wake) runs on the engine thread too,
between steps: each call is a command whose future the caller awaits. The steps in flight
are settled (collected and delivered) first; a WAIT pause's future resolves only once the
requests it lets finish have finished (or another pause mode or a resume replaced it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from headrace.sdk.config import GenerationConfig
from headrace.sdk.errors import HeadraceError, InternalError
from headrace.sdk.outputs import FinishReason, SampleDelta
from headrace.sdk.prompts import Chat, Prompt
from headrace.sdk.streams import FlowHooks, FlowLimits, ResponseQueue
from headrace.sdk.weights import PauseMode
from headrace.worker.config import EngineConfig
from headrace.worker.distributed.weight_sync import WeightGroupSpec, WeightSource
from headrace.worker.engine.engine import Engine
from headrace.worker.engine.outputs import EngineLoad, RequestOutput
from headrace.worker.models.weight_check import WeightChecker

logger = logging.getLogger(__name__)


class OutputStream:
    """Per-step batches of outputs, delivered onto one asyncio loop.

    A server's stream passes its flow-control hooks: past the limits' backlog of unsent
    batches, the hooks are asked to hold its requests (see `headrace.sdk.streams`); without
    hooks nothing is held.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop | None = None,
        limits: FlowLimits | None = None,
        hooks: FlowHooks | None = None,
    ) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._queue: ResponseQueue[list[RequestOutput]] = ResponseQueue(limits, hooks)

    def put(self, outputs: list[RequestOutput]) -> None:
        """Called from the engine thread (or the loop's)."""
        self._loop.call_soon_threadsafe(self._queue.put, outputs)

    async def get(self) -> list[RequestOutput]:
        return await self._queue.get()

    @property
    def holding(self) -> bool:
        """Its hooks were asked to hold the stream's requests (the reader fell behind)."""
        return self._queue.holding


@dataclass(slots=True)
class _Pending:
    """A request whose text prompt is being tokenized."""

    request_id: str
    stream: OutputStream


@dataclass(slots=True)
class _Add:
    request_id: str
    #: Token ids (the text until the tokenizer thread is done), or why tokenizing failed.
    prompt: Prompt | HeadraceError
    config: GenerationConfig
    priority: int
    stream: OutputStream
    #: Announced by a `_Pending` first (its prompt was text).
    announced: bool = False
    adapter: str | None = None


@dataclass(slots=True)
class _Abort:
    request_id: str
    error: HeadraceError | None


@dataclass(slots=True)
class _Hold:
    request_ids: list[str]
    #: True: pause them; False: let them go on.
    paused: bool


@dataclass(slots=True)
class _Control:
    """A generation-control call, run on the engine thread between steps."""

    #: What to do; returns the outputs of requests it ended (aborted), if any.
    call: Callable[[Engine], list[RequestOutput] | None]
    future: concurrent.futures.Future[None] = field(default_factory=concurrent.futures.Future)
    #: Resolve once no request is left but those a pause holds back (a WAIT pause).
    until_drained: bool = False


_STOP = object()
#: How stale `AsyncEngine.load` may get while the engine is busy (load reports go out every
#: 50 ms by default).
LOAD_PERIOD_S = 0.01


class AsyncEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.engine = Engine(config)
        self._commands: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._streams: dict[str, OutputStream] = {}  # owned by the engine thread
        #: Requests announced but not added yet (text being tokenized); engine thread only.
        self._pending: dict[str, OutputStream] = {}
        # One thread: a tokenizer is not safe to share between threads.
        self._tokenizer = concurrent.futures.ThreadPoolExecutor(1, "headrace-tokenize")
        #: Replaced (never mutated) by the engine thread, so any thread may read it: at most
        #: every LOAD_PERIOD_S while busy (it walks every request), and whenever it goes idle.
        self.load: EngineLoad = self.engine.load()
        self._load_time_s = time.monotonic()
        #: WAIT pauses not resolved yet (engine thread only).
        self._drain_waiters: list[concurrent.futures.Future[None]] = []
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
        adapter: str | None = None,
    ) -> None:
        if not isinstance(prompt, str | Chat):  # token ids: checked on the engine thread
            self._commands.put(_Add(request_id, prompt, config, priority, stream, False, adapter))
            return
        self._commands.put(_Pending(request_id, stream))
        add = _Add(request_id, prompt, config, priority, stream, True, adapter)
        self._tokenizer.submit(self._tokenize, add)

    def _tokenize(self, add: _Add) -> None:
        """On the tokenizer thread: the request with its token ids (or its error)."""
        assert isinstance(add.prompt, str | Chat)
        try:
            add.prompt = self.engine.intake.prompt_token_ids(add.prompt)
        except HeadraceError as error:
            add.prompt = error
        except Exception as exc:  # a tokenizer bug fails this request, not the engine
            logger.exception("tokenizing request %s failed", add.request_id)
            add.prompt = InternalError(f"tokenizing failed: {exc!r}")
        self._commands.put(add)

    def abort(self, request_id: str, error: HeadraceError | None = None) -> None:
        """Stop a request within one step; with ``error`` it ends failed, else cancelled."""
        self._commands.put(_Abort(request_id, error))

    def pause(self, request_ids: list[str]) -> None:
        """Generate nothing for these requests until `resume`; unknown ids are ignored."""
        self._commands.put(_Hold(request_ids, paused=True))

    def resume(self, request_ids: list[str]) -> None:
        self._commands.put(_Hold(request_ids, paused=False))

    # --- generation control (any thread; await the result) ----------------------------------

    @property
    def weight_checker(self) -> WeightChecker:
        """Checks tensors against the model; read-only, so any thread may use it."""
        return self.engine.control.checker

    async def pause_generation(self, mode: PauseMode) -> None:
        """Pause (see `GenerationControl`); with WAIT, returns once the requests in flight
        have finished."""
        await self._control(lambda e: e.pause_generation(mode), mode == PauseMode.WAIT)

    async def resume_generation(self) -> None:
        await self._control(lambda e: e.resume_generation())

    async def update_weights(
        self, source: WeightSource, version: str, validate_only: bool = False
    ) -> None:
        await self._control(lambda e: e.update_weights(source, version, validate_only))

    async def join_weight_group(self, spec: WeightGroupSpec) -> None:
        await self._control(lambda e: e.join_weight_group(spec))

    async def sleep(self, offload_weights: bool = False) -> None:
        await self._control(lambda e: e.sleep(offload_weights))

    async def wake_up(self) -> None:
        await self._control(lambda e: e.wake_up())

    async def load_lora_adapter(self, name: str, path: str) -> None:
        def load(engine: Engine) -> None:
            engine.adapters.load(name, path)

        await self._control(load)

    async def unload_lora_adapter(self, name: str) -> None:
        await self._control(lambda e: e.adapters.unload(name))

    async def _control(
        self, call: Callable[[Engine], list[RequestOutput] | None], until_drained: bool = False
    ) -> None:
        command = _Control(call, until_drained=until_drained)
        self._commands.put(command)
        await asyncio.wrap_future(command.future)

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
        self._tokenizer.shutdown(wait=True, cancel_futures=True)
        self._commands.put(_STOP)
        self._thread.join()
        self.engine.close()

    # --- engine thread ---------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            block = not self.engine.has_runnable_work()
            if not self._drain_commands(block):
                return
            if not self.engine.has_runnable_work():
                self._publish_load()
                continue
            try:
                outputs = self.engine.step()
            except Exception:  # Engine.step contains model faults; this is a bug
                logger.exception("engine loop failed")
                self._fail_everything()
                continue
            self._deliver(outputs)
            self._publish_load()
            self._resolve_drained()

    def _publish_load(self, now_too: bool = False) -> None:
        now = time.monotonic()
        idle = not self.engine.has_runnable_work()
        if now_too or idle or now - self._load_time_s >= LOAD_PERIOD_S:
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
        if isinstance(command, _Pending):
            self._pending[command.request_id] = command.stream
        elif isinstance(command, _Add):
            self._add(command)
        elif isinstance(command, _Abort):
            self._abort(command)
        elif isinstance(command, _Hold):
            hold = self.engine.pause_request if command.paused else self.engine.resume_request
            for request_id in command.request_ids:
                hold(request_id)
        elif isinstance(command, _Control):
            self._run_control(command)

    def _run_control(self, command: _Control) -> None:
        error: Exception | None = None
        try:
            self._deliver(self.engine.settle())
            self._deliver(command.call(self.engine) or [])
        except Exception as exc:  # the caller gets it; the engine goes on
            error = exc
        self._publish_load(now_too=True)  # before the caller learns the call is done
        if error is not None:
            command.future.set_exception(error)
        elif command.until_drained:
            self._drain_waiters.append(command.future)
        else:
            command.future.set_result(None)
        self._resolve_drained()

    def _resolve_drained(self) -> None:
        """Resolve WAIT pauses once drained, or once no longer waiting (resumed, re-paused)."""
        if not self._drain_waiters:
            return
        if self.engine.is_drained or self.engine.control.pause_mode != PauseMode.WAIT:
            for future in self._drain_waiters:
                future.set_result(None)
            self._drain_waiters.clear()

    def _add(self, add: _Add) -> None:
        if add.announced and self._pending.pop(add.request_id, None) is None:
            return  # aborted while it was being tokenized; its last output went out then
        try:
            if isinstance(add.prompt, HeadraceError):
                raise add.prompt
            self.engine.add_request(
                add.request_id, add.prompt, add.config, add.priority, add.adapter
            )
        except HeadraceError as exc:
            add.stream.put([_ended(add.request_id, exc)])
            return
        self._streams[add.request_id] = add.stream

    def _abort(self, abort: _Abort) -> None:
        stream = self._pending.pop(abort.request_id, None)
        if stream is not None:  # still being tokenized: it ends here
            stream.put([_ended(abort.request_id, abort.error)])
            return
        output = self.engine.abort_request(abort.request_id, abort.error)
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
            stream.put([_ended(request_id, error)])
        self._streams.clear()


def _ended(request_id: str, error: HeadraceError | None) -> RequestOutput:
    """The last output of a request that never reached the engine: failed with ``error``,
    or cancelled without one."""
    reason = FinishReason.ERROR if error is not None else FinishReason.ABORT
    return RequestOutput(
        request_id, samples=[SampleDelta(0, [], "", [], reason)], finished=True, error=error
    )
