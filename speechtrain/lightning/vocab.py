"""Vocabulary padding for tensor-parallel embedding and output layers."""

import logging
from typing import Any

from speechtrain.lightning import parallel_state

logger = logging.getLogger(__name__)


def get_vocab_size(config: Any, vocab_size: int, make_vocab_size_divisible_by: int = 128) -> int:
    """Pad ``vocab_size`` so that every tensor-parallel shard of the vocabulary has the same, aligned size.

    Args:
        config: anything with a ``tensor_model_parallel_size`` attribute (a ``MegatronStrategy``, a Megatron
            ``TransformerConfig``, a model config). Missing or ``None``: the live tensor-parallel size when
            Megatron's parallel state is initialised, else 1.
        vocab_size: the tokenizer's vocabulary size.
        make_vocab_size_divisible_by: alignment of each shard.

    Returns:
        The smallest multiple of ``make_vocab_size_divisible_by * tensor_model_parallel_size`` that is
        ``>= vocab_size``. The extra ("dummy") rows are never produced by the tokenizer.
    """
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    if make_vocab_size_divisible_by < 1:
        raise ValueError(f"make_vocab_size_divisible_by must be positive, got {make_vocab_size_divisible_by}")
    tp_size = getattr(config, "tensor_model_parallel_size", None)
    if tp_size is None:
        tp_size = parallel_state.tensor_parallel_world_size()
    if tp_size < 1:
        raise ValueError(f"tensor_model_parallel_size must be positive, got {tp_size}")
    multiple = make_vocab_size_divisible_by * tp_size
    padded = -(-vocab_size // multiple) * multiple
    logger.info(
        "Padded vocab_size: %d, original vocab_size: %d, dummy tokens: %d.", padded, vocab_size, padded - vocab_size
    )
    return padded
