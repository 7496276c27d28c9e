"""The router's logic without processes: admission, priority dispatch, streaming back,
cancellation and resuming after a worker loss, over fake worker links."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import grpc
import pytest
from headrace.protos import generation_pb2 as pb
from headrace.protos import worker_pb2
from headrace.router.config import RouterConfig
from headrace.router.request import RoutedRequest
from headrace.router.router import Router
from headrace.sdk import wire
from headrace.sdk.config import GenerationConfig
from headrace.sdk.errors import InvalidArgumentError, ResourceExhaustedError, UnavailableError

PROMPT_IDS = [11, 12, 13, 14]
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]


class FakeLink:
    """A worker link the test drives by hand: it records what the router sends."""

    def __init__(self, target: str, room: int = 8) -> None:
        self.target = target
        self.healthy = True
        self.room = room
        self.inflight: dict[str, RoutedRequest] = {}
        self.sent: list[pb.Request] = []
        self.cancelled: list[str] = []
        self.queued_tokens = 0
        self.free_kv_blocks = 100
        self.report: worker_pb2.LoadReport | None = None
        self.leaving = False
        self.holds: list[tuple[str, bool]] = []
        self.weight_version = "v1"
        self._wire_ids = itertools.count()

    @property
    def num_inflight(self) -> int:
        return len(self.inflight)

    @property
    def accepting(self) -> bool:
        return self.healthy and not self.leaving

    def hold(self, request: RoutedRequest) -> None:
        self.holds.append((request.wire_id, True))

    def release(self, request: RoutedRequest) -> None:
        self.holds.append((request.wire_id, False))

    def has_room(self, request: RoutedRequest) -> bool:
        wanted = request.required_version
        same_weights = not wanted or wanted == self.weight_version
        return self.accepting and len(self.inflight) < self.room and same_weights

    def send(self, request: RoutedRequest) -> None:
        wire_id = f"{self.target}-{next(self._wire_ids)}"
        request.dispatched_to(self, wire_id)  # type: ignore[arg-type]
        self.inflight[wire_id] = request
        self.sent.append(request.for_worker(wire_id))

    def cancel(self, request: RoutedRequest) -> None:
        self.cancelled.append(request.wire_id)

    def forget(self, request: RoutedRequest) -> None:
        self.inflight.pop(request.wire_id, None)

    def lose(self) -> list[RoutedRequest]:
        """The worker died: out of rotation, its requests handed back."""
        self.healthy = False
        orphans = list(self.inflight.values())
        self.inflight.clear()
        for request in orphans:
            request.left_worker()
        return orphans


def make_router(*links: FakeLink, **options: Any) -> Router:
    router = Router(RouterConfig(workers=tuple(link.target for link in links), **options))
    router.pool.links = {link.target: link for link in links}  # type: ignore[misc]
    return router


def make_request(
    request_id: str = "r1", priority: int = 0, prompt: list[int] | str = PROMPT_IDS, **config: Any
) -> pb.Request:
    generation = GenerationConfig(**{"max_tokens": 8, "temperature": 0.0, **config})
    return wire.request_to_wire(request_id, prompt, generation, priority=priority)


def chunk(link: FakeLink, index: int, **fields: Any) -> pb.GenerateResponse:
    """A worker's response carrying one chunk for the index-th request it was sent."""
    wire_id = link.sent[index].request_id
    return pb.GenerateResponse(chunks=[pb.Chunk(request_id=wire_id, **fields)])


class Outbox:
    """A session's outbox as the router uses it: it only puts chunk lists."""

    def __init__(self) -> None:
        self.items: list[list[pb.Chunk]] = []

    def put(self, chunks: list[pb.Chunk]) -> None:
        self.items.append(chunks)


def drain(outbox: Outbox) -> list[pb.Chunk]:
    chunks = [chunk for item in outbox.items for chunk in item]
    outbox.items.clear()
    return chunks


def test_admit_dispatches_to_a_worker_with_room():
    link = FakeLink("a:1")
    router = make_router(link)
    outbox = Outbox()
    request = router.admit(make_request("client-1"), outbox)
    assert link.inflight == {request.wire_id: request}
    sent = link.sent[0]
    assert sent.request_id == request.wire_id != "client-1"
    assert list(sent.token_ids.ids) == PROMPT_IDS and sent.return_prompt_token_ids
    assert router.active.num_in_flight == 1 and len(router.queue) == 0


