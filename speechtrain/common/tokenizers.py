"""Tokenizers for ASR transcripts.

Token ids are ``0 .. vocab_size - 1``. The CTC blank is not a token: CTC models put it at index
``vocab_size`` (last), so a tokenizer can be swapped without renumbering.

- :class:`CharTokenizer`: one token per character, saved as a JSON list.
- :class:`SentencePieceTokenizer`: BPE or unigram subwords from a SentencePiece ``.model`` file, trained with
  :func:`train_sentencepiece` (or ``python -m speechtrain.asr.tokenizer``).
- :func:`load_tokenizer`: either kind, from its file.

Both refuse, with ``ValueError``, text they cannot encode, so datasets skip such utterances.
"""

import io
import json
import os
import random
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

import sentencepiece as spm


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


class SentencePieceTokenizer:
    """Subword tokens from a SentencePiece model (BPE or unigram), e.g. one written by :func:`train_sentencepiece`.

    Ids are the model's piece ids ``0 .. vocab_size - 1``, including its ``<unk>`` piece (id 0 in models trained
    here) and any control pieces (none in models trained here: no ``<s>``, ``</s>`` or ``<pad>``). A CTC model
    puts its blank at ``vocab_size``.

    Text the model cannot represent (a character that would become ``<unk>``) is refused by :meth:`encode` with a
    ``ValueError``, so datasets skip the utterance instead of training on ``<unk>``.

    Args:
        model_path: A SentencePiece ``.model`` file. Its bytes are kept, so :meth:`save` works after the file is
            gone.

    Raises:
        FileNotFoundError: If the file does not exist.
        ValueError: If the file is not a SentencePiece model.
    """

    def __init__(self, model_path: str | os.PathLike) -> None:
        path = Path(model_path)
        if not path.is_file():
            raise FileNotFoundError(f"SentencePieceTokenizer: model file not found: {path}")
        self._proto = path.read_bytes()
        try:
            self._sp = spm.SentencePieceProcessor(model_proto=self._proto)
        except RuntimeError:
            self._sp = None
        if self._sp is None or self._sp.get_piece_size() == 0:
            raise ValueError(f"SentencePieceTokenizer: {path} is not a SentencePiece model")
        self._unk = self._sp.unk_id()

    @classmethod
    def load(cls, path: str | os.PathLike) -> "SentencePieceTokenizer":
        """Read a model written by :meth:`save` or :func:`train_sentencepiece` (same as the constructor)."""
        return cls(path)

    @property
    def vocab(self) -> list[str]:
        """The pieces, in id order; ``▁`` (U+2581) marks a word start."""
        return [self._sp.id_to_piece(i) for i in range(self.vocab_size)]

    @property
    def vocab_size(self) -> int:
        """Number of tokens, ``V``; a CTC model has ``V + 1`` outputs with the blank at index ``V``."""
        return self._sp.get_piece_size()

    def encode(self, text: str) -> list[int]:
        """Map a transcript to token ids.

        Raises:
            ValueError: If ``text`` holds characters that the model maps to ``<unk>`` (all of them are named).
        """
        ids = self._sp.encode(text, out_type=int)
        if self._unk in ids:
            unknown = sorted(c for c in set(text) if self._unk in self._sp.encode(c, out_type=int))
            raise ValueError(
                f"SentencePieceTokenizer.encode: characters {unknown!r} are not in the model's vocabulary of "
                f"{self.vocab_size} in text {text[:80]!r}"
            )
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Map token ids (ints or 0-d tensors) back to text.

        Raises:
            ValueError: If an id is outside ``0 .. vocab_size - 1`` (e.g. a CTC blank left in).
        """
        size = self.vocab_size
        indices = [int(token) for token in ids]
        bad = [index for index in indices if not 0 <= index < size]
        if bad:
            raise ValueError(f"SentencePieceTokenizer.decode: id {bad[0]} is outside 0..{size - 1}")
        return self._sp.decode(indices)

    def save(self, path: str | os.PathLike) -> None:
        """Write the model file (byte for byte the one this tokenizer was loaded from)."""
        Path(path).write_bytes(self._proto)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SentencePieceTokenizer) and self._proto == other._proto

    def __hash__(self) -> int:
        return hash(self._proto)

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer(vocab_size={self.vocab_size})"


Tokenizer = CharTokenizer | SentencePieceTokenizer

_TOO_MANY = re.compile(r"Vocabulary size (?:is )?too high \((\d+)\)\. Please set it to a value <= (\d+)")
_TOO_FEW = re.compile(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)")


def train_sentencepiece(
    texts: Iterable[str],
    out_dir: str | os.PathLike,
    vocab_size: int = 128,
    model_type: str = "bpe",
    character_coverage: float = 1.0,
    max_sentences: int | None = None,
    seed: int = 0,
    num_threads: int = 1,
) -> Path:
    """Train a SentencePiece model in-process and write ``tokenizer.model`` and ``tokenizer.vocab`` to ``out_dir``.

    The model is made for CTC/transducer targets: one ``<unk>`` piece (id 0), no ``<s>``, ``</s>`` or ``<pad>``,
    no byte fallback, and no text normalization (``identity``: transcripts are expected to be normalized
    already, and :class:`SentencePieceTokenizer` then decodes exactly what was encoded, except that runs of
    spaces collapse and edge spaces drop). The result depends only on the texts and the arguments, in any
    process: all texts are used unless ``max_sentences`` asks for a sample (drawn with ``seed``), and
    ``num_threads`` is part of the recipe (the trainer's result changes with it).

    A vocabulary size the texts cannot fill is an error rather than a smaller model, so the output layer of a
    model is always the size that was asked for.

    Args:
        texts: Transcripts, one utterance each.
        out_dir: Folder for the two files (created if needed; existing files are overwritten).
        vocab_size: Number of pieces, ``<unk>`` included.
        model_type: ``"bpe"`` or ``"unigram"``.
        character_coverage: Share of the characters (by count) that must be pieces; rarer characters become
            ``<unk>``, so the utterances holding them are refused by :meth:`SentencePieceTokenizer.encode`.
        max_sentences: Train on a random sample of this many texts (``None``: all of them).
        seed: Seed of that sample.
        num_threads: Trainer threads.

    Returns:
        The path of ``tokenizer.model``. ``tokenizer.vocab`` holds ``piece<TAB>score`` lines in id order.

    Raises:
        ValueError: On an invalid argument, texts holding no characters, or a ``vocab_size`` the texts cannot
            support (the message says which sizes work).
    """
    if model_type not in ("bpe", "unigram"):
        raise ValueError(f"train_sentencepiece: model_type must be 'bpe' or 'unigram', got {model_type!r}")
    if vocab_size < 2:
        raise ValueError(f"train_sentencepiece: vocab_size must be at least 2, got {vocab_size}")
    if not 0.0 < character_coverage <= 1.0:
        raise ValueError(f"train_sentencepiece: character_coverage must be in (0, 1], got {character_coverage}")
    if max_sentences is not None and max_sentences < 1:
        raise ValueError(f"train_sentencepiece: max_sentences must be positive, got {max_sentences}")
    if max_sentences is not None:
        # SentencePiece's own sampling (input_sentence_size) differs from process to process whatever its seed.
        texts = _reservoir_sample(texts, max_sentences, seed)
    buffer = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(texts),
            model_writer=buffer,
            vocab_size=vocab_size,
            model_type=model_type,
            character_coverage=character_coverage,
            unk_id=0,
            bos_id=-1,
            eos_id=-1,
            pad_id=-1,
            byte_fallback=False,
            normalization_rule_name="identity",
            num_threads=num_threads,
            minloglevel=2,
        )
    except RuntimeError as e:
        raise ValueError(f"train_sentencepiece: {_explain_training_error(str(e), vocab_size, model_type)}") from None
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model_path = out_dir / "tokenizer.model"
    model_path.write_bytes(buffer.getvalue())
    sp = spm.SentencePieceProcessor(model_proto=buffer.getvalue())
    lines = [f"{sp.id_to_piece(i)}\t{sp.get_score(i):g}\n" for i in range(sp.get_piece_size())]
    (out_dir / "tokenizer.vocab").write_text("".join(lines), encoding="utf-8")
    return model_path


def _reservoir_sample(texts: Iterable[str], k: int, seed: int) -> list[str]:
    """``k`` texts drawn uniformly without replacement in one pass (memory for ``k`` only), in input order."""
    rng = random.Random(seed)
    kept: list[tuple[int, str]] = []
    for i, text in enumerate(texts):
        if i < k:
            kept.append((i, text))
        elif (j := rng.randrange(i + 1)) < k:
            kept[j] = (i, text)
    return [text for _, text in sorted(kept)]


def _explain_training_error(message: str, vocab_size: int, model_type: str) -> str:
    """SentencePiece's trainer errors are internal assertions; say what to change instead."""
    if match := _TOO_MANY.search(message):
        return (
            f"the texts support at most {match.group(2)} {model_type} pieces, but vocab_size is {vocab_size}; "
            f"choose a smaller vocab_size or train on more text"
        )
    if match := _TOO_FEW.search(message):
        return (
            f"the texts hold {int(match.group(2)) - 1} characters to cover, each needing a piece besides <unk>, "
            f"but vocab_size is {vocab_size}; choose vocab_size >= {match.group(2)} or a lower character_coverage"
        )
    if "!sentences_.empty()" in message:
        return "the texts hold no characters"
    return f"SentencePiece training failed: {message}"


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load a tokenizer file, whichever kind it is.

    A JSON list (what :meth:`CharTokenizer.save` writes) gives a :class:`CharTokenizer`; anything else is read as
    a SentencePiece model (binary protobuf, never starting with ``[``).

    Raises:
        FileNotFoundError: If the file does not exist.
        ValueError: If the file is neither kind.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"load_tokenizer: tokenizer file not found: {path}")
    with open(path, "rb") as f:
        head = f.read(64).lstrip()
    if head.startswith(b"["):
        return CharTokenizer.load(path)
    try:
        return SentencePieceTokenizer(path)
    except ValueError:
        raise ValueError(
            f"load_tokenizer: {path} is neither a character vocabulary (JSON list) nor a SentencePiece model"
        ) from None
