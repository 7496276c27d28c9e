"""Echo and prompt logprobs through the HTTP door, end to end, as evaluation harnesses use them.

lm-evaluation-harness scores a multiple-choice answer by sending the context and the answer
as one prompt, ``{"prompt": ..., "echo": true, "logprobs": 1, "max_tokens": 1,
"temperature": 0}`` (the prompt as text, or as token ids with ``tokenized_requests``), then
sums ``token_logprobs[ctxlen:-1]`` and calls the answer greedy when each of those tokens is
its position's top alternative. These tests send exactly that shape to real router and worker
processes and check the answer against transformers' own log-softmax over the same tiny
checkpoint, and the token names against the tokenizer. lm-eval itself is not needed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from headrace.sdk.launch import ServerProcess
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from tests.e2e.processes import http_door
from tests.factories import cached_checkpoint

pytestmark = pytest.mark.timeout(300)

CONTEXT = "The quick brown fox jumps over"
ANSWERS = [" the lazy dog", " a sleeping cat", " naïve café 🙂"]
#: What lm-eval's local-completions sends for a loglikelihood request (beside the prompt).
LM_EVAL_FIELDS = {"echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0, "seed": 1234}
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def checkpoint() -> Path:
    return cached_checkpoint("qwen2", chat_template=True, max_position_embeddings=512)


@pytest.fixture(scope="module")
def tokenizer(checkpoint: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(checkpoint))


@pytest.fixture(scope="module")
def reference(checkpoint: Path):  # type: ignore[no-untyped-def]
    """token ids → log_softmax of transformers' logits at each position, [len(ids), V]."""
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)

    def log_softmax(token_ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([token_ids])).logits[0]
        return torch.log_softmax(logits.float(), dim=-1)

    return log_softmax


@pytest.fixture(scope="module")
def door(checkpoint: Path, tmp_path_factory) -> Iterator[httpx.Client]:  # type: ignore[no-untyped-def]
    logs = tmp_path_factory.mktemp("http-logprobs")
    with (
        http_door(checkpoint, logs, "--dtype", "float32") as (_, router),
        httpx.Client(base_url=base_url(router), timeout=60) as client,
    ):
        yield client


def base_url(router: ServerProcess) -> str:
    return f"http://127.0.0.1:{router.http_port}/v1"


def complete(door: httpx.Client, **body: Any) -> dict[str, Any]:
    response = door.post("/completions", json=body)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def name(tokenizer: PreTrainedTokenizerBase, token_id: int) -> str:
    """The token decoded alone: its name, unless it is only part of a character (then read
    in its sequence, where it may name the whole character or nothing)."""
    return str(tokenizer.decode([token_id], skip_special_tokens=False))


def is_whole(text: str) -> bool:
    return "\ufffd" not in text


def assert_named(tokenizer: PreTrainedTokenizerBase, tokens: list[str], token_ids: list[int]):
    """Whole tokens are named as decode shows them alone, and all join into the text."""
    assert "".join(tokens) == tokenizer.decode(token_ids, skip_special_tokens=False)
    for token, token_id in zip(tokens, token_ids, strict=True):
        assert token == name(tokenizer, token_id) or not is_whole(name(tokenizer, token_id))


@pytest.mark.parametrize("tokenized", [False, True], ids=["text", "token-ids"])
def test_lm_evals_loglikelihood_request_gets_transformers_logprobs(
    door: httpx.Client, tokenizer, reference, tokenized: bool
):
    for answer in ANSWERS:
        token_ids = tokenizer(CONTEXT + answer)["input_ids"]
        prompt = token_ids if tokenized else CONTEXT + answer
        (choice,) = complete(door, prompt=prompt, **LM_EVAL_FIELDS)["choices"]
        logprobs = choice["logprobs"]
        expected = reference(token_ids)
        # The prompt's tokens, their logprobs (none for the first), then the one generated.
        assert len(logprobs["token_logprobs"]) == len(token_ids) + 1
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        for position, token_id in enumerate(token_ids[1:], start=1):
            want = expected[position - 1, token_id].item()
            assert logprobs["token_logprobs"][position] == pytest.approx(want, abs=TOLERANCE)
        # lm-eval's own reading: the answer's tokens, and whether each was the likeliest.
        num_context = len(tokenizer(CONTEXT)["input_ids"])
        score = sum(logprobs["token_logprobs"][num_context:-1])
        want_score = sum(
            expected[position - 1, token_ids[position]].item()
            for position in range(num_context, len(token_ids))
        )
        assert score == pytest.approx(want_score, abs=TOLERANCE * len(token_ids))
        for position in range(1, len(token_ids)):
            top = logprobs["top_logprobs"][position]
            best = max(top, key=top.get)
            greedy_id = int(expected[position - 1].argmax())
            is_greedy = greedy_id == token_ids[position]
            assert (logprobs["token_logprobs"][position] == max(top.values())) == is_greedy
            names = [name(tokenizer, greedy_id), name(tokenizer, token_ids[position])]
            if all(map(is_whole, names)):  # is_greedy as a string comparison
                assert (best == logprobs["tokens"][position]) == (names[0] == names[1])
        assert_named(tokenizer, logprobs["tokens"][:-1], token_ids)
        assert choice["text"].startswith(CONTEXT + answer)


