"""Word and character error rates, computed as corpus-level sums so that they can be added up across batches and
ranks.

WER compares whitespace-split words. CER compares characters *including spaces* (as NeMo's and torchmetrics' CER
do), so a missing or extra word boundary counts as one error.
"""

from collections.abc import Hashable, Sequence


def edit_distance(hyp: Sequence[Hashable], ref: Sequence[Hashable]) -> int:
    """Levenshtein distance (substitutions, insertions and deletions all cost 1) between two token sequences.

    Tokens are any hashable items: words, characters, ids. Runs Myers' bit-parallel algorithm, in Hyyrö's
    formulation for the edit distance, on Python integers used as ``len(ref)``-bit vectors: a pair of
    200-character transcripts takes ~200 big-integer steps rather than 40,000 Python-level DP cell updates.
    """
    m = len(ref)
    if m == 0:
        return len(hyp)
    positions: dict[Hashable, int] = {}
    for i, token in enumerate(ref):
        positions[token] = positions.get(token, 0) | (1 << i)
    mask = (1 << m) - 1
    last = 1 << (m - 1)
    # Bit i of up / down: the DP column's value rises / falls by one from ref row i to row i + 1.
    up, down, distance = mask, 0, m
    for token in hyp:
        eq = positions.get(token, 0)
        xv = eq | down
        xh = (((eq & up) + up) ^ up) | eq
        h_up = down | ~(xh | up)
        h_down = up & xh
        if h_up & last:
            distance += 1
        elif h_down & last:
            distance -= 1
        # Shifting in a 1: the first DP row is 0, 1, 2, ... (the global distance, not a substring search).
        h_up = (h_up << 1) | 1
        h_down <<= 1
        up = (h_down | ~(xv | h_up)) & mask
        down = h_up & xv & mask
    return distance


def _check_lengths(hyps: Sequence[str], refs: Sequence[str]) -> None:
    if len(hyps) != len(refs):
        raise ValueError(f"{len(hyps)} hypotheses for {len(refs)} references")


def word_errors(hyps: Sequence[str], refs: Sequence[str]) -> tuple[int, int]:
    """(sum of word edit distances, sum of reference words) over a batch of transcripts."""
    _check_lengths(hyps, refs)
    errors = sum(edit_distance(h.split(), r.split()) for h, r in zip(hyps, refs))
    return errors, sum(len(r.split()) for r in refs)


def word_error_rate(hyps: Sequence[str], refs: Sequence[str]) -> float:
    """Corpus WER: total edits over total reference words; NaN (n/a) when the references hold no word."""
    return error_rate(*word_errors(hyps, refs))


def char_errors(hyps: Sequence[str], refs: Sequence[str]) -> tuple[int, int]:
    """(sum of character edit distances, sum of reference characters) over a batch; spaces are characters.

    The strings are compared as given: normalize case and whitespace beforehand if they should not count.
    """
    _check_lengths(hyps, refs)
    errors = sum(edit_distance(h, r) for h, r in zip(hyps, refs))
    return errors, sum(len(r) for r in refs)


def char_error_rate(hyps: Sequence[str], refs: Sequence[str]) -> float:
    """Corpus CER: total character edits over total reference characters; NaN (n/a) when there are none."""
    return error_rate(*char_errors(hyps, refs))


def error_rate(errors: float, total: float) -> float:
    """``errors / total``; NaN (not applicable) when there is nothing to score (``total == 0``), never 0."""
    return errors / total if total > 0 else float("nan")


def format_rate(rate: float) -> str:
    """``12.34%``, or ``n/a`` for a rate over nothing (NaN)."""
    return "n/a" if rate != rate else f"{100.0 * rate:.2f}%"
