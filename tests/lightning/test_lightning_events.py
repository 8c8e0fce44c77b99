import logging
from dataclasses import dataclass, field

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from speechtrain.core.exp_manager import exp_manager
from speechtrain.core.model import SpeechModel
from speechtrain.core.optim import OptimConfig
from speechtrain.lightning import LIFECYCLE_EVENTS, BaseCallback, CallbackGroup, Trainer


class EventLog(BaseCallback):
    """Records every lifecycle event (without the ``on_`` prefix) and ``update_config``, with the save step."""

    def __init__(self):
        self.events = []

    def update_config(self, trainer=None, **kwargs):
        self.events.append(("update_config", None))


for _event in LIFECYCLE_EVENTS:

    def _record(self, global_step=None, _event=_event):
        self.events.append((_event.removeprefix("on_"), global_step))

    setattr(EventLog, _event, _record)


@dataclass
class TinyConfig:
    in_features: int = 4
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=0.01))


class TinySpeechModel(SpeechModel):
    Config = TinyConfig

    def __init__(self, cfg):
        super().__init__(cfg)
        self.layer = torch.nn.Linear(self.cfg.in_features, 1)
        self.dataset = None

    def setup_data(self, stage):
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(32, self.cfg.in_features, generator=generator)
        self.dataset = TensorDataset(x, x.sum(dim=1, keepdim=True))

    def train_dataloader(self):
        return DataLoader(self.dataset, batch_size=4)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss)
        return loss


def _trainer_with_run_folder(tmp_path, max_steps):
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
    )
    run_dir = exp_manager(
        trainer,
        {
            "exp_dir": str(tmp_path),
            "version": "v1",
            "create_tensorboard_logger": False,
            "create_csv_logger": False,
            "save_archive_on_train_end": False,
            "checkpoint_callback_params": {"monitor": "train_loss", "every_n_train_steps": 2},
        },
        name="t",
    )
    return trainer, run_dir


@pytest.fixture
def event_log():
    log = EventLog()
    CallbackGroup.get_instance().register(log)
    yield log
    # exp_manager sends the run's log records to its train.log; detach so later tests do not write there.
    for name in ("speechtrain", "lightning.pytorch"):
        target = logging.getLogger(name)
        for handler in [h for h in target.handlers if getattr(h, "speechtrain_run_log", False)]:
            target.removeHandler(handler)
            handler.close()


_CONSTRUCTION = [
    "model_init_start",
    "model_init_end",
    "update_config",
    "dataloader_init_start",
    "dataloader_init_end",
    "optimizer_init_start",
    "optimizer_init_end",
]

_SAVE = ["save_checkpoint_start", "save_checkpoint_success", "save_checkpoint_end"]


def _save_steps(events):
    """The step of each save, checking that every save is a complete start/success/end triple."""
    names = [name for name, _ in events]
    assert len(names) % 3 == 0, names
    steps = []
    for i in range(0, len(events), 3):
        triple = events[i : i + 3]
        assert [name for name, _ in triple] == _SAVE
        assert len({step for _, step in triple}) == 1
        if not steps or steps[-1] != triple[0][1]:
            steps.append(triple[0][1])
    return steps


def test_lifecycle_events_arrive_in_order_during_fit(tmp_path, event_log):
    trainer, run_dir = _trainer_with_run_folder(tmp_path, max_steps=4)
    trainer.fit(TinySpeechModel({}))
    assert trainer.global_step == 4

    # app_start < model init < update_config < dataloader init < optimizer init, each once; then only saves (each
    # start < success < end), every 2 steps.
    prefix = ["app_start", *_CONSTRUCTION]
    assert [name for name, _ in event_log.events[: len(prefix)]] == prefix
    assert _save_steps(event_log.events[len(prefix) :]) == [2, 4]
    assert Trainer.from_checkpoint(run_dir / "checkpoints" / "t--last.ckpt").max_steps == 4


def test_resuming_announces_the_checkpoint_load(tmp_path, event_log):
    trainer, run_dir = _trainer_with_run_folder(tmp_path, max_steps=4)
    trainer.fit(TinySpeechModel({}))
    event_log.events.clear()

    resumed, _ = _trainer_with_run_folder(tmp_path, max_steps=6)
    resumed.fit(TinySpeechModel({}), ckpt_path=run_dir / "checkpoints" / "t--last.ckpt")
    assert resumed.global_step == 6

    names = [name for name, _ in event_log.events]
    assert names.count("load_checkpoint_start") == 1 and names.count("load_checkpoint_end") == 1
    assert names.index("load_checkpoint_start") < names.index("load_checkpoint_end")
    assert "app_start" not in names  # once per process
    construction = [name for name in names if name in _CONSTRUCTION]
    assert construction == _CONSTRUCTION
    # The weights are loaded before the first save, and the run continues at step 4: it saves at step 6 only.
    saves = [i for i, name in enumerate(names) if name.startswith("save_checkpoint")]
    assert names.index("load_checkpoint_end") < saves[0]
    assert _save_steps([event_log.events[i] for i in saves]) == [6]
