import csv
import json
import logging
from pathlib import Path

import pytest
import torch
from conftest import example_job, example_main, final_weights, run_folder

from speechtrain.core.archive import read_archive
from speechtrain.core.model import SpeechModel
from speechtrain.lightning import BaseCallback, CallbackGroup

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_run_folder_layout_and_final_archive(tmp_path, dtmf_manifest):
    main = example_main()
    main(example_job(tmp_path, dtmf_manifest, "trainer.max_epochs=1"))
    run = run_folder(tmp_path)
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


def test_resumed_run_equals_uninterrupted_run(tmp_path, dtmf_manifest):
    main = example_main()
    straight, split = tmp_path / "straight", tmp_path / "split"
    # A constant schedule: a cosine over max_epochs would decay differently in a run told to stop after 2 epochs.
    constant = "model.optim.sched.name=constant"
    main(example_job(straight, dtmf_manifest, "trainer.max_epochs=4", constant))
    main(example_job(split, dtmf_manifest, "trainer.max_epochs=2", constant))
    main(example_job(split, dtmf_manifest, "trainer.max_epochs=4", constant, "exp_manager.resume_if_exists=true"))

    assert len(list((split / "exp" / "asr_demo").iterdir())) == 1, "resume must continue the same run folder"
    with open(run_folder(split) / "metrics.csv") as handle:
        epochs = [row["epoch"] for row in csv.DictReader(handle) if row["val_wer"]]
    # Rows of the first run survive the resume. (Lightning re-runs the validation of the epoch whose end the
    # checkpoint was saved at, so epoch 1 is validated twice; the script's closing validation is logged under the
    # epoch count reached: 2, then 4.)
    assert epochs[:2] == ["0", "1"] and sorted(set(epochs)) == ["0", "1", "2", "3", "4"]
    expected, resumed = final_weights(straight), final_weights(split)
    assert expected.keys() == resumed.keys()
    for key in expected:
        torch.testing.assert_close(resumed[key], expected[key], rtol=0, atol=0, msg=lambda m, key=key: f"{key}: {m}")


def test_resume_without_checkpoint(tmp_path, dtmf_manifest):
    main = example_main()
    with pytest.raises(FileNotFoundError, match="resume_ignore_no_checkpoint"):
        main(example_job(tmp_path, dtmf_manifest, "exp_manager.resume_if_exists=true"))
    main(
        example_job(
            tmp_path,
            dtmf_manifest,
            "trainer.max_steps=10",
            "exp_manager.resume_if_exists=true",
            "exp_manager.resume_ignore_no_checkpoint=true",
        )
    )
    assert (run_folder(tmp_path) / "asr_demo.stm").is_file()


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
    main = example_main()
    every4 = "+exp_manager.checkpoint_callback_params.every_n_train_steps=4"
    straight, split = tmp_path / "straight", tmp_path / "split"
    main(example_job(straight, dtmf_manifest, "trainer.max_epochs=2", every4))
    crash = _Crash(step=6)
    CallbackGroup.get_instance().register(crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        main(example_job(split, dtmf_manifest, "trainer.max_epochs=2", every4))
    CallbackGroup.get_instance().unregister(crash)
    main(example_job(split, dtmf_manifest, "trainer.max_epochs=2", every4, "exp_manager.resume_if_exists=true"))
    expected, resumed = final_weights(straight), final_weights(split)
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
    main = example_main()
    with caplog.at_level(logging.WARNING, logger="speechtrain"):
        main(example_job(tmp_path, dtmf_manifest, "trainer.max_epochs=1", f"model.train_ds.manifest_filepath={bad}"))
    summaries = [r.getMessage() for r in caplog.records if "Epoch 0: skipped" in r.getMessage()]
    assert summaries == [f"Epoch 0: skipped 2 utterances: empty_text=1 (e.g. {records[9]['audio_filepath']}), "
                         f"missing_audio=1 (e.g. {tmp_path / 'gone.wav'})"]  # fmt: skip
    assert (run_folder(tmp_path) / "asr_demo.stm").is_file(), "the run finished despite the bad files"
