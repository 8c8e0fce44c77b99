"""Text front-end of the TTS models: characters, or IPA phonemes from eSpeak NG (the wheel that reads the
built-in corpus, so a phoneme model hears and reads the same pronunciations).

A :class:`TextFrontEnd` turns text into symbols (normalised characters, or phonemes) and symbols into ids with a
:class:`~speechtrain.common.tokenizers.CharTokenizer` over the symbol inventory, which the model archive stores.
"""

from collections.abc import Iterable
from dataclasses import dataclass

from speechtrain.common.tokenizers import CharTokenizer

KINDS = ("chars", "phonemes")

_espeak = None


def phonemize(text: str, voice: str = "en-us") -> str:
    """IPA phonemes of ``text`` (eSpeak NG; words separated by spaces)."""
    global _espeak
    if _espeak is None:
        from speechtrain.corpora.engines import _Espeak

        _espeak = _Espeak()
    return _espeak.phonemes(text, voice)


@dataclass
class TextFrontEndConfig:
    """``model.text``: ``kind`` chars or phonemes, the eSpeak ``voice`` (language) for phonemes, and the symbol
    ``vocab`` (filled in from the training transcripts when null)."""

    kind: str = "phonemes"
    voice: str = "en-us"
    vocab: list[str] | None = None


class TextFrontEnd:
    """Text -> symbol ids (see the module docstring).

    Raises:
        ValueError: on an unknown ``kind``.
    """

    def __init__(self, cfg: TextFrontEndConfig) -> None:
        if cfg.kind not in KINDS:
            raise ValueError(f"text.kind must be one of {', '.join(KINDS)}, got {cfg.kind!r}.")
        self.cfg = cfg
        self.tokenizer = CharTokenizer(cfg.vocab) if cfg.vocab else None

    def symbols(self, text: str) -> str:
        """The symbol string of ``text``: lower-cased, whitespace-collapsed characters, or IPA phonemes."""
        text = " ".join(text.lower().split())
        return phonemize(text, self.cfg.voice) if self.cfg.kind == "phonemes" else text

    def fit(self, texts: Iterable[str]) -> list[str]:
        """Set the symbol inventory from ``texts``; returns it (sorted)."""
        self.tokenizer = CharTokenizer.from_texts(self.symbols(t) for t in texts)
        self.cfg.vocab = self.tokenizer.vocab
        return self.cfg.vocab

    @property
    def vocab_size(self) -> int:
        return self._tokenizer().vocab_size

    def encode(self, text: str) -> list[int]:
        """Symbol ids of ``text``.

        Raises:
            ValueError: naming the symbols outside the inventory.
        """
        return self._tokenizer().encode(self.symbols(text))

    def _tokenizer(self) -> CharTokenizer:
        if self.tokenizer is None:
            raise RuntimeError("The text front-end has no symbol inventory yet: call fit(texts) or give text.vocab.")
        return self.tokenizer
