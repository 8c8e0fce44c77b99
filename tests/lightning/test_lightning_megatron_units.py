"""Single-process pieces of the Megatron bridge: precision, loss scaling, gradient norms, RNG streams, layout
checks and configuration."""

import pytest
import torch

from speechtrain.lightning import DynamicLossScaler, MegatronMixedPrecision, MegatronStrategy, Trainer, parallel_state
from speechtrain.lightning.grad_norm import clip_grad_norm_, grad_norm
from speechtrain.lightning.megatron_compat import CpuRNGStatesTracker


def test_loss_scaler_halves_after_hysteresis_and_grows_after_clean_window():
    scaler = DynamicLossScaler(initial_scale=2.0**10, min_scale=4.0, growth_interval=3, hysteresis=2)
    scaler.update(found_inf=True)
    assert scaler.scale == 2.0**10  # first overflow is tolerated
    scaler.update(found_inf=True)
    assert scaler.scale == 2.0**9
    for _ in range(3):
        scaler.update(found_inf=False)
    assert scaler.scale == 2.0**10
    for _ in range(20):
        scaler.update(found_inf=True)
    assert scaler.scale == 4.0  # never below min_scale
    state = scaler.state_dict()
    restored = DynamicLossScaler()
    restored.load_state_dict(state)
    assert restored.state_dict() == state


def test_fp16_overflow_skips_the_step_and_lowers_the_scale():
    plugin = MegatronMixedPrecision("16-mixed", loss_scale=DynamicLossScaler(initial_scale=8.0, hysteresis=1))
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=1.0)

    class Module:
        def log(self, *args, **kwargs):
            pass

        def clip_gradients(self, *args, **kwargs):
            pass

    def closure(grad):
        def run():
            weight.grad = plugin.grad_scale_func()(grad.clone())
            return torch.zeros(())

        return run

    module = Module()
    plugin._after_closure = lambda model, optimizer: None
    plugin.optimizer_step(optimizer, module, closure(torch.tensor([1.0, float("inf"), 0.0])))
    assert torch.equal(weight.detach(), torch.ones(3)) and plugin.scaler.scale == 4.0
    plugin.optimizer_step(optimizer, module, closure(torch.tensor([1.0, 2.0, 0.0])))
    torch.testing.assert_close(weight.detach(), torch.tensor([0.0, -1.0, 1.0]))  # gradients were unscaled


def test_precision_names_and_fp8_without_transformer_engine():
    assert MegatronMixedPrecision(32).precision == "32-true"
    assert MegatronMixedPrecision("bf16-mixed").autocast_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="Unsupported precision"):
        MegatronMixedPrecision("8-mixed")
    with pytest.raises(ImportError, match=r"transformer-engine.*speechtrain\[gpu\]"):
        MegatronMixedPrecision("bf16-mixed", fp8="hybrid")


def test_bf16_true_converts_weights():
    module = MegatronMixedPrecision("bf16-true").convert_module(torch.nn.Linear(2, 2))
    assert module.weight.dtype == torch.bfloat16


def test_grad_norm_and_clipping_match_torch_in_one_process():
    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    b.load_state_dict(a.state_dict())
    for module in (a, b):
        module(torch.randn(5, 4)).pow(2).sum().backward() if module is a else None
    for pa, pb in zip(a.parameters(), b.parameters()):
        pb.grad = pa.grad.clone()
    expected = torch.nn.utils.clip_grad_norm_(list(a.parameters()), 0.1)
    actual = clip_grad_norm_(list(b.parameters()), 0.1)
    torch.testing.assert_close(actual, expected)
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pb.grad, pa.grad)
    assert grad_norm(list(b.parameters())).item() == pytest.approx(0.1, rel=1e-4)


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


def test_grad_norm_counts_shared_and_duplicated_parameters_once(monkeypatch):
    sharded, duplicated, shared = (torch.nn.Parameter(torch.zeros(1)) for _ in range(3))
    sharded.tensor_model_parallel = True
    shared.shared = True
    for p, value in ((sharded, 3.0), (duplicated, 4.0), (shared, 12.0)):
        p.grad = torch.full((1,), value)
    params = [sharded, duplicated, shared]
    assert grad_norm(params).item() == pytest.approx(13.0)  # sqrt(9 + 16 + 144): TP rank 0, first stage
    with monkeypatch.context() as patch:
        patch.setattr(parallel_state, "tensor_parallel_rank", lambda: 1)
        assert grad_norm(params).item() == pytest.approx(3.0)  # full copies count on TP rank 0 only
    monkeypatch.setattr(parallel_state, "pipeline_parallel_rank", lambda: 1)
    monkeypatch.setattr(parallel_state, "pipeline_parallel_world_size", lambda: 2)
    assert grad_norm(params).item() == pytest.approx(5.0)  # a shared (tied) weight counts on its first stage only


def test_an_all_bad_batch_takes_part_in_the_collectives_with_nothing(tmp_path):
    """A rank whose whole batch was unreadable (collate gave None) still reduces gradients and the loss."""
    import subprocess
    import sys

    script = """
import torch
torch.distributed.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
from speechtrain.lightning.megatron_compat import import_megatron
import_megatron()
from megatron.core import parallel_state as mpu
mpu.initialize_model_parallel(1, 1)
from speechtrain.lightning import MegatronParallel
from speechtrain.testing.toy_models import ToyTransformerRegressor
model = ToyTransformerRegressor({{}})
model.configure_model()
loss = MegatronParallel(model).run(None, forward_only=False)
assert loss.item() == 0.0
assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
print("ok")
"""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = subprocess.run(
        [sys.executable, "-c", script.format(port=port)], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
