"""Chat prompts in the engine: a conversation is rendered with the model's chat template and
then generated like any prompt (equal to the oracle on the rendered ids); a model without a
template, and malformed conversations, are refused naming the field."""

from __future__ import annotations

import pytest
from headrace.sdk import Chat, GenerationConfig, InvalidArgumentError
from headrace.worker import LLM
from transformers import AutoTokenizer

from tests.factories import TOOLS_CHAT_TEMPLATE, build_checkpoint, hf_greedy

QUESTION = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Where does the fox run?"},
]
GREEDY = GenerationConfig(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("chat"), family="qwen2", chat_template=True)


@pytest.fixture(scope="module")
def llm(chat_model):
    return LLM(str(chat_model), dtype="float32")


def rendered(model_dir, messages, add_generation_prompt=True) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return list(
        tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt,
            tokenize=True,
            return_dict=False,
        )
    )


def test_a_chat_is_the_rendered_prompt_and_equals_the_oracle(llm, chat_model):
    prompt_ids = rendered(chat_model, QUESTION)
    (answer,) = llm.chat(QUESTION, GREEDY)
    assert answer.prompt_token_ids == prompt_ids
    assert answer.token_ids == hf_greedy(chat_model, [prompt_ids], 10)[0]
    assert answer.usage.num_prompt_tokens == len(prompt_ids)


def test_several_conversations_come_back_in_order(llm):
    first = [{"role": "user", "content": "Once upon a time"}]
    second = [{"role": "user", "content": "The quick brown fox"}]
    both = llm.chat([first, second], GREEDY)
    assert [r.token_ids for r in both] == [
        llm.chat(first, GREEDY)[0].token_ids,
        llm.chat(second, GREEDY)[0].token_ids,
    ]


def test_without_a_generation_prompt_the_last_message_is_continued(llm, chat_model):
    messages = [*QUESTION, {"role": "assistant", "content": "The fox runs"}]
    (result,) = llm.chat(messages, GREEDY, add_generation_prompt=False)
    assert result.prompt_token_ids == rendered(chat_model, messages, add_generation_prompt=False)
    assert llm.tokenizer.decode(result.prompt_token_ids).endswith("The fox runs")


@pytest.mark.parametrize(
    ("messages", "field"),
    [
        ([], "chat.messages"),
        ([{"content": "no role"}], "chat.messages[0].role"),
        ([{"role": "user", "content": 7}], "chat.messages[0].content"),
        ("just text", "chat.messages"),
    ],
)
def test_a_malformed_conversation_names_the_field(llm, messages, field):
    with pytest.raises(InvalidArgumentError) as refused:
        llm.chat(messages, GREEDY)
    assert refused.value.field == field


def test_a_model_without_a_chat_template_refuses_a_chat(tmp_path):
    plain = LLM(str(build_checkpoint(tmp_path / "plain")), dtype="float32")
    with pytest.raises(InvalidArgumentError, match="no chat template") as refused:
        plain.chat(QUESTION, GREEDY)
    assert refused.value.field == "chat"
    assert len(plain.generate("Where does the fox run?", GREEDY)[0].token_ids) == 10


def test_chat_objects_mix_with_other_prompts_in_one_batch(llm, chat_model):
    chat = Chat.of(QUESTION)
    results = llm.generate([chat, "Once upon a time"], GREEDY)
    assert results[0].prompt_token_ids == rendered(chat_model, QUESTION)
    assert results[1].token_ids == llm.generate("Once upon a time", GREEDY)[0].token_ids


# --- tools ---------------------------------------------------------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
#: A whole tool-calling round as transformers takes it: the call's arguments as an object.
TOOL_ROUND = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    },
    {"role": "tool", "content": "sunny, 21 C", "tool_call_id": "call_1"},
]


@pytest.fixture(scope="module")
def tools_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tools")
    return build_checkpoint(path, family="llama", chat_template=TOOLS_CHAT_TEMPLATE)


def test_tools_and_tool_calls_render_as_transformers_renders_them(tools_model):
    llm = LLM(str(tools_model), dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(tools_model)
    want = tokenizer.apply_chat_template(
        TOOL_ROUND, tools=[WEATHER], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    (result,) = llm.generate(Chat.of(TOOL_ROUND, tools=[WEATHER]), GREEDY)
    assert result.prompt_token_ids == list(want)
    text = tokenizer.decode(result.prompt_token_ids)
    assert '"name": "get_weather"' in text and '{"city": "Paris"}' in text and "<tools>" in text
    (without,) = llm.generate(Chat.of(TOOL_ROUND), GREEDY)
    assert "<tools>" not in tokenizer.decode(without.prompt_token_ids)
