"""The closing validation counts every utterance once at any data-parallel size: the same WER, CER and loss at DP=1
and DP=3 on a set of 23 utterances (a multiple of neither), with real processes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from speechtrain.corpora.dtmf import make_dtmf_corpus
from speechtrain.lightning.launch import fresh_launch_env

ROOT = Path(__file__).resolve().parents[2]


def _closing_metrics(tmp_path: Path, manifest: Path, devices: int) -> dict:
    exp = tmp_path / f"dp{devices}"
    data = [f"model.train_ds.manifest_filepath={manifest}", f"model.validation_ds.manifest_filepath={manifest}"]
    # One step at a learning rate below fp32's resolution and no batch norm: the weights stay as initialised, the
    # same at every data-parallel size.
    frozen = ["trainer.max_steps=1", "model.optim.lr=1e-30", "model.optim.sched.min_lr=0",
              "model.encoder.conv_norm_type=layer_norm", "trainer.val_check_interval=1",
              "trainer.check_val_every_n_epoch=null"]  # fmt: skip
    command = [sys.executable, str(ROOT / "examples" / "asr_train.py"), "model.size=debug", f"trainer.devices={devices}",  # noqa: E501
               *data, *frozen, "model.tokenizer.vocab=['0','1','2','3','4','5','6','7','8','9',' ']",
               "trainer.max_time=null", "model.decoding.strategy=greedy", f"exp_manager.exp_dir={exp}",
               "model.validation_ds.batch_size=7", "model.validation_ds.batch_duration=null", "trainer.precision=32",
               "exp_manager.create_checkpoint_callback=false"]  # fmt: skip
    env = fresh_launch_env(OMP_WAIT_POLICY="PASSIVE", OMP_NUM_THREADS="1")
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    (path,) = exp.rglob("final_metrics.json")
    return json.loads(path.read_text())


@pytest.mark.slow  # (the sampler's property at DP=2 and 3: tests/data/test_data_lhotse_loader.py, default suite)
@pytest.mark.multiprocess
def test_validation_metrics_are_the_same_at_dp1_and_dp3(tmp_path):
    manifest = make_dtmf_corpus(tmp_path / "dtmf", 23, seed=11)
    one, three = _closing_metrics(tmp_path, manifest, 1), _closing_metrics(tmp_path, manifest, 3)
    assert set(one) == set(three) and "val_wer" in one
    for key, value in one.items():
        assert three[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
