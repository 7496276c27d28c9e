"""`AsyncEngine` under faults: text prompts tokenize off the engine thread, aborts overtake the
tokenizer, paused requests generate nothing and resume exactly, oversized text is refused
untokenized."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from headrace.sdk import GenerationConfig, InvalidArgumentError
from headrace.sdk.outputs import FinishReason
from headrace.worker import LLM, AsyncEngine, EngineConfig

from tests.factories import build_checkpoint

PROMPT = [5, 17, 42, 99, 7, 64, 23, 11]


def greedy(**kw) -> GenerationConfig:
    return GenerationConfig(temperature=0.0, **{"max_tokens": 12, "ignore_eos": True, **kw})


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("async"), family="llama")


@pytest.fixture
def engine(ckpt):
    engine = AsyncEngine(EngineConfig(str(ckpt), dtype="float32", max_model_len=128))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def offline(ckpt):
    return LLM(str(ckpt), dtype="float32", max_model_len=128)


def all_blocks_free(engine: AsyncEngine) -> bool:
    bm = engine.engine.block_manager
    return bm.num_free_blocks == bm.num_blocks and not engine.engine.has_unfinished_requests()


async def collect(engine: AsyncEngine, request_id: str, prompt, config) -> tuple[list[int], str]:
    tokens: list[int] = []
    reason = ""
    async for output in engine.generate(request_id, prompt, config):
        for delta in output.samples:
            tokens.extend(delta.token_ids)
            reason = delta.finish_reason or reason
    return tokens, reason


def test_a_slow_tokenization_never_stalls_the_engine_thread(engine, monkeypatch):
    """Regression (hardening defect 2): a 10 MB text prompt was tokenized on the engine
    thread, and every other request waited for it."""
    release = threading.Event()
    tokenize = engine.engine.intake.prompt_token_ids

    def slow_tokenize(prompt):
        if isinstance(prompt, str):  # token ids are checked here too, at once
            release.wait(timeout=30)
        return tokenize(prompt)

    monkeypatch.setattr(engine.engine.intake, "prompt_token_ids", slow_tokenize)

    async def main():
        text = asyncio.create_task(collect(engine, "text", "hello there", greedy()))
        tokens, reason = await asyncio.wait_for(collect(engine, "ids", PROMPT, greedy()), 20)
        assert len(tokens) == 12 and reason == "length"  # served while tokenization blocks
        assert not text.done()
        release.set()
        tokens, _ = await asyncio.wait_for(text, 20)
        assert len(tokens) == 12

    asyncio.run(main())
    assert all_blocks_free(engine)


def test_an_abort_during_tokenization_ends_the_request_before_it_runs(engine, monkeypatch):
    release = threading.Event()
    tokenize = engine.engine.intake.prompt_token_ids
    monkeypatch.setattr(
        engine.engine.intake,
        "prompt_token_ids",
        lambda p: (isinstance(p, str) and release.wait(30), tokenize(p))[1],
    )

    async def main():
        stream = engine.generate("text", "hello there", greedy())
        first = asyncio.create_task(anext(stream))
        await asyncio.sleep(0.1)
        engine.abort("text")
        output = await asyncio.wait_for(first, 10)
        assert output.finished and output.samples[0].finish_reason == FinishReason.ABORT
        release.set()
        await asyncio.sleep(0.3)  # the tokenized request arrives, and must be dropped

    asyncio.run(main())
    assert all_blocks_free(engine)


def test_text_longer_than_could_ever_fit_is_refused_untokenized(engine, monkeypatch):
    def never(prompt):
        raise AssertionError("tokenized")

    limit = engine.engine.spec.max_prompt_bytes
    assert limit < 10 * 2**20

    async def main():
        with pytest.raises(InvalidArgumentError, match=f"at most {limit}") as refused:
            await collect(engine, "big", "a" * (limit + 1), greedy())
        assert refused.value.field == "prompt"

    monkeypatch.setattr(engine.engine.spec.tokenizer, "encode", never)
    asyncio.run(main())


def test_a_paused_request_generates_nothing_and_resumes_exactly(engine, offline):
    expected = offline.generate([PROMPT], greedy(max_tokens=40))[0].token_ids

    async def main():
        tokens: list[int] = []
        stream = engine.generate("r", PROMPT, greedy(max_tokens=40))
        tokens.extend((await anext(stream)).samples[0].token_ids)
        engine.hold(["r"])
        await asyncio.sleep(0.3)  # let the pause land; a step or two may still come
        (seq,) = engine.engine.scheduler.running
        before = seq.num_tokens
        await asyncio.sleep(0.5)
        assert seq.num_tokens == before  # nothing generated while paused
        assert not engine.engine.has_runnable_work()  # and the engine thread idles
        engine.release(["r"])
        async for output in stream:
            tokens.extend(output.samples[0].token_ids)
        return tokens

    tokens = asyncio.run(main())
    assert tokens == expected
    assert all_blocks_free(engine)


def test_an_idle_paused_engine_does_not_spin(engine):
    async def main():
        stream = engine.generate("r", PROMPT, greedy(max_tokens=100))
        await anext(stream)
        engine.hold(["r"])
        await asyncio.sleep(0.3)
        start = time.process_time()  # every thread's CPU time, the engine's included
        await asyncio.sleep(1.0)
        used = time.process_time() - start
        engine.abort("r")
        async for _ in stream:
            pass
        return used

    assert asyncio.run(main()) < 0.5  # a spinning engine thread would burn the whole second
