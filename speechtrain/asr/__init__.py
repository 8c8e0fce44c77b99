"""Automatic speech recognition: preprocessing, encoders, CTC and transducers, decoding, NeMo checkpoints.

Importing the package registers the reader of NeMo's ``.nemo`` files with :mod:`speechtrain.core.archive`.
"""

from speechtrain.asr import nemo_import  # noqa: F401
