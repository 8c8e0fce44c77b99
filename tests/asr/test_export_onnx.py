"""ONNX export for onnx-asr (speechtrain.asr.export_onnx): ONNX Runtime computes what the PyTorch model computes
(encoder frames, CTC log-probabilities, decoder + joint logits) on dynamic batch and time, onnx-asr loads the folder
and transcribes as the model's greedy decoding does, and what onnx-asr cannot run is refused by name."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import soundfile as sf
import torch

from speechtrain.asr import export_onnx as export
from speechtrain.asr.conv_ctc import ConvCTCModel
from speechtrain.asr.ctc import ConformerCTCModel
from speechtrain.asr.features import NemoMelFeatures, PreprocessorConfig
from speechtrain.asr.transducer import ConformerTransducerModel
from speechtrain.core.model import SpeechModel
from speechtrain.corpora.dtmf import render_digits

try:
    import onnx_asr
except ImportError:  # a dev extra; the export itself needs only onnx and onnxruntime
    onnx_asr = None
needs_onnx_asr = pytest.mark.skipif(onnx_asr is None, reason="onnx-asr is not installed (pip install onnx-asr)")

DIGITS = [" ", *"0123456789"]
ENCODER = {"d_model": 16, "num_heads": 2, "num_layers": 2, "conv_kernel_size": 5, "subsampling": "dw_striding",
           "subsampling_factor": 8, "subsampling_conv_channels": 8, "dropout": 0.0, "dropout_att": 0.0}  # fmt: skip
NO_INTERCTC = {"loss_weights": [], "apply_at_layers": [], "self_conditioning": False}
TP_JOB = Path(__file__).with_name("export_onnx_tp_job.py")


def _config(**extra):
    return {"tokenizer": {"vocab": DIGITS}, "preprocessor": {"kind": "nemo", "n_mels": 80, "dither": 0.0},
            "spec_augment": None, "encoder": dict(ENCODER), "interctc": NO_INTERCTC, **extra}  # fmt: skip


def _perturbed(model, seed=0):
    """``model`` built, its weights and batch-norm statistics drawn at random (an untrained model says only blank)."""
    model.configure_model()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.3 * torch.randn(param.shape, generator=generator))
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm1d):
                module.running_mean.normal_(0.0, 0.5, generator=generator)
                module.running_var.uniform_(0.5, 2.0, generator=generator)
    return model.eval()


def _transducer(**extra):
    torch.manual_seed(0)
    pred = {"pred_hidden": 16, "pred_rnn_layers": 2, "dropout": 0.0}
    return _perturbed(ConformerTransducerModel(_config(prediction=pred, **extra)))


@pytest.fixture(scope="module")
def ctc_export(tmp_path_factory):
    """A self-conditioned Conformer-CTC archive exported with the command line (and int8 copies)."""
    folder = tmp_path_factory.mktemp("ctc")
    torch.manual_seed(0)
    interctc = {"loss_weights": [0.3], "apply_at_layers": [0], "self_conditioning": True}
    archive = _perturbed(ConformerCTCModel(_config(interctc=interctc))).save_to(folder / "ctc.stm")
    export.main([f"model_path={archive}", f"out={folder / 'onnx'}", "quantize=int8"])
    return SpeechModel.restore_from(archive).eval(), folder / "onnx"


@pytest.fixture(scope="module")
def hybrid_export(tmp_path_factory):
    """A hybrid TDT-CTC model with durations that skip a count (0, 1, 2, 4), exported with the Python API."""
    model = _transducer(loss="tdt", durations=[0, 1, 2, 4], hybrid=True, joint={"joint_hidden": 16, "dropout": 0.0})
    folder = tmp_path_factory.mktemp("hybrid")
    export.export_onnx(model, folder)
    return model, folder


@pytest.fixture(scope="module")
def variant_export(tmp_path_factory):
    """An RNN-T with every encoder variant the export restates (4x striding, x-scaling, tied position biases, a
    layer-norm convolution module, half-rate layers) and stacked frames, its weights in ``.onnx.data`` files."""
    encoder = {
        **ENCODER,
        "num_layers": 3,
        "subsampling": "striding",
        "subsampling_factor": 4,
        "xscaling": True,
        "untie_biases": False,
        "conv_norm_type": "layer_norm",
        "time_reduce_idx": 1,
        "time_recovery_idx": 2,
    }
    joint = {"joint_hidden": 16, "dropout": 0.0, "frame_stack": 2, "activation": "silu"}
    model = _transducer(loss="rnnt", encoder=encoder, joint=joint)
    folder = tmp_path_factory.mktemp("variant")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(export, "EXTERNAL_DATA_BYTES", 0)
        export.export_onnx(model, folder, quantize="int8")
    return model, folder


def _features(batch, frames, seed=0):
    """Random (B, 80, T) features and lengths (the first utterance full, the others shorter; padding zero)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([frames] + [max(1, frames * (batch - i) // (batch + 1)) for i in range(1, batch)])
    feats = torch.randn(batch, 80, frames, generator=generator)
    feats *= (torch.arange(frames)[None, :] < lengths[:, None])[:, None, :]
    return feats, lengths


SHAPES = [(3, 97), (1, 41)]


def _run(folder, name, feats, lengths):
    session = ort.InferenceSession(str(folder / name))
    return session.run(None, {"audio_signal": feats.numpy(), "length": lengths.numpy()})


@torch.no_grad()
def _check_ctc(model, folder):
    for batch, frames in SHAPES:
        feats, lengths = _features(batch, frames)
        capture = tuple(model.cfg.interctc.apply_at_layers) if model.cfg.interctc.self_conditioning else ()
        condition = model._condition if capture else None
        x, ref_lengths, _ = model.encoder.forward_with_layers(feats, lengths, capture, condition)
        logprobs, out_lengths = _run(folder, export.CTC_FILE, feats, lengths)
        assert out_lengths.tolist() == ref_lengths.tolist()
        np.testing.assert_allclose(logprobs, model.log_probs(x).numpy(), atol=1e-4, rtol=0)


@torch.no_grad()
def _check_transducer(model, folder):
    for batch, frames in SHAPES:
        feats, lengths = _features(batch, frames)
        enc, enc_lengths = model.joint_frames(*model.encoder(feats, lengths))
        outputs, out_lengths = _run(folder, export.ENCODER_FILE, feats, lengths)
        assert out_lengths.tolist() == enc_lengths.tolist()
        np.testing.assert_allclose(outputs, enc.transpose(1, 2).numpy(), atol=1e-4, rtol=0)
    session = ort.InferenceSession(str(folder / export.DECODER_JOINT_FILE))
    generator = torch.Generator().manual_seed(1)
    pred = model.cfg.prediction
    for batch, labels in ((1, 1), (3, 2)):
        enc = torch.randn(batch, model.joint.enc_proj.in_features, 4, generator=generator)
        targets = torch.randint(0, model.blank + 1, (batch, labels), generator=generator)
        targets[:, 0] = model.blank  # the start symbol
        h, c = (torch.randn(pred.pred_rnn_layers, batch, pred.pred_hidden, generator=generator) for _ in range(2))
        logits, lengths, h_out, c_out = session.run(None, {
            "encoder_outputs": enc.numpy(), "targets": targets.int().numpy(),
            "target_length": np.full(batch, labels, dtype=np.int32), "input_states_1": h.numpy(),
            "input_states_2": c.numpy()})  # fmt: skip
        g, (h_ref, c_ref) = model.prediction.lstm(model.prediction.embed(targets), (h, c))
        ref = model.joint(model.joint.enc_proj(enc.transpose(1, 2))[:, :, None], model.joint.pred_proj(g)[:, None])
        tokens = model.blank + 1
        assert lengths.tolist() == [labels] * batch
        np.testing.assert_allclose(logits[..., :tokens], ref[..., :tokens].numpy(), atol=1e-4, rtol=0)
        if model.cfg.loss == "tdt":
            durations = list(model.durations)
            assert logits.shape[-1] == tokens + max(durations) + 1
            slots = [tokens + d for d in durations]
            np.testing.assert_allclose(logits[..., slots], ref[..., tokens:].numpy(), atol=1e-4, rtol=0)
            empty = [tokens + d for d in range(max(durations) + 1) if d not in durations]
            assert (logits[..., empty] < -1e8).all()
        else:
            assert logits.shape[-1] == tokens
        np.testing.assert_allclose(h_out, h_ref.numpy(), atol=1e-5, rtol=0)
        np.testing.assert_allclose(c_out, c_ref.numpy(), atol=1e-5, rtol=0)


def test_ctc_export_equals_pytorch_on_dynamic_batch_and_time(ctc_export):
    model, folder = ctc_export
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.int8.onnx", "model.onnx", "vocab.txt"]
    assert json.loads((folder / "config.json").read_text()) == {
        "model_type": "nemo-conformer-ctc", "features_size": 80, "subsampling_factor": 8}  # fmt: skip
    _check_ctc(model, folder)


def test_hybrid_tdt_export_equals_pytorch_encoder_ctc_head_and_decoder_joint(hybrid_export):
    model, folder = hybrid_export
    assert {p.name for p in folder.iterdir()} == {"model.onnx", "encoder-model.onnx", "decoder_joint-model.onnx",
                                                  "vocab.txt", "config.json"}  # fmt: skip
    assert json.loads((folder / "config.json").read_text()) == {
        "model_type": "nemo-conformer-tdt",
        "features_size": 80,
        "subsampling_factor": 8,
        "max_tokens_per_step": 10,
    }
    _check_ctc(model, folder)
    _check_transducer(model, folder)


def test_rnnt_export_equals_pytorch_with_every_encoder_variant_and_external_weights(variant_export):
    model, folder = variant_export
    assert (folder / "encoder-model.onnx.data").is_file() and (folder / "encoder-model.int8.onnx.data").is_file()
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "nemo-conformer-rnnt" and config["subsampling_factor"] == 4 * 2  # frame_stack
    _check_transducer(model, folder)


def test_int8_copies_quantise_the_matrix_products(ctc_export, variant_export):
    for folder, name in ((ctc_export[1], "model.int8.onnx"), (variant_export[1], "decoder_joint-model.int8.onnx")):
        ops = {node.op_type for node in onnx.load(str(folder / name)).graph.node}
        assert {"DynamicQuantizeLinear", "MatMulInteger"} <= ops, name
    feats, lengths = _features(2, 120)
    full = _run(ctc_export[1], "model.onnx", feats, lengths)[0]
    int8 = _run(ctc_export[1], "model.int8.onnx", feats, lengths)[0]
    assert np.abs(int8 - full).max() < 0.2 * np.abs(full).max()


def test_vocabulary_and_config_are_what_onnx_asr_reads():
    assert export.vocabulary_lines([" ", "a", "▁the", "<unk>"]) == "▁ 0\na 1\n▁the 2\n<unk> 3\n<blk> 4\n"
    model = _transducer(loss="tdt", hybrid=True, decoder_type="ctc", joint={"joint_hidden": 16, "dropout": 0.0},
                        decoding={"max_symbols": 3})  # fmt: skip
    assert export.onnx_asr_config(export.to_plain(model.cfg)) == {
        "model_type": "nemo-conformer-ctc",
        "features_size": 80,
        "subsampling_factor": 8,
        "max_tokens_per_step": 3,
    }


@pytest.mark.parametrize("n_mels", [80, 128])
def test_nemo_features_equal_onnx_asr_preprocessor(n_mels):
    """onnx-asr computes the features itself (NumPy on a CPU, or its ONNX graph): ours (preprocessor.kind=nemo) are
    the same within float rounding."""
    preprocessors = pytest.importorskip("onnx_asr.preprocessors.numpy_preprocessor", reason="onnx-asr not installed")
    rng = np.random.default_rng(0)
    lengths = np.array([16000, 12345, 801])
    audio = np.zeros((3, 16000), dtype=np.float32)
    for i, n in enumerate(lengths):
        audio[i, :n] = 0.1 * rng.standard_normal(n)
    ours = NemoMelFeatures(PreprocessorConfig(n_mels=n_mels, kind="nemo", dither=0.0), 16000).eval()
    feats, frames = ours(torch.from_numpy(audio), torch.from_numpy(lengths))
    from onnx_asr.preprocessors.preprocessor import OnnxPreprocessor

    for theirs in (preprocessors.NemoPreprocessorNumpy(f"nemo{n_mels}"), OnnxPreprocessor(f"nemo{n_mels}", {})):
        their_feats, their_frames = theirs(audio, lengths)
        assert frames.tolist() == their_frames.tolist()
        np.testing.assert_allclose(feats.numpy(), their_feats, atol=1e-3, rtol=0)


@pytest.fixture(scope="module")
def audio_files(tmp_path_factory):
    """Five DTMF utterances of 0.3 to 2.5 s as 16-bit WAV files (onnx-asr reads PCM WAV)."""
    folder = tmp_path_factory.mktemp("audio")
    rng = np.random.default_rng(3)
    paths = []
    for i, digits in enumerate(["12", "907", "31415", "2718281", "6"]):
        path = folder / f"u{i}.wav"
        sf.write(path, render_digits(digits, rng), 16000, subtype="PCM_16")
        paths.append(str(path))
    return paths


def _greedy(model, paths, decoder_type=None):
    if decoder_type:
        model.cfg.decoder_type = decoder_type
    try:
        return model.transcribe(paths, batch_size=len(paths), strategy="greedy")
    finally:
        if decoder_type:
            model.cfg.decoder_type = "transducer"


def _onnx_asr_matches(model, folder, model_type, paths, decoder_type=None):
    ours = _greedy(model, paths, decoder_type)
    theirs = onnx_asr.load_model(model_type, folder).recognize(paths)
    assert sum(len(t.split()) for t in ours) >= len(paths), (model_type, ours)  # not all blank
    # onnx-asr joins the tokens and drops leading and repeated spaces: the words are compared
    assert [t.split() for t in theirs] == [t.split() for t in ours], (model_type, decoder_type)


@needs_onnx_asr
def test_onnx_asr_transcribes_a_ctc_export_as_our_greedy_decoding(ctc_export, audio_files):
    _onnx_asr_matches(*ctc_export, "nemo-conformer-ctc", audio_files)
    int8 = onnx_asr.load_model("nemo-conformer-ctc", ctc_export[1], quantization="int8").recognize(audio_files)
    assert len(int8) == len(audio_files) and all(isinstance(t, str) for t in int8)


@needs_onnx_asr
def test_onnx_asr_transcribes_both_heads_of_a_hybrid_tdt_export_as_our_greedy_decoding(hybrid_export, audio_files):
    _onnx_asr_matches(*hybrid_export, "nemo-conformer-tdt", audio_files)
    _onnx_asr_matches(*hybrid_export, "nemo-conformer-ctc", audio_files, decoder_type="ctc")


@needs_onnx_asr
def test_onnx_asr_transcribes_an_rnnt_export_with_stacked_frames_as_our_greedy_decoding(variant_export, audio_files):
    _onnx_asr_matches(*variant_export, "nemo-conformer-rnnt", audio_files)


def test_what_onnx_asr_cannot_run_is_refused_by_name(tmp_path):
    torch.manual_seed(0)
    cases = [
        (ConformerCTCModel({**_config(), "preprocessor": {"n_mels": 80}}), "preprocessor.kind"),
        (ConformerCTCModel({**_config(), "preprocessor": {"kind": "nemo", "n_mels": 64}}), "n_mels=64"),
        (ConformerCTCModel({**_config(), "preprocessor": {"kind": "nemo", "n_mels": 80, "window_stride": 0.02}}),
         "window_stride"),
        (ConformerCTCModel({**_config(), "sample_rate": 8000}), "8000 Hz"),
        (ConformerTransducerModel(_config(prediction={"context_size": 2})), "context_size=2"),
        (ConvCTCModel({"tokenizer": {"vocab": DIGITS}, "preprocessor": {"kind": "nemo", "n_mels": 80}}),
         "ConvCTCModel cannot be exported"),
    ]  # fmt: skip
    for model, match in cases:
        with pytest.raises(ValueError, match=match):
            export.export_onnx(model, tmp_path / "out")
    with pytest.raises(ValueError, match="quantize='int4'"):
        export.export_onnx(cases[0][0], tmp_path / "out", quantize="int4")
    assert not (tmp_path / "out").exists()


def test_command_line_errors_name_the_argument(tmp_path, capsys):
    (tmp_path / "taken").write_text("")
    for argv, message in ((["out=x"], "model_path="), ([f"model_path={tmp_path}/no.stm", "out=x"], "no such file"),
                          (["model_path=m.stm", "out=x", "quantize=fp16"], "quantize=fp16")):  # fmt: skip
        with pytest.raises(SystemExit) as stop:
            export.main(argv)
        assert stop.value.code == 2 and message in capsys.readouterr().err
    model = ConformerCTCModel({**_config(), "preprocessor": {"n_mels": 80}})
    model.configure_model()
    archive = model.save_to(tmp_path / "ta.stm")
    for out, message in ((tmp_path / "o", "ta.stm: this ConformerCTCModel uses the 'torchaudio' front-end"),
                         (tmp_path / "taken", "is a file; the export writes a folder")):  # fmt: skip
        with pytest.raises(SystemExit):
            export.main([f"model_path={archive}", f"out={out}"])
        assert message in capsys.readouterr().err


def test_a_new_export_replaces_the_files_of_an_earlier_one(tmp_path, ctc_export):
    stale = tmp_path / "encoder-model.int8.onnx"
    stale.write_bytes(b"old")
    (tmp_path / "notes.txt").write_text("mine")
    written = export.export_onnx(ctc_export[0], tmp_path)
    assert not stale.exists() and (tmp_path / "notes.txt").is_file()
    assert sorted(p.name for p in written) == ["config.json", "model.onnx", "vocab.txt"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".export-")]


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_tensor_parallel_model_exports_its_gathered_weights(tmp_path):
    """A hybrid TDT model built under TP=2 (encoder split over two gloo ranks) exports the graphs of the same model
    built in one process: export_onnx gathers the full state dict, and rank 0 writes."""
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1"}
    single, parallel = tmp_path / "tp1", tmp_path / "tp2"
    commands = [
        [sys.executable, str(TP_JOB), "--out", str(single)],
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
         str(TP_JOB), "--out", str(parallel)],
    ]  # fmt: skip
    for command in commands:
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, check=False)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    feats, lengths = _features(2, 90)
    for name in (export.CTC_FILE, export.ENCODER_FILE):
        for a, b in zip(_run(single, name, feats, lengths), _run(parallel, name, feats, lengths)):
            np.testing.assert_allclose(b, a, atol=1e-5, rtol=0)
    assert (single / "vocab.txt").read_text() == (parallel / "vocab.txt").read_text()
