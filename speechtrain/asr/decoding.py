"""CTC decoding: greedy (best path), or beam search with a word lexicon and an n-gram language model.

The beam search is flashlight-text's lexicon decoder (C++, with KenLM inside; reached through torchaudio's
``ctc_decoder``). Its lexicon is built here from the LM's vocabulary, spelled with the model's own tokenizer, so
it can never disagree with the tokenizer (a fine-tuned model with a new tokenizer keeps a valid lexicon). Words
outside the lexicon cannot be recognised in this mode: the LM (:mod:`speechtrain.asr.ngram`) should be fitted on
text that covers the target vocabulary, e.g. the training transcripts.

Tokens that are not words: a sentencepiece model marks word starts inside its pieces, so no separator token is
needed; flashlight still wants a "silence" token, and gets ``<unk>``, which a model trained here never emits.
A character model's space is its word separator, so it serves as the silence token.
"""

import contextlib
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from speechtrain.asr.ngram import BOS, EOS, UNK
from speechtrain.common.tokenizers import CharTokenizer, SentencePieceTokenizer

STRATEGIES = ("greedy", "beam")
BLANK_TOKEN = "<blank>"


@dataclass
class DecodingConfig:
    """How a CTC model turns log-probabilities into text (``model.decoding``).

    Attributes:
        strategy: ``greedy`` (best path), or ``beam`` (beam search; with ``lm_path``, constrained to the LM's
            words and scored by it). Validation inside ``fit`` always decodes greedily (fast, and comparable
            across runs); ``trainer.validate`` and transcription use this strategy and, for ``beam``, also log
            the greedy WER (``val_wer_greedy``).
        lm_path: a word n-gram LM in ARPA format (packed into the model archive). With ``strategy: beam`` and
            none given, the training scripts fit one of ``lm_order`` on the training transcripts (cached).
        lm_order: the n-gram order of that fitted LM (0: beam search without LM or lexicon).
        beam_size: hypotheses kept per frame.
        lm_weight: weight of the LM's log-probability (natural log) against the acoustic score.
        word_score: a bonus added per word (positive values favour more words).
        beam_threshold: hypotheses scoring this far below the best are pruned.
    """

    strategy: str = "greedy"
    lm_path: str | None = None
    lm_order: int = 3
    beam_size: int = 16
    lm_weight: float = 1.0
    word_score: float = 0.0
    beam_threshold: float = 25.0


def greedy_decode(log_probs: torch.Tensor, lengths: torch.Tensor, blank: int) -> list[list[int]]:
    """Best path of each row of ``log_probs`` (B, F, V+1): argmax per frame, repeats merged, blanks dropped."""
    best = log_probs.argmax(-1).cpu()
    paths = []
    for row, length in zip(best, lengths.cpu()):
        ids = torch.unique_consecutive(row[:length]).tolist()
        paths.append([i for i in ids if i != blank])
    return paths


def _token_strings(tokenizer: Any) -> tuple[list[str], str]:
    """The decoder's token names (the tokenizer's ids in order, then the blank) and its silence token."""
    if isinstance(tokenizer, SentencePieceTokenizer):
        vocab = tokenizer.vocab
        if UNK not in vocab:
            raise ValueError("Beam search needs the sentencepiece model's <unk> piece (the silence token).")
        return vocab + [BLANK_TOKEN], UNK
    if isinstance(tokenizer, CharTokenizer):
        vocab = tokenizer.vocab
        if " " not in vocab:
            raise ValueError("Beam search with a character tokenizer needs the space character in its vocabulary.")
        space = next(name for name in ("|", "<space>", "<sil>") if name not in vocab)
        return [space if c == " " else c for c in vocab] + [BLANK_TOKEN], space
    raise TypeError(f"Beam search does not support {type(tokenizer).__name__}.")


def spell(tokenizer: Any, word: str) -> list[str] | None:
    """The token names that spell ``word`` (None if the tokenizer cannot represent it)."""
    if isinstance(tokenizer, SentencePieceTokenizer):
        try:
            ids = tokenizer.encode(word)
        except ValueError:
            return None
        vocab = tokenizer.vocab
        return [vocab[i] for i in ids] or None
    vocab = set(tokenizer.vocab)
    return list(word) if word and all(c in vocab and c != " " for c in word) else None


