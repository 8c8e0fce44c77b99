"""Word error rate, computed as corpus-level sums so that it can be added up across batches and ranks."""

from collections.abc import Sequence


def edit_distance(hyp: Sequence[str], ref: Sequence[str]) -> int:
    """Levenshtein distance between two token sequences."""
    previous = list(range(len(ref) + 1))
    for i, h in enumerate(hyp, start=1):
        current = [i]
        for j, r in enumerate(ref, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (h != r)))
        previous = current
    return previous[-1]


def word_errors(hyps: Sequence[str], refs: Sequence[str]) -> tuple[int, int]:
    """(sum of word edit distances, sum of reference words) over a batch of transcripts."""
    if len(hyps) != len(refs):
        raise ValueError(f"{len(hyps)} hypotheses for {len(refs)} references")
    errors = sum(edit_distance(h.split(), r.split()) for h, r in zip(hyps, refs))
    return errors, sum(len(r.split()) for r in refs)


def word_error_rate(hyps: Sequence[str], refs: Sequence[str]) -> float:
    """Corpus WER: total edits over total reference words (1.0 for empty references with any output)."""
    errors, words = word_errors(hyps, refs)
    return errors / words if words else float(errors > 0)
