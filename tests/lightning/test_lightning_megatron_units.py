"""Single-process pieces of the Megatron bridge: RNG streams, layout checks and configuration."""

import socket

import pytest
import torch

from speechtrain.lightning import MegatronStrategy, Trainer, parallel_state
from speechtrain.lightning.megatron_compat import (
    import_megatron,
    model_parallel_manual_seed,
    model_parallel_rng,
    rng_tracker_states,
    set_rng_tracker_states,
)


@pytest.fixture
def megatron_single_process():
    """Megatron's parallel state over a one-process gloo group (torn down afterwards)."""
    from speechtrain.lightning import teardown

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    import_megatron().parallel_state.initialize_model_parallel(1, 1)
    yield
    teardown(None)


def test_megatron_rng_tracker_on_cpu_streams_are_independent_and_resumable(megatron_single_process):
    """Megatron's own tracker runs a CPU run's model-parallel stream on the CPU generator, seeded by its rules."""
    model_parallel_manual_seed(42)
    with model_parallel_rng():
        first = torch.rand(3)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    assert torch.equal(first, torch.rand(3, generator=torch.Generator().manual_seed(42 + 2718)))  # Megatron's rule
    with model_parallel_rng():
        second = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before), "the default stream must not move"
    saved = rng_tracker_states()
    with model_parallel_rng():
        third = torch.rand(3)
    assert not torch.equal(second, third)
    set_rng_tracker_states(saved)
    with model_parallel_rng():
        assert torch.equal(torch.rand(3), third)
    with model_parallel_rng():  # (the restored dict was copied: Megatron's updates do not reach ``saved``)
        assert not torch.equal(torch.rand(3), third)
    set_rng_tracker_states(saved)
    with model_parallel_rng():
        assert torch.equal(torch.rand(3), third)


def test_parallel_state_without_megatron():
    assert parallel_state.tensor_parallel_world_size() == 1
    assert parallel_state.data_parallel_rank() == 0
    assert parallel_state.is_pipeline_first_stage() and parallel_state.is_pipeline_last_stage()


def test_layout_that_does_not_divide_says_what_to_change():
    strategy = MegatronStrategy(tensor_model_parallel_size=4, pipeline_model_parallel_size=1)
    strategy.num_nodes = 1
    strategy.parallel_devices = [torch.device("cpu")] * 2
    with pytest.raises(ValueError, match=r"2 x 1 = 2 processes.*\(4\).*Use a multiple of 4 processes"):
        strategy._check_layout()


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"virtual_pipeline_model_parallel_size": 2}, "virtual_pipeline_model_parallel_size"),
        ({"context_parallel_size": 2}, "context_parallel_size"),
        ({"sequence_parallel": True}, "sequence_parallel"),
    ],
)
def test_unsupported_options_say_so(kwargs, name):
    with pytest.raises(NotImplementedError, match=f"{name} is not supported yet"):
        MegatronStrategy(**kwargs)


def test_trainer_builds_the_bridge_from_a_config_mapping():
    trainer = Trainer(
        accelerator="cpu", devices=1, strategy={"tensor_model_parallel_size": 1, "micro_batch_size": 4}, logger=False
    )
    assert isinstance(trainer.strategy, MegatronStrategy) and trainer.strategy.micro_batch_size == 4
    assert trainer.to_config()["strategy"] == {"tensor_model_parallel_size": 1, "micro_batch_size": 4}
    with pytest.raises(ValueError, match="Did you mean 'tensor_model_parallel_size'"):
        Trainer(accelerator="cpu", devices=1, strategy={"tensor_model_paralel_size": 2}, logger=False)


def test_get_vocab_size_reads_the_strategy_and_the_live_parallel_state(monkeypatch):
    from speechtrain.lightning import get_vocab_size

    assert get_vocab_size(MegatronStrategy(tensor_model_parallel_size=2), 1025) == 1280
    monkeypatch.setattr(parallel_state, "tensor_parallel_world_size", lambda: 4)
    assert get_vocab_size(None, 1025) == 1536  # 3 x (128 x 4)
