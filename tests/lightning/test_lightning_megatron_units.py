"""Single-process pieces of the Megatron bridge: RNG streams, layout checks and configuration."""

import pytest
import torch

from speechtrain.lightning import MegatronStrategy, Trainer, parallel_state
from speechtrain.lightning.megatron_compat import CpuRNGStatesTracker


def test_cpu_rng_tracker_streams_are_independent_and_resumable():
    tracker = CpuRNGStatesTracker()
    tracker.add("model-parallel-rng", 42)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    with tracker.fork():
        first = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before), "the default stream must not move"
    saved = tracker.get_states()
    with tracker.fork():
        second = torch.rand(3)
    assert not torch.equal(first, second)
    tracker.set_states(saved)
    with tracker.fork():
        assert torch.equal(torch.rand(3), second)
    with pytest.raises(KeyError, match="never seeded"):
        with tracker.fork("other"):
            pass


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