def test_admit_refuses_without_a_healthy_worker_or_while_draining():
    link = FakeLink("a:1")
    router = make_router(link)
    link.healthy = False
    with pytest.raises(UnavailableError, match="no healthy worker takes requests") as refused:
        router.admit(make_request(), Outbox())
    assert refused.value.retry_after_s == router.config.retry_after_s
    link.healthy = True
    router.draining = True
    with pytest.raises(UnavailableError, match="draining"):
        router.admit(make_request(), Outbox())
    assert router.active.num_in_flight == 0


def test_a_draining_worker_leaves_rotation_and_its_queue_fails_fast():
    """Regression (hardening defect 1): a draining worker counted as healthy, so requests
    were admitted and waited for it until their own timeout."""
    link = FakeLink("a:1", room=1)
    router = make_router(link)
    outbox = Outbox()
    running = router.admit(make_request("running"), outbox)
    queued = router.admit(make_request("queued"), outbox)
    link.leaving = True  # its load report says draining
    router.on_change()
    assert not router.has_healthy_worker
    (refusal,) = drain(outbox)  # at once, not after unavailable_after_s
    assert refusal.request_id == "queued" and refusal.error.code == UNAVAILABLE
    assert refusal.error.retry_delay.ToTimedelta().total_seconds() == router.config.retry_after_s
    assert queued.done and not running.done  # what runs on the draining worker finishes there
    with pytest.raises(UnavailableError):
        router.admit(make_request("late"), outbox)


def test_a_worker_that_died_gets_time_to_come_back_before_its_requests_fail():
    link = FakeLink("a:1")
    router = make_router(link, unavailable_after_s=60.0)
    outbox = Outbox()
    request = router.admit(make_request("r"), outbox)
    router.on_down(link, link.lose())  # type: ignore[arg-type]
    router.on_change()
    assert not request.done and len(router.queue) == 1  # waits to resume on a restart
    link.healthy = True
    router.on_change()
    assert link.inflight and not drain(outbox)


def _report(**fields: Any) -> worker_pb2.LoadReport:
    defaults = {"total_kv_blocks": 64, "block_size": 16, "max_model_len": 512}
    return worker_pb2.LoadReport(**{**defaults, **fields})


def test_a_prompt_no_worker_could_ever_take_is_refused_at_admission():
    """Regression (hardening defect 2): an oversized prompt waited in the queue, and held
    everything behind it, for room that never came."""
    link = FakeLink("a:1", room=0)
    link.report = _report(max_prompt_bytes=1000)
    router = make_router(link)
    with pytest.raises(InvalidArgumentError, match="at most 1000") as refused:
        router.admit(make_request(prompt="x" * 1001), Outbox())
    assert refused.value.field == "prompt"
    with pytest.raises(InvalidArgumentError, match="512 tokens; the workers take at most 511"):
        router.admit(make_request(prompt=[5] * 512), Outbox())
    router.admit(make_request(prompt=[5] * 511), Outbox())  # fits: it waits for room
    assert len(router.queue) == 1


def test_a_held_request_is_held_on_the_worker_it_fails_over_to():
    a, b = FakeLink("a:1"), FakeLink("b:2", room=0)
    router = make_router(a, b)
    request = router.admit(make_request("r"), Outbox())
    router.hold(request)
    assert a.holds == [(request.wire_id, True)]
    router.on_response(a, chunk(a, 0, token_ids=[3], prompt_token_ids=PROMPT_IDS))
    b.room = 1
    router.on_down(a, a.lose())  # type: ignore[arg-type]
    assert request.held and b.sent  # resumed on b, which must not generate for it either
    router.release(request)
    assert b.holds == [(request.wire_id, False)]


def test_a_full_queue_answers_resource_exhausted_with_a_retry_hint():
    router = make_router(FakeLink("a:1", room=0), max_queued_requests=2, retry_after_s=2.5)
    outbox = Outbox()
    router.admit(make_request("1"), outbox)
    router.admit(make_request("2"), outbox)
    with pytest.raises(ResourceExhaustedError) as refused:
        router.admit(make_request("3"), outbox)
    assert refused.value.retry_after_s == 2.5
    assert len(router.queue) == 2


