"""Cache-aware streaming: chunk-by-chunk features and encoder frames equal the offline ones with the same context,
and the final streaming hypothesis equals the offline greedy decode, label for label (tiny random models)."""

import pytest
import soundfile as sf
import torch
from conftest import chirp, spread_weights

from speechtrain.asr.conformer import ConformerConfig, ConformerEncoder
from speechtrain.asr.ctc import ConformerCTCModel
from speechtrain.asr.decoding import greedy_decode
from speechtrain.asr.features import PreprocessorConfig, build_preprocessor
from speechtrain.asr.streaming import EncoderStream, FeatureStream, StreamingTranscriber, latency_seconds
from speechtrain.asr.transcribe import main
from speechtrain.asr.transducer import ConformerTransducerModel
from speechtrain.common.config import ConfigError

LETTERS = [" ", *"abcdefgh"]
CHUNKED = {"att_context_size": [[8, 3], [4, 0]], "att_context_style": "chunked_limited",
           "conv_context_size": "causal", "causal_downsampling": True}  # fmt: skip


def _config(encoder=None, **extra):
    return {
        "tokenizer": {"vocab": LETTERS},
        "preprocessor": {"n_mels": 16, "dither": 0.0, "normalize": "none"},
        "spec_augment": None,
        "encoder": {
            "d_model": 32,
            "num_layers": 2,
            "num_heads": 2,
            "conv_kernel_size": 5,
            "subsampling": "striding",
            "subsampling_factor": 4,
            "subsampling_conv_channels": 16,
            "dropout": 0.0,
            "dropout_att": 0.0,
            **CHUNKED,
            **(encoder or {}),
        },  # fmt: skip
        **extra,
    }


def _model(cls=ConformerCTCModel, seed=0, **cfg):
    torch.manual_seed(seed)
    model = cls(_config(**cfg))
    model.configure_model()
    return spread_weights(model)


@pytest.mark.parametrize("kind", ["torchaudio", "nemo"])
def test_streamed_features_equal_the_offline_ones(kind):
    pre = build_preprocessor(PreprocessorConfig(n_mels=16, dither=0.0, kind=kind, normalize="none"), 16000).eval()
    audio = chirp(1.37)[None]
    offline, lengths = pre(audio, torch.tensor([audio.shape[1]]))
    stream = FeatureStream(pre)
    pieces = [stream.push(audio[:, i : i + size]) for i, size in zip(range(0, 30000, 1000), [1000] * 30)
              if i < audio.shape[1]]  # fmt: skip
    streamed = torch.cat([*pieces, stream.finish()], dim=2)
    assert streamed.shape[2] == int(lengths)  # (NeMo's front end computes one more frame, which is padding)
    assert torch.allclose(streamed, offline[:, :, : int(lengths)], atol=1e-5)


@pytest.mark.parametrize(
    "encoder",
    [
        CHUNKED,  # two look-aheads trained together, causal subsampling
        {"att_context_size": [6, 0], "att_context_style": "regular", "causal_downsampling": False},
        {"att_context_size": [16, 1], "subsampling": "dw_striding", "subsampling_factor": 8},
    ],
    ids=["chunked-two-contexts", "regular-causal", "dw_striding-8x"],
)
@pytest.mark.parametrize("chunk_chunks", [1, 2])
def test_encoder_frames_chunk_by_chunk_equal_the_offline_limited_context_encoder(encoder, chunk_chunks):
    cfg = ConformerConfig(**{**_config()["encoder"], **encoder})
    torch.manual_seed(0)
    enc = ConformerEncoder(cfg, 16, seed=3).eval()
    feats = torch.randn(1, 16, 203)
    for context in enc.contexts:
        enc.set_context(context)
        offline, lengths = enc(feats, torch.tensor([203]))
        size = context[1] + 1 if cfg.att_context_style == "chunked_limited" else 1
        stream = EncoderStream(enc, chunk=size * chunk_chunks)
        pieces = [stream.push(feats[:, :, i : i + 7]) for i in range(0, 203, 7)]
        streamed = torch.cat([*pieces, stream.finish()], dim=1)
        assert streamed.shape == offline.shape and int(lengths) == offline.shape[1]
        assert (streamed - offline).abs().max() < 1e-5, context


