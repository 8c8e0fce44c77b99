"""Helpers every room may use: typed configs, the empty-batch convention, text metrics (WER/CER) and tokenizers.

Nothing here imports another speechtrain package, so the model families (asr, tts, speechlm), ``data`` and ``core``
can all depend on it without depending on each other.
"""
