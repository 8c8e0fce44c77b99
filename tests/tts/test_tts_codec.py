import json

import pytest
import torch

from speechtrain.core.model import SpeechModel
from speechtrain.tts.codec import MelRVQCodec, kmeans, mel_distance
from speechtrain.tts.text import TextFrontEnd, TextFrontEndConfig, phonemize

SMALL = {"n_fft": 256, "win_length": 256, "hop_length": 64, "n_mels": 20, "num_codebooks": 3, "codebook_size": 8,
         "kmeans_iterations": 10, "griffin_lim_iterations": 8}  # fmt: skip


def _audio(seconds=(0.5, 0.3), rate=16000):
    generator = torch.Generator().manual_seed(0)
    waves = []
    for i, s in enumerate(seconds):
        t = torch.arange(int(s * rate)) / rate
        tone = torch.sin(2 * torch.pi * (300 + 200 * i) * t * (1 + t))  # a chirp
        waves.append(0.3 * tone + 0.01 * torch.randn(t.shape, generator=generator))
    lens = torch.tensor([w.numel() for w in waves])
    return torch.nn.utils.rnn.pad_sequence(waves, batch_first=True), lens


def _fitted_codec(**overrides):
    codec = MelRVQCodec({**SMALL, **overrides})
    audio, lens = _audio()
    log_mel, frames = codec.log_mel(audio, lens)
    codec.fit([log_mel[i, :, : frames[i]] for i in range(len(lens))])
    return codec


def test_kmeans_finds_well_separated_clusters():
    generator = torch.Generator().manual_seed(0)
    centres = torch.tensor([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0]])
    points = torch.cat([c + 0.1 * torch.randn(50, 2, generator=generator) for c in centres])
    found = kmeans(points, 3, 10, torch.Generator().manual_seed(1))
    distance = torch.cdist(centres, found).min(dim=1).values
    assert (distance < 0.1).all()
    with pytest.raises(ValueError, match="cannot make 4 clusters"):
        kmeans(points[:3], 4, 1, generator)


def test_round_trip_shapes_lengths_and_determinism():
    codec = _fitted_codec()
    audio, lens = _audio()
    codes, frames = codec.encode(audio, lens)
    assert codes.shape == (2, 3, int(frames.max())) and codes.dtype == torch.int64
    assert frames.tolist() == [(n // 64) + 1 for n in lens.tolist()]
    assert 0 <= int(codes.min()) and int(codes.max()) < 8
    assert torch.equal(codec.encode(audio, lens)[0], codes)
    decoded, decoded_lens = codec.decode(codes, frames)
    again, _ = codec.decode(codes, frames)
    assert torch.equal(decoded, again)  # zero initial phase: no randomness
    assert decoded_lens.tolist() == [(f - 1) * 64 for f in frames.tolist()]
    assert decoded[1, decoded_lens[1] :].abs().sum() == 0  # padding stays silent
    # Each utterance's codes do not depend on what it is batched with.
    alone, _ = codec.encode(audio[1:, : lens[1]], lens[1:])
    assert torch.equal(alone[0, :, : frames[1]], codes[1, :, : frames[1]])


def test_each_codebook_lowers_the_quantisation_error():
    codec = _fitted_codec()
    audio, lens = _audio()
    log_mel, frames = codec.log_mel(audio, lens)
    codes = codec.quantize(log_mel)
    errors = [mel_distance(log_mel, codec.dequantize(codes[:, :k]), frames) for k in (1, 2, 3)]
    assert errors[0] > errors[1] > errors[2]


def test_archive_round_trip_and_unfitted_codec(tmp_path):
    codec = _fitted_codec()
    codec.save_to(tmp_path / "codec.stm")
    restored = SpeechModel.restore_from(tmp_path / "codec.stm")
    audio, lens = _audio()
    assert torch.equal(restored.encode(audio, lens)[0], codec.encode(audio, lens)[0])
    with pytest.raises(RuntimeError, match="no codebooks yet"):
        MelRVQCodec(SMALL).encode(audio, lens)


def test_text_front_end_characters_and_phonemes():
    chars = TextFrontEnd(TextFrontEndConfig(kind="chars"))
    assert chars.fit(["Hello  World", "ok"]) == [" ", "d", "e", "h", "k", "l", "o", "r", "w"]
    assert chars.encode("hello") == [3, 2, 5, 5, 6]
    with pytest.raises(ValueError, match="'z'"):
        chars.encode("zoo")
    assert phonemize("the cat") == "ðə kˈæt"
    phonemes = TextFrontEnd(TextFrontEndConfig(kind="phonemes"))
    phonemes.fit(["the cat sat"])
    assert phonemes.symbols("The  Cat") == "ðə kˈæt" and len(phonemes.encode("the cat")) == 7
    with pytest.raises(ValueError, match="text.kind"):
        TextFrontEnd(TextFrontEndConfig(kind="graphemes"))


def test_codec_train_example_fits_saves_and_reports(tmp_path, dtmf_manifest, capsys):
    import importlib.util
    from pathlib import Path

    from speechtrain.core.hydra_runner import compose_config

    script = Path(__file__).resolve().parents[2] / "examples" / "codec_train.py"
    spec = importlib.util.spec_from_file_location("codec_train", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    overrides = [f"train_manifest={dtmf_manifest}", f"eval_manifest={dtmf_manifest}", "max_utterances=20",
                 "eval_utterances=4", f"output={tmp_path / 'codec.stm'}",
                 *[f"codec.{k}={v}" for k, v in SMALL.items()]]  # fmt: skip
    module.main(compose_config(script.parent / "conf", "codec_train", overrides, module.CodecTrainJob))
    out = capsys.readouterr().out
    report = json.loads(out[out.index("{") :])
    assert report["archive"] == str(tmp_path / "codec.stm") and (tmp_path / "codec.stm").is_file()
    assert report["utterances"] == 4 and report["mse_after_3"] < report["mse_after_1"]
