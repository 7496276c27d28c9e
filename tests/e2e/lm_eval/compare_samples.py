"""Compare lm-eval runs of one loglikelihood task item by item (their ``--log_samples`` files).

    python tests/e2e/lm_eval/compare_samples.py REFERENCE.jsonl OTHER.jsonl [OTHER.jsonl ...]

For every document and every choice, each OTHER run must give the REFERENCE's loglikelihood
within ``--tolerance`` (default 1e-3) and the same is_greedy; the accuracy of each run is
printed. Exits 1 on any difference. Needs only the standard library (no lm-eval, no
headrace), so it runs in lm-eval's own venv or anywhere else.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

Scores = dict[int, list[tuple[float, bool]]]


def read(path: Path) -> tuple[Scores, float]:
    """Per document its choices' (loglikelihood, is_greedy), and the run's accuracy."""
    scores: Scores = {}
    num_correct = 0.0
    for line in path.read_text().splitlines():
        sample = json.loads(line)
        scores[sample["doc_id"]] = [
            (float(loglikelihood), is_greedy == "True")
            for loglikelihood, is_greedy in sample["filtered_resps"]
        ]
        num_correct += sample["acc"]
    return scores, num_correct / len(scores)


def compare(reference: Scores, other: Scores, tolerance: float) -> tuple[float, list[str]]:
    """The largest loglikelihood difference, and every mismatch as a line."""
    mismatches, largest = [], 0.0
    if reference.keys() != other.keys():
        mismatches.append(f"documents differ: {sorted(reference.keys() ^ other.keys())}")
    for doc_id in sorted(reference.keys() & other.keys()):
        for choice, (want, got) in enumerate(zip(reference[doc_id], other[doc_id], strict=True)):
            largest = max(largest, abs(want[0] - got[0]))
            if abs(want[0] - got[0]) > tolerance or want[1] != got[1]:
                mismatches.append(f"doc {doc_id} choice {choice}: {want} vs {got}")
    return largest, mismatches


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reference", type=Path)
    parser.add_argument("others", type=Path, nargs="+")
    parser.add_argument("--tolerance", type=float, default=1e-3)
    args = parser.parse_args()
    reference, accuracy = read(args.reference)
    print(f"{args.reference}: acc {accuracy:.4f}, {len(reference)} documents")
    failed = False
    for path in args.others:
        scores, other_accuracy = read(path)
        largest, mismatches = compare(reference, scores, args.tolerance)
        print(f"{path}: acc {other_accuracy:.4f}, largest loglikelihood difference {largest:.2e}")
        for line in mismatches:
            print(f"  {line}")
        failed |= bool(mismatches) or other_accuracy != accuracy
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
