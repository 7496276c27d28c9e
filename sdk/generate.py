"""``headrace generate``: stream one generation from a server to the terminal.

    headrace generate "What is the capital of France?"        # a chat question (greedy)
    headrace generate --raw "The three primary colors are" --max-tokens 32   # plain text
    headrace generate --json "Hello" | jq .text     # one JSON object per chunk
    headrace generate --target router:443 --tls-ca ca.pem --api-key KEY "Hello"
    headrace generate --json-schema person.json "Describe a person as JSON"
    headrace generate --choice yes --choice no "Is water wet?"
    headrace generate --num-beams 4 --n 2 "Name a color"    # the 2 best of 4 beams, scored

When the served model has a chat template (an Instruct model), the prompt is sent as one
user message of a conversation, which the server renders with that template; ``--raw``
sends it as plain text instead (a base model, or text to continue). Decoding is greedy unless
``--temperature`` says otherwise. Text goes to stdout as it arrives; a summary line (tokens,
tok/s, finish reason) to stderr. With ``--n`` above 1 or ``--num-beams`` above 1, each sample
is printed whole once the request ends, under a line naming it (a beam's with its score and
cumulative logprob): a beam search returns nothing before it ends anyway.
With `OTEL_EXPORTER_OTLP_ENDPOINT` set (and the OpenTelemetry SDK installed, as the router
and worker extras do), the request's client span is exported, the root of its trace.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from headrace.sdk import tracing
from headrace.sdk.cli_help import HelpFormatter
from headrace.sdk.client import Client
from headrace.sdk.config import GenerationConfig
from headrace.sdk.credentials import API_KEY_ENV
from headrace.sdk.errors import InvalidArgumentError
from headrace.sdk.outputs import Completion, GenerationResult, StreamChunk
from headrace.sdk.prompts import Chat, ChatMessage, Prompt
from headrace.sdk.tls import ClientTls

DEFAULT_TARGET = "localhost:50051"


def add_generate_command(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="stream a generation from a server",
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    add = parser.add_argument
    add("prompt", help="the question (or, with --raw, the text to continue)")
    add("--raw", action="store_true", help="send the prompt as plain text, not as a chat")
    add("--system", help="a system message before the question (chat models)")
    add("--target", default=DEFAULT_TARGET, help="HOST:PORT of a router or worker")
    add("--model", default="", help="model name to ask for (default: the server's)")
    add("--max-tokens", type=int, default=64, help="most tokens to generate")
    add("--min-tokens", type=int, default=0, help="fewest tokens before EOS may end it")
    add("--temperature", type=float, default=0.0, help="0 is greedy")
    add("--top-k", type=int, default=0, help="sample among the k most likely; 0 disables")
    add("--top-p", type=float, default=1.0, help="nucleus sampling threshold")
    add("--min-p", type=float, default=0.0, help="drop tokens below min-p x the top one")
    add("--repetition-penalty", type=float, default=1.0, help="> 1 discourages repeats")
    add("--seed", type=int, help="make sampling reproducible")
    add("--stop", action="append", default=[], help="a stop string (repeatable)")
    add("--ignore-eos", action="store_true", help="keep generating past EOS")
    add("--n", type=int, default=1, help="samples to return (with --num-beams: the best beams)")
    add("--priority", type=int, default=0, help="higher runs sooner")
    add("--adapter", default="", help="a LoRA adapter the server has loaded (default: none)")
    add("--timeout", type=float, help="seconds before the server gives up on the request")
    add("--json", action="store_true", help="print each chunk as one JSON line")
    _add_control_arguments(parser)
    _add_beam_arguments(parser)
    _add_connection_arguments(parser)
    parser.set_defaults(handler=run_generate)


def _add_control_arguments(parser: argparse.ArgumentParser) -> None:
    """Output constraints (one at a time) and logit controls."""
    add = parser.add_argument
    add("--json-schema", metavar="FILE", help="constrain the output to this JSON Schema's JSON")
    add("--json-object", action="store_true", help="constrain the output to one JSON value")
    add("--regex", help="constrain the output to match this regular expression")
    add("--grammar", metavar="FILE", help="constrain the output to this EBNF grammar")
    add("--choice", action="append", default=[], help="the output is one of these (repeatable)")
    add(
        "--logit-bias",
        action="append",
        default=[],
        metavar="ID=BIAS",
        help="add BIAS to token ID's logit (repeatable)",
    )
    add("--bad-word", action="append", default=[], help="never generate this word (repeatable)")


def _control_options(args: argparse.Namespace) -> dict[str, Any]:
    """`GenerationConfig` options of the constraint and logit-control flags (files read now)."""
    bias = {}
    for item in args.logit_bias:
        token_id, _, amount = item.partition("=")
        try:
            bias[int(token_id)] = float(amount)
        except ValueError:
            raise InvalidArgumentError("logit_bias", f"expected ID=BIAS, got {item!r}") from None
    return {
        "json_schema": Path(args.json_schema).read_text() if args.json_schema else None,
        "json_object": args.json_object,
        "regex": args.regex,
        "grammar": Path(args.grammar).read_text() if args.grammar else None,
        "choice": tuple(args.choice),
        "logit_bias": bias or None,
        "bad_words": tuple(args.bad_word),
    }


def _add_beam_arguments(parser: argparse.ArgumentParser) -> None:
    """Beam search: greedy over num_beams hypotheses (sampling flags and --stop refused)."""
    add = parser.add_argument
    add("--num-beams", type=int, default=1, help="beam search over this many beams; 1 is off")
    add(
        "--length-penalty",
        type=float,
        default=1.0,
        help="a beam's score is its cumulative logprob / its tokens ** this",
    )
    add(
        "--early-stopping",
        choices=("true", "false", "never"),
        default="false",
        help="when the search ends: as soon as num-beams beams finished (true), once no "
        "running beam can beat them at its length (false) or at any length (never)",
    )


def _add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--tls", action="store_true", help="use TLS, trusting the system's CAs")
    add("--tls-ca", metavar="PEM", help="use TLS, trusting this CA")
    add("--tls-cert", metavar="PEM", help="mTLS: the client certificate to present")
    add("--tls-key", metavar="PEM", help="the private key of --tls-cert")
    add("--tls-server-name", metavar="NAME", help="the name on the server's certificate")
    add(
        "--api-key",
        metavar="KEY",
        help=f"sent as authorization: Bearer (default: ${API_KEY_ENV}, which `ps` cannot show)",
    )


def client_options(args: argparse.Namespace) -> dict[str, Any]:
    """`Client` keyword arguments from the connection flags (PEM files read now)."""
    options: dict[str, Any] = {"model": args.model, "api_key": args.api_key}
    if args.tls or args.tls_ca or args.tls_cert or args.tls_key or args.tls_server_name:
        ca, cert, key = (
            Path(path) if path else None for path in (args.tls_ca, args.tls_cert, args.tls_key)
        )
        tls = ClientTls(ca, cert, key, args.tls_server_name)
        options["credentials"] = tls.credentials()
        options["options"] = tls.channel_options()
    return options


def generation_config(args: argparse.Namespace) -> GenerationConfig:
    """The request's config from the flags (checked: a bad value raises InvalidArgumentError)."""
    return GenerationConfig(
        max_tokens=args.max_tokens,
        min_tokens=args.min_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
        n=args.n,
        num_beams=args.num_beams,
        length_penalty=args.length_penalty,
        early_stopping=args.early_stopping,
        **_control_options(args),
    )


