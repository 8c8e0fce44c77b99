import sys
from dataclasses import dataclass, field

import pytest
import yaml

from speechtrain.core.hydra_runner import hydra_runner
from speechtrain.core.job import train_job_schema
from speechtrain.core.optim import OptimConfig
from speechtrain.lightning import BaseCallback, CallbackGroup


@dataclass
class EncoderConfig:
    d_model: int = 8
    num_layers: int = 2


@dataclass
class ToyModelConfig:
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)


JOB = {
    "name": "toy",
    "trainer": {"max_epochs": 1, "devices": 1},
    "model": {"encoder": {"d_model": 16}, "optim": {"lr": 0.1}},
}


@pytest.fixture
def run(tmp_path, monkeypatch):
    """Run a decorated job with the given command line; returns the config the job received."""
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "job.yaml").write_text(yaml.safe_dump(JOB))
    workdir = tmp_path / "work"
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    seen = {}

    @hydra_runner(config_path=str(tmp_path / "conf"), config_name="job", schema=train_job_schema(ToyModelConfig))
    def main(cfg):
        seen["cfg"] = cfg

    def invoke(*argv):
        monkeypatch.setattr(sys, "argv", ["toy_train.py", *argv])
        main()
        return seen.get("cfg")

    return invoke


def test_overrides_add_and_delete(run):
    cfg = run("trainer.max_epochs=3", "model.optim.lr=1e-4", "+trainer.max_steps=7", "~model.encoder")
    assert cfg.trainer.max_epochs == 3 and cfg.trainer.max_steps == 7
    assert cfg.model.optim.lr == pytest.approx(1e-4)
    assert cfg.model.encoder.d_model == 8  # deleted from the YAML: the schema default comes back
    assert cfg.model.optim.betas == [0.9, 0.98]  # defaults from the typed schema fill what YAML leaves out


def test_no_hydra_output_folders(run, tmp_path):
    run("trainer.max_epochs=2")
    assert list((tmp_path / "work").iterdir()) == []


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["model.optim.lrr=1"], "Unknown config key 'model.optim.lrr'. Did you mean 'model.optim.lr'?"),
        (
            ["+model.encoder.d_modle=3"],
            "Unknown config key 'model.encoder.d_modle'. Did you mean 'model.encoder.d_model'?",
        ),
        (["+trainer.max_epoch=3"], "Unknown config key 'trainer.max_epoch'. Did you mean 'trainer.max_epochs'?"),
        (["model.encoder.num_layers=many"], "model.encoder.num_layers"),
        (["--config-name", "missing"], "No config file"),
    ],
)
def test_config_errors_name_the_key_and_exit_2(run, capsys, argv, expected):
    with pytest.raises(SystemExit) as exit_info:
        run(*argv)
    assert exit_info.value.code == 2
    assert expected in capsys.readouterr().err


def test_misspelt_key_in_yaml(tmp_path, monkeypatch, capsys, run):
    bad = {**JOB, "model": {"encoder": {"d_modle": 3}}}
    (tmp_path / "conf" / "bad.yaml").write_text(yaml.safe_dump(bad))
    with pytest.raises(SystemExit):
        run("--config-name=bad")
    assert (
        "Unknown config key 'model.encoder.d_modle'. Did you mean 'model.encoder.d_model'?" in capsys.readouterr().err
    )


def test_print_cfg_and_help(run, capsys):
    assert run("--cfg", "job", "model.optim.lr=0.5") is None
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["optim"]["lr"] == 0.5
    assert run("--help") is None
    assert "usage:" in capsys.readouterr().out


def test_app_events_bracket_the_job(run):
    events = []

    class Recorder(BaseCallback):
        def on_app_start(self):
            events.append("start")

        def on_app_end(self):
            events.append("end")

    CallbackGroup.get_instance().register(Recorder())
    run()
    run()  # a second job in the same process does not repeat the once-per-process events
    assert events == ["start", "end"]
