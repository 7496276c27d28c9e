"""LoRA adapters through real worker and router processes: loaded at start (``--lora``) and at
run time through the router (fanned out to every worker), used per request over gRPC and as
the OpenAI door's ``model``, unloaded, and kept across a failover.

The offline `LLM` with the same adapter is the reference here; tests/worker/test_lora.py ties
it to transformers + PEFT.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import openai
import pytest
from headrace.sdk.client import AsyncClient, Client
from headrace.sdk.config import GenerationConfig
from headrace.sdk.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError
from headrace.sdk.launch import ServerProcess
from headrace.worker.engine.llm import LLM

from tests.e2e.processes import load_report, start_router, start_worker, wait_serving
from tests.factories import cached_checkpoint
from tests.lora_factories import build_adapter

pytestmark = pytest.mark.timeout(300)

GREEDY = GenerationConfig(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[5 + i, 17, 42 + i, 9, 100 + 3 * i] for i in range(6)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[Path, dict[str, Path], dict[str | None, list[list[int]]]]:  # type: ignore[no-untyped-def]
    """(checkpoint, adapters, offline tokens per adapter)."""
    base = cached_checkpoint("llama")
    root = tmp_path_factory.mktemp("adapters")
    adapters = {
        "a": build_adapter(base, root / "a", seed=11, rank=8),
        "b": build_adapter(base, root / "b", seed=12, rank=4, use_rslora=True),
    }
    modules = tuple((name, str(path)) for name, path in adapters.items())
    llm = LLM(str(base), dtype="float32", lora_modules=modules)
    want: dict[str | None, list[list[int]]] = {}
    for name in ("a", "b", None):
        want[name] = [r.token_ids for r in llm.generate(PROMPTS, GREEDY, adapter=name)]
    llm.close()
    assert want["a"] != want[None] and want["b"] != want[None]
    return base, adapters, want


def _worker(model: Path, logs: Path, name: str, *args: str) -> ServerProcess:
    folder = logs / name
    folder.mkdir(exist_ok=True)
    return start_worker(model, folder, "--dtype", "float32", *args)


def _adapters(report) -> list[list[str]]:  # type: ignore[no-untyped-def]
    return [sorted(a.name for a in w.lora_adapters) for w in report.workers]


def test_load_use_unload_through_the_router(setup, tmp_path: Path) -> None:
    base, adapters, want = setup
    a = _worker(base, tmp_path, "a", "--lora", f"a={adapters['a']}")
    b = _worker(base, tmp_path, "b", "--lora", f"a={adapters['a']}")
    router = start_router([a.target, b.target], "--http-port", "0", log_path=tmp_path / "r.log")
    with a, b, router:
        assert wait_serving(router.target)
        with Client(router.target) as client:
            assert _adapters(client.list_lora_adapters()) == [["a"], ["a"]]
            report = client.load_lora_adapter("b", str(adapters["b"]))
            assert _adapters(report) == [["a", "b"], ["a", "b"]]
            for name in ("a", "b", ""):
                got = [client.generate(p, GREEDY, adapter=name).token_ids for p in PROMPTS]
                assert got == want[name or None], name
            with pytest.raises(NotFoundError, match="'nope'"):
                client.generate(PROMPTS[0], GREEDY, adapter="nope")
            assert client.generate(PROMPTS[0], GREEDY).token_ids == want[None][0]
            with pytest.raises(InvalidArgumentError, match="already loaded"):
                client.load_lora_adapter("b", str(adapters["b"]))

            http = openai.OpenAI(
                base_url=f"http://127.0.0.1:{router.http_port}/v1", api_key="x", max_retries=0
            )
            listed = [m.id for m in http.models.list().data]
            assert listed[1:] == ["a", "b"]
            completion = http.completions.create(
                model="b",
                prompt=PROMPTS[1],
                max_tokens=12,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            assert completion.model == "b"
            assert (
                completion.choices[0].text == client.generate(PROMPTS[1], GREEDY, adapter="b").text
            )
            with pytest.raises(openai.NotFoundError):
                http.completions.create(model="nope", prompt="hi", max_tokens=2)

            client.unload_lora_adapter("b")
            assert _adapters(client.list_lora_adapters()) == [["a"], ["a"]]
            with pytest.raises(NotFoundError, match="'b'"):
                client.generate(PROMPTS[0], GREEDY, adapter="b")
            with pytest.raises(InvalidArgumentError, match="cannot read"):
                client.load_lora_adapter("c", str(tmp_path / "nowhere"))
            assert _adapters(client.list_lora_adapters()) == [["a"], ["a"]]


def test_unload_in_use_is_refused_by_the_worker(setup, tmp_path: Path) -> None:
    base, adapters, _ = setup
    long = GenerationConfig(max_tokens=400, temperature=0.0, ignore_eos=True)
    with _worker(base, tmp_path, "w", "--lora", f"a={adapters['a']}") as worker:
        assert wait_serving(worker.target)
        with Client(worker.target) as client:
            stream = client.stream(PROMPTS[0], long, adapter="a")
            next(stream)
            with pytest.raises(FailedPreconditionError, match="in use"):
                client.unload_lora_adapter("a")
            stream.close()


def test_failover_keeps_the_adapter(setup, tmp_path: Path) -> None:
    """Streams with adapter a over two workers; one worker is killed mid-generation and its
    streams resume on the other with the same adapter: every stream equals the offline run."""
    base, adapters, _ = setup
    config = GenerationConfig(max_tokens=60, temperature=0.0, ignore_eos=True)
    prompts = [[3 + i, 50, 7 * i + 1, 21] for i in range(12)]
    modules = (("a", str(adapters["a"])),)
    llm = LLM(str(base), dtype="float32", lora_modules=modules)
    want = [r.token_ids for r in llm.generate(prompts, config, adapter="a")]
    llm.close()
    lora = ("--lora", f"a={adapters['a']}")
    a, b = _worker(base, tmp_path, "a", *lora), _worker(base, tmp_path, "b", *lora)
    with a, b, start_router([a.target, b.target], log_path=tmp_path / "router.log") as router:
        assert wait_serving(router.target)

        async def run() -> list[list[int]]:
            async with AsyncClient(router.target) as client:
                streamed: dict[int, list[int]] = {i: [] for i in range(len(prompts))}

                async def one(i: int) -> None:
                    async for chunk in client.stream(prompts[i], config, adapter="a"):
                        streamed[i].extend(chunk.token_ids)

                tasks = [asyncio.create_task(one(i)) for i in range(len(prompts))]
                while sum(map(len, streamed.values())) < len(prompts) * 5:
                    await asyncio.sleep(0.01)
                assert load_report(b.target).running_requests > 0  # b is mid-generation
                b.proc.send_signal(signal.SIGKILL)
                await asyncio.gather(*tasks)
                return [streamed[i] for i in range(len(prompts))]

        got = asyncio.run(run())
    assert got == want
    assert "resuming request" in (tmp_path / "router.log").read_text()
