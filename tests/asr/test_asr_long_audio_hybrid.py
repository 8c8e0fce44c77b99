"""Long files through the transcribe CLI (a real process) with the demo recipe's own model: a hybrid TDT-CTC
Conformer composed from ``asr_train_hybrid.yaml`` at a tiny width (its half-rate middle layers, self-conditioned
intermediate CTC, TDT frame stacking and a 64-piece BPE tokenizer kept), with a word LM in its archive as the demo's
has. Greedy and beam, with word timestamps; on a 2-minute file the chunked transcript (``split=fixed``) equals the
whole-file decode; a 45 s file split at its pauses (the default) decodes as its stretches of speech do alone.

The model is random, with its self-attention's values zeroed: every frame then depends on a bounded stretch of
audio (convolutions and feed-forward layers only), shorter than the chunks' context, so chunking may not change a
single output frame and the merged transcript must be the whole file's, token for token (a trained model attends
over its whole input, and chunk borders then differ a little). The 10-minute file is marked slow.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from speechtrain.asr.ngram import NgramLM

ROOT = Path(__file__).resolve().parents[2]
BLANK_BIAS = 0.0
TEXT = ["the cat sat on the mat", "a dog ran to the park", "seven hundred and twenty five", "press one for billing",
        "the student avoids the railway bridge", "their aunt moved to bern in march"]  # fmt: skip


def _demo_model(folder: Path):
    """The demo recipe's model class and layout at a tiny width, random, attention values zeroed, saved with a
    BPE tokenizer and a word 3-gram LM."""
    from speechtrain.asr.transducer import ConformerTransducerConfig, ConformerTransducerModel
    from speechtrain.common.tokenizers import train_sentencepiece
    from speechtrain.core.hydra_runner import compose_config
    from speechtrain.core.job import train_job_schema

    tokenizer = train_sentencepiece(TEXT * 20, folder / "bpe", vocab_size=64)
    lm = NgramLM.fit(TEXT, order=3).write_arpa(folder / "lm.arpa")
    overrides = [f"model.tokenizer.path={tokenizer}", "model.encoder.d_model=16", "model.encoder.num_heads=2",
                 "model.encoder.subsampling_conv_channels=8", "model.encoder.conv_kernel_size=5",
                 "model.preprocessor.n_mels=20", "model.preprocessor.dither=0.0", "model.preprocessor.kind=nemo",
                 "model.prediction.pred_hidden=16", "model.joint.joint_hidden=16",
                 f"model.decoding.lm_path={lm}"]  # fmt: skip
    cfg = compose_config(ROOT / "examples" / "conf", "asr_train_hybrid", overrides,
                         train_job_schema(ConformerTransducerConfig))  # fmt: skip
    assert cfg.model.hybrid and cfg.model.joint.frame_stack == 2 and cfg.model.encoder.time_reduce_idx >= 0
    torch.manual_seed(0)
    model = ConformerTransducerModel(cfg.model)
    model.configure_model()
    model.eval()  # (after the layers are built: they are built in training mode)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ".attention.value." in name and name.endswith("weight"):
                parameter.zero_()  # each frame then hears only its neighbourhood (see the module docstring)
        model.joint.out.bias[model.blank] += BLANK_BIAS  # a random model that emits a label every few frames,
        model.decoder.bias[model.blank] += BLANK_BIAS  # as a trained one does,
        model.joint.out.bias[-1] += 4.0  # and moves on by TDT's longest duration, as a trained one mostly does
    path = folder / "hybrid.stm"
    model.save_to(path)
    return model, path


def _long_file(path: Path, seconds: float) -> np.ndarray:
    """Noise bursts of random lengths and levels, like words between pauses, repeated every 2 s (see the module
    docstring: every chunk's window then holds whole periods, and its per-band statistics are the file's)."""
    rng = np.random.default_rng(0)
    period = np.zeros(2 * 16000, dtype=np.float32)
    start = int(0.1 * 16000)
    while (length := int(rng.uniform(0.15, 0.4) * 16000)) + start <= int(1.85 * 16000):  # silent around the borders
        period[start : start + length] = rng.uniform(0.02, 0.3) * rng.standard_normal(length)
        start += length + int(rng.uniform(0.05, 0.2) * 16000)
    audio = np.tile(period, int(seconds // 2))
    sf.write(path, audio, 16000, subtype="FLOAT")
    return audio


def _cli(model_path: Path, audio: Path, out: Path, decoding: str, decoder_type: str = "transducer",
         split: str = "fixed") -> dict:  # fmt: skip
    command = [sys.executable, "-m", "speechtrain.asr.transcribe", f"model_path={model_path}", f"audio={audio}",
               f"output={out}", f"decoding={decoding}", f"decoder_type={decoder_type}", "timestamps=true",
               "device=cpu", f"split={split}"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False,
                          env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "RTFx" in done.stdout, done.stdout
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    return row


def _check(row: dict, seconds: float) -> None:
    assert "error" not in row and isinstance(row["pred_text"], str) and row["pred_text"], row.get("error")
    words = row["words"]
    assert words, "word timestamps"
    times = [t for w in words for t in (w["start"], w["end"])]
    assert times == sorted(times) and times[-1] <= seconds + 0.1
    assert words[-1]["end"] > seconds - 40, "words from the last chunks too"


@pytest.mark.parametrize(
    ("decoding", "decoder_type"),
    [("greedy", "transducer"), pytest.param("beam", "transducer", marks=pytest.mark.slow),
     pytest.param("greedy", "ctc", marks=pytest.mark.slow), pytest.param("beam", "ctc", marks=pytest.mark.slow)],
)  # fmt: skip
def test_a_two_minute_file_decodes_in_chunks_as_the_whole_file(tmp_path, decoding, decoder_type):
    """Either decoder of the hybrid (its TDT decoder, or its CTC head: decoder_type=ctc), greedy or beam + LM."""
    model, path = _demo_model(tmp_path)
    audio = _long_file(tmp_path / "two_minutes.wav", 120.0)
    row = _cli(path, tmp_path / "two_minutes.wav", tmp_path / "out.json", decoding, decoder_type)
    _check(row, 120.0)
    model.cfg.decoder_type = decoder_type
    with torch.inference_mode():  # the whole file at once: 120 s fits in memory
        enc, lengths = model(torch.from_numpy(audio)[None], torch.tensor([len(audio)]))
        whole = model.decode(enc, lengths, decoding)[0]
    assert row["pred_text"] == whole
    if decoding == "beam":
        assert set(row["pred_text"].split()) <= {w for t in TEXT for w in t.split()}, "beam + LM: the LM's words"
    elif decoder_type == "transducer":  # timestamps: the greedy alignment of the whole file
        from speechtrain.asr.transducer_decoding import word_timestamps

        with torch.inference_mode():
            (hypothesis,) = model.greedy_hypotheses(enc, lengths)
        stacked = 0.04 * model.cfg.joint.frame_stack
        expected = word_timestamps(model.tokenizer, hypothesis["ids"], hypothesis["starts"], hypothesis["ends"],
                                   stacked)  # fmt: skip
        assert [w["word"] for w in row["words"]] == row["pred_text"].split()
        assert [(w["word"], w["start"]) for w in row["words"]] == [
            (w["word"], pytest.approx(w["start"], abs=1e-3)) for w in expected
        ]


def test_a_45_second_file_split_at_pauses_decodes_each_stretch_alone(tmp_path):
    """The CLI's default split: a 45 s file of three stretches of bursts between 1 s pauses decodes as the
    stretches do, each cut out on its own."""
    from speechtrain.asr.long_audio import speech_segments

    model, path = _demo_model(tmp_path)
    audio = _long_file(tmp_path / "base.wav", 14.0)
    silence = np.zeros(16000, dtype=np.float32)
    audio = np.concatenate([silence, audio, silence, audio[::-1], silence, audio, silence])
    sf.write(tmp_path / "three.wav", audio, 16000, subtype="FLOAT")
    row = _cli(path, tmp_path / "three.wav", tmp_path / "out.json", "greedy", split="pauses")
    _check(row, len(audio) / 16000)
    stretches = speech_segments(tmp_path / "three.wav")
    assert len(stretches) == 3
    alone = []
    with torch.inference_mode():
        for lo, hi in stretches:
            piece = torch.from_numpy(audio[round(lo * 16000) : round(hi * 16000)])[None]
            alone.append(model.decode(*model(piece, torch.tensor([piece.shape[1]])), "greedy")[0].strip())
    assert row["pred_text"] == " ".join(t for t in alone if t)


@pytest.mark.slow
@pytest.mark.parametrize("decoding", ["greedy", "beam"])
def test_a_ten_minute_file_decodes_with_timestamps(tmp_path, decoding):
    _, path = _demo_model(tmp_path)
    _long_file(tmp_path / "ten_minutes.wav", 600.0)
    row = _cli(path, tmp_path / "ten_minutes.wav", tmp_path / "out.json", decoding)
    _check(row, 600.0)
    assert row["duration"] == pytest.approx(600.0, abs=0.01)
