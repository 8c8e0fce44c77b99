import json
import logging

import numpy as np
import pytest
import soundfile as sf
import torch
from torch.utils.data import DataLoader

from speechtrain.common.tokenizers import CharTokenizer
from speechtrain.corpora.dtmf import make_dtmf_corpus
from speechtrain.data import audio_text
from speechtrain.data.audio_text import SKIP_REASONS, AudioTextDataset, collate_audio_text

SR = 16000
TOKENIZER = CharTokenizer(list(" abc"))


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    """Each test sees the process-wide 'warned once' memory empty."""
    monkeypatch.setattr(audio_text, "_warned_reasons", set())


def _wav(path, samples, sample_rate=SR, subtype="PCM_16"):
    sf.write(path, samples, sample_rate, subtype=subtype, format="WAV")
    return path.name


def _tone(n, seed=0):
    return (0.3 * np.random.default_rng(seed).uniform(-1, 1, n)).astype(np.float32)


def _manifest(folder, rows):
    path = folder / "manifest.json"
    lines = [
        json.dumps({"audio_filepath": row[0], "duration": row[1], "text": row[2], **dict(*row[3:])}) for row in rows
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _bad_input(folder, reason):
    """A manifest row that is bad for ``reason``: (audio_filepath, duration, text)."""
    name = f"{reason}.wav"
    if reason == "empty_text":
        return _wav(folder / name, _tone(800)), 0.05, "  "
    if reason == "unencodable_text":
        return _wav(folder / name, _tone(800)), 0.05, "abZ"
    if reason == "missing_audio":
        return name, 0.05, "abc"
    if reason == "unreadable_audio":
        (folder / name).write_bytes(b"RIFF\x00\x00not really a wav file at all")
        return name, 0.05, "abc"
    if reason == "wrong_sample_rate":
        return _wav(folder / name, _tone(400), sample_rate=8000), 0.05, "abc"
    if reason == "empty_audio":
        return _wav(folder / name, np.zeros(0, dtype=np.float32)), 0.0, "abc"
    if reason == "non_finite_audio":
        samples = _tone(800)
        samples[100] = np.nan
        return _wav(folder / name, samples, subtype="FLOAT"), 0.05, "abc"
    raise AssertionError(reason)


def test_good_item(tmp_path):
    samples = _tone(1600)
    manifest = _manifest(tmp_path, [(_wav(tmp_path / "utt1.wav", samples), 0.1, "ab c")])
    dataset = AudioTextDataset(manifest, TOKENIZER)
    assert len(dataset) == 1
    item = dataset[0]
    assert item["id"] == "utt1"
    assert item["audio"].dtype == torch.float32 and item["audio"].shape == (1600,)
    expected = np.round(samples * 32768) / 32768  # 16-bit PCM quantization
    assert torch.allclose(item["audio"], torch.from_numpy(expected.astype(np.float32)), atol=1e-4)
    assert item["tokens"].dtype == torch.long
    assert item["tokens"].tolist() == TOKENIZER.encode("ab c")
    assert not dataset.skipped


@pytest.mark.parametrize("subtype", ["PCM_16", "PCM_24", "FLOAT"])
def test_every_sample_format_reads_as_libsndfile_scales_it(tmp_path, subtype):
    # 16-bit files take a faster integer path; its values must be exactly libsndfile's float conversion.
    samples = _tone(1600, seed=3)
    samples[:4] = [-1.0, 1.0 - 2**-15, 0.0, -(2**-15)]
    name = _wav(tmp_path / "u.wav", samples, subtype=subtype)
    item = AudioTextDataset(_manifest(tmp_path, [(name, 0.1, "a")]), TOKENIZER)[0]
    expected, _ = sf.read(tmp_path / name, dtype="float32")
    assert torch.equal(item["audio"], torch.from_numpy(expected))


def test_stereo_is_averaged_to_mono(tmp_path):
    left, right = _tone(800, seed=1), _tone(800, seed=2)
    name = _wav(tmp_path / "st.wav", np.stack([left, right], axis=1), subtype="FLOAT")
    dataset = AudioTextDataset(_manifest(tmp_path, [(name, 0.05, "a")]), TOKENIZER)
    assert torch.allclose(dataset[0]["audio"], torch.from_numpy((left + right) / 2), atol=1e-7)


def test_offset_reads_a_segment(tmp_path):
    samples = _tone(SR)
    name = _wav(tmp_path / "long.wav", samples, subtype="FLOAT")
    dataset = AudioTextDataset(_manifest(tmp_path, [(name, 0.25, "a", {"offset": 0.5})]), TOKENIZER)
    item = dataset[0]
    assert item["id"] == "long@0.500"
    assert torch.equal(item["audio"], torch.from_numpy(samples[8000:12000]))


def test_other_sample_rates_are_resampled_on_the_fly(tmp_path):
    t = np.arange(8000) / 8000
    name = _wav(tmp_path / "8k.wav", (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), sample_rate=8000,
                subtype="FLOAT")  # fmt: skip
    item = AudioTextDataset(_manifest(tmp_path, [(name, 1.0, "a")]), TOKENIZER)[0]
    assert item["audio"].shape == (SR,)
    # The same tone, now at 16 kHz (away from the edges, where the resampling filter sees zeros).
    expected = 0.5 * np.sin(2 * np.pi * 440 * np.arange(SR) / SR)
    assert np.abs(item["audio"].numpy()[200:-200] - expected[200:-200]).max() < 1e-2


@pytest.mark.parametrize("reason", SKIP_REASONS)
def test_each_bad_input_is_skipped_counted_and_warned_once(tmp_path, caplog, reason):
    good = _wav(tmp_path / "good.wav", _tone(800))
    first = _bad_input(tmp_path, reason)
    second_folder = tmp_path / "more"
    second_folder.mkdir()
    second = _bad_input(second_folder, reason)
    second = (f"more/{second[0]}", *second[1:])
    manifest = _manifest(tmp_path, [(good, 0.05, "abc"), first, second])
    dataset = AudioTextDataset(manifest, TOKENIZER, resample=False)

    with caplog.at_level(logging.WARNING, logger="speechtrain.data"):
        items = [dataset[i] for i in range(len(dataset))]
        again = dataset[1]

    assert items[0] is not None and items[1] is None and items[2] is None and again is None
    assert dataset.skipped == {reason: 3}
    warnings = [r for r in caplog.records if r.name == "speechtrain.data"]
    assert len(warnings) == 1
    assert warnings[0].levelno == logging.WARNING
    assert str(tmp_path / first[0]) in warnings[0].getMessage()
    assert reason in warnings[0].getMessage()
    assert f"skipped 3 ({reason}=3)" in dataset.summary()


def test_every_reason_warns_once_across_a_mixed_manifest(tmp_path, caplog):
    manifest = _manifest(tmp_path, [_bad_input(tmp_path, reason) for reason in SKIP_REASONS])
    dataset = AudioTextDataset(manifest, TOKENIZER, resample=False)
    with caplog.at_level(logging.WARNING, logger="speechtrain.data"):
        assert collate_audio_text([dataset[i] for i in range(len(dataset))]) is None
        assert all(dataset[i] is None for i in range(len(dataset)))
    assert dataset.skipped == {reason: 2 for reason in SKIP_REASONS}
    assert len([r for r in caplog.records if r.name == "speechtrain.data"]) == len(SKIP_REASONS)


def test_duration_filters_are_counted(tmp_path):
    name = _wav(tmp_path / "a.wav", _tone(800))
    rows = [(name, d, "a") for d in (0.05, 0.5, 1.0, 2.0, 3.0)]
    dataset = AudioTextDataset(_manifest(tmp_path, rows), TOKENIZER, min_duration=0.5, max_duration=2.0)
    assert dataset.durations == [0.5, 1.0, 2.0]
    assert len(dataset) == 3
    assert dataset.filtered == {"too_short": 1, "too_long": 1}
    summary = dataset.summary()
    assert "3 utterances" in summary
    assert "filtered by duration 2 (too_long=1, too_short=1)" in summary
    assert "skipped 0" in summary


def test_invalid_arguments(tmp_path):
    manifest = _manifest(tmp_path, [])
    with pytest.raises(ValueError, match="min_duration"):
        AudioTextDataset(manifest, TOKENIZER, min_duration=2.0, max_duration=1.0)
    with pytest.raises(ValueError, match="sample_rate"):
        AudioTextDataset(manifest, TOKENIZER, sample_rate=0)
    with pytest.raises(FileNotFoundError):
        AudioTextDataset(tmp_path / "missing.json", TOKENIZER)


def _item(uid, audio_len, tokens):
    return {"id": uid, "audio": torch.arange(1, audio_len + 1, dtype=torch.float32), "tokens": torch.tensor(tokens)}


def test_collate_pads_and_drops_bad_items():
    batch = collate_audio_text([_item("a", 3, [1, 2]), None, _item("b", 5, [3]), _item("c", 1, [1, 1, 1])])
    assert batch["ids"] == ["a", "b", "c"]
    assert batch["audio"].dtype == torch.float32 and batch["audio"].shape == (3, 5)
    assert batch["audio_lens"].dtype == torch.long and batch["audio_lens"].tolist() == [3, 5, 1]
    assert batch["tokens"].dtype == torch.long and batch["tokens"].shape == (3, 3)
    assert batch["token_lens"].dtype == torch.long and batch["token_lens"].tolist() == [2, 1, 3]
    assert batch["audio"].tolist() == [[1, 2, 3, 0, 0], [1, 2, 3, 4, 5], [1, 0, 0, 0, 0]]
    assert batch["tokens"].tolist() == [[1, 2, 0], [3, 0, 0], [1, 1, 1]]


def test_collate_of_only_bad_items_is_none():
    assert collate_audio_text([None, None]) is None
    assert collate_audio_text([]) is None


def test_dtmf_corpus_through_a_dataloader(tmp_path):
    manifest = make_dtmf_corpus(tmp_path, 10, seed=0)
    records = [json.loads(line) for line in manifest.read_text().splitlines()]
    tokenizer = CharTokenizer.from_texts(r["text"] for r in records)
    dataset = AudioTextDataset(manifest, tokenizer)
    batches = list(DataLoader(dataset, batch_size=4, collate_fn=collate_audio_text))
    assert [len(b["ids"]) for b in batches] == [4, 4, 2]
    for start, batch in zip(range(0, 10, 4), batches):
        for row, record in enumerate(records[start : start + 4]):
            assert round(int(batch["audio_lens"][row]) / SR, 4) == record["duration"]
            tokens = batch["tokens"][row, : batch["token_lens"][row]]
            assert tokenizer.decode(tokens) == record["text"]
    assert not dataset.skipped
