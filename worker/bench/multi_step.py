"""`headrace bench engine --num-decode-steps K`: the same workload with and without
multi-step decode.

One engine built with `num_decode_steps` K runs the workload with multi-step decode on and
off (`Scheduler.decode_several`), in alternating rounds (`switched.py`); each round's ratio
is the multi-step runs' tok/s over the plain runs', and the median round is reported beside
the decode step per run and the host's part of it (a step's time less the model's, per
run), and whether every request got the same tokens (it must not change them).
"""

from __future__ import annotations

from collections.abc import Callable

from headrace.worker.bench.common import Report, Summary, Workload, quantile
from headrace.worker.bench.switched import alternate
from headrace.worker.engine.engine import Engine


def compare_decode_steps(
    engine: Engine,
    workload: Workload,
    rounds: int,
    run_headrace: Callable[..., Report],
) -> Summary:
    """Alternate the workload without and with multi-step decode on ``engine`` (warmed up
    and measured once by the caller), ``rounds`` pairs; print and return the ratios."""
    names = ("headrace, one run a step", "headrace, multi-step")
    pairs = alternate(
        engine, workload, rounds, engine.scheduler.decode_several, names, run_headrace
    )
    ratios = [several.tokens_per_s / one.tokens_per_s for one, several in pairs]
    ratio = quantile(ratios, 0.5)
    same = all(one.token_ids == several.token_ids for one, several in pairs)
    k = engine.config.num_decode_steps
    rounds_text = ", ".join(f"{r:.2f}" for r in ratios)
    print(f"  multi-step decode K={k} against one run a step: {ratio:.2f}x tok/s ({rounds_text})")
    for one, several in pairs:
        step = [quantile(r.decode_step_s, 0.5) * 1e3 for r in (one, several)]
        host = [quantile(r.host_overhead_s, 0.5) * 1e3 for r in (one, several)]
        print(
            f"    {one.tokens_per_s:.1f} -> {several.tokens_per_s:.1f} tok/s; decode step per "
            f"run p50 {step[0]:.2f} -> {step[1]:.2f} ms, host {host[0]:.2f} -> {host[1]:.2f} ms"
        )
    print(f"  same tokens: {'yes' if same else 'NO'}")
    return {
        "decode_steps": k,
        "ratio_multi_step_tok_s": round(ratio, 3),
        "ratio_multi_step_tok_s_rounds": [round(r, 3) for r in ratios],
        "multi_step_same_tokens": same,
    }
