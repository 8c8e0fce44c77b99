"""Long audio: chunked CTC inference with overlap gives the whole-file output, word timestamps from the alignment;
split at pauses, each stretch of speech decodes as it would alone."""

from types import SimpleNamespace

import numpy as np
import pytest
import soundfile as sf
import torch

from speechtrain.asr import long_audio
from speechtrain.asr.ctc import ConformerCTCModel
from speechtrain.asr.long_audio import speech_segments, transcribe_chunked, transcribe_segmented, word_timestamps
from speechtrain.asr.transcribe import transcribe_paths
from speechtrain.common.tokenizers import CharTokenizer

RATE, HOP = 1000, 10  # 10 ms output frames
VOCAB = [" ", *"abcdefgh"]


class LabelReader(torch.nn.Module):
    """A stand-in CTC model whose output at each frame is the label written into the audio there (the audio holds
    label / 10 per sample; blank where it is 0), so that any merging error shows."""

    def __init__(self) -> None:
        super().__init__()
        self.tokenizer = CharTokenizer(VOCAB)
        self.blank = len(VOCAB)
        self.cfg = SimpleNamespace(sample_rate=RATE, decoding=SimpleNamespace(strategy="greedy"))
        self.device = torch.device("cpu")

    def output_frames(self, samples: int) -> int:
        return samples // HOP

    def forward(self, audio: torch.Tensor, lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        frames = audio.shape[1] // HOP
        values = torch.round(audio[:, HOP // 2 :: HOP][:, :frames] * 10).long()  # (B, F)
        labels = torch.where(values > 0, values - 1, torch.full_like(values, self.blank))
        return torch.log_softmax(10.0 * torch.nn.functional.one_hot(labels, self.blank + 1).float(), -1), lens // HOP


def _write_words(path, words, rate=RATE):
    """A file that 'says' ``words``: per character 3 frames of its label, 2 blank frames between characters, a
    space label between words; returns the expected (word, start, end)."""
    frames, expected = _sentence(words)
    frames += [0] * 50
    audio = np.repeat(np.array(frames, dtype=np.float32) / 10, HOP)
    sf.write(path, audio, rate, subtype="FLOAT")
    return expected


def test_chunked_output_equals_the_whole_file_and_timestamps_follow_the_alignment(tmp_path):
    rng = np.random.default_rng(0)
    words = ["".join(rng.choice(list("abcdefgh"), size=rng.integers(1, 5))) for _ in range(400)]
    path = tmp_path / "long.wav"
    expected = _write_words(path, words)
    assert sf.info(path).duration > 60
    model = LabelReader()
    whole = transcribe_chunked(model, path, chunk_len=1e6, overlap=0, timestamps=True)
    for chunk_len, overlap in ((7.0, 2.0), (3.33, 0.5), (10.0, 0.0)):
        chunked = transcribe_chunked(model, path, chunk_len=chunk_len, overlap=overlap, timestamps=True, batch_size=3)
        assert chunked.text == whole.text == " ".join(words)
        assert chunked.words == whole.words
    assert [(w["word"], w["start"], w["end"]) for w in whole.words] == [
        (word, pytest.approx(start), pytest.approx(end)) for word, start, end in expected
    ]


def test_word_timestamps_of_sentencepiece_pieces():
    tokenizer = SimpleNamespace(
        vocab=["<unk>", "\u2581he", "llo", "\u2581wor", "ld"],
        decode=lambda ids: "".join(["?", " he", "llo", " wor", "ld"][i] for i in ids).strip(),
    )
    labels = torch.tensor([5, 1, 1, 5, 2, 5, 5, 3, 4, 4, 5])  # blank = 5
    words = word_timestamps(labels, 5, tokenizer, 0.08, offset=1.0)
    assert words == [{"word": "hello", "start": 1.08, "end": 1.4}, {"word": "world", "start": 1.56, "end": 1.8}]


def test_transcription_chunks_long_files_of_a_real_model_and_reports_words(tmp_path):
    torch.manual_seed(0)
    model = ConformerCTCModel({"size": "debug", "tokenizer": {"vocab": VOCAB}, "preprocessor": {"dither": 0.0},
                               "decoding": {"strategy": "greedy"}}).eval()  # fmt: skip
    audio = 0.1 * np.random.default_rng(1).standard_normal(16000 * 50).astype(np.float32)
    sf.write(tmp_path / "long.wav", audio, 16000)
    sf.write(tmp_path / "short.wav", audio[: 16000 * 3], 16000)
    rows = transcribe_paths(model, [str(tmp_path / "long.wav"), str(tmp_path / "short.wav")], chunk_len=20.0,
                            chunk_overlap=4.0, timestamps=True)  # fmt: skip
    assert all(r["pred_text"] is not None and "error" not in r for r in rows)
    for row in rows:
        times = [t for w in row["words"] for t in (w["start"], w["end"])]
        assert times == sorted(times) and (not times or times[-1] <= row["duration"] + 0.1)
    assert rows[0]["words"] and rows[0]["words"][-1]["end"] > 20, "words from every chunk"
    with pytest.raises(ValueError, match="timestamps=true needs a CTC model"):
        transcribe_paths(SimpleNamespace(transcribe=None), [str(tmp_path / "short.wav")], timestamps=True)


@pytest.mark.parametrize(
    ("decoder_type", "strategy"),
    [("transducer", "greedy"), pytest.param("ctc", "greedy", marks=pytest.mark.slow),
     pytest.param("transducer", "beam", marks=pytest.mark.slow), pytest.param("ctc", "beam", marks=pytest.mark.slow)],
)  # fmt: skip
def test_a_hybrid_tdt_ctc_model_decodes_files_longer_than_a_chunk(tmp_path, decoder_type, strategy):
    """The demo recipe's model class (a hybrid TDT-CTC transducer) on a 45 s file: the chunked path merges its
    encoder frames and its own decoder reads them (before, CTC's per-frame argmax over encoder frames produced token
    ids outside the vocabulary). One chunk covering the file decodes exactly as the unchunked model."""
    from speechtrain.asr.transducer import ConformerTransducerModel

    torch.manual_seed(0)
    model = ConformerTransducerModel({"size": "debug", "tokenizer": {"vocab": VOCAB}, "preprocessor": {"dither": 0.0},
                                      "loss": "tdt", "hybrid": True, "decoder_type": decoder_type,
                                      "decoding": {"strategy": strategy, "lm_order": 0}}).eval()  # fmt: skip
    model.configure_model()
    with torch.no_grad():  # a random model that mostly emits blanks, as a trained one does: short hypotheses
        model.joint.out.bias[model.blank] += 6.0
        model.decoder.bias[model.blank] += 6.0
    audio = 0.1 * np.random.default_rng(2).standard_normal(16000 * 45).astype(np.float32)
    sf.write(tmp_path / "long.wav", audio, 16000, subtype="FLOAT")
    rows = transcribe_paths(model, [str(tmp_path / "long.wav")], chunk_len=20.0, chunk_overlap=4.0,
                            timestamps=strategy == "greedy")  # fmt: skip
    assert "error" not in rows[0] and isinstance(rows[0]["pred_text"], str), rows[0]
    whole = transcribe_chunked(model, tmp_path / "long.wav", chunk_len=60.0, overlap=0.0)
    with torch.inference_mode():
        enc, lengths = model(torch.from_numpy(audio)[None], torch.tensor([len(audio)]))
        assert whole.text == model.decode(enc, lengths)[0]


def _sentence(words):
    """Frames (labels + 1; 0 blank) that 'say' ``words``: per character 3 frames of its label, 2 blank frames
    between characters, a space label between words; and the expected (word, start, end)."""
    frames, expected, t = [], [], 0
    for w, word in enumerate(words):
        if w:
            frames += [VOCAB.index(" ") + 1] * 2 + [0] * 3
            t += 5
        start = t
        for char in word:
            frames += [VOCAB.index(char) + 1] * 3 + [0] * 2
            t += 5
        expected.append((word, start * 0.01, (t - 2) * 0.01))
    return frames, expected


@pytest.mark.parametrize("chunk_len", [30.0, 0.4])
def test_split_at_pauses_decodes_each_stretch_of_speech_alone_with_file_times(tmp_path, chunk_len):
    """Three sentences between pauses of 0.85 s, and a click of 0.05 s in the second pause: each sentence is one
    stretch (its 30 ms gaps between characters are no pause), the click is dropped, and the words and their times are
    the sentences' at their places in the file (a stretch longer than a chunk is chunked inside)."""
    sentences = [["abc", "de"], ["fgh"], ["ab", "ba", "cd"]]
    frames, expected, spans = [0] * 40, [], []
    for n, words in enumerate(sentences):
        said, times = _sentence(words)
        start = len(frames)
        expected += [(w, round(a + start * 0.01, 3), round(b + start * 0.01, 3)) for w, a, b in times]
        frames += said
        spans.append((start * 0.01, (len(frames) - 2) * 0.01))  # (each character ends with 2 blank frames)
        frames += [0] * 40 + ([VOCAB.index("h") + 1] * 5 if n == 1 else [0] * 5) + [0] * 40
    audio = np.repeat(np.array(frames, dtype=np.float32) / 10, HOP)
    sf.write(tmp_path / "three.wav", audio, RATE, subtype="FLOAT")
    segments = speech_segments(tmp_path / "three.wav", min_pause=0.3, margin=0.2)
    assert len(segments) == 3
    for (lo, hi), (start, stop) in zip(segments, spans):
        assert lo == pytest.approx(start - 0.2, abs=0.011) and hi == pytest.approx(stop + 0.2, abs=0.011)
    out = transcribe_segmented(LabelReader(), tmp_path / "three.wav", chunk_len, 0.2, timestamps=True)
    assert out.text == "abc de fgh ab ba cd"
    assert [(w["word"], w["start"], w["end"]) for w in out.words] == [
        (w, pytest.approx(a, abs=1e-6), pytest.approx(b, abs=1e-6)) for w, a, b in expected
    ]
    fixed = transcribe_chunked(LabelReader(), tmp_path / "three.wav", chunk_len, 0.2)
    assert fixed.text == "abc defghhab ba cd", "one decode: the click heard (this model says no space at pauses)"
    inside = transcribe_segmented(LabelReader(), tmp_path / "three.wav", chunk_len, 0.2, offset=spans[1][0] - 0.1,
                                  duration=spans[2][1] - spans[1][0] + 0.2)  # fmt: skip
    assert inside.text == "fgh ab ba cd", "offset and duration bound the split"


def test_pauses_are_found_against_the_files_noise_floor_block_by_block(tmp_path, monkeypatch):
    """Noise bursts over a noise floor 40 dB lower, read in blocks shorter than the file: the stretches are the
    bursts, gaps under ``min_pause`` join them; a file with no level contrast is one stretch, a silent one none."""
    rate, rng = 16000, np.random.default_rng(0)
    audio = 0.003 * rng.standard_normal(14 * rate).astype(np.float32)
    for start, stop in [(1.0, 3.0), (3.5, 6.0), (9.0, 10.5), (10.7, 12.0)]:
        audio[int(start * rate) : int(stop * rate)] += 0.3 * rng.standard_normal(int((stop - start) * rate))
    sf.write(tmp_path / "bursts.wav", audio, rate)
    monkeypatch.setattr(long_audio, "_ENERGY_BLOCK_FRAMES", 37)  # 0.37 s blocks
    found = speech_segments(tmp_path / "bursts.wav", min_pause=0.3, margin=0.2)
    assert found == [pytest.approx(s, abs=0.011) for s in [(0.8, 3.2), (3.3, 6.2), (8.8, 12.2)]]
    sf.write(tmp_path / "hum.wav", 0.1 * rng.standard_normal(5 * rate).astype(np.float32), rate)
    assert speech_segments(tmp_path / "hum.wav") == [(0.0, 5.0)]
    sf.write(tmp_path / "silent.wav", np.zeros(5 * rate, dtype=np.float32), rate)
    assert speech_segments(tmp_path / "silent.wav") == [(0.0, 5.0)]  # no contrast either: one stretch
    assert transcribe_segmented(LabelReader(), tmp_path / "silent.wav", 1.0, 0.2).text == ""
    with pytest.raises(ValueError, match="min_pause must be > 0"):
        speech_segments(tmp_path / "hum.wav", min_pause=0)


def test_a_hybrid_model_split_at_pauses_decodes_each_stretch_as_its_own_file(tmp_path):
    """The demo recipe's model class (hybrid TDT-CTC, its transducer decoder) through ``transcribe_paths`` on a
    file longer than a chunk: the transcript is the stretches' own transcripts, each stretch cut out as a file."""
    from speechtrain.asr.transducer import ConformerTransducerModel

    torch.manual_seed(0)
    model = ConformerTransducerModel({"size": "debug", "tokenizer": {"vocab": VOCAB}, "preprocessor": {"dither": 0.0},
                                      "loss": "tdt", "hybrid": True, "decoding": {"strategy": "greedy"}})  # fmt: skip
    model.configure_model()
    model.eval()  # (after the layers are built: they are built in training mode)
    with torch.no_grad():
        model.joint.out.bias[model.blank] += 2.0
    rate, rng = 16000, np.random.default_rng(3)
    audio = np.zeros(16 * rate, dtype=np.float32)
    for start, stop in [(0.5, 4.0), (4.6, 9.5), (10.5, 15.5)]:
        audio[int(start * rate) : int(stop * rate)] = 0.2 * rng.standard_normal(int((stop - start) * rate))
    sf.write(tmp_path / "long.wav", audio, rate, subtype="FLOAT")
    (row,) = transcribe_paths(model, [str(tmp_path / "long.wav")], chunk_len=6.0, chunk_overlap=1.0, timestamps=True)
    alone = []
    for lo, hi in speech_segments(tmp_path / "long.wav"):
        with torch.inference_mode():
            piece = torch.from_numpy(audio[round(lo * rate) : round(hi * rate)])[None]
            alone.append(model.decode(*model(piece, torch.tensor([piece.shape[1]])))[0].strip())
    assert len(alone) == 3 and row["pred_text"] == " ".join(t for t in alone if t)
    times = [t for w in row["words"] for t in (w["start"], w["end"])]
    assert times == sorted(times) and [w["word"] for w in row["words"]] == row["pred_text"].split()