def arpa_words(path: str | Path) -> list[str]:
    """The unigrams of an ARPA file, without ``<s>``, ``</s>`` and ``<unk>``."""
    words, in_unigrams = [], False
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line.startswith("\\"):
                if in_unigrams:
                    break
                in_unigrams = line == "\\1-grams:"
                continue
            if in_unigrams and line:
                fields = line.split()
                if len(fields) >= 2 and fields[1] not in (BOS, EOS, UNK):
                    words.append(fields[1])
    if not words:
        raise ValueError(f"{path}: no unigrams found; is it an ARPA language model?")
    return words


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence KenLM's progress bar (C++ writes to fd 2) while the LM loads."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class BeamSearchDecoder:
    """CTC beam search over a model's log-probabilities (blank = the last output), optionally with a lexicon and a
    word n-gram LM.

    Args:
        tokenizer: the model's tokenizer (sentencepiece or characters).
        cfg: the :class:`DecodingConfig` (its beam settings and ``lm_path`` are used).

    Raises:
        ImportError: if flashlight-text is not installed (named, with the command that installs it).
        FileNotFoundError: if ``cfg.lm_path`` does not exist.
    """

    def __init__(self, tokenizer: Any, cfg: DecodingConfig) -> None:
        try:
            from torchaudio.models.decoder import ctc_decoder
        except ImportError as e:  # torchaudio itself is a dependency; the message is about flashlight-text
            raise ImportError(f"Beam search needs flashlight-text: pip install flashlight-text ({e})") from None
        self.tokenizer = tokenizer
        tokens, silence = _token_strings(tokenizer)
        self.lexicon_size, self.skipped_words = 0, []
        with tempfile.TemporaryDirectory(prefix="speechtrain-lexicon-") as tmp:
            lexicon = None
            if cfg.lm_path:
                if not Path(cfg.lm_path).is_file():
                    raise FileNotFoundError(f"decoding.lm_path={cfg.lm_path}: no such file.")
                lexicon = Path(tmp) / "lexicon.txt"
                with open(lexicon, "w", encoding="utf-8") as f:
                    for word in arpa_words(cfg.lm_path):
                        spelling = spell(tokenizer, word)
                        if spelling is None:
                            self.skipped_words.append(word)
                            continue
                        f.write(f"{word}\t{' '.join(spelling)}\n")
                        self.lexicon_size += 1
            try:
                with _quiet_stderr():
                    self._decoder = ctc_decoder(
                        lexicon=str(lexicon) if lexicon else None,
                        tokens=tokens,
                        lm=cfg.lm_path or None,
                        nbest=1,
                        beam_size=cfg.beam_size,
                        beam_threshold=cfg.beam_threshold,
                        lm_weight=cfg.lm_weight,
                        word_score=cfg.word_score,
                        blank_token=BLANK_TOKEN,
                        sil_token=silence,
                        unk_word=UNK,
                    )
            except RuntimeError as e:
                if "flashlight" in str(e).lower():
                    message = f"Beam search needs flashlight-text: pip install flashlight-text ({e})"
                    raise ImportError(message) from None
                raise
        self._lexicon = lexicon is not None
        # A sentencepiece model's silence (<unk>) may open or close a lexicon-free hypothesis: it is not text.
        self._silence = tokens.index(silence) if isinstance(tokenizer, SentencePieceTokenizer) else -1

    def __call__(self, log_probs: torch.Tensor, lengths: torch.Tensor) -> list[str]:
        """Best hypothesis of each row of ``log_probs`` (B, F, V+1) as text."""
        emissions = log_probs.detach().float().cpu().contiguous()
        texts = []
        for hyps in self._decoder(emissions, lengths.detach().cpu().to(torch.int32)):
            if not hyps:
                texts.append("")
            elif self._lexicon:
                texts.append(" ".join(w for w in hyps[0].words if w != UNK))
            else:
                size = self.tokenizer.vocab_size
                ids = [int(i) for i in hyps[0].tokens if int(i) < size and int(i) != self._silence]
                texts.append(self.tokenizer.decode(ids).strip())
        return texts
