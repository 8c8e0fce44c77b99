import json

import numpy as np
import pytest
import soundfile as sf

from speechtrain.data.manifest import read_nemo_manifest
from speechtrain.data.speech_corpus import SAMPLE_RATE, build_corpus, plan, split_voices


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("espeak")
    return root, build_corpus(root, hours=0.03, seed=3, workers=2)


def test_plan_is_deterministic_and_splits_are_disjoint():
    first, second = plan(0.05, seed=1), plan(0.05, seed=1)
    assert first == second and plan(0.05, seed=2) != first
    texts = {split: {u.text for u in first if u.split == split} for split in ("train", "dev", "test")}
    assert (
        not texts["train"] & texts["dev"] and not texts["train"] & texts["test"] and not texts["dev"] & texts["test"]
    )
    voices = split_voices(1)
    assert voices["train"] == voices["dev"] and not set(voices["train"]) & set(voices["test"])
    assert {v.split("+")[1] for v in voices["train"]}.isdisjoint({v.split("+")[1] for v in voices["test"]})
    assert len(voices["train"]) >= 100


def test_corpus_files_match_their_manifests(corpus):
    root, record = corpus
    assert record["splits"]["train"]["utterances"] > record["splits"]["test"]["utterances"] > 0
    for split in ("train", "dev", "test"):
        records = read_nemo_manifest(root / split / "manifest.json")
        assert len(records) == record["splits"][split]["utterances"]
        for r in records[:10]:
            audio, rate = sf.read(r["audio_filepath"])
            assert rate == SAMPLE_RATE and abs(len(audio) / rate - r["duration"]) < 1e-3
            assert np.abs(audio).max() > 0.01, "silent audio"
            assert r["text"] and r["text"] == r["text"].lower()
    test_voices = {r["voice"] for r in read_nemo_manifest(root / "test" / "manifest.json")}
    train_voices = {r["voice"] for r in read_nemo_manifest(root / "train" / "manifest.json")}
    assert not test_voices & train_voices


def test_lhotse_cuts_load(corpus):
    from lhotse import CutSet

    root, record = corpus
    cuts = CutSet.from_file(root / "dev" / "cuts.jsonl.gz")
    assert len(cuts) == record["splits"]["dev"]["utterances"]
    cut = next(iter(cuts))
    assert cut.sampling_rate == SAMPLE_RATE and cut.supervisions[0].text
    assert cut.load_audio().shape == (1, cut.num_samples)


def test_finished_corpus_is_reused(corpus, monkeypatch):
    root, record = corpus
    import speechtrain.data.speech_corpus as module

    monkeypatch.setattr(module, "plan", lambda *a, **k: pytest.fail("a finished corpus must not be rebuilt"))
    assert build_corpus(root, hours=0.03, seed=3) == record
    assert json.loads((root / "corpus.json").read_text()) == record
