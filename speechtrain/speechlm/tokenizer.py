"""The LLM's text tokenizer: a Hugging Face fast tokenizer (``tokenizer.json``) behind a small API.

:class:`LLMTokenizer` reads the ``tokenizer.json`` (+ ``tokenizer_config.json`` for the bos / eos / pad tokens)
of a Hugging Face checkpoint folder, or wraps one trained here by :func:`train_bpe_tokenizer` (the demo's tiny
LLM). Only the ``tokenizers`` library is used, never ``transformers``.

Conventions:

- :meth:`LLMTokenizer.encode` never adds special tokens (no automatic ``<|begin_of_text|>``); chat templates
  (:mod:`speechtrain.speechlm.prompts`) emit every special token themselves. Special tokens *written in the
  text* are still recognised as single tokens, as in Hugging Face.
- :meth:`LLMTokenizer.decode` skips special tokens.
- :attr:`LLMTokenizer.pad_id` falls back to the eos id when the checkpoint declares no pad token.
"""

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

AUDIO_PLACEHOLDER = "<|audioplaceholder|>"

# The pre-tokenization split of Llama 3's tokenizer.json (its ByteLevel step runs with use_regex=False after it).
# Unlike GPT-2's pattern it keeps runs of newlines together ("\n\n" is one piece even before a word), so a
# header's "\n\n" tokenizes the same whether the content follows it or not.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)

# train_bpe_tokenizer: which of the given special tokens become bos / eos when not named explicitly.
_BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>")
_EOS_CANDIDATES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>")


def _token_content(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string, ``{"content": ...}`` or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"Unrecognised special token entry in tokenizer_config.json: {value!r}")


class LLMTokenizer:
    """A ``tokenizers.Tokenizer`` plus its bos / eos / pad tokens.

    Args:
        tokenizer: The fast tokenizer (e.g. ``Tokenizer.from_file(".../tokenizer.json")``).
        bos_token, eos_token, pad_token: Special token strings (each must be in the vocabulary) or ``None``.
        config: Further ``tokenizer_config.json`` fields to keep when saving (e.g. a checkpoint's chat template).
    """

    CONFIG_NAME = "tokenizer_config.json"
    TOKENIZER_NAME = "tokenizer.json"

    def __init__(
        self,
        tokenizer: Tokenizer,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        config: dict | None = None,
    ):
        self.tokenizer = tokenizer
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.config = dict(config or {})
        for token in (bos_token, eos_token, pad_token):
            if token is not None:
                self.token_to_id(token)  # fail early, naming the token
        self._vocab_size: int | None = None

    # ----------------------------------------------------------------- files
    @classmethod
    def from_folder(cls, folder: str | os.PathLike) -> "LLMTokenizer":
        """Load ``folder/tokenizer.json`` and, if present, the special tokens of ``folder/tokenizer_config.json``."""
        folder = Path(folder)
        path = folder / cls.TOKENIZER_NAME
        if not path.is_file():
            raise FileNotFoundError(f"No {cls.TOKENIZER_NAME} in {folder}")
        tokenizer = Tokenizer.from_file(str(path))
        config: dict = {}
        config_path = folder / cls.CONFIG_NAME
        if config_path.is_file():
            config = json.loads(config_path.read_text(encoding="utf-8"))
        tokens = {key: _token_content(config.pop(key, None)) for key in ("bos_token", "eos_token", "pad_token")}
        return cls(tokenizer, **tokens, config=config)

    def save(self, folder: str | os.PathLike) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` (loadable by :meth:`from_folder` and by HF)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save(str(folder / self.TOKENIZER_NAME))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **self.config}
        config.update(bos_token=self.bos_token, eos_token=self.eos_token, pad_token=self.pad_token)
        (folder / self.CONFIG_NAME).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")

    # ------------------------------------------------------------ text <-> ids
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without automatically added special tokens."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids and each token's ``(start, end)`` character span in ``text``."""
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` (a list or a 1-D tensor), special tokens skipped."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def token_to_id(self, token: str) -> int:
        """The id of ``token``; ``KeyError`` naming it when the vocabulary lacks it."""
        index = self.tokenizer.token_to_id(token)
        if index is None:
            raise KeyError(f"Token {token!r} is not in the tokenizer's vocabulary (add it with add_special_tokens)")
        return index

    def id_to_token(self, index: int) -> str | None:
        return self.tokenizer.id_to_token(int(index))

    # ------------------------------------------------------------- properties
    @property
    def vocab_size(self) -> int:
        """Embedding rows the model needs: one past the largest id, added tokens included."""
        if self._vocab_size is None:
            vocab = self.tokenizer.get_vocab(with_added_tokens=True)
            largest = max(vocab.values(), default=-1)
            self._vocab_size = max(self.tokenizer.get_vocab_size(with_added_tokens=True), largest + 1)
        return self._vocab_size

    @property
    def bos_id(self) -> int | None:
        return None if self.bos_token is None else self.token_to_id(self.bos_token)

    @property
    def eos_id(self) -> int | None:
        return None if self.eos_token is None else self.token_to_id(self.eos_token)

    @property
    def pad_id(self) -> int | None:
        """The pad token's id, else the eos id."""
        return self.eos_id if self.pad_token is None else self.token_to_id(self.pad_token)

    @property
    def audio_id(self) -> int:
        """The id of the audio placeholder ``<|audioplaceholder|>``."""
        return self.token_to_id(AUDIO_PLACEHOLDER)

    def add_special_tokens(self, tokens: Sequence[str]) -> int:
        """Register ``tokens`` that are missing as special (never split) tokens; returns how many were added.

        New ids come after the existing ones, so a model grows its embedding to :attr:`vocab_size`.
        """
        missing = []
        for token in tokens:
            if self.tokenizer.token_to_id(token) is None and token not in missing:
                missing.append(token)
        if missing:
            self.tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])
            self._vocab_size = None
        return len(missing)

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return (
            f"LLMTokenizer(vocab_size={self.vocab_size}, bos={self.bos_token!r}, eos={self.eos_token!r}, "
            f"pad={self.pad_token!r})"
        )


