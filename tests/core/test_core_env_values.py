"""Values read from the environment (``${oc.env:...}``) are used, and saved only as their interpolation text."""

import tarfile

import pytest
from conftest import tiny_ctc_config
from omegaconf import OmegaConf

from speechtrain.asr.conv_ctc import ConvCTCModel
from speechtrain.common.config import env_interpolations, settle_env_interpolations
from speechtrain.core.model import SpeechModel
from speechtrain.lightning import Trainer

SECRET = "/very/secret/place"


def test_env_values_and_the_values_that_refer_to_them_are_found():
    config = OmegaConf.create(
        {
            "root": "${oc.env:ST_SECRET}",
            "a": {"path": "${root}/train.json", "list": [1, "${oc.env:ST_SECRET,x}"]},
            "copy": "${a}",
            "plain": "${a.list.0}",
        }  # fmt: skip
    )
    found = env_interpolations(config)
    assert found == {
        "root": "${oc.env:ST_SECRET}",
        "a.path": "${oc.env:ST_SECRET}/train.json",
        "a.list.1": "${oc.env:ST_SECRET,x}",
        "copy.path": "${oc.env:ST_SECRET}/train.json",
        "copy.list.1": "${oc.env:ST_SECRET,x}",
    }


def test_saved_values_keep_the_text_and_restore_with_or_without_the_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("ST_SECRET", SECRET)
    job = OmegaConf.create({"data": "${oc.env:ST_SECRET}", "model": tiny_ctc_config()})
    job.model.train_ds.manifest_filepath = "${data}/train.json"
    model = ConvCTCModel(job.model)
    assert model.cfg.train_ds.manifest_filepath == f"{SECRET}/train.json"  # the run uses the value

    path = model.save_to(tmp_path / "m.stm")
    with tarfile.open(path) as tar:
        text = tar.extractfile("model_config.yaml").read().decode()
    assert SECRET not in text and "${oc.env:ST_SECRET}/train.json" in text

    assert SpeechModel.restore_from(path).cfg.train_ds.manifest_filepath == f"{SECRET}/train.json"
    monkeypatch.delenv("ST_SECRET")
    restored = SpeechModel.restore_from(path)  # not set here: left empty, the model builds
    assert restored.cfg.train_ds.manifest_filepath is None


def test_trainer_config_keeps_the_text(tmp_path, monkeypatch):
    monkeypatch.setenv("ST_SECRET", str(tmp_path / "secret_root"))
    job = OmegaConf.create({"trainer": {"accelerator": "cpu", "devices": 1, "max_steps": 1,
                                        "default_root_dir": "${oc.env:ST_SECRET}", "logger": False}})  # fmt: skip
    trainer = Trainer.from_job_config(job.trainer)
    assert trainer.default_root_dir == str(tmp_path / "secret_root")
    stored = trainer.to_config()
    assert stored["default_root_dir"] == "${oc.env:ST_SECRET}"
    assert Trainer.from_config(stored).default_root_dir == str(tmp_path / "secret_root")
    monkeypatch.delenv("ST_SECRET")
    assert Trainer.from_config(stored).init_args.get("default_root_dir") is None  # not set here: left empty


@pytest.mark.parametrize("value", ["${oc.env:ST_UNSET_VARIABLE}", "${oc.env:ST_UNSET_VARIABLE}/x"])
def test_an_unset_variable_is_left_empty_and_a_set_one_resolves(value, monkeypatch):
    assert settle_env_interpolations({"k": value, "n": 1}, "test") == {"k": None, "n": 1}
    monkeypatch.setenv("ST_UNSET_VARIABLE", "v")
    assert settle_env_interpolations({"k": value}, "test") == {"k": value}
