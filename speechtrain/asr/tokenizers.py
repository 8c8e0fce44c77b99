"""Tokenizers moved to :mod:`speechtrain.common.tokenizers` (shared by ASR, TTS and SALM); re-exported for old
imports."""

from speechtrain.common.tokenizers import (
    CharTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    load_tokenizer,
    train_sentencepiece,
)

__all__ = ["CharTokenizer", "SentencePieceTokenizer", "Tokenizer", "load_tokenizer", "train_sentencepiece"]
