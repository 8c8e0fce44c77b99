import json

import numpy as np
import pytest
import soundfile as sf
import torch

from speechtrain.common.batch import is_empty_batch
from speechtrain.common.tokenizers import CharTokenizer
from speechtrain.data.audio_text import SkipTally
from speechtrain.data.cut_datasets import AsrCutDataset, SalmCutDataset, TtsCutDataset
from speechtrain.data.lhotse_loader import (
    CutBatch,
    LoaderConfig,
    get_lhotse_dataloader_from_config,
    loader_config,
    read_cuts,
)

SR = 16000
TOKENIZER = CharTokenizer([" ", *"abcdefghijklmnopqrstuvwxyz"])


def _corpus(tmp_path, rows):
    """rows: (name, seconds, text, extra fields); writes 16 kHz wavs and a manifest; returns its path."""
    lines = []
    for i, (name, seconds, text, extra) in enumerate(rows):
        if name is not None and seconds > 0:
            samples = (0.2 * np.sin(np.arange(int(seconds * SR)) * (0.05 + 0.01 * i))).astype(np.float32)
            sf.write(tmp_path / name, samples, SR, subtype="FLOAT")
        lines.append(json.dumps({"audio_filepath": str(tmp_path / (name or "none.wav")), "duration": seconds,
                                 "text": text, **extra}))  # fmt: skip
    manifest = tmp_path / "manifest.json"
    manifest.write_text("\n".join(lines) + "\n")
    return manifest


def test_tts_batches_text_audio_and_speakers(tmp_path):
    manifest = _corpus(tmp_path, [("a.wav", 0.2, "hello", {"speaker": "anna"}),
                                  ("b.wav", 0.3, "hi there", {"speaker": "bob"}),
                                  ("c.wav", 0.1, "who", {"speaker": "carl"})])  # fmt: skip
    cuts = read_cuts(LoaderConfig(manifest_filepath=str(manifest)))
    dataset = TtsCutDataset(TOKENIZER, speakers={"anna": 0, "bob": 1})
    batch = dataset[CutBatch(cuts, 0)]
    assert batch["texts"] == ["hello", "hi there"] and batch["speaker_ids"].tolist() == [0, 1]
    assert batch["text_lens"].tolist() == [5, 8] and batch["text_tokens"][0, :5].tolist() == TOKENIZER.encode("hello")
    assert batch["audio_lens"].tolist() == [3200, 4800] and batch["audio"].shape == (2, 4800)
    assert batch["skipped"] == {"unknown_speaker": 1}
    # Without a speaker table the names are passed through.
    assert TtsCutDataset(TOKENIZER)[cuts]["speakers"] == ["anna", "bob", "carl"]


def test_tts_batches_codec_codes_and_context_audio(tmp_path):
    np.save(tmp_path / "a.npy", np.arange(8).reshape(2, 4))
    np.save(tmp_path / "b.npy", np.arange(12).reshape(2, 6))
    manifest = _corpus(tmp_path, [
        ("a.wav", 0.2, "one", {"codes": str(tmp_path / "a.npy"), "context": str(tmp_path / "b.wav")}),
        ("b.wav", 0.3, "two", {"codes": str(tmp_path / "b.npy"), "context": str(tmp_path / "a.wav")}),
        ("c.wav", 0.1, "three", {"codes": str(tmp_path / "missing.npy"), "context": str(tmp_path / "a.wav")}),
    ])  # fmt: skip
    cuts = read_cuts(LoaderConfig(manifest_filepath=str(manifest)))
    batch = TtsCutDataset(TOKENIZER, codes_field="codes", codes_pad_id=-1, context_field="context")[cuts]
    assert "audio" not in batch and batch["codes"].shape == (2, 2, 6) and batch["code_lens"].tolist() == [4, 6]
    assert batch["codes"][0, 1].tolist() == [4, 5, 6, 7, -1, -1]
    assert batch["context_audio_lens"].tolist() == [4800, 3200]
    assert batch["skipped"] == {"missing_codes": 1}


def test_salm_token_stream_and_loss_mask(tmp_path):
    manifest = _corpus(tmp_path, [("a.wav", 0.2, "yes", {}), ("b.wav", 0.2, "no", {"prompt": "say"})])
    cuts = read_cuts(LoaderConfig(manifest_filepath=str(manifest)))
    audio_id, bos, eos, pad = 100, 101, 102, 103
    dataset = SalmCutDataset(TOKENIZER, audio_locator_id=audio_id, bos_id=bos, eos_id=eos, pad_id=pad, prompt="what")
    batch = dataset[cuts]
    enc = TOKENIZER.encode
    first = [bos, *enc("what"), audio_id, *enc("yes"), eos]
    second = [bos, *enc("say"), audio_id, *enc("no"), eos]
    assert batch["input_ids"][0].tolist() == first
    assert batch["input_ids"][1].tolist() == second + [pad] * (len(first) - len(second))
    assert batch["input_lens"].tolist() == [len(first), len(second)]
    assert batch["audio_positions"].tolist() == [5, 4]
    # The loss covers the answer and eos only.
    assert batch["input_ids"][0][batch["loss_mask"][0]].tolist() == [*enc("yes"), eos]
    assert batch["input_ids"][1][batch["loss_mask"][1]].tolist() == [*enc("no"), eos]


