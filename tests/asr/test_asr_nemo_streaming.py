"""NeMo cache-aware streaming FastConformer checkpoints: imported, run offline and streamed chunk by chunk, against
NeMo's own outputs (``tests/fixtures/nemo/fastconformer_hybrid_tdt_streaming.*``, made by
``tools/make_nemo_fixtures.py``: a hybrid TDT-CTC model with ``att_context_size [[4, 1], [4, 0]]``,
``chunked_limited``, causal convolutions and subsampling, ``normalize: none``).

Chunking conventions that differ, and what is compared:

- NeMo's ``CacheAwareStreamingAudioBuffer`` drops the features after the last whole subsampling step (fewer than
  ``subsampling_factor`` frames: the last encoder frame here); ours encodes them (the offline frame count). The
  frames and tokens NeMo streams are compared with ours over the frames NeMo produced.
- NeMo's pre-encode cache (``subsampling_factor + 1`` feature frames before each chunk, ``drop_extra_pre_encoded``
  outputs dropped) is zero-filled while fewer frames have gone by: with look-ahead 0 its second chunk (encoder
  frame 1) reads 8 zero feature frames through the subsampling, so NeMo's stream differs from NeMo's offline
  output there (5e-3 on this model, carried to later frames by the layer caches). Our stream gives the offline
  frames; for that look-ahead it is compared with NeMo's offline encoder chunk by chunk, and with NeMo's stream on
  the frames before the difference and on the final tokens.
"""

import pytest
import torch
from safetensors.torch import load_file
from test_asr_nemo import FIXTURES, fixture_batch, max_difference
from test_asr_nemo_transducer import transducer_differences

from speechtrain.asr.nemo_config import translate_nemo_config
from speechtrain.asr.streaming import CTCGreedyStream, EncoderStream, FeatureStream, TransducerGreedyStream
from speechtrain.asr.transducer import ConformerTransducerModel
from speechtrain.core.model import SpeechModel

NAME = "fastconformer_hybrid_tdt_streaming"
CONTEXTS = [(4, 1), (4, 0)]


@pytest.fixture(scope="module")
def model() -> ConformerTransducerModel:
    return SpeechModel.restore_from(FIXTURES / f"{NAME}.nemo").eval()


def streamed_chunks(model: ConformerTransducerModel, audio: torch.Tensor) -> list[torch.Tensor]:
    """Our streaming encoder's chunks (each (T_k, D)), fed the audio (N,) at once: one chunk per attention chunk."""
    features, encoder = FeatureStream(model.preprocessor), EncoderStream(model.encoder)
    with torch.no_grad():
        frames = torch.cat([encoder.push(features.push(audio[None])), encoder.push(features.finish()),
                            encoder.finish()], dim=1)[0]  # fmt: skip
    return list(frames.split(encoder.chunk))


def test_streaming_keys_are_imported(model):
    cfg = model.cfg.encoder
    assert [tuple(c) for c in cfg.att_context_size] == CONTEXTS and cfg.att_context_style == "chunked_limited"
    assert cfg.conv_context_size == "causal" and cfg.causal_downsampling
    assert model.cfg.preprocessor.normalize == "none"


def test_offline_outputs_equal_nemos(model):
    ctc = max_difference(model, NAME)
    pred, joint = transducer_differences(model, NAME)
    print(f"{NAME} offline: max |difference| vs NeMo: CTC log-probs {ctc:.2e}, joint logits {joint:.2e}")
    assert ctc < 1e-4 and pred < 1e-5 and joint < 1e-4


@pytest.mark.parametrize("context", [0, 1])
def test_streamed_chunks_and_tokens_equal_nemos(model, context):
    expected = load_file(FIXTURES / f"{NAME}.expected.safetensors")
    audio, lengths = fixture_batch()
    model.encoder.set_context(CONTEXTS[context])
    try:
        for i, n in enumerate(lengths.tolist()):
            ours = streamed_chunks(model, audio[i, :n])
            offline = expected[f"offline{context}_enc_{i}"].split([len(c) for c in ours])
            worst = max((a - b).abs().max().item() for a, b in zip(ours, offline, strict=True))
            sizes = expected[f"stream{context}_chunks_{i}"].tolist()
            nemo = expected[f"stream{context}_enc_{i}"].split(sizes)
            assert [len(c) for c in ours[: len(sizes)]] == sizes  # the same chunks (NeMo's lacks the last frame)
            exact = len(sizes) if context == 0 else 1  # see the module docstring
            streamed = max((a - b).abs().max().item() for a, b in zip(ours[:exact], nemo[:exact], strict=True))
            print(f"context {CONTEXTS[context]}, utterance {i}: max |ours - NeMo's| per chunk: vs offline "
                  f"{worst:.2e}, vs NeMo's stream {streamed:.2e} ({exact} chunks)")  # fmt: skip
            assert worst < 1e-4 and streamed < 1e-4
            for kind, decoder in (("ctc", CTCGreedyStream(model)), ("tdt", TransducerGreedyStream(model))):
                for chunk in ours[: len(sizes)]:  # the frames NeMo streamed
                    decoder.push(chunk[None])
                decoder.finish()
                assert decoder.ids == expected[f"stream{context}_{kind}_{i}"].tolist(), (kind, i)
    finally:
        model.encoder.set_context(CONTEXTS[0])


def test_nemos_streaming_yaml_keys_are_translated():
    nemo = {
        "model": {
            "sample_rate": 16000,
            "preprocessor": {
                "_target_": "nemo.collections.asr.modules.AudioToMelSpectrogramPreprocessor",
                "normalize": "none",
            },
            "encoder": {
                "_target_": "nemo.collections.asr.modules.ConformerEncoder",
                "n_layers": 2,
                "d_model": 16,
                "att_context_size": [[70, 13], [70, 6]],
                "att_context_style": "chunked_limited",
                "att_context_probs": [0.5, 0.5],
                "conv_context_size": "causal",
                "causal_downsampling": True,
            },
        }
    }
    ours = translate_nemo_config(nemo)
    enc = ours["model"]["encoder"]
    assert enc["att_context_size"] == [[70, 13], [70, 6]] and enc["att_context_style"] == "chunked_limited"
    assert enc["att_context_probs"] == [0.5, 0.5] and enc["conv_context_size"] == "causal"
    assert enc["causal_downsampling"] is True and ours["model"]["preprocessor"]["normalize"] == "none"
