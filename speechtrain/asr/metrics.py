"""WER / CER moved to :mod:`speechtrain.common.metrics` (shared by ASR, TTS and SALM); re-exported for old imports."""

from speechtrain.common.metrics import char_error_rate, char_errors, edit_distance, word_error_rate, word_errors

__all__ = ["char_error_rate", "char_errors", "edit_distance", "word_error_rate", "word_errors"]