def run_generate(args: argparse.Namespace) -> int:
    config = generation_config(args)
    provider = tracing.configure_tracing("headrace-generate")
    try:
        return _stream(args, config)
    finally:
        if provider is not None:
            provider.shutdown()  # export the span before exiting


def _prompt(args: argparse.Namespace, client: Client) -> Prompt:
    """The question as a chat when the model has a chat template (and not --raw)."""
    if args.raw or not client.model_info().has_chat_template:
        return str(args.prompt)
    system = [ChatMessage("system", args.system)] if args.system else []
    return Chat((*system, ChatMessage("user", args.prompt)))


def _stream(args: argparse.Namespace, config: GenerationConfig) -> int:
    start = time.perf_counter()
    num_tokens, last = 0, None
    # Several samples (or beams) are kept and printed whole: streamed, they would interleave.
    whole: GenerationResult | None = None
    if not args.json and (config.n > 1 or config.is_beam_search):
        whole = GenerationResult.empty("", config.n, with_logprobs=False)
    with Client(args.target, **client_options(args)) as client:
        prompt = _prompt(args, client)
        chunks = client.stream(
            prompt, config, priority=args.priority, timeout=args.timeout, adapter=args.adapter
        )
        for chunk in chunks:
            num_tokens += len(chunk.token_ids)
            last = chunk
            if whole is not None:
                whole.add(chunk)
                continue
            sys.stdout.write(_as_json(chunk) + "\n" if args.json else chunk.text)
            sys.stdout.flush()
    if whole is not None:
        print_samples(whole)
    seconds = time.perf_counter() - start
    if not args.json:
        reason = last.finish_reason if last is not None else None
        print(
            f"\n[{num_tokens} tokens in {seconds:.2f} s, {num_tokens / seconds:.1f} tok/s, "
            f"finish: {reason}]",
            file=sys.stderr,
        )
    return 0


def print_samples(result: GenerationResult) -> None:
    """Each of a request's samples whole, under a line naming it (a beam's with its score)."""
    for completion in result.outputs:
        print(f"[{_sample_label(completion)}]")
        print(completion.text)


def _sample_label(completion: Completion) -> str:
    finish = f"finish: {completion.finish_reason}"
    if completion.beam_score is None:
        return f"sample {completion.index}, {finish}"
    return (
        f"beam {completion.index}: score {completion.beam_score:.4f}, cumulative logprob "
        f"{completion.cumulative_logprob:.4f}, {len(completion.token_ids)} tokens, {finish}"
    )


def _as_json(chunk: StreamChunk) -> str:
    record = dataclasses.asdict(chunk)
    if chunk.finish_reason is not None:
        record["finish_reason"] = str(chunk.finish_reason)
    return json.dumps(record, ensure_ascii=False)
