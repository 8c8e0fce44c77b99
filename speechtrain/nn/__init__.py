"""Tensor-parallel-aware building blocks shared by the ASR, TTS and speech-LLM models.

Every block works in a plain single process (ordinary PyTorch layers) and, once Megatron's parallel state is
initialised (``MegatronStrategy``), with its weights sharded over the tensor-parallel group. Both paths draw the
same initial weights from the same seed, so a TP=2 model is the TP=1 model cut in pieces.
"""

from speechtrain.nn.parallel import ColumnParallelLinear, RowParallelLinear
from speechtrain.nn.transformer import (
    CrossAttention,
    DecoderBlock,
    FeedForward,
    MultiHeadAttention,
    TransformerBlock,
)

__all__ = [
    "ColumnParallelLinear",
    "CrossAttention",
    "DecoderBlock",
    "FeedForward",
    "MultiHeadAttention",
    "RowParallelLinear",
    "TransformerBlock",
]
