import numpy as np
import pytest
import soundfile as sf
import torch
from conftest import tiny_ctc_config

from speechtrain.asr.conv_ctc import ConvCTCModel
from speechtrain.common.metrics import edit_distance, word_error_rate


def _model(**encoder):
    torch.manual_seed(0)
    return ConvCTCModel(tiny_ctc_config(**encoder)).eval()


@pytest.mark.parametrize("subsampling", [1, 2, 4])
def test_batched_forward_equals_per_utterance_forward(subsampling):
    model = _model(subsampling=subsampling, num_layers=2)
    lengths = [16000, 9000, 4321]
    torch.manual_seed(3)
    waves = [torch.randn(n) for n in lengths]
    batch = torch.zeros(3, max(lengths))
    for i, w in enumerate(waves):
        batch[i, : len(w)] = w
    with torch.no_grad():
        log_probs, out_lens = model(batch, torch.tensor(lengths))
        for i, w in enumerate(waves):
            single, single_len = model(w[None], torch.tensor([len(w)]))
            assert out_lens[i] == single_len[0]
            torch.testing.assert_close(log_probs[i, : out_lens[i]], single[0], atol=1e-5, rtol=1e-5)


def test_blank_is_last_and_output_is_log_probabilities():
    model = _model()
    assert model.blank == model.tokenizer.vocab_size == 11
    with torch.no_grad():
        log_probs, _ = model(torch.randn(1, 8000), torch.tensor([8000]))
    assert log_probs.shape[-1] == 12 and log_probs.dtype == torch.float32
    torch.testing.assert_close(log_probs.exp().sum(-1), torch.ones(log_probs.shape[:2]))


def test_features_stay_fp32_under_bf16_autocast():
    model = _model()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        feats, _ = model.preprocessor(torch.randn(2, 8000), torch.tensor([8000, 8000]))
        log_probs, _ = model(torch.randn(2, 8000), torch.tensor([8000, 8000]))
    assert feats.dtype == torch.float32 and log_probs.dtype == torch.float32


def test_transcribe_reads_files_and_resamples_other_rates(tmp_path):
    model = _model()
    sf.write(tmp_path / "a.wav", np.zeros(8000, dtype=np.float32), 16000)
    sf.write(tmp_path / "b.wav", np.zeros(8000, dtype=np.float32), 8000)
    assert len(model.transcribe([tmp_path / "a.wav", np.zeros(4000, dtype=np.float32)])) == 2
    assert model._load_audio(tmp_path / "b.wav").shape == (16000,)


def test_missing_tokenizer_is_a_clear_error():
    cfg = tiny_ctc_config()
    cfg["tokenizer"] = {}
    with pytest.raises(ValueError, match="model.tokenizer needs either vocab"):
        ConvCTCModel(cfg)


def test_wer():
    assert edit_distance("a b c".split(), "a x c d".split()) == 2
    assert word_error_rate(["1 2 3", "4"], ["1 2 3", "5 6"]) == pytest.approx(2 / 5)
