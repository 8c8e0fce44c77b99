import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import soundfile as sf
import torch
from conftest import tiny_ctc_config

from speechtrain.asr.conv_ctc import ConvCTCModel
from speechtrain.asr.transcribe import main, plan_batches, transcribe_paths
from speechtrain.core.model import SpeechModel
from speechtrain.corpora.dtmf import make_dtmf_corpus
from speechtrain.data.manifest import read_nemo_manifest


@pytest.fixture(scope="module")
def archive(tmp_path_factory):
    torch.manual_seed(0)
    return ConvCTCModel(tiny_ctc_config(num_layers=2)).save_to(tmp_path_factory.mktemp("model") / "tiny.stm")


@pytest.fixture(scope="module")
def model(archive):
    return SpeechModel.restore_from(archive).eval()


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    return make_dtmf_corpus(tmp_path_factory.mktemp("corpus"), 6, seed=3)


def _per_utterance(model, audio):
    return [model.transcribe([a], batch_size=1)[0] for a in audio]


def _read_rows(path):
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines()]


def _write_manifest(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_cli_on_manifest_keeps_input_order_and_matches_model_transcribe(archive, model, manifest, tmp_path, capsys,
                                                                        monkeypatch):  # fmt: skip
    monkeypatch.chdir(tmp_path)
    main([f"model_path={archive}", f"audio={manifest}", "batch_duration=2"])
    rows = _read_rows(tmp_path / "manifest_preds.json")
    expected = read_nemo_manifest(manifest)
    paths = [r["audio_filepath"] for r in expected]
    assert [r["audio_filepath"] for r in rows] == paths
    assert [r["text"] for r in rows] == [r["text"] for r in expected]
    assert [r["duration"] for r in rows] == [r["duration"] for r in expected]
    assert [r["pred_text"] for r in rows] == _per_utterance(model, paths)
    assert [r["pred_text"] for r in rows] == model.transcribe(paths, batch_size=len(paths))
    assert all("error" not in r for r in rows)
    out = capsys.readouterr().out
    assert "Transcribed 6/6 utterances" in out and "RTFx" in out and "WER " in out


def test_directory_and_single_file_inputs(archive, model, manifest, tmp_path, capsys, monkeypatch):
    audio_dir = manifest.parent / "audio"
    nested = tmp_path / "in" / "sub"
    nested.mkdir(parents=True)
    files = sorted(audio_dir.glob("*.wav"))
    for f in files[:2]:
        (tmp_path / "in" / f.name).write_bytes(f.read_bytes())
    (nested / files[2].name).write_bytes(files[2].read_bytes())
    (nested / "notes.txt").write_text("not audio")
    monkeypatch.chdir(tmp_path)

    main([f"model_path={archive}", f"audio={tmp_path / 'in'}", "output=dir_preds.json"])
    rows = _read_rows(tmp_path / "dir_preds.json")
    expected = sorted(str(p) for p in (tmp_path / "in").rglob("*.wav"))
    assert [r["audio_filepath"] for r in rows] == expected and len(rows) == 3
    assert [r["pred_text"] for r in rows] == _per_utterance(model, expected)
    assert all(r["duration"] == pytest.approx(sf.info(r["audio_filepath"]).duration) for r in rows)
    assert "text" not in rows[0] and "WER" not in capsys.readouterr().out

    main([f"model_path={archive}", f"audio={files[0]}"])
    (row,) = _read_rows(tmp_path / "transcripts.json")
    assert row["audio_filepath"] == str(files[0]) and row["pred_text"] == model.transcribe([files[0]])[0]


def test_unreadable_audio_becomes_an_error_row_not_a_crash(archive, model, manifest, tmp_path, capsys):
    good = read_nemo_manifest(manifest)
    (tmp_path / "garbage.wav").write_bytes(b"this is not a wav file" * 100)
    bad = [
        {"audio_filepath": "missing.wav", "duration": 1.0, "text": "1 2"},
        {"audio_filepath": "garbage.wav", "text": "3"},  # fails when its duration is read
        {"audio_filepath": "garbage.wav", "duration": 1.0, "text": "4"},  # fails inside the model's batch
    ]
    rows_in = [{k: v for k, v in r.items() if k != "offset"} for r in good[:3]] + bad + good[3:]
    path = _write_manifest(tmp_path / "mixed.json", rows_in)
    main([f"model_path={archive}", f"audio={path}", f"output={tmp_path / 'preds.json'}"])

    rows = _read_rows(tmp_path / "preds.json")
    assert len(rows) == len(rows_in)
    failed = [r for r in rows if r["pred_text"] is None]
    assert [Path(r["audio_filepath"]).name for r in failed] == ["missing.wav", "garbage.wav", "garbage.wav"]
    assert "FileNotFoundError" in failed[0]["error"] and all("LibsndfileError" in r["error"] for r in failed[1:])
    ok = [r for r in rows if r["pred_text"] is not None]
    assert [r["pred_text"] for r in ok] == _per_utterance(model, [r["audio_filepath"] for r in ok])
    out = capsys.readouterr().out
    assert f"Transcribed {len(good)}/{len(rows_in)} utterances" in out and "Skipped 3 " in out
    assert f"{len(good)} utterances; 3 skipped, see 'error')" in out  # the WER says what it left out


def test_batching_by_duration_does_not_change_transcripts(model, manifest):
    paths = [r["audio_filepath"] for r in read_nemo_manifest(manifest)]
    reference = _per_utterance(model, paths)
    for limits in ({"batch_duration": 0.5}, {"batch_duration": 3.0}, {"batch_duration": None, "batch_size": 4}):
        rows = transcribe_paths(model, manifest, **limits)
        assert [r["pred_text"] for r in rows] == reference, limits
    assert [r["pred_text"] for r in transcribe_paths(model, paths)] == reference


def test_offset_segments_and_manifests_without_text_or_duration(model, manifest, tmp_path):
    first = read_nemo_manifest(manifest)[0]["audio_filepath"]
    path = _write_manifest(
        tmp_path / "segments.json",
        [{"audio_filepath": first, "offset": 0.1, "duration": 0.3, "id": "a"}, {"audio_filepath": first}],
    )
    rows = transcribe_paths(model, path)
    wave, rate = sf.read(first, dtype="float32")
    segment = wave[round(0.1 * rate) : round(0.4 * rate)]
    assert rows[0]["id"] == "a" and rows[0]["pred_text"] == model.transcribe([segment])[0]
    assert rows[1]["pred_text"] == model.transcribe([first])[0]
    assert rows[1]["duration"] == pytest.approx(len(wave) / rate)


def test_bf16_autocast_transcribes_every_utterance(model, manifest):
    rows = transcribe_paths(model, manifest, batch_duration=2.0, precision="bf16")
    assert all(isinstance(r["pred_text"], str) and "error" not in r for r in rows)


def test_offset_segments_are_resampled_like_the_model_reads_files(model, tmp_path):
    path = read_nemo_manifest(make_dtmf_corpus(tmp_path, 2, seed=5, sample_rate=8000))[1]["audio_filepath"]
    rows = transcribe_paths(model, [{"audio_filepath": path, "offset": 0.0}])
    assert rows[0]["pred_text"] == model.transcribe([path])[0]


class _RecordingModel:
    """Stands in for a model: records each call of ``transcribe``; fails a batch holding a file named ``fail_on``."""

    def __init__(self, fail_on=None):
        self.calls = []
        self.fail_on = fail_on

    def transcribe(self, audio, batch_size=16):
        self.calls.append((list(audio), batch_size))
        if any(Path(a).stem == self.fail_on for a in audio):
            raise ValueError(f"cannot decode {self.fail_on}")
        return [Path(a).stem for a in audio]


def test_a_failing_batch_is_retried_one_utterance_at_a_time(manifest):
    paths = [r["audio_filepath"] for r in read_nemo_manifest(manifest)]
    bad = Path(paths[2]).stem
    fake = _RecordingModel(fail_on=bad)
    rows = transcribe_paths(fake, manifest, batch_duration=None)
    assert [r["pred_text"] for r in rows] == [None if Path(p).stem == bad else Path(p).stem for p in paths]
    assert rows[2]["error"] == f"ValueError: cannot decode {bad}"
    assert [len(call) for call, _ in fake.calls] == [len(paths)] + [1] * len(paths)


@pytest.mark.parametrize("limits", [{"batch_duration": 2.5}, {"batch_duration": 2.5, "batch_size": 2}])
def test_model_is_called_once_per_duration_batch(manifest, limits):
    durations = {r["audio_filepath"]: r["duration"] for r in read_nemo_manifest(manifest)}
    fake = _RecordingModel()
    rows = transcribe_paths(fake, manifest, **limits)
    assert [r["pred_text"] for r in rows] == [Path(p).stem for p in durations]
    assert sorted(a for call, _ in fake.calls for a in call) == sorted(durations)
    for call, batch_size in fake.calls:
        assert batch_size == len(call) <= limits.get("batch_size", len(call))
        assert len(call) == 1 or sum(durations[a] for a in call) <= limits["batch_duration"]
    longest = [max(durations[a] for a in call) for call, _ in fake.calls]
    assert longest == sorted(longest, reverse=True)


def test_plan_batches_invariants():
    rng = random.Random(0)
    durations = [rng.uniform(0.1, 20.0) for _ in range(300)]
    for batch_duration, batch_size in ((30.0, None), (30.0, 4), (None, 7), (5.0, None)):
        batches = plan_batches(durations, batch_duration, batch_size)
        assert sorted(i for b in batches for i in b) == list(range(len(durations)))
        flat = [durations[i] for b in batches for i in b]
        assert flat == sorted(durations, reverse=True)
        for b in batches:
            assert batch_size is None or len(b) <= batch_size
            assert batch_duration is None or len(b) == 1 or sum(durations[i] for i in b) <= batch_duration
    assert plan_batches([], 10.0, None) == []


def test_unknown_key_fails_with_a_suggestion(archive, manifest):
    result = subprocess.run(
        [sys.executable, "-m", "speechtrain.asr.transcribe", f"model_path={archive}", f"audio={manifest}",
         "batch_durations=3"],
        capture_output=True, text=True, env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}, timeout=120,
    )  # fmt: skip
    assert result.returncode != 0
    assert "Unknown config key 'batch_durations'. Did you mean 'batch_duration'?" in result.stderr


@pytest.mark.parametrize(
    "argv, message",
    [
        (["audio=x.json"], "Missing model_path=..."),
        (["model_path=m.stm", "audio=x.json", "precision=fp16"], "precision=fp16: expected one of 32, bf16"),
        (["model_path=m.stm", "audio", "batch_size=2"], "Arguments must be key=value"),
        (["model_path=m.stm", "audio=x.json", "batch_duration=0"], "batch_duration must be > 0 seconds or null"),
        (["model_path=missing.stm", "audio=x.json"], "model_path=missing.stm: no such file"),
        (["model_path=m.stm", "audio=x.json", "split=silence"], "split=silence: expected one of pauses, fixed"),
        (["model_path=m.stm", "audio=x.json", "min_pause=0"], "min_pause=0.0: expected seconds > 0"),
    ],
)
def test_bad_arguments_exit_with_a_clear_message(argv, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match=message):
        main(argv)
