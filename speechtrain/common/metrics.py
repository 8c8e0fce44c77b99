"""Word and character error rates, computed as corpus-level sums so that they can be added up across batches and
ranks.

WER compares whitespace-split words. CER compares characters *including spaces* (as NeMo's and torchmetrics' CER
do), so a missing or extra word boundary counts as one error.

Normalisation (:class:`WerConfig`, ``model.wer`` and the transcription CLI's ``wer.*``) is applied to hypotheses
and references alike: ``lowercase``, ``remove_punctuation`` and ``numbers`` (spelled-out English numbers as digits,
by whisper-normalizer's ``EnglishNumberNormalizer``: "twenty five" and "25" score the same). The choice is part
of the model config (and so of ``config.yaml`` and the archive) and is printed next to every WER.
"""

import re
import unicodedata
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any


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


def reference_hits(hyp: Sequence[Hashable], ref: Sequence[Hashable]) -> tuple[list[bool], int]:
    """Which reference tokens a minimum-edit alignment of ``hyp`` to ``ref`` keeps (True) rather than substitutes or
    deletes, and how many tokens it inserts; ``hits.count(False) + insertions == edit_distance(hyp, ref)``.

    Per-token errors answer what a corpus WER cannot: which words fail (say, words a fine-tune never heard against
    those it did). A plain dynamic program with a backtrace (:func:`edit_distance` keeps no alignment); of equally
    short alignments it keeps matches first.
    """
    rows, cols = len(ref), len(hyp)
    table = [[i + j if i * j == 0 else 0 for j in range(cols + 1)] for i in range(rows + 1)]
    for i in range(1, rows + 1):
        for j in range(1, cols + 1):
            table[i][j] = min(
                table[i - 1][j - 1] + (ref[i - 1] != hyp[j - 1]), table[i - 1][j] + 1, table[i][j - 1] + 1
            )
    hits, insertions, i, j = [False] * rows, 0, rows, cols
    while i or j:
        if i and j and table[i][j] == table[i - 1][j - 1] + (ref[i - 1] != hyp[j - 1]):
            hits[i - 1] = ref[i - 1] == hyp[j - 1]
            i, j = i - 1, j - 1
        elif i and table[i][j] == table[i - 1][j] + 1:
            i -= 1  # deleted: stays False
        else:
            insertions, j = insertions + 1, j - 1
    return hits, insertions


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


@dataclass
class WerConfig:
    """How transcripts are normalised before WER and CER are counted (hypotheses and references alike).

    Attributes:
        lowercase: compare case-insensitively.
        remove_punctuation: drop punctuation (apostrophes inside words, decimal points and commas inside numbers
            and a percent sign after a number are kept).
        numbers: write spelled-out English numbers as digits ("twenty five" -> "25", "three point five" -> "3.5");
            needs ``lowercase`` and the ``text`` extra (whisper-normalizer).
    """

    lowercase: bool = False
    remove_punctuation: bool = False
    numbers: bool = False


# What punctuation removal keeps: an apostrophe between letters (don't), a point or comma between digits (3.5,
# 1,000) and a percent sign after a digit. Hand-written: whisper-normalizer's basic normaliser also drops bracketed
# text and diacritics, and splits contractions, which a WER option named "punctuation" should not do.
_KEEP = re.compile(r"(?<=\w)'(?=\w)|(?<=\d)[.,](?=\d)|(?<=\d)%")


class TextNormalizer:
    """Applies a :class:`WerConfig` to a transcript: ``TextNormalizer(cfg)(text) -> text``."""

    def __init__(self, cfg: "WerConfig | Any | None" = None) -> None:
        self.cfg = WerConfig(**dict(cfg)) if cfg is not None and not isinstance(cfg, WerConfig) else cfg or WerConfig()
        self._numbers = None
        if self.cfg.numbers:
            if not self.cfg.lowercase:
                raise ValueError(
                    "wer.numbers=true needs wer.lowercase=true: the number normaliser reads lower-case words."
                )
            try:
                from whisper_normalizer.english import EnglishNumberNormalizer
            except ImportError as error:
                raise ImportError(
                    "wer.numbers=true needs whisper-normalizer: pip install 'speechtrain[text]'"
                ) from error
            self._numbers = EnglishNumberNormalizer()

    @property
    def active(self) -> bool:
        return self.cfg.lowercase or self.cfg.remove_punctuation or self.cfg.numbers

    def describe(self) -> str:
        """The choice in words, e.g. ``lowercase, no punctuation, numbers as digits`` (``as written`` when none)."""
        cfg = self.cfg
        names = (
            ("lowercase", cfg.lowercase),
            ("no punctuation", cfg.remove_punctuation),
            ("numbers as digits", cfg.numbers),
        )
        return ", ".join(name for name, on in names if on) or "as written"

    def __call__(self, text: str) -> str:
        if not self.active:
            return text
        if self.cfg.lowercase:
            text = text.lower()
        if self._numbers is not None:
            # "twenty-five" and "1,000" as the number normaliser expects them: "twenty five", "1000".
            text = self._numbers(re.sub(r"(\d),(\d)", r"\1\2", re.sub(r"(?<=[a-z])-(?=[a-z])", " ", text)))
        if self.cfg.remove_punctuation:
            text = _remove_punctuation(text)
        return " ".join(text.split())


def _remove_punctuation(text: str) -> str:
    keep = {m.start() for m in _KEEP.finditer(text)}
    return "".join(
        " " if i not in keep and unicodedata.category(ch).startswith(("P", "S")) and ch not in "+" else ch
        for i, ch in enumerate(text)
    )
