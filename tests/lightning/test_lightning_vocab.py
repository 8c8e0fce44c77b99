import logging
from types import SimpleNamespace

import pytest

from speechtrain.lightning import get_vocab_size


@pytest.mark.parametrize(
    "vocab_size, tp_size, divisor, expected",
    [
        (1000, 1, 128, 1024),
        (1000, 2, 128, 1024),
        (1025, 2, 128, 1280),
        (128, 1, 128, 128),
        (1, 1, 128, 128),
        (129, 1, 128, 256),
        (256, 2, 128, 256),
        (257, 4, 128, 512),
        (1000, 1, 64, 1024),
        (100, 1, 7, 105),
        (100, 3, 7, 105),
        (106, 3, 7, 126),
        (5, 1, 1, 5),
    ],
)
def test_padded_size_is_smallest_aligned_multiple(vocab_size, tp_size, divisor, expected):
    config = SimpleNamespace(tensor_model_parallel_size=tp_size)
    padded = get_vocab_size(config, vocab_size, make_vocab_size_divisible_by=divisor)
    assert padded == expected
    # Every tensor-parallel shard gets the same number of rows, aligned to the divisor.
    assert padded % tp_size == 0 and (padded // tp_size) % divisor == 0
    assert padded - vocab_size < divisor * tp_size


def test_default_divisor_is_128():
    assert get_vocab_size(SimpleNamespace(tensor_model_parallel_size=1), 130) == 256


@pytest.mark.parametrize("config", [object(), None, SimpleNamespace(tensor_model_parallel_size=None)])
def test_config_without_tensor_parallel_size_counts_as_one(config):
    assert get_vocab_size(config, 1025) == 1152
    assert get_vocab_size(config, 1025) == get_vocab_size(SimpleNamespace(tensor_model_parallel_size=1), 1025)


def test_logs_original_padded_and_dummy_counts(caplog):
    with caplog.at_level(logging.INFO, logger="speechtrain.lightning.vocab"):
        get_vocab_size(SimpleNamespace(tensor_model_parallel_size=2), 1025)
    messages = [r.getMessage() for r in caplog.records if r.name == "speechtrain.lightning.vocab"]
    assert messages == ["Padded vocab_size: 1280, original vocab_size: 1025, dummy tokens: 255."]


def test_already_aligned_size_logs_zero_dummy_tokens(caplog):
    with caplog.at_level(logging.INFO, logger="speechtrain.lightning.vocab"):
        assert get_vocab_size(None, 512) == 512
    assert "Padded vocab_size: 512, original vocab_size: 512, dummy tokens: 0." in caplog.text


@pytest.mark.parametrize(
    "tp_size, vocab_size, divisor, match",
    [
        (1, 0, 128, "vocab_size must be positive, got 0"),
        (1, -5, 128, "vocab_size must be positive, got -5"),
        (1, 1000, 0, "make_vocab_size_divisible_by must be positive, got 0"),
        (1, 1000, -128, "make_vocab_size_divisible_by must be positive, got -128"),
        (-2, 1000, 128, "tensor_model_parallel_size must be positive, got -2"),
        (0, 1000, 128, "tensor_model_parallel_size must be positive, got 0"),
    ],
)
def test_bad_input_raises_value_error(tp_size, vocab_size, divisor, match):
    with pytest.raises(ValueError, match=match):
        get_vocab_size(SimpleNamespace(tensor_model_parallel_size=tp_size), vocab_size, divisor)
