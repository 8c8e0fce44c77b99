"""What a user meets at the entry points: a mistake stops the job with one line that names the key and the fix,
exit status 2, and no run folder left behind; a run that has no usable data never "succeeds"."""

import json
import sys

import pytest
from conftest import example_main, example_overrides


def _run_example(monkeypatch, tmp_path, manifest, *overrides):
    monkeypatch.setattr(sys, "argv", ["asr_train.py", *example_overrides(tmp_path, manifest), *overrides])
    return example_main()()


TRAIN, VAL = "model.train_ds.manifest_filepath", "model.validation_ds.manifest_filepath"
NEVER = ["trainer.max_steps=8", "+trainer.val_check_interval=100", "trainer.check_val_every_n_epoch=null"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        ([f"{TRAIN}={{tmp}}/missing.json"], f"{TRAIN}={{tmp}}/missing.json: no such file"),
        ([f"{VAL}={{tmp}}/nope.json"], f"{VAL}={{tmp}}/nope.json: no such file"),
        (["model.optim.lr=-0.001"], "model.optim.lr=-0.001: must be > 0"),
        (NEVER, "This run would never validate: it stops after trainer.max_steps=8 steps, before the first "
                "validation at batch trainer.val_check_interval=100. Lower it, e.g. trainer.val_check_interval=4."),
        (["model.encoder.d_modle=3"], "Unknown config key 'model.encoder.d_modle'. Did you mean 'model.encoder.d_m"),
    ],
)  # fmt: skip
def test_mistakes_stop_with_one_line_exit_2_and_leave_nothing(tmp_path, dtmf_manifest, monkeypatch, capsys,
                                                              overrides, message):  # fmt: skip
    overrides = [o.format(tmp=tmp_path) for o in overrides]
    with pytest.raises(SystemExit) as stop:
        _run_example(monkeypatch, tmp_path, dtmf_manifest, "trainer.max_epochs=1", *overrides)
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("asr_train.py: error: "), err
    assert message.format(tmp=tmp_path) in err[0]
    assert not (tmp_path / "exp").exists()  # no run folder left behind


def _untokenizable_copy(manifest, path, count=8):
    rows = [json.loads(line) for line in manifest.read_text().splitlines()[:count]]
    for row in rows:
        row["audio_filepath"] = str(manifest.parent / row["audio_filepath"])
        row["text"] = "no digits here"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_validation_set_without_usable_utterances_stops_the_run_by_name(tmp_path, dtmf_manifest, monkeypatch,
                                                                          capsys):  # fmt: skip
    bad = _untokenizable_copy(dtmf_manifest, tmp_path / "letters.json")
    with pytest.raises(SystemExit) as stop:
        _run_example(monkeypatch, tmp_path, dtmf_manifest, f"{VAL}={bad}", "trainer.max_steps=2",
                     "+trainer.val_check_interval=2", "trainer.check_val_every_n_epoch=null",
                     "exp_manager.checkpoint_callback_params.every_n_train_steps=1")  # fmt: skip
    assert stop.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"No usable utterance in validation set letters of model.validation_ds.manifest_filepath={bad}" in line
    assert "all 8 utterances were skipped: unencodable_text=8 (e.g. " in line
    # A checkpoint had been written: the run folder stays, and its train.log says why the run ended.
    (run,) = (tmp_path / "exp" / "asr_demo").iterdir()
    assert (
        "The run ended with an error: No usable utterance in validation set letters" in (run / "train.log").read_text()
    )

    # That run's checkpoint: fine-tuning starts from it (config from the run folder), transcription says what to pass.
    import torch

    from speechtrain.asr.jobs import restore_for_finetuning
    from speechtrain.asr.transcribe import main as transcribe

    (ckpt,) = (run / "checkpoints").glob("*last.ckpt")
    model = restore_for_finetuning(ckpt)
    saved = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
    assert saved and all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    with pytest.raises(SystemExit) as stop:
        transcribe([f"model_path={ckpt}", f"audio={dtmf_manifest}"])
    assert stop.value.code == 2
    assert "is a PyTorch/Lightning checkpoint (a zip), not a speechtrain model archive" in capsys.readouterr().err


def test_a_lightning_checkpoint_is_named_for_what_it_is(tmp_path):
    import torch

    from speechtrain.core.archive import ArchiveError
    from speechtrain.core.model import SpeechModel

    torch.save({"state_dict": {}}, tmp_path / "last.ckpt")
    with pytest.raises(ArchiveError, match="is a PyTorch/Lightning checkpoint .* Pass the run's archive"):
        SpeechModel.restore_from(tmp_path / "last.ckpt")


def test_prepare_only_builds_what_the_recipe_reads_and_trains_nothing(tmp_path, dtmf_manifest, monkeypatch, capsys):
    # make demo runs this first and starts its training clock after it: the recipe alone names the data.
    assert _run_example(monkeypatch, tmp_path, dtmf_manifest, "prepare_only=true") is None
    out = capsys.readouterr().out.splitlines()
    assert f"validation: {dtmf_manifest}" in out
    assert f"tokenizer: {tmp_path / 'digits.json'}" in out
    (lm,) = [line.removeprefix("lm: ") for line in out if line.startswith("lm: ")]
    assert lm.endswith("lm.arpa") and (tmp_path / lm).is_file()  # fitted on the training transcripts, cached
    assert out[-1].startswith("prepared in ")
    assert not (tmp_path / "exp").exists()  # no run folder: nothing was trained
