import csv
import importlib.util
import json
import logging
from pathlib import Path

import pytest
import torch

from speechtrain.asr.ctc import ConformerCTCConfig
from speechtrain.asr.tokenizers import CharTokenizer
from speechtrain.core.archive import read_archive
from speechtrain.core.hydra_runner import compose_config
from speechtrain.core.job import train_job_schema
from speechtrain.core.model import SpeechModel
from speechtrain.lightning import BaseCallback, CallbackGroup

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _example_main():
    spec = importlib.util.spec_from_file_location("asr_train_example", EXAMPLES / "asr_train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def _job(tmp_path, manifest, *overrides):
    """The example's real config, shrunk to a tiny Conformer and the DTMF corpus, plus CLI-style overrides."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    tokenizer = tmp_path / "digits.json"
    CharTokenizer([" ", *"0123456789"]).save(tokenizer)
    base = [
        f"exp_manager.exp_dir={tmp_path / 'exp'}",
        "trainer.precision=32",
        "trainer.max_time=null",
        "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false",
        "trainer.num_sanity_val_steps=0",
        f"model.tokenizer.path={tokenizer}",
        f"model.train_ds.manifest_filepath={manifest}",
        f"model.validation_ds.manifest_filepath={manifest}",
        "model.encoder.d_model=16",
        "model.encoder.num_layers=1",
        "model.encoder.num_heads=2",
        "model.encoder.conv_kernel_size=3",
        "model.encoder.subsampling_conv_channels=8",
        "model.encoder.subsampling_factor=2",
        "model.encoder.dropout=0.1",
        "model.preprocessor.n_mels=16",
        "model.train_ds.batch_size=8",
        "model.train_ds.batch_duration=null",
        "model.train_ds.num_workers=0",
        "model.optim.sched.warmup_steps=2",
        "exp_manager.checkpoint_callback_params.save_top_k=1",
    ]
    return compose_config(EXAMPLES / "conf", "asr_train", [*base, *overrides], train_job_schema(ConformerCTCConfig))


def _run_folder(tmp_path, name="asr_demo"):
    (folder,) = (tmp_path / "exp" / name).iterdir()
    return folder


def test_run_folder_layout_and_final_archive(tmp_path, dtmf_manifest):
    main = _example_main()
    main(_job(tmp_path, dtmf_manifest, "trainer.max_epochs=1"))
    run = _run_folder(tmp_path)
    names = {p.name for p in run.iterdir()}
    assert {"config.yaml", "train.log", "metrics.csv", "checkpoints", "asr_demo.stm"} <= names
    assert any(n.startswith("events.out.tfevents") for n in names)
    checkpoints = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert "asr_demo--last.ckpt" in checkpoints
    assert any(n.startswith("asr_demo--val_wer=") and n.endswith("-epoch=0.ckpt") for n in checkpoints)
    assert "val_wer" in (run / "metrics.csv").read_text().splitlines()[0]
    archive = read_archive(run / "asr_demo.stm")
    assert archive.trainer_config["precision"] == 32
    restored = SpeechModel.restore_from(run / "asr_demo.stm")
    assert restored.cfg.encoder.d_model == 16


def _final_weights(tmp_path):
    return read_archive(_run_folder(tmp_path) / "asr_demo.stm").state_dict


def test_resumed_run_equals_uninterrupted_run(tmp_path, dtmf_manifest):
    main = _example_main()
    straight, split = tmp_path / "straight", tmp_path / "split"
    # A constant schedule: a cosine over max_epochs would decay differently in a run told to stop after 2 epochs.
    constant = "model.optim.sched.name=constant"
    main(_job(straight, dtmf_manifest, "trainer.max_epochs=4", constant))
    main(_job(split, dtmf_manifest, "trainer.max_epochs=2", constant))
    main(_job(split, dtmf_manifest, "trainer.max_epochs=4", constant, "exp_manager.resume_if_exists=true"))

    assert len(list((split / "exp" / "asr_demo").iterdir())) == 1, "resume must continue the same run folder"
    with open(_run_folder(split) / "metrics.csv") as handle:
        epochs = [row["epoch"] for row in csv.DictReader(handle) if row["val_wer"]]
    # Rows of the first run survive the resume. (Lightning re-runs the validation of the epoch whose end the
    # checkpoint was saved at, so epoch 1 is validated twice; the script's closing validation is logged under the
    # epoch count reached: 2, then 4.)
    assert epochs[:2] == ["0", "1"] and sorted(set(epochs)) == ["0", "1", "2", "3", "4"]
    expected, resumed = _final_weights(straight), _final_weights(split)
    assert expected.keys() == resumed.keys()
    for key in expected:
        torch.testing.assert_close(resumed[key], expected[key], rtol=0, atol=0, msg=lambda m, key=key: f"{key}: {m}")


def test_resume_without_checkpoint(tmp_path, dtmf_manifest):
    main = _example_main()
    with pytest.raises(FileNotFoundError, match="resume_ignore_no_checkpoint"):
        main(_job(tmp_path, dtmf_manifest, "exp_manager.resume_if_exists=true"))
    main(
        _job(
            tmp_path,
            dtmf_manifest,
            "trainer.max_steps=10",
            "exp_manager.resume_if_exists=true",
            "exp_manager.resume_ignore_no_checkpoint=true",
        )
    )
    assert (_run_folder(tmp_path) / "asr_demo.stm").is_file()


class _Crash(BaseCallback):
    """Dies at the start of a given step, like a run killed mid-epoch (nothing is saved on the way out)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            raise RuntimeError("simulated crash")


def test_run_crashed_mid_epoch_resumes_on_the_same_batches(tmp_path, dtmf_manifest):
    """The sampler's position is in the checkpoint: resuming after step 4 of a 10-step epoch replays nothing and
    skips nothing."""
    main = _example_main()
    every4 = "+exp_manager.checkpoint_callback_params.every_n_train_steps=4"
    straight, split = tmp_path / "straight", tmp_path / "split"
    main(_job(straight, dtmf_manifest, "trainer.max_epochs=2", every4))
    crash = _Crash(step=6)
    CallbackGroup.get_instance().register(crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        main(_job(split, dtmf_manifest, "trainer.max_epochs=2", every4))
    CallbackGroup.get_instance().unregister(crash)
    main(_job(split, dtmf_manifest, "trainer.max_epochs=2", every4, "exp_manager.resume_if_exists=true"))
    expected, resumed = _final_weights(straight), _final_weights(split)
    for key in expected:
        torch.testing.assert_close(resumed[key], expected[key], rtol=0, atol=0, msg=lambda m, key=key: f"{key}: {m}")


def test_bad_files_are_skipped_and_summarised_per_epoch(tmp_path, dtmf_manifest, caplog):
    records = [json.loads(line) for line in dtmf_manifest.read_text().splitlines()]
    for record in records:
        record["audio_filepath"] = str(dtmf_manifest.parent / record["audio_filepath"])
    records[5]["audio_filepath"] = str(tmp_path / "gone.wav")
    records[9]["text"] = ""
    bad = tmp_path / "bad.json"
    bad.write_text("".join(json.dumps(r) + "\n" for r in records))
    main = _example_main()
    with caplog.at_level(logging.WARNING, logger="speechtrain"):
        main(_job(tmp_path, dtmf_manifest, "trainer.max_epochs=1", f"model.train_ds.manifest_filepath={bad}"))
    summaries = [r.getMessage() for r in caplog.records if "Epoch 0: skipped" in r.getMessage()]
    assert summaries == [f"Epoch 0: skipped 2 utterances: empty_text=1 (e.g. {records[9]['audio_filepath']}), "
                         f"missing_audio=1 (e.g. {tmp_path / 'gone.wav'})"]  # fmt: skip
    assert (_run_folder(tmp_path) / "asr_demo.stm").is_file(), "the run finished despite the bad files"
