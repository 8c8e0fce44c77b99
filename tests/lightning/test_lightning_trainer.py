import datetime
import logging
import time

import lightning.pytorch as pl
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint, Timer
from lightning.pytorch.plugins import TorchCheckpointIO
from torch.utils.data import DataLoader, TensorDataset

from speechtrain.lightning import Trainer
from speechtrain.lightning.trainer import TRAINER_CONFIG_KEY


class TinyRegression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(32, 4, generator=generator)
        return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=4)


class RecordsItsArgs(TorchCheckpointIO):
    """A plugin that records its ``init_args`` (as speechtrain's plugins do) but lives outside the trusted packages."""

    def __init__(self, size):
        super().__init__()
        self.init_args = {"size": size}


_QUIET = {"enable_progress_bar": False, "enable_model_summary": False, "logger": False}


def _settings(trainer):
    return {
        "max_epochs": trainer.max_epochs,
        "max_steps": trainer.max_steps,
        "precision": trainer.precision,
        "accumulate_grad_batches": trainer.accumulate_grad_batches,
        "gradient_clip_val": trainer.gradient_clip_val,
        "log_every_n_steps": trainer.log_every_n_steps,
        "limit_train_batches": trainer.limit_train_batches,
        "default_root_dir": trainer.default_root_dir,
        "timer_seconds": next((cb._duration for cb in trainer.callbacks if isinstance(cb, Timer)), None),
    }


def _configured_trainer(tmp_path, **extra):
    return Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=3,
        max_steps=11,
        precision="bf16-mixed",
        accumulate_grad_batches=2,
        gradient_clip_val=0.5,
        log_every_n_steps=7,
        limit_train_batches=0.5,
        max_time=datetime.timedelta(minutes=5),
        default_root_dir=tmp_path,
        **_QUIET,
        **extra,
    )


def test_init_args_record_the_keyword_arguments_as_passed(tmp_path):
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=4, default_root_dir=tmp_path, **_QUIET)
    assert trainer.init_args == {
        "accelerator": "cpu",
        "devices": 1,
        "max_steps": 4,
        "default_root_dir": tmp_path,
        **_QUIET,
    }


def test_positional_arguments_are_refused_like_lightning_does():
    with pytest.raises(TypeError):
        Trainer("cpu")


def test_init_args_are_a_deep_copy(tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="train_loss")
    callbacks = [checkpoint]
    max_time = {"minutes": 5}
    trainer = Trainer(accelerator="cpu", callbacks=callbacks, max_time=max_time, default_root_dir=tmp_path, **_QUIET)
    callbacks.append(EarlyStopping(monitor="train_loss"))
    callbacks.clear()
    max_time["minutes"] = 50
    checkpoint.monitor = "changed"
    recorded = trainer.init_args["callbacks"]
    assert len(recorded) == 1 and isinstance(recorded[0], ModelCheckpoint)
    assert recorded[0] is not checkpoint and recorded[0].monitor == "train_loss"
    assert trainer.init_args["max_time"] == {"minutes": 5}


def test_to_config_is_plain_yaml_safe_data_and_drops_objects_with_a_warning(tmp_path, caplog):
    trainer = _configured_trainer(tmp_path, callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt")])
    with caplog.at_level(logging.WARNING, logger="speechtrain.lightning.trainer"):
        config = trainer.to_config()
    assert config == {
        "accelerator": "cpu",
        "devices": 1,
        "max_epochs": 3,
        "max_steps": 11,
        "precision": "bf16-mixed",
        "accumulate_grad_batches": 2,
        "gradient_clip_val": 0.5,
        "log_every_n_steps": 7,
        "limit_train_batches": 0.5,
        "max_time": {"seconds": 300.0},
        "default_root_dir": str(tmp_path),
        "callbacks": [],
        **_QUIET,
    }
    assert yaml.safe_load(yaml.safe_dump(config)) == config
    messages = [r.getMessage() for r in caplog.records if r.name == "speechtrain.lightning.trainer"]
    assert messages == [
        "Trainer config leaves out arguments that cannot be stored as data: trainer.callbacks[0] (ModelCheckpoint)."
    ]


def test_nothing_dropped_means_no_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="speechtrain.lightning.trainer"):
        _configured_trainer(tmp_path).to_config()
    assert not [r for r in caplog.records if r.name == "speechtrain.lightning.trainer"]


def test_from_config_rebuilds_an_equivalent_trainer(tmp_path):
    original = _configured_trainer(tmp_path)
    config = original.to_config()
    rebuilt = Trainer.from_config(config)
    assert _settings(rebuilt) == _settings(original)
    assert _settings(rebuilt)["timer_seconds"] == 300.0
    assert rebuilt.init_args["max_time"] == datetime.timedelta(minutes=5)
    assert rebuilt.to_config() == config
    assert Trainer.from_config(config, max_steps=2, max_epochs=1).max_steps == 2


def test_from_config_builds_trusted_targets(tmp_path):
    config = {
        "accelerator": "cpu",
        "default_root_dir": str(tmp_path),
        "callbacks": [{"_target_": "lightning.pytorch.callbacks.EarlyStopping", "monitor": "wer", "patience": 2}],
        **_QUIET,
    }
    trainer = Trainer.from_config(config)
    (early_stopping,) = [cb for cb in trainer.callbacks if isinstance(cb, EarlyStopping)]
    assert early_stopping.monitor == "wer" and early_stopping.patience == 2


@pytest.mark.parametrize(
    "target",
    ["os.system", "builtins.eval", "lightningx.Evil", "speechtrainer.Evil", "test_lightning_trainer.RecordsItsArgs"],
)
def test_untrusted_target_is_refused(tmp_path, target):
    marker = tmp_path / "marker"
    config = {"accelerator": "cpu", "plugins": [{"_target_": target, "command": f"touch {marker}"}]}
    with pytest.raises(ValueError, match="Refusing to build"):
        Trainer.from_config(config)
    assert not marker.exists()


