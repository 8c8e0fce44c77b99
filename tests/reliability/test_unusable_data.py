"""Runs with nothing to learn from never "succeed": a manifest whose audio paths all point nowhere is refused at
start, an epoch in which every utterance was skipped stops the run; both name the manifest, the reasons and where
relative paths were resolved. Recorded in the fault-injection summary (see conftest.py)."""

import json
import sys

import pytest
from conftest import example_main, example_overrides


def run_example(monkeypatch, tmp_path, manifest, *overrides):
    monkeypatch.setattr(sys, "argv", ["asr_train.py", *example_overrides(tmp_path, manifest), *overrides])
    return example_main()()


def untokenizable_copy(manifest, path, count=8):
    """Real audio, but transcripts the digit tokenizer cannot encode: every utterance is skipped."""
    rows = [json.loads(line) for line in manifest.read_text().splitlines()[:count]]
    for row in rows:
        row["audio_filepath"] = str(manifest.parent / row["audio_filepath"])
        row["text"] = "no digits here"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _relative_copy(manifest, folder, count=6):
    """``head -6 train/manifest.json > new/train.json``: its relative audio paths now resolve against ``new/``."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = manifest.read_text().splitlines(keepends=True)[:count]
    assert all('"audio_filepath": "audio/' in line for line in lines)
    (folder / "train.json").write_text("".join(lines))
    return folder / "train.json"


def test_a_manifest_whose_audio_paths_point_nowhere_is_refused_at_start(tmp_path, dtmf_manifest, monkeypatch,
                                                                         capsys, fault):  # fmt: skip
    record = fault("manifest copied with `head` (relative paths now point nowhere): refused at start")
    new = _relative_copy(dtmf_manifest, tmp_path / "new")
    with pytest.raises(SystemExit) as stop:
        run_example(monkeypatch, tmp_path, dtmf_manifest, f"model.train_ds.manifest_filepath={new}")
    assert stop.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"model.train_ds.manifest_filepath={new}: no usable utterance, none of its 6 audio files exists" in line
    assert f"{tmp_path / 'new' / 'audio'}/dtmf-000000.wav ('audio/dtmf-000000.wav' is relative" in line
    assert f"resolved against the manifest's folder {tmp_path / 'new'}" in line
    assert not (tmp_path / "exp").exists()
    record.survive(steps_lost=0)


def test_a_training_epoch_without_usable_utterances_stops_the_run(tmp_path, dtmf_manifest, monkeypatch, capsys,
                                                                   fault):  # fmt: skip
    record = fault("no usable utterance in an epoch (all untokenizable): stops by name, nothing saved")
    bad = untokenizable_copy(dtmf_manifest, tmp_path / "letters.json")
    with pytest.raises(SystemExit) as stop:
        run_example(monkeypatch, tmp_path, dtmf_manifest, f"model.train_ds.manifest_filepath={bad}",
                     "trainer.max_epochs=1", "model.validation_ds.manifest_filepath=null")  # fmt: skip
    assert stop.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"No usable utterance in training epoch 0 of model.train_ds.manifest_filepath={bad}" in line
    assert "unencodable_text=8" in line
    assert not list((tmp_path / "exp").rglob("*.stm")) and not list((tmp_path / "exp").rglob("*.ckpt"))
    record.survive(steps_lost=0)
