import json

import pytest

from speechtrain.asr.ngram import NgramLM
from speechtrain.asr.report import decoding_report, lm_statistics


def test_lm_statistics_counts_oov_and_matches_a_hand_computed_perplexity():
    lm = NgramLM.fit(["a b", "a c", "b c"], order=1)
    oov, ppl = lm_statistics(lm, ["a b", "a zzz c"])
    assert oov == pytest.approx(1 / 5)  # zzz: one of five running words
    # Unigrams: the unknown word is skipped (and resets the context); every known word and each </s> is scored.
    scored = ["a", "b", "</s>", "a", "c", "</s>"]
    expected = 10 ** (-sum(lm.log10_prob(w) for w in scored) / len(scored))
    assert ppl == pytest.approx(expected)


def test_report_puts_greedy_first_and_breaks_down_by_engine(tmp_path):
    import numpy as np
    import soundfile as sf
    import torch

    class Cfg:
        class decoding:  # noqa: N801
            strategy, lm_path = "beam", None

    class Model(torch.nn.Module):  # transcribes the first utterance right and the others as "x"
        cfg = Cfg()

        def text_normalizer(self, text):
            return text.lower()

        def _audio_batches(self, paths, batch_size):
            yield torch.zeros(len(paths), 10), torch.full((len(paths),), 10)

        def forward(self, audio, lengths):
            return audio, lengths

        def greedy_decode(self, audio, lengths):
            return ["hello world"] + ["x"] * (audio.shape[0] - 1)

    sf.write(tmp_path / "a.wav", np.zeros(160, dtype=np.float32), 16000)
    rows = [{"text": "hello world", "engine": "piper", "voice": "piper:joe"},
            {"text": "one two", "engine": "espeak", "voice": "en+m1"},
            {"text": "three", "engine": "espeak", "voice": "en+f2"}]  # fmt: skip
    rows = [{"audio_filepath": "a.wav", "duration": 0.01, **r} for r in rows]
    (tmp_path / "manifest.json").write_text("".join(json.dumps(r) + "\n" for r in rows))
    metrics = {"val_wer_greedy_test": 0.5, "val_cer_greedy_test": 0.25, "val_wer_test": 0.1, "val_cer_test": 0.05}
    report = decoding_report(Model(), metrics, [("test", tmp_path / "manifest.json"), ("dev", tmp_path / "no")])
    lines = report.splitlines()
    assert lines[0].startswith("set | greedy WER | greedy CER | beam+LM WER")
    assert lines[2] == "test | 50.00% | 25.00% | 10.00% | 5.00% | n/a | n/a"
    assert "test | piper | 0.00% | 1" in report and "test | espeak | 100.00% | 2" in report
    assert "test | espeak / en+m1 | 100.00% | 1" in report
