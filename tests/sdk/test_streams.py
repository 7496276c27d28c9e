"""A stream's flow control (`FlowControl` behind a `ResponseQueue`), as router and worker
sessions share it: backlog holds and releases, the client's own holds, the slow-reader
timer. The sessions' side is a recorder of what it is asked to do."""

from __future__ import annotations

import asyncio

import pytest
from headrace.sdk.errors import InvalidArgumentError, ResourceExhaustedError
from headrace.sdk.streams import FlowControl, FlowLimits, ResponseQueue


class Recorder:
    """A session's side of flow control: it records each request held, released, expired."""

    def __init__(self) -> None:
        self.held: list[str] = []
        self.released: list[str] = []
        self.expired: list[tuple[str, ResourceExhaustedError]] = []

    def flow(self, limits: FlowLimits) -> FlowControl:
        return FlowControl(limits, self.held.append, self.released.append, self._expire)

    def _expire(self, request_id: str, error: ResourceExhaustedError) -> None:
        self.expired.append((request_id, error))


def test_a_backlog_past_the_limit_holds_every_request_and_half_of_it_releases_them() -> None:
    async def test() -> None:
        recorder = Recorder()
        limits = FlowLimits(max_backlog=4)
        flow = recorder.flow(limits)
        queue: ResponseQueue[int] = ResponseQueue(limits, flow)
        flow.add("a")
        flow.add("b")
        for item in range(4):
            queue.put(item)
        assert recorder.held == []  # at the limit, not past it
        queue.put(4)
        assert recorder.held == ["a", "b"]
        flow.add("c")  # admitted while the client is behind: held at once
        assert recorder.held == ["a", "b", "c"]
        await queue.get()
        await queue.get()
        assert recorder.released == []  # 3 unsent: more than half the limit
        await queue.get()
        assert recorder.released == ["a", "b", "c"]
        flow.close()

    asyncio.run(test())


def test_a_request_the_client_holds_stays_held_through_a_backlog_release() -> None:
    async def test() -> None:
        recorder = Recorder()
        flow = recorder.flow(FlowLimits())
        flow.add("a")
        flow.add("b")
        flow.hold_for_client(["a", "unknown"])
        assert recorder.held == ["a"]
        flow.hold_all()
        flow.release_all()
        assert recorder.held == ["a", "b"] and recorder.released == ["b"]
        flow.hold_all()
        flow.release_for_client(["a"])  # the backlog still holds the stream
        assert recorder.released == ["b"]
        flow.release_all()
        assert recorder.released == ["b", "a", "b"]
        flow.close()

    asyncio.run(test())


def test_a_request_held_past_the_slow_reader_timeout_expires_resource_exhausted() -> None:
    async def test() -> None:
        recorder = Recorder()
        flow = recorder.flow(FlowLimits(slow_reader_timeout_s=0.05))
        for request_id in ("held", "released", "finished"):
            flow.add(request_id)
        flow.hold_all()
        flow.hold_for_client(["held"])
        flow.release_for_client(["released"])  # the backlog holds it still
        flow.release_all()  # releases all but "held" before the timeout
        flow.hold_for_client(["finished"])
        flow.remove("finished")  # its timer goes with it
        await asyncio.sleep(0.2)
        assert [request_id for request_id, _ in recorder.expired] == ["held"]
        error = recorder.expired[0][1]
        assert isinstance(error, ResourceExhaustedError)
        assert "read none of this request's output for 0.05 s" in str(error)
        flow.close()

    asyncio.run(test())


def test_closing_stops_every_timer() -> None:
    async def test() -> None:
        recorder = Recorder()
        flow = recorder.flow(FlowLimits(slow_reader_timeout_s=0.05))
        flow.add("a")
        flow.hold_all()
        flow.close()
        await asyncio.sleep(0.2)
        assert recorder.expired == []

    asyncio.run(test())


def test_flow_limits_refuse_a_backlog_under_two_and_a_timeout_of_zero() -> None:
    with pytest.raises(InvalidArgumentError, match="max_backlog"):
        FlowLimits(max_backlog=1)
    with pytest.raises(InvalidArgumentError, match="slow_reader_timeout_s"):
        FlowLimits(slow_reader_timeout_s=0)