def train_bpe_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    special_tokens: Sequence[str],
    *,
    bos_token: str | None = None,
    eos_token: str | None = None,
    pad_token: str | None = None,
    min_frequency: int = 2,
) -> LLMTokenizer:
    """Train a byte-level BPE tokenizer (Llama 3 style) on ``texts``.

    The pre-tokenizer is Llama 3's regex split followed by ``ByteLevel(add_prefix_space=False)``; the decoder is
    ``ByteLevel``, so decoding reproduces any text exactly (leading spaces and newlines included). The special
    tokens get the first ids, in the given order, and are never split. All 256 byte symbols are in the
    vocabulary, so nothing is out of vocabulary.

    Args:
        texts: The training text.
        vocab_size: Target size, special tokens and the 256 byte symbols included (smaller corpora may stop short).
        special_tokens: Tokens registered first (e.g. a chat template's :attr:`ChatTemplate.special_tokens`).
        bos_token, eos_token, pad_token: Which special tokens play these roles. When ``None``, bos / eos are the
            first of ``<|begin_of_text|>, <s>, <bos>`` / ``<|end_of_text|>, <|endoftext|>, </s>, <eos>`` found
            in ``special_tokens`` (else none); pad stays ``None`` (falls back to eos).
        min_frequency: Pairs seen fewer times are not merged.
    """
    special_tokens = list(dict.fromkeys(special_tokens))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in special_tokens],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    if bos_token is None:
        bos_token = next((t for t in _BOS_CANDIDATES if t in special_tokens), None)
    if eos_token is None:
        eos_token = next((t for t in _EOS_CANDIDATES if t in special_tokens), None)
    return LLMTokenizer(tokenizer, bos_token=bos_token, eos_token=eos_token, pad_token=pad_token)
