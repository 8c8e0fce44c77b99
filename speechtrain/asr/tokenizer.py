"""Train a SentencePiece tokenizer on the transcripts of NeMo manifests and say how CTC will cope with it.

    python -m speechtrain.asr.tokenizer --manifest train.json [more.json builtin:dtmf/train] \\
        --vocab-size 128 --type bpe --out tokenizers/bpe128

Writes ``tokenizer.model`` (read it with :func:`speechtrain.common.tokenizers.load_tokenizer`) and ``tokenizer.vocab``
to ``--out``, prints the model's path, then a summary: tokens per utterance and per second of audio (from the
manifests' durations), and for 4x and 8x subsampling of the log-mel frames, how many utterances have more tokens
than a CTC model has output frames. Such utterances cannot be aligned (a repeated token needs a blank between its
copies, so it counts twice); a warning on stderr names the problem and the usual fixes.
"""

import argparse
import math
import sys
from collections.abc import Sequence

from speechtrain.asr.features import PreprocessorConfig
from speechtrain.common.cli import fail
from speechtrain.common.tokenizers import SentencePieceTokenizer, train_sentencepiece
from speechtrain.corpora.builtin import resolve_manifest
from speechtrain.data.manifest import read_nemo_manifest

SUBSAMPLING_FACTORS = (4, 8)


def read_transcripts(manifests: Sequence[str]) -> tuple[list[str], list[float]]:
    """Transcripts and durations (seconds) of every utterance in ``manifests`` (paths or ``builtin:`` names).

    Transcripts are kept as written (no lowercasing): the datasets encode them unchanged, so the tokenizer must
    learn them unchanged.
    """
    texts, durations = [], []
    for manifest in manifests:
        for record in read_nemo_manifest(resolve_manifest(manifest)):
            texts.append(record["text"])
            durations.append(record["duration"])
    return texts, durations


def ctc_min_frames(ids: Sequence[int]) -> int:
    """Output frames CTC needs for ``ids``: one per token, plus a blank between equal neighbours."""
    return len(ids) + sum(a == b for a, b in zip(ids, ids[1:]))


def summarize(tokenizer: SentencePieceTokenizer, texts: Sequence[str], durations: Sequence[float]) -> list[str]:
    """Summary lines; those starting with ``warning:`` point at a problem."""
    encoded, refused = [], 0
    for text, duration in zip(texts, durations):
        try:
            encoded.append((tokenizer.encode(text), duration))
        except ValueError:
            refused += 1
    num_tokens = sum(len(ids) for ids, _ in encoded)
    seconds = sum(duration for _, duration in encoded)
    per_utterance = num_tokens / max(len(encoded), 1)
    chars_per_token = sum(len(text) for text in texts) / max(num_tokens, 1)
    lines = [
        f"vocab_size: {tokenizer.vocab_size} (a CTC model adds the blank at id {tokenizer.vocab_size})",
        f"utterances: {len(texts)}, {sum(durations) / 3600:.2f} h of audio",
        f"tokens per utterance: {per_utterance:.1f} ({chars_per_token:.2f} characters per token)",
    ]
    if refused:
        lines.append(f"warning: {refused} utterances hold characters outside the model; datasets will skip them")
    if seconds <= 0:
        return lines + ["tokens per second: unknown (the manifests give no duration)"]
    tokens_per_second = num_tokens / seconds
    lines.append(f"tokens per second of audio: {tokens_per_second:.2f}")
    frames_per_second = 1.0 / PreprocessorConfig().window_stride
    for factor in SUBSAMPLING_FACTORS:
        rate = frames_per_second / factor
        # The frame count of the model: floor(samples / hop) + 1 features, then ceil over the stride.
        too_long = sum(
            ctc_min_frames(ids) > math.floor(duration * frames_per_second + 1e-6) // factor + 1
            for ids, duration in encoded
        )
        lines.append(f"CTC at {factor}x subsampling ({rate:g} frames/s): {too_long} utterances have too many tokens")
        if tokens_per_second > rate or too_long:
            lines.append(
                f"warning: at {factor}x subsampling {too_long} of {len(encoded)} utterances cannot be aligned by CTC "
                f"({tokens_per_second:.2f} tokens/s against {rate:g} frames/s); use a larger vocabulary or less "
                f"subsampling"
            )
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m speechtrain.asr.tokenizer",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--manifest", nargs="+", required=True, help="NeMo JSON-lines manifests or builtin: names")
    parser.add_argument("--out", required=True, help="output folder for tokenizer.model and tokenizer.vocab")
    parser.add_argument("--vocab-size", type=int, default=128, help="number of pieces, <unk> included")
    parser.add_argument("--type", choices=("bpe", "unigram"), default="bpe", help="SentencePiece model type")
    parser.add_argument(
        "--character-coverage", type=float, default=1.0, help="share of characters that get a piece (rest: <unk>)"
    )
    args = parser.parse_args(argv)
    try:
        texts, durations = read_transcripts(args.manifest)
        path = train_sentencepiece(
            texts, args.out, args.vocab_size, args.type, character_coverage=args.character_coverage
        )
    except (FileNotFoundError, ValueError) as e:
        fail(str(e), "python -m speechtrain.asr.tokenizer")
    print(path)
    for line in summarize(SentencePieceTokenizer(path), texts, durations):
        print(line, file=sys.stderr if line.startswith("warning:") else sys.stdout)


if __name__ == "__main__":
    main()
