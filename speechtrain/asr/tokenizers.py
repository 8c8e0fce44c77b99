"""Tokenizers for ASR transcripts.

Token ids are ``0 .. vocab_size - 1``. The CTC blank is not a token: CTC models put it at index
``vocab_size`` (last), so a tokenizer can be swapped without renumbering.
"""

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path


class CharTokenizer:
    """One token per character.

    Args:
        vocab: Distinct single characters; ``vocab[i]`` has id ``i``. The space character is an ordinary
            entry (word boundaries are characters in character-level ASR).

    Raises:
        ValueError: If the vocabulary is empty, holds something other than single characters, or repeats one.
    """

    def __init__(self, vocab: Sequence[str]) -> None:
        vocab = list(vocab)
        if not vocab:
            raise ValueError("CharTokenizer: the vocabulary is empty")
        bad = [v for v in vocab if not isinstance(v, str) or len(v) != 1]
        if bad:
            raise ValueError(f"CharTokenizer: vocabulary entries must be single characters, got {bad[:5]!r}")
        if len(set(vocab)) != len(vocab):
            repeated = sorted({v for v in vocab if vocab.count(v) > 1})
            raise ValueError(f"CharTokenizer: repeated vocabulary entries {repeated!r}")
        self._vocab = vocab
        self._ids = {char: i for i, char in enumerate(vocab)}

    @classmethod
    def from_texts(cls, texts: Iterable[str]) -> "CharTokenizer":
        """Build a tokenizer whose vocabulary is the sorted set of characters found in ``texts``.

        Raises:
            ValueError: If the texts hold no character at all.
        """
        chars: set[str] = set()
        for text in texts:
            chars.update(text)
        if not chars:
            raise ValueError("CharTokenizer.from_texts: the texts hold no characters")
        return cls(sorted(chars))

    @property
    def vocab(self) -> list[str]:
        """The characters, in id order (a copy)."""
        return list(self._vocab)

    @property
    def vocab_size(self) -> int:
        """Number of tokens, ``V``; a CTC model has ``V + 1`` outputs with the blank at index ``V``."""
        return len(self._vocab)

    def encode(self, text: str) -> list[int]:
        """Map a transcript to token ids.

        Raises:
            ValueError: If ``text`` holds characters outside the vocabulary (all of them are named).
        """
        try:
            return [self._ids[char] for char in text]
        except KeyError:
            unknown = sorted({char for char in text if char not in self._ids})
            raise ValueError(
                f"CharTokenizer.encode: characters {unknown!r} are not in the vocabulary of {self.vocab_size} "
                f"in text {text[:80]!r}"
            ) from None

    def decode(self, ids: Iterable[int]) -> str:
        """Map token ids (ints or 0-d tensors) back to text.

        Raises:
            ValueError: If an id is outside ``0 .. vocab_size - 1`` (e.g. a CTC blank left in).
        """
        chars = []
        for token in ids:
            index = int(token)
            if not 0 <= index < len(self._vocab):
                raise ValueError(f"CharTokenizer.decode: id {index} is outside 0..{len(self._vocab) - 1}")
            chars.append(self._vocab[index])
        return "".join(chars)

    def save(self, path: str | os.PathLike) -> None:
        """Write the vocabulary as a UTF-8 JSON list, one character per line (spaces and newlines survive)."""
        Path(path).write_text(json.dumps(self._vocab, ensure_ascii=False, indent=0) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | os.PathLike) -> "CharTokenizer":
        """Read a vocabulary written by :meth:`save`.

        Raises:
            FileNotFoundError: If the file does not exist.
            ValueError: If the file is not a JSON list of distinct single characters.
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"CharTokenizer.load: vocabulary file not found: {path}")
        try:
            vocab = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"CharTokenizer.load: {path} is not a UTF-8 JSON list of characters: {e}") from None
        if not isinstance(vocab, list):
            raise ValueError(f"CharTokenizer.load: {path} must hold a JSON list, got {type(vocab).__name__}")
        try:
            return cls(vocab)
        except ValueError as e:
            raise ValueError(f"CharTokenizer.load: {path}: {e}") from None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CharTokenizer) and self._vocab == other._vocab

    def __hash__(self) -> int:
        return hash(tuple(self._vocab))

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size}, vocab={''.join(self._vocab)!r})"
