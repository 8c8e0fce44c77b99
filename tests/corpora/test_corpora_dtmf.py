import json
import multiprocessing
import re
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pytest
import soundfile as sf

from speechtrain.corpora import dtmf as synthetic
from speechtrain.corpora.cache import default_datasets_cache
from speechtrain.corpora.dtmf import (
    DTMF_FREQUENCIES,
    make_dtmf_corpus,
    prepare_dtmf_corpus,
    render_digits,
)


def _read_manifest(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _wav_bytes(folder):
    return {p.name: p.read_bytes() for p in sorted((folder / "audio").glob("*.wav"))}


def test_same_seed_gives_identical_files_and_other_seed_differs(tmp_path):
    a = make_dtmf_corpus(tmp_path / "a", 6, seed=3)
    b = make_dtmf_corpus(tmp_path / "b", 6, seed=3)
    c = make_dtmf_corpus(tmp_path / "c", 6, seed=4)
    assert a.read_bytes() == b.read_bytes()
    assert _wav_bytes(a.parent) == _wav_bytes(b.parent)
    assert len(_wav_bytes(a.parent)) == 6
    assert a.read_bytes() != c.read_bytes()
    assert all(wa != wc for wa, wc in zip(_wav_bytes(a.parent).values(), _wav_bytes(c.parent).values()))


def test_utterance_depends_only_on_seed_and_index(tmp_path):
    small = make_dtmf_corpus(tmp_path / "small", 3, seed=1)
    large = make_dtmf_corpus(tmp_path / "large", 5, seed=1)
    assert _read_manifest(large)[:3] == _read_manifest(small)
    assert list(_wav_bytes(large.parent).values())[:3] == list(_wav_bytes(small.parent).values())


def test_manifest_matches_wavs(tmp_path):
    manifest = make_dtmf_corpus(tmp_path, 20, seed=0)
    records = _read_manifest(manifest)
    assert len(records) == 20
    lengths = set()
    for record in records:
        assert set(record) == {"audio_filepath", "duration", "text"}
        assert not record["audio_filepath"].startswith("/")
        info = sf.info(str(tmp_path / record["audio_filepath"]))
        assert (info.samplerate, info.channels, info.subtype, info.format) == (16000, 1, "PCM_16", "WAV")
        assert record["duration"] == round(info.frames / 16000, 4)
        assert re.fullmatch(r"\d( \d){1,7}", record["text"])
        # Each digit lasts at least 70 ms plus the two edge silences.
        assert record["duration"] > 0.07 * len(record["text"].split()) + 0.1
        lengths.add(len(record["text"].split()))
    assert len(lengths) > 2


def test_edges_are_quieter_than_the_tones(tmp_path):
    manifest = make_dtmf_corpus(tmp_path, 5, seed=2)
    for record in _read_manifest(manifest):
        audio, sr = sf.read(str(tmp_path / record["audio_filepath"]), dtype="float32")
        edge = int(0.04 * sr)
        rms = float(np.sqrt(np.mean(audio**2)))
        assert np.sqrt(np.mean(audio[:edge] ** 2)) < 0.5 * rms
        assert np.sqrt(np.mean(audio[-edge:] ** 2)) < 0.5 * rms
        assert np.abs(audio).max() < 1.0


def _dominant_pair(audio, sample_rate):
    n_fft = 1 << 16  # zero-padding: a fine frequency grid for short tones
    spectrum = np.abs(np.fft.rfft(audio * np.hanning(len(audio)), n_fft))
    freqs = np.fft.rfftfreq(n_fft, 1.0 / sample_rate)
    first = freqs[np.argmax(spectrum)]
    spectrum[np.abs(freqs - first) < 60.0] = 0.0
    second = freqs[np.argmax(spectrum)]
    return sorted((first, second))


@pytest.mark.parametrize("digit", list("0123456789"))
def test_rendered_digit_is_its_dtmf_pair(digit):
    for seed in range(3):
        audio = render_digits(digit, np.random.default_rng(seed))
        low, high = _dominant_pair(audio, 16000)
        expected_low, expected_high = DTMF_FREQUENCIES[digit]
        # Frequencies are jittered by up to 1.5% per utterance.
        assert abs(low / expected_low - 1) < 0.02, (digit, low)
        assert abs(high / expected_high - 1) < 0.02, (digit, high)
        assert abs(low / high - expected_low / expected_high) < 1e-2


def test_keypad_mapping():
    assert DTMF_FREQUENCIES["0"] == (941.0, 1336.0)
    assert DTMF_FREQUENCIES["1"] == (697.0, 1209.0)
    assert DTMF_FREQUENCIES["6"] == (770.0, 1477.0)
    assert DTMF_FREQUENCIES["8"] == (852.0, 1336.0)
    assert len(set(DTMF_FREQUENCIES.values())) == 10


@pytest.mark.parametrize("digits", ["", "12a", "1 2"])
def test_render_rejects_non_digits(digits):
    with pytest.raises(ValueError, match="digits"):
        render_digits(digits, np.random.default_rng(0))


def test_make_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="num_utterances"):
        make_dtmf_corpus(tmp_path, -1)
    with pytest.raises(ValueError, match="sample_rate"):
        make_dtmf_corpus(tmp_path, 1, sample_rate=4000)
    with pytest.raises(ValueError, match="id_prefix"):
        make_dtmf_corpus(tmp_path, 1, id_prefix="../x")


