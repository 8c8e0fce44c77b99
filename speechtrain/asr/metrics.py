"""WER / CER and their text normalisation moved to :mod:`speechtrain.common.metrics` (shared by ASR, TTS and SALM);
re-exported for old imports."""

from speechtrain.common.metrics import (
    TextNormalizer,
    WerConfig,
    char_error_rate,
    char_errors,
    edit_distance,
    word_error_rate,
    word_errors,
)

__all__ = [
    "TextNormalizer",
    "WerConfig",
    "char_error_rate",
    "char_errors",
    "edit_distance",
    "word_error_rate",
    "word_errors",
]
