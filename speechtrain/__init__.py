"""speechtrain: speech-first training (ASR, TTS, speech-LLMs) through one Lightning <-> Megatron Core bridge.

Importing the top-level package is cheap and torch-free; the heavy parts live in subpackages:

- ``speechtrain.lightning``: the bridge (Trainer, callbacks, strategy, precision, teardown, cache folders).
- ``speechtrain.core``: model base class and archive, Hydra entry, run manager.
- ``speechtrain.data``: manifests, datasets and the built-in synthetic corpus.
- ``speechtrain.asr``: speech recognition models and tokenizers.
"""

__version__ = "0.1.0"
