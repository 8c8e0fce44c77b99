"""Streaming ONNX export (speechtrain.asr.export_onnx_streaming): ONNX Runtime's cache-aware encoder steps give the
PyTorch streaming encoder's frames chunk by chunk, and the ORT-only client (speechtrain.asr.onnx_stream) decodes the
greedy transcript of PyTorch's streaming and offline decoding (tiny random CTC, TDT and hybrid models)."""

import json

import numpy as np
import pytest
import torch
from conftest import chirp, spread_weights

from speechtrain.asr import export_onnx as export
from speechtrain.asr.ctc import ConformerCTCModel
from speechtrain.asr.onnx_stream import OnnxStreamingRecognizer
from speechtrain.asr.streaming import EncoderStream, FeatureStream, StreamingTranscriber
from speechtrain.asr.transducer import ConformerTransducerModel

STREAMING = {"d_model": 32, "num_layers": 2, "num_heads": 2, "conv_kernel_size": 5, "subsampling": "striding",
             "subsampling_factor": 4, "subsampling_conv_channels": 8, "dropout": 0.0, "dropout_att": 0.0,
             "att_context_size": [[8, 3], [4, 0]], "att_context_style": "chunked_limited",
             "conv_context_size": "causal", "causal_downsampling": True}  # fmt: skip
SMALL = {"prediction": {"pred_hidden": 32}, "joint": {"joint_hidden": 32}, "decoding": {"max_symbols": 3}}
CASES = {
    "ctc-self-conditioned": (ConformerCTCModel, {"interctc": {"loss_weights": [0.2], "apply_at_layers": [0],
                                                              "self_conditioning": True}}, [8, 3], 4),
    "tdt-stacked": (ConformerTransducerModel, {**SMALL, "loss": "tdt", "joint": {"joint_hidden": 32,
                                                                                "frame_stack": 2}}, [4, 0], 3),
    "hybrid-dw8": (ConformerTransducerModel, {**SMALL, "loss": "tdt", "hybrid": True,
                                              "encoder": {**STREAMING, "subsampling": "dw_striding",
                                                          "subsampling_factor": 8, "att_context_size": [16, 1],
                                                          "causal_downsampling": False}}, None, 4),
}  # fmt: skip


def _model(cls, **extra):
    torch.manual_seed(0)
    cfg = {"tokenizer": {"vocab": [" ", *"abcdefgh"]}, "preprocessor": {"kind": "nemo", "n_mels": 80, "dither": 0.0,
           "normalize": "none"}, "spec_augment": None, "encoder": dict(STREAMING), **extra}  # fmt: skip
    model = cls(cfg)
    model.configure_model()
    return spread_weights(model)


@pytest.mark.parametrize("case", sorted(CASES))
def test_onnx_streaming_steps_equal_pytorch_streaming_and_decode_the_offline_transcript(case, tmp_path):
    cls, extra, context, chunk = CASES[case]
    model = _model(cls, **extra)
    export.export_onnx(model, tmp_path, att_context_size=context, chunk=chunk)
    config = json.loads((tmp_path / export.CONFIG_FILE).read_text())
    context = context or list(model.encoder.contexts[0])
    assert config["streaming"]["att_context_size"] == context and config["streaming"]["chunk_size"] == chunk
    model.encoder.set_context(context)
    audio = chirp()
    stream = FeatureStream(model.preprocessor)
    feats = torch.cat([stream.push(audio[None]), stream.finish()], dim=2)  # (1, 80, F)

    capture = tuple(model.cfg.interctc.apply_at_layers) if model.cfg.interctc.self_conditioning else ()
    encoder = EncoderStream(model.encoder, chunk, model._condition if capture else None, capture)
    with torch.no_grad():
        reference = torch.cat([*(encoder.push(feats[:, :, i : i + 7]) for i in range(0, feats.shape[2], 7)),
                               encoder.finish()], dim=1)  # fmt: skip  # (1, T, D)
    heads = ["ctc", "transducer"] if model.cfg.get("hybrid") else ["ctc" if cls is ConformerCTCModel else "transducer"]
    for head in heads:
        onnx = OnnxStreamingRecognizer(tmp_path, decoder_type=head)
        for i in range(0, feats.shape[2], 7):
            onnx.push(feats[0, :, i : i + 7].numpy())
        onnx.finish()
        with torch.no_grad():
            expected = model.ctc_log_probs(reference) if head == "ctc" and cls is not ConformerCTCModel else (
                model.log_probs(reference) if head == "ctc" else reference)  # fmt: skip
        start = 0
        for out in onnx.chunk_outputs:  # every step's frames, chunk by chunk
            assert len(out) == chunk or start + len(out) == expected.shape[1]
            np.testing.assert_allclose(out, expected[0, start : start + len(out)].numpy(), atol=1e-4, rtol=0)
            start += len(out)
        assert start == expected.shape[1]

        torch_stream = StreamingTranscriber(model, context, chunk, decoder_type=head)
        for i in range(0, len(audio), 1000):
            torch_stream.push(audio[i : i + 1000])
        final = torch_stream.finish()
        if model.cfg.get("hybrid"):
            model.cfg.decoder_type = head
        offline = model.transcribe([audio.numpy()], strategy="greedy")[0]
        assert onnx.ids and onnx.ids == torch_stream.ids, head
        assert onnx.text == final == offline, head


def test_streaming_export_refuses_what_does_not_stream(tmp_path):
    model = _model(ConformerCTCModel)
    with pytest.raises(ValueError, match="not one this model was trained with"):
        export.export_onnx(model, tmp_path, att_context_size=[5, 5])
    with pytest.raises(ValueError, match="multiple of right \\+ 1 = 4"):
        export.export_onnx(model, tmp_path, chunk=6)
    with pytest.raises(ValueError, match="conv_context_size=causal"):
        export.export_onnx(_model(ConformerCTCModel, encoder={**STREAMING, "conv_context_size": None}), tmp_path)
    with pytest.raises(ValueError, match="at least 2"):
        export.export_onnx(_model(ConformerCTCModel, encoder={**STREAMING, "att_context_size": [1, 0]}), tmp_path)
    offline = _model(
        ConformerCTCModel, encoder={**STREAMING, "att_context_size": [-1, -1], "att_context_style": "regular"}
    )
    with pytest.raises(ValueError, match="options of a streaming model's export"):
        export.export_onnx(offline, tmp_path, chunk=4)
