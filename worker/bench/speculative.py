"""`headrace bench engine --speculative K`: the same workload with and without speculation.

One engine proposing K tokens a step (`num_speculative_tokens`) runs the workload with
speculation on and off (`Scheduler.speculate`), in alternating rounds (`switched.py`); each
round's ratio is speculation's tok/s over the plain runs', and the median round is reported
with the proposals made and kept, per position, and whether every request got the same
tokens (speculation must not change them: greedy, or seeded).

`--prompts copy` replaces the random prompts with ones whose output copies from them: a
passage of the shipped public-domain text, then "The same passage again, word for word:" and
the passage's first words, which a language model goes on copying (prompt lookup's best
case: editing, extraction, quoting). `--prompts story` asks, through the chat template, for a
story: free text with little to look up, where speculation must cost next to nothing. (Random
token ids, the default, are not that case: small models answer them with loops, which prompt
lookup predicts well.)
"""

from __future__ import annotations

import random
from collections.abc import Callable

from headrace.worker.bench.common import Report, Summary, Workload, quantile
from headrace.worker.bench.quality import load_text
from headrace.worker.bench.switched import alternate
from headrace.worker.config import EngineConfig
from headrace.worker.engine.engine import Engine
from transformers import PreTrainedTokenizerBase

#: Characters of the text in each copy prompt's passage, and of its start repeated after it.
PASSAGE_CHARS, CUE_CHARS = 1200, 80
COPY_CUE = "\n\nThe same passage again, word for word:\n\n"


#: What `--prompts story` asks for, one subject per request in turn.
STORY_SUBJECTS = (
    "a dragon who learns to cook",
    "a lighthouse keeper and a lost whale",
    "a robot that collects old maps",
    "two rival bakers in a small town",
)


def text_workload(
    kind: str, tokenizer: PreTrainedTokenizerBase, num_requests: int, max_tokens: int, seed: int
) -> Workload:
    """``kind`` "copy" or "story" prompts (module docstring); passages drawn by ``seed``."""
    text = load_text()
    rng = random.Random(seed)
    prompts = []
    for i in range(num_requests):
        if kind == "copy":
            start = text.find(" ", rng.randrange(0, len(text) - PASSAGE_CHARS)) + 1
            passage = text[start : start + PASSAGE_CHARS]
            prompt = passage + COPY_CUE + passage[:CUE_CHARS]
        else:
            subject = STORY_SUBJECTS[i % len(STORY_SUBJECTS)]
            chat = [{"role": "user", "content": f"Write a short story about {subject}."}]
            prompt = str(
                tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
            )
        prompts.append(list(tokenizer(prompt, add_special_tokens=False).input_ids))
    return Workload(prompts, [max_tokens] * num_requests)


def compare_speculation(
    config: EngineConfig,
    engine: Engine,
    workload: Workload,
    rounds: int,
    run_headrace: Callable[..., Report],
) -> Summary:
    """Alternate the workload without and with speculation on ``engine`` (warmed up and
    measured once by the caller), ``rounds`` pairs (`switched.alternate`); print and return
    the ratios."""
    before = engine.speculation.snapshot()
    names = ("headrace, no speculation", "headrace, speculating")
    pairs = alternate(engine, workload, rounds, engine.scheduler.speculate, names, run_headrace)
    stats = engine.speculation.since(before)  # these rounds' counts
    ratios = [spec.tokens_per_s / base.tokens_per_s for base, spec in pairs]
    same = all(base.token_ids == spec.token_ids for base, spec in pairs)
    k = config.num_speculative_tokens
    ratio = quantile(ratios, 0.5)
    per_position = [
        kept / made if made else 0.0
        for made, kept in zip(stats.proposed_at, stats.accepted_at, strict=True)
    ]
    rounds_text = ", ".join(f"{r:.2f}" for r in ratios)
    print(f"  speculation k={k} against none: {ratio:.2f}x tok/s (rounds: {rounds_text})")
    print(
        f"  proposed {stats.num_proposed}, kept {stats.num_accepted} "
        f"({stats.acceptance_rate:.0%}); kept by position: "
        + ", ".join(f"{rate:.0%}" for rate in per_position)
        + f"; same tokens: {'yes' if same else 'NO'}"
    )
    for base, spec in pairs:
        print(f"    {base.tokens_per_s:.1f} -> {spec.tokens_per_s:.1f} tok/s")
    return {
        "speculative_tokens": k,
        "ratio_speculative_tok_s": round(ratio, 3),
        "ratio_speculative_tok_s_rounds": [round(r, 3) for r in ratios],
        "speculation_proposed": stats.num_proposed,
        "speculation_accepted": stats.num_accepted,
        "speculation_acceptance_by_position": [round(r, 3) for r in per_position],
        "speculation_same_tokens": same,
    }