def test_other_sample_rate(tmp_path):
    manifest = make_dtmf_corpus(tmp_path, 2, sample_rate=8000)
    for record in _read_manifest(manifest):
        info = sf.info(str(tmp_path / record["audio_filepath"]))
        assert info.samplerate == 8000
        assert record["duration"] == round(info.frames / 8000, 4)


def test_prepare_builds_splits_with_distinct_seeds(tmp_path):
    manifests = prepare_dtmf_corpus(tmp_path, {"train": 4, "val": 3}, seed=0)
    assert manifests == {"train": tmp_path / "train" / "manifest.json", "val": tmp_path / "val" / "manifest.json"}
    train, val = _read_manifest(manifests["train"]), _read_manifest(manifests["val"])
    assert (len(train), len(val)) == (4, 3)
    assert train[0]["audio_filepath"] == "audio/dtmf-train-000000.wav"
    assert val[0]["audio_filepath"] == "audio/dtmf-val-000000.wav"
    train_audio = (tmp_path / "train" / train[0]["audio_filepath"]).read_bytes()
    val_audio = (tmp_path / "val" / val[0]["audio_filepath"]).read_bytes()
    assert train_audio != val_audio
    recorded = json.loads((tmp_path / "corpus.json").read_text())
    assert recorded["seed"] == 0 and recorded["splits"] == {"train": 4, "val": 3}


def test_prepare_reuses_a_finished_build(tmp_path, monkeypatch):
    prepare_dtmf_corpus(tmp_path, {"train": 3}, seed=5)
    before = _wav_bytes(tmp_path / "train")

    def fail(*args, **kwargs):
        raise AssertionError("rebuilt a corpus that should have been reused")

    monkeypatch.setattr(synthetic, "make_dtmf_corpus", fail)
    assert prepare_dtmf_corpus(tmp_path, {"train": 3}, seed=5) == {"train": tmp_path / "train" / "manifest.json"}
    assert _wav_bytes(tmp_path / "train") == before


def test_prepare_rebuilds_after_interruption(tmp_path, monkeypatch):
    real = synthetic.make_dtmf_corpus

    def interrupted(out_dir, *args, **kwargs):
        if out_dir.name == "val":
            raise KeyboardInterrupt
        return real(out_dir, *args, **kwargs)

    monkeypatch.setattr(synthetic, "make_dtmf_corpus", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare_dtmf_corpus(tmp_path, {"train": 2, "val": 2})
    assert not (tmp_path / "corpus.json").exists()

    monkeypatch.setattr(synthetic, "make_dtmf_corpus", real)
    manifests = prepare_dtmf_corpus(tmp_path, {"train": 2, "val": 2})
    assert len(_read_manifest(manifests["val"])) == 2
    assert (tmp_path / "corpus.json").exists()


def test_prepare_rebuilds_when_parameters_or_files_change(tmp_path):
    prepare_dtmf_corpus(tmp_path, {"train": 5}, seed=0)
    seed0 = _wav_bytes(tmp_path / "train")

    prepare_dtmf_corpus(tmp_path, {"train": 5}, seed=1)
    seed1 = _wav_bytes(tmp_path / "train")
    assert seed1.keys() == seed0.keys() and seed1 != seed0

    # A smaller build leaves no stale wavs behind.
    prepare_dtmf_corpus(tmp_path, {"train": 2}, seed=1)
    assert sorted(_wav_bytes(tmp_path / "train")) == ["dtmf-train-000000.wav", "dtmf-train-000001.wav"]

    # A truncated manifest is noticed even though corpus.json matches.
    manifest = tmp_path / "train" / "manifest.json"
    manifest.write_text(manifest.read_text().splitlines()[0] + "\n")
    prepare_dtmf_corpus(tmp_path, {"train": 2}, seed=1)
    assert len(_read_manifest(manifest)) == 2


@pytest.mark.parametrize("splits", [{"": 1}, {"a/b": 1}, {"..": 1}, {"train": -1}, {"train": 1.5}])
def test_prepare_rejects_bad_splits(tmp_path, splits):
    with pytest.raises(ValueError, match="split"):
        prepare_dtmf_corpus(tmp_path, splits)


def test_default_root_follows_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("SPEECHTRAIN_DATASETS_CACHE", raising=False)
    monkeypatch.delenv("SPEECHTRAIN_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_datasets_cache() == tmp_path / "home" / ".cache" / "speechtrain" / "datasets"

    monkeypatch.setenv("SPEECHTRAIN_HOME", str(tmp_path / "st"))
    assert default_datasets_cache() == tmp_path / "st" / "datasets"

    monkeypatch.setenv("SPEECHTRAIN_DATASETS_CACHE", str(tmp_path / "cache"))
    assert default_datasets_cache() == tmp_path / "cache"
    manifests = prepare_dtmf_corpus(splits={"val": 1})
    assert manifests == {"val": tmp_path / "cache" / "dtmf-v1" / "val" / "manifest.json"}
    assert manifests["val"].is_file()


@pytest.mark.multiprocess
def test_concurrent_prepares_agree_with_a_single_build(tmp_path):
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(2, mp_context=context) as pool:
        futures = [pool.submit(prepare_dtmf_corpus, tmp_path / "shared", {"train": 40}, 7) for _ in range(2)]
        results = [f.result(timeout=120) for f in futures]
    assert results[0] == results[1]
    prepare_dtmf_corpus(tmp_path / "alone", {"train": 40}, 7)
    assert results[0]["train"].read_bytes() == (tmp_path / "alone" / "train" / "manifest.json").read_bytes()
    assert _wav_bytes(tmp_path / "shared" / "train") == _wav_bytes(tmp_path / "alone" / "train")
