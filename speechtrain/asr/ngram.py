"""Word n-gram language models for CTC beam search: interpolated Kneser-Ney, written as an ARPA file.

    python -m speechtrain.asr.ngram manifest=train.json output=lm.arpa [order=3]

The ARPA file is what KenLM (inside flashlight-text, see :mod:`speechtrain.asr.decoding`) reads; no KenLM
binaries (``lmplz``) are needed. Estimation follows Chen & Goodman's interpolated Kneser-Ney with one discount
per order, ``D = n1 / (n1 + 2 n2)`` from that order's count-of-counts:

* the highest order uses raw counts; lower orders use continuation counts (how many distinct words precede the
  n-gram), except n-grams that start with ``<s>``, which nothing can precede and so keep their raw counts;
* ``p(w | h) = max(c(h w) - D, 0) / c(h .) + gamma(h) p(w | h')`` with ``gamma(h) = D N1+(h .) / c(h .)``, and
  the unigrams are interpolated with a uniform distribution over the vocabulary (``<unk>`` included), so every
  word has a probability;
* in ARPA form, a seen n-gram stores its interpolated probability and, as a history, ``gamma`` as its back-off
  weight; an unseen one backs off, which gives exactly the interpolated probability.

Transcripts are split on whitespace, as the WER is; each is one sentence between ``<s>`` and ``</s>``.
"""

import functools
import json
import math
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from speechtrain.common.cli import fail, parse_key_values
from speechtrain.common.config import ConfigError

BOS, EOS, UNK = "<s>", "</s>", "<unk>"


def _discount(counts: Iterable[int]) -> float:
    """Ney's discount ``n1 / (n1 + 2 n2)`` from the counts of one order, kept in [0.1, 0.9] for tiny corpora."""
    histogram = Counter(counts)
    n1, n2 = histogram.get(1, 0), histogram.get(2, 0)
    return min(max(n1 / (n1 + 2 * n2), 0.1), 0.9) if n1 + n2 else 0.5