def test_dispatch_takes_the_highest_priority_first_when_room_appears():
    link = FakeLink("a:1", room=0)
    router = make_router(link)
    outbox = Outbox()
    for request_id, priority in [("low", 0), ("high", 5), ("mid", 1)]:
        router.admit(make_request(request_id, priority), outbox)
    assert link.sent == []
    link.room = 3
    router.on_change()  # a load report: the worker has room now
    order = [link.inflight[sent.request_id].client_id for sent in link.sent]
    assert order == ["high", "mid", "low"]


def test_chunks_go_back_under_the_client_id_and_a_finished_one_frees_room():
    link = FakeLink("a:1", room=1)
    router = make_router(link)
    outbox = Outbox()
    router.admit(make_request("first"), outbox)
    router.admit(make_request("second"), outbox)
    assert len(link.sent) == 1  # the second waits for room
    router.on_response(link, chunk(link, 0, token_ids=[7, 8], prompt_token_ids=PROMPT_IDS))
    router.on_response(
        link,
        chunk(
            link,
            0,
            token_ids=[9],
            finished=True,
            finish_reason=pb.FINISH_REASON_LENGTH,
            usage=pb.Usage(prompt_tokens=4, generated_tokens=3),
        ),
    )
    got = drain(outbox)
    assert [c.request_id for c in got] == ["first", "first"]
    assert [list(c.token_ids) for c in got] == [[7, 8], [9]]
    assert not got[0].prompt_token_ids  # the client did not ask for them
    assert got[1].finished and got[1].usage.generated_tokens == 3
    assert len(link.sent) == 2 and link.inflight[link.sent[1].request_id].client_id == "second"
    assert router.active.num_in_flight == 1


def test_a_request_resumes_on_another_worker_with_the_tokens_already_streamed():
    a, b = FakeLink("a:1"), FakeLink("b:2", room=0)
    router = make_router(a, b)
    outbox = Outbox()
    router.admit(make_request("r", max_tokens=8, min_tokens=5, seed=3), outbox)
    router.on_response(a, chunk(a, 0, token_ids=[20, 21, 22], prompt_token_ids=PROMPT_IDS))
    b.room = 1
    router.on_down(a, a.lose())  # type: ignore[arg-type]
    assert router.metrics.failovers._value.get() == 1
    resumed = b.sent[0]
    assert list(resumed.token_ids.ids) == [*PROMPT_IDS, 20, 21, 22]
    assert resumed.config.max_tokens == 5 and resumed.config.min_tokens == 2
    assert resumed.config.seed == 3
    router.on_response(
        b,
        chunk(
            b,
            0,
            token_ids=[23],
            finished=True,
            finish_reason=pb.FINISH_REASON_STOP,
            usage=pb.Usage(prompt_tokens=7, generated_tokens=1),
            prompt_token_ids=[*PROMPT_IDS, 20, 21, 22],
        ),
    )
    got = drain(outbox)
    assert [list(c.token_ids) for c in got] == [[20, 21, 22], [23]]
    # The client's view: its own prompt, every token it got, whichever worker made it.
    assert got[-1].usage.prompt_tokens == 4 and got[-1].usage.generated_tokens == 4


def test_a_text_prompt_resumes_from_the_token_ids_the_first_worker_reported():
    a, b = FakeLink("a:1"), FakeLink("b:2", room=0)
    router = make_router(a, b)
    router.admit(make_request("r", prompt="hello there"), Outbox())
    assert a.sent[0].text == "hello there"
    router.on_response(a, chunk(a, 0, token_ids=[5], prompt_token_ids=[1, 2, 3]))
    b.room = 1
    router.on_down(a, a.lose())  # type: ignore[arg-type]
    assert b.sent[0].WhichOneof("prompt") == "token_ids"
    assert list(b.sent[0].token_ids.ids) == [1, 2, 3, 5]


def test_requests_with_several_samples_fail_over_as_unavailable():
    a, b = FakeLink("a:1"), FakeLink("b:2")
    router = make_router(a, b)
    outbox = Outbox()
    router.admit(make_request("r", n=2, temperature=1.0), outbox)
    owner = a if a.inflight else b
    router.on_down(owner, owner.lose())  # type: ignore[arg-type]
    (last,) = drain(outbox)
    assert last.finished and last.error.code == grpc.StatusCode.UNAVAILABLE.value[0]
    assert router.active.num_in_flight == 0


