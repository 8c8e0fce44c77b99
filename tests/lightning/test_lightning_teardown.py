import socket

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from speechtrain.lightning import Trainer, teardown


class TinyRegression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(16, 4, generator=generator)
        return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=4)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(autouse=True)
def no_process_group_left_behind():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def gloo_group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    assert dist.is_initialized() and dist.get_world_size() == 1


def _fitted(tmp_path, model):
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        default_root_dir=tmp_path,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
    )
    trainer.fit(model)
    assert trainer.global_step == 3
    return trainer


def test_teardown_destroys_the_process_group_and_is_safe_twice(tmp_path, gloo_group):
    trainer = _fitted(tmp_path, TinyRegression())
    assert dist.is_initialized()  # fitting on one device leaves the group alone
    teardown(trainer)
    assert not dist.is_initialized()
    assert trainer._speechtrain_torn_down is True
    teardown(trainer)
    assert not dist.is_initialized()
    # The process can start the next run: a fresh group on a fresh port works.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    total = torch.tensor([2.0])
    dist.all_reduce(total)
    assert total.item() == 2.0


def test_teardown_with_model_drops_gradients_and_moves_weights_to_cpu(tmp_path, gloo_group):
    model = TinyRegression()
    trainer = _fitted(tmp_path, model)
    model.layer.weight.grad = torch.ones_like(model.layer.weight)
    model.layer.bias.grad = torch.ones_like(model.layer.bias)
    teardown(trainer, model=model)
    assert not dist.is_initialized()
    assert all(p.grad is None for p in model.parameters())
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    teardown(trainer, model=model)
    assert all(p.grad is None for p in model.parameters())


def test_teardown_without_a_process_group(tmp_path):
    assert not dist.is_initialized()
    trainer = _fitted(tmp_path, TinyRegression())
    teardown(trainer)
    teardown(trainer)
    teardown(None)
    assert not dist.is_initialized()
    assert trainer._speechtrain_torn_down is True


def test_teardown_destroys_megatron_parallel_state(gloo_group):
    parallel_state = pytest.importorskip("megatron.core.parallel_state")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    assert parallel_state.model_parallel_is_initialized()
    teardown(None)
    assert not parallel_state.model_parallel_is_initialized()
    assert not dist.is_initialized()
