"""Greedy word errors by how often training heard the word: decodes a set with the model alone (greedy, no LM, no
lexicon), aligns each hypothesis to its reference and counts, per bucket of the reference word's count in the
training transcripts, how many reference words were not recognised (substituted or deleted).

    python benchmarks/asr_rare_words.py --model speechtrain_experiments/asr_demo/<run>/asr_demo.stm \
        [--audio builtin:speech/test] [--train builtin:speech/train builtin:speech/train_extra] [--examples 10]

This is what chose the demo's 64-piece tokenizer: the errors left were words heard rarely in training. It also
prints how many hypothesis words are no word of the training transcripts (a misspelling, or a word cut in two), and
the greedy WER if each of them were replaced by the closest training word (``difflib``): how much of the greedy WER
a lexicon could at most take back, against the real-word confusions that only better hearing fixes.
"""

import argparse
import difflib
import os
from collections import Counter

BUCKETS = ((0, 0), (1, 4), (5, 19), (20, 99), (100, 999), (1000, None))


def missed_words(ref: list[str], hyp: list[str]) -> list[bool]:
    """For each reference word, whether a minimum-edit alignment to ``hyp`` fails to match it."""
    n, m = len(ref), len(hyp)
    dist = [[i + j if i == 0 or j == 0 else 0 for j in range(m + 1)] for i in range(n + 1)]
    for i in range(1, n + 1):
        for j in range(1, m + 1):
            dist[i][j] = min(dist[i - 1][j] + 1, dist[i][j - 1] + 1, dist[i - 1][j - 1] + (ref[i - 1] != hyp[j - 1]))
    missed, i, j = [True] * n, n, m
    while i > 0 and j > 0:
        if dist[i][j] == dist[i - 1][j - 1] + (ref[i - 1] != hyp[j - 1]):
            missed[i - 1] = ref[i - 1] != hyp[j - 1]
            i, j = i - 1, j - 1
        elif dist[i][j] == dist[i - 1][j] + 1:
            i -= 1
        else:
            j -= 1
    return missed


def bucket_of(count: int) -> str:
    for low, high in BUCKETS:
        if high is None or count <= high:
            return f"{low}+" if high is None else (f"{low}" if low == high else f"{low}-{high}")
    raise AssertionError


def non_words(refs: list[str], hyps: list[str], heard: Counter) -> tuple[int, int, float, float]:
    """(hypothesis words, of them not in ``heard``, greedy WER, WER with each such word replaced by its closest word
    in ``heard``)."""
    from speechtrain.common.metrics import error_rate, word_errors

    words = [w for h in hyps for w in h.split()]
    vocabulary = list(heard)
    closest = {w: (difflib.get_close_matches(w, vocabulary, n=1, cutoff=0.0) or [w])[0]
               for w in set(words) if w not in heard}  # fmt: skip
    fixed = [" ".join(closest.get(w, w) for w in h.split()) for h in hyps]
    return (len(words), sum(w in closest for w in words), error_rate(*word_errors(hyps, refs)),
            error_rate(*word_errors(fixed, refs)))  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    import torch

    from speechtrain.asr.ctc import resolve_manifest
    from speechtrain.core.model import SpeechModel
    from speechtrain.data.manifest import read_nemo_manifest

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--audio", default="builtin:speech/test")
    parser.add_argument("--train", nargs="+", default=["builtin:speech/train", "builtin:speech/train_extra"])
    parser.add_argument("--examples", type=int, default=10, help="reference / hypothesis pairs to print")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))
    heard = Counter(
        w for name in args.train for r in read_nemo_manifest(resolve_manifest(name)) for w in r["text"].split()
    )
    records = read_nemo_manifest(resolve_manifest(args.audio))  # validated, audio paths resolved
    model = SpeechModel.restore_from(args.model)
    model.eval()
    audio = [r["audio_filepath"] for r in records]
    hyps = [h if isinstance(h, str) else h.text for h in model.transcribe(audio, strategy="greedy")]
    words, missed = Counter(), Counter()
    for record, hyp in zip(records, hyps, strict=True):
        ref = record["text"].split()
        for word, miss in zip(ref, missed_words(ref, hyp.split()), strict=True):
            words[bucket_of(heard[word])] += 1
            missed[bucket_of(heard[word])] += miss
    print(f"\n{args.audio}: {sum(words.values())} reference words; training transcripts: {sum(heard.values())} words, "
          f"{len(heard)} distinct\n")  # fmt: skip
    print("| heard in training | reference words | not recognised (greedy) |\n|---|---|---|")
    for low, _ in BUCKETS:
        name = bucket_of(low)
        if words[name]:
            print(f"| {name} | {words[name]} | {missed[name] / words[name]:.1%} |")
    total, unknown, wer, wer_fixed = non_words([r["text"] for r in records], hyps, heard)
    print(f"\nhypothesis words not in the training transcripts: {unknown} of {total} ({unknown / max(1, total):.1%}); "
          f"greedy WER {wer:.2%}, {wer_fixed:.2%} with each replaced by the closest training word")  # fmt: skip
    for record, hyp in list(zip(records, hyps))[: args.examples]:
        print(f"\nREF: {record['text']}\nHYP: {hyp}")


if __name__ == "__main__":
    main()