def test_a_beam_search_with_several_beams_returned_restarts_whole_on_another_worker():
    a, b = FakeLink("a:1"), FakeLink("b:2", room=0)
    router = make_router(a, b)
    outbox = Outbox()
    router.admit(make_request("r", prompt="hello", n=2, num_beams=3, early_stopping=True), outbox)
    # A beam search's only chunk before its end carries no tokens.
    router.on_response(a, chunk(a, 0, prompt_token_ids=PROMPT_IDS))
    assert [list(c.token_ids) for c in drain(outbox)] == [[]]
    b.room = 1
    router.on_down(a, a.lose())  # type: ignore[arg-type]
    (restarted,) = b.sent
    assert restarted.text == "hello" and restarted.num_resumed_tokens == 0
    assert restarted.config == a.sent[0].config  # num_beams, n and max_tokens untouched
    beams = [
        pb.Chunk(request_id=restarted.request_id, index=k, token_ids=[20 + k, 30], text="ab",
                 finish_reason=pb.FINISH_REASON_LENGTH, cumulative_logprob=-1.0 - k,
                 beam_score=(-1.0 - k) / 2)
        for k in range(2)
    ]  # fmt: skip
    beams[-1].finished = True
    beams[-1].usage.CopyFrom(pb.Usage(prompt_tokens=4, generated_tokens=4))
    router.on_response(b, pb.GenerateResponse(chunks=beams))
    got = drain(outbox)
    assert [(c.request_id, c.index, list(c.token_ids)) for c in got] == [
        ("r", 0, [20, 30]),
        ("r", 1, [21, 30]),
    ]
    assert [(c.cumulative_logprob, c.beam_score) for c in got] == [(-1.0, -0.5), (-2.0, -1.0)]
    assert got[-1].finished and got[-1].usage.generated_tokens == 4
    assert not any(c.HasField("error") for c in got)


def test_cancel_ends_a_queued_request_here_and_asks_the_worker_for_a_dispatched_one():
    link = FakeLink("a:1", room=1)
    router = make_router(link)
    outbox = Outbox()
    running = router.admit(make_request("running"), outbox)
    queued = router.admit(make_request("queued"), outbox)
    router.cancel(queued)
    (last,) = drain(outbox)
    assert last.request_id == "queued" and last.finish_reason == pb.FINISH_REASON_CANCELLED
    router.cancel(running)
    assert link.cancelled == [running.wire_id]
    assert not running.done  # the worker's last chunk ends it
    router.on_response(
        link, chunk(link, 0, finished=True, finish_reason=pb.FINISH_REASON_CANCELLED)
    )
    assert running.done and router.active.num_in_flight == 0


def test_to_client_drops_prompt_logprobs_on_resume_once_sent():
    request = make_router(FakeLink("a:1")).admit(make_request("r", prompt_logprobs=1), Outbox())
    request.to_client(
        pb.Chunk(
            token_ids=[9],
            prompt_token_ids=PROMPT_IDS,
            prompt_logprobs=[pb.TokenLogprob(token_id=12, logprob=-1.0)],
        )
    )
    resumed = request.for_worker("w2")
    assert not resumed.config.HasField("prompt_logprobs")
    assert list(resumed.token_ids.ids) == [*PROMPT_IDS, 9]


def test_over_its_cap_a_worker_still_takes_what_outranks_something_it_holds() -> None:
    """The worker serves a higher priority first (preempting at its sequence cap), so at the
    in-flight cap the router still sends it one, up to twice the cap; never a peer."""
    from types import SimpleNamespace

    from headrace.router.workers import WorkerLink

    config = RouterConfig(workers=("127.0.0.1:1",), max_inflight_per_worker=2)

    def routed(priority: int) -> Any:
        return SimpleNamespace(
            parsed=SimpleNamespace(priority=priority), num_tokens_estimate=8, required_version=""
        )

    async def check() -> None:  # a link's channel belongs to an event loop
        link = WorkerLink("127.0.0.1:1", config, None)  # type: ignore[arg-type]
        link.healthy = True
        link.report = worker_pb2.LoadReport(free_kv_blocks=1000, block_size=16, max_model_len=4096)
        link.inflight = {"a": routed(0), "b": routed(3)}
        assert not link.has_room(routed(0))  # at the cap: a peer of the lowest waits
        assert link.has_room(routed(1))  # outranks the priority-0 one in flight
        link.inflight.update(c=routed(5), d=routed(5))
        assert not link.has_room(routed(9))  # twice the cap: no more, whatever the priority
        await link.channel.close()

    asyncio.run(check())