@pytest.mark.parametrize(
    "target, make_kwargs",
    [
        # ``subprocess.call``, imported into a Lightning module: a trusted prefix must not make it callable.
        ("lightning.pytorch.trainer.connectors.signal_connector.call", lambda marker: {"args": ["touch", marker]}),
        # A function of a trusted package that would unpickle any file it is pointed at.
        ("lightning.fabric.utilities.cloud_io._load", lambda marker: {"path_or_url": marker, "weights_only": False}),
        # A class imported into a trusted module but defined elsewhere.
        ("speechtrain.core.exp_manager.Path", lambda marker: {}),
    ],
    ids=["subprocess-call", "unpickling-function", "foreign-class"],
)
def test_only_the_listed_classes_are_built(tmp_path, target, make_kwargs):
    """Not a package prefix: an explicit list of classes (speechtrain's strategy and precision plugin, a few
    Lightning callbacks), so no function or class merely importable from a trusted package can be named."""
    marker = tmp_path / "marker"
    config = {"accelerator": "cpu", "plugins": [{"_target_": target, **make_kwargs(str(marker))}]}
    with pytest.raises(ValueError, match="only these classes may be named there: lightning.pytorch.callbacks"):
        Trainer.from_config(config)
    assert not marker.exists()


def test_objects_recording_init_args_are_stored_with_their_target_but_refused_outside_trusted_packages(tmp_path):
    trainer = Trainer(accelerator="cpu", plugins=[RecordsItsArgs(size=3)], default_root_dir=tmp_path, **_QUIET)
    config = trainer.to_config()
    assert config["plugins"] == [{"_target_": f"{RecordsItsArgs.__module__}.RecordsItsArgs", "size": 3}]
    with pytest.raises(ValueError, match="Refusing to build"):
        Trainer.from_config(config)
    assert Trainer.from_config({k: v for k, v in config.items() if k != "plugins"}).max_steps == -1


def test_from_checkpoint_rebuilds_the_trainer_that_wrote_it(tmp_path):
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=5,
        max_steps=4,
        precision="bf16-mixed",
        log_every_n_steps=2,
        default_root_dir=tmp_path,
        callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=2)],
        **_QUIET,
    )
    trainer.fit(TinyRegression())
    assert trainer.global_step == 4
    last = tmp_path / "ckpt" / "last.ckpt"

    checkpoint = torch.load(last, map_location="cpu", weights_only=True)
    assert checkpoint["global_step"] == 4
    assert checkpoint[TRAINER_CONFIG_KEY] == trainer.to_config()
    assert checkpoint[TRAINER_CONFIG_KEY]["callbacks"] == []

    rebuilt = Trainer.from_checkpoint(last)
    assert _settings(rebuilt) == _settings(trainer)
    assert rebuilt.to_config() == trainer.to_config()

    longer = Trainer.from_checkpoint(last, max_steps=6)
    assert longer.max_steps == 6 and longer.max_epochs == 5
    longer.fit(TinyRegression(), ckpt_path=last)
    assert longer.global_step == 6


def test_from_checkpoint_without_a_trainer_config_raises(tmp_path):
    path = tmp_path / "foreign.ckpt"
    torch.save({"state_dict": {}, "global_step": 0}, path)
    with pytest.raises(KeyError, match="holds no trainer config"):
        Trainer.from_checkpoint(path)


def test_after_fit_and_validate_the_model_is_back_on_the_runs_device(tmp_path, monkeypatch):
    """Lightning's teardown leaves the module on the CPU; the closing report, SALM's evaluation and the HF export
    run after fit on the device the run trained on (a GPU run: its tensor-parallel collectives need CUDA tensors).
    Here the strategy's device is made to look like a GPU and the model's last move is recorded."""
    model = TinyRegression()
    moves = []
    real_to = model.to

    def to(*args, **kwargs):
        moves.append(str(args[0] if args else kwargs.get("device")))
        return real_to(*args, **kwargs) if moves[-1] == "cpu" else model

    monkeypatch.setattr(model, "to", to)
    lightning_fit = pl.Trainer.fit

    def fit_then_look_like_a_gpu_run(self, *args, **kwargs):
        result = lightning_fit(self, *args, **kwargs)
        monkeypatch.setattr(type(self.strategy), "root_device", property(lambda _: torch.device("cuda", 0)))
        return result

    monkeypatch.setattr(pl.Trainer, "fit", fit_then_look_like_a_gpu_run)
    Trainer(accelerator="cpu", devices=1, max_steps=2, default_root_dir=tmp_path, **_QUIET).fit(model)
    assert moves[-1] == "cuda:0"


def test_the_wall_clock_limit_stops_at_the_next_agreement(tmp_path):
    """trainer.max_time is checked with the other periodic rank agreements (every 10 steps in a multi-process run,
    every step alone: no reduction is needed), not with a broadcast every batch."""
    from speechtrain.lightning.limits import WallClockLimit

    class Slow(TinyRegression):
        def training_step(self, batch, batch_idx):
            time.sleep(0.02)
            return super().training_step(batch, batch_idx)

    trainer = Trainer(accelerator="cpu", devices=1, max_steps=1000, max_time={"seconds": 0.3}, max_epochs=-1,
                      default_root_dir=tmp_path, **_QUIET)  # fmt: skip
    assert any(isinstance(cb, WallClockLimit) for cb in trainer.callbacks)
    trainer.fit(Slow())
    assert 10 <= trainer.global_step < 100, trainer.global_step  # about 0.3 s of 20 ms steps