def test_the_generated_token_after_an_echo_is_the_greedy_one(
    door: httpx.Client, tokenizer, reference
):
    token_ids = tokenizer(CONTEXT)["input_ids"]
    (choice,) = complete(door, prompt=token_ids, **LM_EVAL_FIELDS)["choices"]
    greedy = int(reference(token_ids)[-1].argmax())
    assert choice["logprobs"]["tokens"][-1] == name(tokenizer, greedy)
    assert choice["logprobs"]["token_logprobs"][-1] == pytest.approx(
        reference(token_ids)[-1, greedy].item(), abs=TOLERANCE
    )
    assert choice["text"] == tokenizer.decode(token_ids + [greedy])


def test_echo_with_max_tokens_0_scores_the_prompt_alone(door: httpx.Client, tokenizer, reference):
    token_ids = tokenizer(CONTEXT + ANSWERS[0])["input_ids"]
    body = complete(door, prompt=CONTEXT + ANSWERS[0], echo=True, logprobs=2, max_tokens=0)
    (choice,) = body["choices"]
    assert (choice["text"], choice["finish_reason"]) == (CONTEXT + ANSWERS[0], "length")
    assert_named(tokenizer, choice["logprobs"]["tokens"], token_ids)
    expected = reference(token_ids)
    for position in range(1, len(token_ids)):
        top = choice["logprobs"]["top_logprobs"][position]
        # The top 2 and the prompt's own token (tokens whose names coincide share an entry).
        token_id = token_ids[position]
        candidates = [*expected[position - 1].topk(2).indices.tolist(), token_id]
        named = [(name(tokenizer, t), expected[position - 1, t].item()) for t in candidates]
        for key, value in top.items():
            assert any(
                value == pytest.approx(v, abs=TOLERANCE) and (key == n or not is_whole(n))
                for n, v in named
            )
        assert max(top.values()) == pytest.approx(named[0][1], abs=TOLERANCE)
    assert body["usage"]["completion_tokens"] == 0
    assert body["usage"]["prompt_tokens"] == len(token_ids)


def test_echo_of_a_batch_and_of_several_samples(door: httpx.Client, tokenizer):
    prompts = [CONTEXT, tokenizer(ANSWERS[2])["input_ids"]]
    body = complete(door, prompt=prompts, echo=True, max_tokens=2, n=2, temperature=0)
    texts = [choice["text"] for choice in body["choices"]]
    assert [text.startswith(CONTEXT) for text in texts] == [True, True, False, False]
    assert all(text.startswith(ANSWERS[2]) for text in texts[2:])  # the worker's decode
    assert texts[0] == texts[1] and texts[2] == texts[3]  # greedy samples agree


def test_an_echoed_stream_carries_the_prompt_first(door: httpx.Client, tokenizer):
    body = {"prompt": CONTEXT, "echo": True, "logprobs": 1, "max_tokens": 3, "stream": True}
    body.update(temperature=0)
    with door.stream("POST", "/completions", json=body) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: {")]
    events = [json.loads(line.removeprefix("data: ")) for line in lines]
    first = events[0]["choices"][0]
    assert first["text"].startswith(CONTEXT)
    num_prompt_tokens = len(tokenizer(CONTEXT)["input_ids"])
    assert first["logprobs"]["token_logprobs"][0] is None
    assert len(first["logprobs"]["tokens"]) == num_prompt_tokens + 1
    plain = complete(door, prompt=CONTEXT, echo=True, logprobs=1, max_tokens=3, temperature=0)
    assert "".join(e["choices"][0]["text"] for e in events) == plain["choices"][0]["text"]


def test_vllms_prompt_logprobs_field_on_both_endpoints(door: httpx.Client, tokenizer, reference):
    token_ids = tokenizer(CONTEXT)["input_ids"]
    (choice,) = complete(door, prompt=CONTEXT, prompt_logprobs=1, max_tokens=1)["choices"]
    scored = choice["prompt_logprobs"]
    expected = reference(token_ids)
    assert scored[0] is None and len(scored) == len(token_ids)
    for position, token_id in enumerate(token_ids[1:], start=1):
        entry = scored[position][str(token_id)]
        assert entry["logprob"] == pytest.approx(expected[position - 1, token_id].item(), abs=1e-4)
        assert entry["decoded_token"] == name(tokenizer, token_id)
        assert entry["rank"] == int(
            (expected[position - 1] >= expected[position - 1, token_id]).sum()
        )
    chat = door.post(
        "/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "prompt_logprobs": 0,
            "max_tokens": 1,
        },
    ).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) > 1


def test_echo_refusals_name_their_field(door: httpx.Client):
    chat = door.post(
        "/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "echo": True}
    )
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "echo"
    streamed = door.post("/completions", json={"prompt": "a", "prompt_logprobs": 2, "stream": True})
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"