SMALL = {"prediction": {"pred_hidden": 32}, "joint": {"joint_hidden": 32}, "decoding": {"max_symbols": 3}}
CASES = {
    "ctc": (ConformerCTCModel, {}),
    "ctc-self-conditioned": (
        ConformerCTCModel,
        {"interctc": {"loss_weights": [0.2], "apply_at_layers": [0], "self_conditioning": True}},
    ),  # fmt: skip
    "tdt-stacked": (
        ConformerTransducerModel,
        {**SMALL, "loss": "tdt", "joint": {"joint_hidden": 32, "frame_stack": 2}},
    ),
    "rnnt": (ConformerTransducerModel, {**SMALL, "loss": "rnnt"}),
    "hybrid-transducer": (ConformerTransducerModel, {**SMALL, "loss": "tdt", "hybrid": True}),
    "hybrid-ctc": (ConformerTransducerModel, {**SMALL, "loss": "tdt", "hybrid": True, "decoder_type": "ctc"}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_final_streaming_hypothesis_equals_the_offline_greedy_decode(case):
    cls, extra = CASES[case]
    model = _model(cls, **extra)
    audio = chirp()
    for context in model.encoder.contexts:
        model.encoder.set_context(context)
        offline = model.transcribe([audio.numpy()], strategy="greedy")[0]
        with torch.no_grad():
            out, lengths = model(audio[None], torch.tensor([len(audio)]))  # CTC: log-probabilities; else frames
            if cls is ConformerTransducerModel and model.cfg.decoder_type == "transducer":
                offline_ids = model.greedy_hypotheses(out, lengths)[0]["ids"]
            else:
                log_probs = out if cls is ConformerCTCModel else model.ctc_log_probs(out)
                offline_ids = greedy_decode(log_probs, lengths, model.blank)[0]
        stream = StreamingTranscriber(model, list(context))
        partials = [stream.push(audio[i : i + 1000]) for i in range(0, len(audio), 1000)]
        final = stream.finish()
        assert offline_ids, "the test model should say something"
        assert stream.ids == offline_ids and final == offline, (context, final, offline)
        assert any(p and p != final for p in partials) or len(final) <= 2  # partial hypotheses come before the end


def test_streaming_refuses_models_it_cannot_run_exactly(tmp_path):
    with pytest.raises(ValueError, match="preprocessor.normalize=none"):
        StreamingTranscriber(_model(preprocessor={"n_mels": 16, "dither": 0.0}))
    with pytest.raises(ValueError, match="conv_context_size=causal"):
        StreamingTranscriber(_model(encoder={"conv_context_size": None}))
    with pytest.raises(ValueError, match="finite left context"):
        StreamingTranscriber(_model(encoder={"att_context_size": [-1, 3]}))
    with pytest.raises(ValueError, match="right context 0"):
        StreamingTranscriber(_model(encoder={"att_context_size": [8, 2], "att_context_style": "regular"}))
    with pytest.raises(ValueError, match="multiple of right \\+ 1 = 4"):
        StreamingTranscriber(_model(), chunk=6)
    with pytest.raises(ValueError, match="not one this model was trained with"):
        StreamingTranscriber(_model(), [5, 5])


@pytest.mark.parametrize(
    "encoder, message",
    [
        ({"att_context_size": [8, -1]}, "chunked_limited needs right >= 0"),
        ({"att_context_size": [[8, 1, 2]]}, "expected \\[left, right\\]"),
        ({"conv_context_size": [3, 3]}, "before \\+ after = conv_kernel_size - 1 = 4"),
        ({"att_context_probs": [0.5, 0.2]}, "summing to 1"),
        ({"time_reduce_idx": 0, "time_recovery_idx": 1}, "temporal U-Net"),
    ],
)
def test_bad_streaming_keys_are_refused_with_the_key(encoder, message):
    with pytest.raises(ConfigError, match=message):
        ConformerCTCModel(_config(encoder))


def test_training_draws_one_context_per_step_from_the_step_number_alone():
    """Every data-parallel rank draws the same context without communicating: the draw depends on the step number
    and the model's seed only; over steps, every trained context is used."""
    a, b = (ConformerEncoder(ConformerConfig(**_config()["encoder"]), 16, seed=5) for _ in range(2))
    picks = []
    for step in range(40):
        a.training_step_index = b.training_step_index = step
        picks.append(a.training_context())
        assert b.training_context() == picks[-1]
    assert set(picks) == {(8, 3), (4, 0)}
    model = _model()
    model.train()
    audio = torch.randn(2, 16000) * 0.1
    feats, lengths = model.features(audio, torch.tensor([16000, 9000]))
    out, _, _ = model._encode(audio, torch.tensor([16000, 9000]), ())
    assert torch.isfinite(out).all()  # padded frames with no valid key in their context attend to themselves


def test_offline_models_are_unchanged_by_default():
    enc = ConformerEncoder(ConformerConfig(d_model=32, num_layers=1, num_heads=2, subsampling_conv_channels=8), 16, 0)
    assert not enc.limited_context and enc._allowed(torch.ones(1, 5, dtype=torch.bool)) is None
    assert enc.layers[0].conv.padding == (4, 4)


def test_latency_counts_the_chunk_and_the_front_end():
    model = _model()
    model.encoder.set_context([8, 3])  # chunks of 4 frames of 4 x 10 ms, causal subsampling
    assert latency_seconds(model) == pytest.approx(3 * 0.04 + 0.016)
    assert latency_seconds(model, chunk=8) == pytest.approx(7 * 0.04 + 0.016)


def test_cli_streaming_transcripts_equal_the_offline_greedy_ones(tmp_path, capsys):
    model = _model(ConformerTransducerModel, **SMALL, loss="tdt", hybrid=True)
    archive = model.save_to(tmp_path / "stream.stm")
    for seed in range(2):
        sf.write(tmp_path / f"u{seed}.wav", chirp(1.5 + seed, seed).numpy(), 16000)
    out = tmp_path / "streamed.json"
    main([f"model_path={archive}", f"audio={tmp_path}", f"output={out}", "streaming=true", "chunk=8",
          "att_context_size=[4,0]", "device=cpu"])  # fmt: skip
    import json

    rows = [json.loads(line) for line in out.read_text().splitlines()]
    model.encoder.set_context([4, 0])
    expected = model.transcribe([r["audio_filepath"] for r in rows], strategy="greedy")
    assert [r["pred_text"] for r in rows] == expected and all("partials" in r for r in rows)
    with pytest.raises(SystemExit):
        main([f"model_path={archive}", f"audio={tmp_path}", "chunk=8"])  # a streaming option without streaming
    assert "add streaming=true" in capsys.readouterr().err


def test_the_streaming_recipe_trains_and_its_model_streams_as_it_decodes_offline(tmp_path, dtmf_manifest):
    """asr_train_streaming.yaml, shrunk to a tiny encoder on the DTMF corpus: a few steps train with the three
    look-aheads, and the archive streams with its final hypotheses equal to its offline greedy ones."""
    import importlib.util

    from conftest import EXAMPLES

    from speechtrain.asr.ctc import INTERCTC_OFF
    from speechtrain.asr.transducer import ConformerTransducerConfig
    from speechtrain.common.tokenizers import CharTokenizer
    from speechtrain.core.hydra_runner import compose_config
    from speechtrain.core.job import train_job_schema
    from speechtrain.core.model import SpeechModel
    from speechtrain.data.manifest import read_nemo_manifest

    schema = train_job_schema(ConformerTransducerConfig)
    recipe = compose_config(EXAMPLES / "conf", "asr_train_streaming", [], schema)
    enc = recipe.model.encoder
    assert (recipe.model.hybrid, recipe.model.preprocessor.normalize, enc.att_context_style) == (
        True, "none", "chunked_limited")  # fmt: skip
    assert (enc.conv_context_size, enc.causal_downsampling, enc.time_reduce_idx) == ("causal", True, -1)
    tokenizer = tmp_path / "digits.json"
    CharTokenizer([" ", *"0123456789"]).save(tokenizer)
    overrides = [f"exp_manager.exp_dir={tmp_path / 'exp'}", "trainer.max_time=null", "trainer.max_steps=4",
                 "trainer.val_check_interval=4", "trainer.check_val_every_n_epoch=null", "trainer.precision=32",
                 "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
                 f"model.tokenizer.path={tokenizer}", f"model.train_ds.manifest_filepath={dtmf_manifest}",
                 "model.train_ds.input_cfg=null", f"model.validation_ds.manifest_filepath={dtmf_manifest}",
                 "model.size=debug", "model.encoder.d_model=16", "model.encoder.num_layers=2",
                 "model.encoder.num_heads=2", "model.encoder.subsampling_conv_channels=8",
                 "model.encoder.att_context_size=[[8,0],[8,3]]", "model.preprocessor.n_mels=16",
                 "model.prediction.pred_hidden=16", "model.joint.joint_hidden=16", "model.train_ds.batch_size=8",
                 "model.train_ds.batch_duration=null", "model.train_ds.num_workers=0",
                 "exp_manager.checkpoint_callback_params.save_top_k=1", *INTERCTC_OFF]  # fmt: skip
    spec = importlib.util.spec_from_file_location("asr_train_example", EXAMPLES / "asr_train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.main(compose_config(EXAMPLES / "conf", "asr_train_streaming", overrides, schema))
    assert model.trainer.global_step == 4
    (archive,) = (tmp_path / "exp" / "asr_streaming_demo").glob("*/asr_streaming_demo.stm")
    model = SpeechModel.restore_from(archive).eval()
    files = [row["audio_filepath"] for row in read_nemo_manifest(dtmf_manifest)[:2]]
    for context in ([8, 0], [8, 3]):
        model.encoder.set_context(context)
        offline = model.transcribe(files, strategy="greedy")
        for path, expected in zip(files, offline):
            stream = StreamingTranscriber(model, context)
            audio, _ = sf.read(path, dtype="float32")
            for start in range(0, len(audio), 640):
                stream.push(audio[start : start + 640])
            assert stream.finish() == expected
