"""Stream one generation from an in-process engine to the terminal.

    python -m headrace.worker.generate --model smollm2-135m-instruct "Tell me a joke"

(The gRPC `headrace generate --target HOST:PORT` arrives with the worker service.)
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import cast

from headrace.sdk.config import GenerationConfig
from headrace.worker.config import EngineConfig
from headrace.worker.engine.engine import Engine
from headrace.worker.models.store import DEFAULT_MODEL


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m headrace.worker.generate")
    parser.add_argument("prompt")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument(
        "--raw", action="store_true", help="no chat template, even if the model has one"
    )
    args = parser.parse_args(argv)
    config = GenerationConfig(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
    )
    engine = Engine(EngineConfig(model=args.model, dtype=args.dtype))
    prompt: str | list[int] = args.prompt
    if not args.raw and engine.tokenizer.chat_template:
        ids = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": args.prompt}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        prompt = [int(t) for t in cast(list[int], ids)]
    start = time.perf_counter()
    engine.add_request("cli", prompt, config)
    num_tokens, reason = 0, None
    while engine.has_unfinished_requests():
        for output in engine.step():
            for delta in output.samples:
                num_tokens += len(delta.token_ids)
                sys.stdout.write(delta.text)
                sys.stdout.flush()
                reason = delta.finish_reason or reason
    seconds = time.perf_counter() - start
    print(
        f"\n[{num_tokens} tokens, {num_tokens / seconds:.1f} tok/s, finish: {reason}]",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