# --- weight versions across failover --------------------------------------------------------


def test_a_failed_over_request_resumes_only_on_a_worker_with_its_weight_version():
    a, b, c = FakeLink("a:1"), FakeLink("b:2"), FakeLink("c:3")
    b.weight_version = "v2"  # updated already; c still serves v1
    router = make_router(a, b, c)
    outbox = Outbox()
    router.admit(make_request("r"), outbox)
    assert a.sent  # least loaded first
    router.on_response(
        a, chunk(a, 0, token_ids=[20, 21], prompt_token_ids=PROMPT_IDS, weight_version="v1")
    )
    router.on_down(a, a.lose())  # type: ignore[arg-type]
    assert not b.sent and list(c.sent[0].token_ids.ids) == [*PROMPT_IDS, 20, 21]
    router.on_response(c, chunk(c, 0, token_ids=[22], finished=True, weight_version="v1"))
    assert [list(x.token_ids) for x in drain(outbox)] == [[20, 21], [22]]


def router_id(link: FakeLink, index: int) -> str:
    return f"{link.target}-{index}"


def test_with_no_worker_on_its_weight_version_a_failed_over_request_fails():
    """Tokens of two policies never meet in one sample: UNAVAILABLE instead of a resume."""
    a, b = FakeLink("a:1"), FakeLink("b:2", room=0)
    router = make_router(a, b)
    outbox = Outbox()
    router.admit(make_request("r"), outbox)
    router.on_response(a, chunk(a, 0, token_ids=[20], weight_version="v1"))
    b.weight_version, b.room = "v2", 1
    router.on_down(a, a.lose())  # type: ignore[arg-type]
    router.admit(make_request("next"), outbox)  # the failed one does not block the queue
    (failed,) = [c for c in drain(outbox) if c.request_id == "r" and c.finished]
    assert failed.error.code == UNAVAILABLE and "weight version 'v1'" in failed.error.message
    assert [req.request_id for req in b.sent] == [router_id(b, 0)]  # only "next", fresh
    assert list(b.sent[0].token_ids.ids) == PROMPT_IDS


def test_a_worker_updated_since_its_last_report_is_caught_by_its_first_chunk():
    a, b = FakeLink("a:1"), FakeLink("b:2", room=0)
    router = make_router(a, b)
    outbox = Outbox()
    router.admit(make_request("r"), outbox)
    router.on_response(a, chunk(a, 0, token_ids=[20], weight_version="v1"))
    b.room = 1
    router.on_down(a, a.lose())  # type: ignore[arg-type]
    assert b.sent  # its report said v1 ...
    router.on_response(b, chunk(b, 0, token_ids=[99], weight_version="v2"))  # ... it was not
    chunks = drain(outbox)
    assert [list(c.token_ids) for c in chunks] == [[20], []]
    assert chunks[-1].error.code == UNAVAILABLE and b.cancelled


def test_prefix_affinity_keys_on_the_adapter_and_failover_keeps_it():
    a, b = FakeLink("a:1"), FakeLink("b:2", room=0)
    router = make_router(a, b)
    keys = []
    for adapter in ("", "sql", "chat"):
        wire_request = make_request(f"r-{adapter}")
        wire_request.adapter = adapter
        keys.append(router.admit(wire_request, Outbox()).affinity_key)
    assert len(set(keys)) == 3  # same prompt, three adapters: three keys
    assert [sent.adapter for sent in a.sent] == ["", "sql", "chat"]
    router.on_response(a, chunk(a, 1, token_ids=[20], prompt_token_ids=PROMPT_IDS))
    b.room = 3
    router.on_down(a, a.lose())  # type: ignore[arg-type]
    resumed = {sent.adapter: list(sent.token_ids.ids) for sent in b.sent}
    assert resumed["sql"] == [*PROMPT_IDS, 20]  # resumed with its tokens, on its adapter