def test_in_memory_cuts_are_read_through_lhotse(tmp_path):
    manifest = _corpus(tmp_path, [("a.wav", 0.2, "abc", {})])
    (cut,) = read_cuts(LoaderConfig(manifest_filepath=str(manifest)))
    expected = torch.from_numpy(sf.read(tmp_path / "a.wav", dtype="float32")[0])
    memory_cut = cut.move_to_memory(audio_format="flac")
    batch = AsrCutDataset(TOKENIZER)[[memory_cut]]
    assert torch.allclose(batch["audio"][0], expected, atol=1e-4)  # the corpus stores 16-bit samples
    broken = memory_cut.with_recording_path_prefix("")
    broken.recording.sources[0].source = b"not audio"
    assert AsrCutDataset(TOKENIZER)[[broken]]["skipped"] == {"unreadable_audio": 1}


def test_skips_from_loader_workers_add_up_in_the_training_process(tmp_path):
    rows = [(f"u{i}.wav", 0.1, "abc", {}) for i in range(12)]
    rows[2] = ("u2.wav", 0.1, "", {})  # empty transcript
    rows[5] = (None, 0.1, "abc", {})  # missing file
    rows[9] = (None, 0.1, "abc", {})
    manifest = _corpus(tmp_path, rows)
    loader = get_lhotse_dataloader_from_config(
        {"manifest_filepath": str(manifest), "batch_size": 3, "num_workers": 2, "use_bucketing": False}, 0, 1,
        AsrCutDataset(TOKENIZER),
    )  # fmt: skip
    tally = SkipTally()
    kept = 0
    for batch in loader:
        tally.add_batch(batch)
        kept += 0 if is_empty_batch(batch) else len(batch["ids"])
    assert kept == 9 and tally.counts == {"missing_audio": 2, "empty_text": 1}
    assert "missing_audio=2 (e.g. " in tally.take_summary() and tally.take_summary() is None


def test_tokens_per_second_filter_and_resampling_through_the_loader(tmp_path, caplog):
    rows = [("a.wav", 1.0, "ab", {}), ("b.wav", 1.0, "abcdefghijklmnop", {}), ("c.wav", 1.0, "abcdefg", {})]
    manifest = _corpus(tmp_path, rows)
    sf.write(tmp_path / "c.wav", np.zeros(8000, dtype=np.float32), 8000)  # stored at 8 kHz
    dataset = AsrCutDataset(TOKENIZER)
    with caplog.at_level("INFO", logger="speechtrain.data"):
        loader = get_lhotse_dataloader_from_config(
            {"manifest_filepath": str(manifest), "batch_size": 8, "min_tps": 3, "max_tps": 12}, 0, 1, dataset
        )
        (batch,) = list(loader)
    # Manifests are read lazily: the filters report once a pass has read them.
    assert "epoch 0: dataset filters kept 1 of 3" in caplog.text and "too_few_tokens_per_second=1" in caplog.text
    assert batch["ids"][0].startswith("c-") and batch["audio_lens"].tolist() == [SR]


def test_augmentation_config_is_typed_and_seeded_by_epoch(tmp_path):
    cfg = loader_config({"manifest_filepath": "x.json", "batch_size": 2,
                         "augmentation": {"gain": {"min_db": 3.0, "max_db": 3.0, "prob": 1.0}}})  # fmt: skip
    assert cfg.augmentation.gain.max_db == 3.0 and cfg.augmentation.speed is None
    with pytest.raises(Exception, match="Did you mean 'augmentation.speed'"):
        loader_config({"augmentation": {"sped": {"prob": 0.5}}})
    manifest = _corpus(tmp_path, [("a.wav", 0.1, "abc", {})])
    cuts = read_cuts(LoaderConfig(manifest_filepath=str(manifest)))
    augmented = AsrCutDataset.from_config(TOKENIZER, cfg)[CutBatch(cuts, 0)]["audio"]
    plain = AsrCutDataset(TOKENIZER)[CutBatch(cuts, 0)]["audio"]
    assert torch.allclose(augmented, plain * 10 ** (3 / 20), atol=1e-6)