@dataclass
class NgramLM:
    """An interpolated Kneser-Ney word n-gram model.

    Attributes:
        order: the n of the n-grams (1 = unigram).
        probs: per order (index 0 = unigrams), each seen n-gram's log10 probability.
        backoffs: per order, the log10 back-off weight of each n-gram that is a history of a longer one.
    """

    order: int
    probs: list[dict[tuple[str, ...], float]]
    backoffs: list[dict[tuple[str, ...], float]]

    @classmethod
    def fit(cls, sentences: Iterable[str], order: int = 3) -> "NgramLM":
        """Estimate the model from whitespace-tokenised sentences.

        Raises:
            ValueError: if ``order`` < 1 or no sentence has a word.
        """
        if order < 1:
            raise ValueError(f"NgramLM: order must be >= 1, got {order}")
        raw: list[Counter] = [Counter() for _ in range(order)]
        for sentence in sentences:
            words = [BOS, *sentence.split(), EOS]
            if len(words) == 2:
                continue
            for n in range(1, order + 1):
                for i in range(len(words) - n + 1):
                    raw[n - 1][tuple(words[i : i + n])] += 1
        if not raw[0]:
            raise ValueError("NgramLM.fit: no words in the training text")
        # Counts used at each order: raw at the top and for n-grams starting with <s>, else continuation counts.
        counts: list[Counter] = [Counter() for _ in range(order)]
        counts[order - 1] = raw[order - 1]
        for n in range(order - 1, 0, -1):
            for gram in raw[n]:  # each distinct (n+1)-gram adds one left extension to its suffix
                counts[n - 1][gram[1:]] += 1
            for gram, count in raw[n - 1].items():
                if gram[0] == BOS:
                    counts[n - 1][gram] = count
        counts[0].pop((BOS,), None)

        vocab = sorted({g[0] for g in raw[0]} - {BOS} | {UNK})
        probs: list[dict[tuple[str, ...], float]] = [{} for _ in range(order)]
        backoffs: list[dict[tuple[str, ...], float]] = [{} for _ in range(order)]
        # Unigrams, interpolated with the uniform distribution.
        discount = _discount(counts[0].values())
        total = sum(counts[0].values())
        gamma = discount * len(counts[0]) / total
        lower = {(w,): max(counts[0].get((w,), 0) - discount, 0) / total + gamma / len(vocab) for w in vocab}
        probs[0] = {g: math.log10(p) for g, p in lower.items()}
        for n in range(2, order + 1):
            discount = _discount(counts[n - 1].values())
            totals: Counter = Counter()
            types: Counter = Counter()
            for gram, count in counts[n - 1].items():
                totals[gram[:-1]] += count
                types[gram[:-1]] += 1
            gammas = {h: discount * types[h] / totals[h] for h in totals}
            current = {}
            for gram, count in counts[n - 1].items():
                history = gram[:-1]
                p_lower = _interpolated(gram[1:], probs, backoffs, n - 1)
                current[gram] = (count - discount) / totals[history] + gammas[history] * p_lower
            probs[n - 1] = {g: math.log10(p) for g, p in current.items()}
            backoffs[n - 2] = {h: math.log10(g) for h, g in gammas.items()}
        probs[0][(BOS,)] = -99.0
        return cls(order=order, probs=probs, backoffs=backoffs)

    @functools.cached_property
    def known(self) -> frozenset[str]:
        """The words with a unigram probability (``<s>``, ``</s>`` and ``<unk>`` included)."""
        return frozenset(g[0] for g in self.probs[0])

    def log10_prob(self, word: str, history: Sequence[str] = ()) -> float:
        """log10 p(word | history), backing off as an ARPA reader does (unknown words are ``<unk>``)."""
        known = self.known
        context = tuple(w if w in known else UNK for w in history)[-(self.order - 1) :] if self.order > 1 else ()
        gram = (*context, word if word in known else UNK)
        return math.log10(_interpolated(gram, self.probs, self.backoffs, len(gram)))

    @classmethod
    def read_arpa(cls, path: str | Path) -> "NgramLM":
        """Read an ARPA file (as :meth:`write_arpa` writes it, or KenLM's ``lmplz``).

        Raises:
            ValueError: if the file holds no n-grams.
        """
        probs: list[dict[tuple[str, ...], float]] = []
        backoffs: list[dict[tuple[str, ...], float]] = []
        n = 0
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if line.startswith("\\") and line.endswith("-grams:"):
                    n = int(line[1:].split("-")[0])
                    while len(probs) < n:
                        probs.append({})
                        backoffs.append({})
                    continue
                if not line or line.startswith("\\") or n == 0:
                    continue
                fields = line.split()
                gram = tuple(fields[1 : 1 + n])
                probs[n - 1][gram] = float(fields[0])
                if len(fields) > 1 + n:
                    backoffs[n - 1][gram] = float(fields[1 + n])
        if not probs or not probs[0]:
            raise ValueError(f"{path}: no n-grams found; is it an ARPA language model?")
        if (UNK,) not in probs[0]:
            probs[0][(UNK,)] = -99.0
        return cls(order=len(probs), probs=probs, backoffs=backoffs)

    def write_arpa(self, path: str | Path) -> Path:
        """Write the model in ARPA text format (n-grams sorted within each order)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write("\\data\\\n")
            for n in range(1, self.order + 1):
                f.write(f"ngram {n}={len(self.probs[n - 1])}\n")
            for n in range(1, self.order + 1):
                f.write(f"\n\\{n}-grams:\n")
                backoff = self.backoffs[n - 1]
                for gram in sorted(self.probs[n - 1]):
                    line = f"{self.probs[n - 1][gram]:.6f}\t{' '.join(gram)}"
                    if gram in backoff:
                        line += f"\t{backoff[gram]:.6f}"
                    f.write(line + "\n")
            f.write("\n\\end\\\n")
        return path

    @property
    def vocabulary(self) -> list[str]:
        """The words with a unigram probability (``<s>``, ``</s>`` and ``<unk>`` included), sorted."""
        return sorted(g[0] for g in self.probs[0])


def interpolate(models: Sequence[tuple["NgramLM", float]]) -> NgramLM:
    """The linear interpolation ``sum_i w_i p_i(word | history)`` of word n-gram LMs as one :class:`NgramLM` (what
    SRILM's ``-mix-lm`` builds), over the union of their vocabularies: a word is the mixture's if any model knows it
    (a model gives 0 to a word outside its vocabulary; each gives its ``<unk>`` share to ``<unk>``).

    Every n-gram that one of the models stores gets the mixture's exact probability; for the rest the mixture backs
    off to its own lower order, with back-off weights that make each history's distribution sum to 1 (the usual
    static approximation of a mixture: exact where any model has seen the n-gram).

    Args:
        models: (model, weight) pairs; the weights are positive and sum to 1.

    Raises:
        ValueError: no model, or weights that are not positive or do not sum to 1 (the weights named).
    """
    weights = [w for _, w in models]
    if not models or any(not w > 0 for w in weights) or abs(sum(weights) - 1.0) > 1e-6:
        raise ValueError(f"interpolate: weights must be positive and sum to 1, got {weights}.")
    order = max(m.order for m, _ in models)

    def model_prob(model: NgramLM, gram: tuple[str, ...]) -> float:
        word = gram[-1]
        if word not in model.known:
            return 0.0
        context = tuple(w if w in model.known else UNK for w in gram[:-1])
        context = context[len(context) - (model.order - 1) :] if model.order > 1 else ()
        return _interpolated((*context, word), model.probs, model.backoffs, len(context) + 1)

    probs: list[dict[tuple[str, ...], float]] = [{} for _ in range(order)]
    backoffs: list[dict[tuple[str, ...], float]] = [{} for _ in range(order)]
    for n in range(1, order + 1):
        grams = sorted({g for m, _ in models if n <= m.order for g in m.probs[n - 1]} - {(BOS,)})
        mixed = {g: sum(w * model_prob(m, g) for m, w in models) for g in grams}
        probs[n - 1] = {g: math.log10(p) if p > 0 else -99.0 for g, p in mixed.items()}
        if n == 1:
            probs[0][(BOS,)] = -99.0
            continue
        # Back-off weights of the histories of order n - 1: the mass left after their stored continuations, over
        # the mass the mixture's lower order gives to the words that were not stored.
        seen: dict[tuple[str, ...], list[float]] = {}
        for gram, p in mixed.items():
            lower = _interpolated(gram[1:], probs, backoffs, n - 1)
            sums = seen.setdefault(gram[:-1], [0.0, 0.0])
            sums[0] += p
            sums[1] += lower
        backoffs[n - 2] = {h: math.log10(max(1.0 - above, 1e-12) / max(1.0 - below, 1e-12))
                           for h, (above, below) in seen.items()}  # fmt: skip
    return NgramLM(order=order, probs=probs, backoffs=backoffs)


def _interpolated(gram: tuple[str, ...], probs: list[dict], backoffs: list[dict], n: int) -> float:
    """p(gram[-1] | gram[:-1]) (a probability, not a log) from the orders up to ``n``, by ARPA back-off."""
    gram = gram[-n:]
    if gram in probs[n - 1]:
        return 10.0 ** probs[n - 1][gram]
    weight = backoffs[n - 2].get(gram[:-1], 0.0) if n > 1 else 0.0
    if n == 1:
        return 10.0 ** probs[0][(UNK,)]
    return 10.0**weight * _interpolated(gram[1:], probs, backoffs, n - 1)


def manifest_texts(paths: Sequence[str | Path]) -> list[str]:
    """The ``text`` fields of NeMo manifests (rows without text are skipped)."""
    texts = []
    for path in paths:
        with open(path, encoding="utf-8-sig") as f:
            for line in f:
                if line.strip():
                    text = json.loads(line).get("text")
                    if isinstance(text, str) and text.strip():
                        texts.append(text)
    return texts


@dataclass
class NgramConfig:
    """Command-line options of ``python -m speechtrain.asr.ngram``.

    Attributes:
        manifest: a NeMo manifest (or a comma-separated list) whose ``text`` fields are the training text.
        output: the ARPA file to write.
        order: the n-gram order.
    """

    manifest: str | None = None
    output: str | None = None
    order: int = 3


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry point (see the module docstring)."""
    cfg = parse_key_values(sys.argv[1:] if argv is None else argv, NgramConfig, __doc__)
    try:
        if not cfg.manifest or not cfg.output:
            raise ConfigError("Give manifest=... and output=...")
        texts = manifest_texts([p for p in cfg.manifest.split(",") if p])
        lm = NgramLM.fit(texts, order=cfg.order)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        fail(str(e))
    lm.write_arpa(cfg.output)
    sizes = ", ".join(f"{len(p)} {n + 1}-grams" for n, p in enumerate(lm.probs))
    print(f"Wrote a {cfg.order}-gram LM ({sizes}) from {len(texts)} sentences to {cfg.output}")


if __name__ == "__main__":
    main()
