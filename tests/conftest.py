"""Shared fixtures: tiny model configs and a small generated corpus."""

import pytest

from speechtrain.data.synthetic import make_dtmf_corpus


@pytest.fixture(autouse=True)
def _fresh_callback_group():
    """Lifecycle callbacks registered by one test must not reach the next."""
    from speechtrain.lightning import CallbackGroup

    CallbackGroup.reset()
    yield
    CallbackGroup.reset()


@pytest.fixture(scope="session")
def dtmf_manifest(tmp_path_factory):
    """A 48-utterance DTMF corpus (NeMo manifest path)."""
    return make_dtmf_corpus(tmp_path_factory.mktemp("dtmf"), 48, seed=7)


def tiny_ctc_config(manifest=None, **encoder):
    """A ConvCTCModel config small enough for a unit test."""
    return {
        "tokenizer": {"vocab": [" ", *"0123456789"]},
        "preprocessor": {"n_mels": 16, "dither": 0.0},
        "encoder": {"d_model": 16, "num_layers": 1, "kernel_size": 3, "dropout": 0.0, **encoder},
        "train_ds": {"manifest_filepath": str(manifest) if manifest else None, "batch_size": 8, "shuffle": True},
        "validation_ds": {"manifest_filepath": str(manifest) if manifest else None, "batch_size": 16},
        "optim": {"lr": 3e-3, "sched": {"name": "constant", "warmup_steps": 2}},
    }
