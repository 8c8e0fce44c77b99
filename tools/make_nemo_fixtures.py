"""Build the tiny NeMo ``.nemo`` fixtures that the tests load without NeMo (``tests/fixtures/nemo/``).

Needs NeMo (``pip install nemo-toolkit[asr]``, in its own environment); run from the repository root::

    python tools/make_nemo_fixtures.py [--out tests/fixtures/nemo]

For each fixture it builds a tiny random NeMo model (seeded; every weight and batch-norm statistic drawn away from
its initial value so that a wrong mapping shows), saves it with NeMo's own ``save_to``, and runs it in eval mode on
a fixed batch of two utterances of different lengths (``input_a.wav``, ``input_b.wav``, 16-bit PCM, written here
and read back so that NeMo and the tests see the same samples). NeMo's CTC log-probs and output lengths go to
``<name>.expected.safetensors``; for a transducer (RNN-T, TDT, and the hybrid's transducer branch) also the prediction
network's output and the joint's raw logits on a fixed label sequence (``labels``), and NeMo's greedy hypotheses
(``greedy_<i>``: token ids per utterance). The archives are recompressed with gzip, as NeMo 1.x wrote them.
``manifest.json`` records the NeMo and torch versions.

A streaming fixture (``att_context_size`` set) also holds NeMo's cache-aware streaming run of each utterance alone,
for each look-ahead ``c`` (index into ``att_context_size``): NeMo's offline features cut into chunks by NeMo's
``CacheAwareStreamingAudioBuffer`` (its pre-encode cache and ``drop_extra_pre_encoded``), fed to
``encoder.cache_aware_stream_step`` with its caches; ``stream<c>_enc_<i>`` (T, D) are the chunks' encoder outputs
one after the other (``offline<c>_enc_<i>``: NeMo's offline encoder output with that look-ahead),
``stream<c>_chunks_<i>`` the frames of each chunk, ``stream<c>_ctc_<i>`` and
``stream<c>_tdt_<i>`` the final greedy token ids of ``conformer_stream_step`` with the CTC and the TDT decoder.
``--only NAME`` rebuilds one fixture (and keeps the other entries of the manifest).
"""

import argparse
import io
import json
import math
import tarfile
import tempfile
from pathlib import Path

import numpy as np
import sentencepiece as spm
import soundfile as sf
import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file

SAMPLE_RATE = 16000
LENGTHS = (12000, 7000)  # a batch of two different lengths
TEXT = (
    "the quick brown fox jumps over the lazy dog while a zebra and a jaguar quietly watch "
    "seven wizards vex the jumping king's quiz of boxes an expert pilot flies through heavy fog"
)

STREAMING_CONTEXTS = [[4, 1], [4, 0]]  # [left, right] encoder frames

FIXTURES = {
    # name: (encoder overrides, preprocessor overrides, kind: ctc | hybrid | rnnt | tdt | hybrid_tdt)
    "fastconformer_ctc": ({"subsampling": "dw_striding", "subsampling_factor": 8, "xscaling": True,
                           "untie_biases": True}, {}, "ctc"),
    "fastconformer_ctc_noxs_tied": ({"subsampling": "dw_striding", "subsampling_factor": 8, "xscaling": False,
                                     "untie_biases": False}, {}, "ctc"),
    "conformer_ctc": ({"subsampling": "striding", "subsampling_factor": 4, "xscaling": True, "untie_biases": False,
                       "conv_kernel_size": 7, "conv_norm_type": "layer_norm", "n_heads": 4},
                      {"pad_to": 16}, "ctc"),
    "fastconformer_hybrid": ({"subsampling": "dw_striding", "subsampling_factor": 8, "xscaling": True,
                              "untie_biases": True}, {}, "hybrid"),
    "fastconformer_rnnt": ({"subsampling": "dw_striding", "subsampling_factor": 8, "xscaling": True,
                            "untie_biases": True}, {}, "rnnt"),
    "conformer_tdt": ({"subsampling": "striding", "subsampling_factor": 4, "xscaling": False, "untie_biases": True},
                      {}, "tdt"),
    "fastconformer_hybrid_tdt": ({"subsampling": "dw_striding", "subsampling_factor": 8, "xscaling": True,
                                  "untie_biases": True}, {}, "hybrid_tdt"),
    # cache-aware streaming: two look-aheads trained together (the first is the default), causal convolutions and
    # subsampling, no per-utterance normalisation
    "fastconformer_hybrid_tdt_streaming": ({"subsampling": "dw_striding", "subsampling_factor": 8, "xscaling": True,
                                            "untie_biases": True, "att_context_size": STREAMING_CONTEXTS,
                                            "att_context_style": "chunked_limited", "conv_context_size": "causal",
                                            "causal_downsampling": True},
                                           {"normalize": "none"}, "hybrid_tdt"),
}  # fmt: skip
TDT_DURATIONS = [0, 1, 2, 3, 4]
JOINT_GAIN, BLANK_BIAS = 3.0, 1.5
GREEDY_FRAMES = (12, 7)  # the greedy decoding's input: random "encoder outputs" of these lengths
LABELS = ((3, 17, 5, 30, 8), (12, 1, 39, 4, 4))  # a fixed (B, U) label batch for the transducers' tensors


def make_tokenizer(folder: Path) -> None:
    """A tiny BPE model in NeMo's layout (``tokenizer.model``, ``tokenizer.vocab``, ``vocab.txt``)."""
    text = folder / "text.txt"
    text.write_text("\n".join([TEXT] * 4) + "\n")
    spm.SentencePieceTrainer.train(
        input=str(text), model_prefix=str(folder / "tokenizer"), vocab_size=40, model_type="bpe",
        character_coverage=1.0, bos_id=-1, eos_id=-1, normalization_rule_name="identity", minloglevel=2,
    )  # fmt: skip
    sp = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    (folder / "vocab.txt").write_text("".join(sp.id_to_piece(i) + "\n" for i in range(sp.get_piece_size())))
    text.unlink()


def model_config(tokenizer_dir: Path, encoder: dict, preprocessor: dict, kind: str) -> dict:
    d_model = 16
    enc = {
        "_target_": "nemo.collections.asr.modules.ConformerEncoder", "feat_in": 20, "feat_out": -1, "n_layers": 2,
        "d_model": d_model, "subsampling_conv_channels": 8, "causal_downsampling": False, "ff_expansion_factor": 2,
        "self_attention_model": "rel_pos", "n_heads": 2, "att_context_size": [-1, -1], "pos_emb_max_len": 5000,
        "conv_kernel_size": 9, "conv_norm_type": "batch_norm", "conv_context_size": None, "dropout": 0.1,
        "dropout_pre_encoder": 0.1, "dropout_emb": 0.0, "dropout_att": 0.1, **encoder,
    }  # fmt: skip
    cfg = {
        "sample_rate": SAMPLE_RATE,
        "log_prediction": False,
        "ctc_reduction": "mean_volume",
        "tokenizer": {"dir": str(tokenizer_dir), "type": "bpe"},
        "preprocessor": {
            "_target_": "nemo.collections.asr.modules.AudioToMelSpectrogramPreprocessor",
            "sample_rate": SAMPLE_RATE,
            "normalize": "per_feature",
            "window_size": 0.025,
            "window_stride": 0.01,
            "window": "hann",
            "features": 20,
            "n_fft": 512,
            "log": True,
            "frame_splicing": 1,
            "dither": 1e-5,
            "pad_to": 0,
            "pad_value": 0.0,
            **preprocessor,
        },  # fmt: skip
        "spec_augment": {
            "_target_": "nemo.collections.asr.modules.SpectrogramAugmentation",
            "freq_masks": 2,
            "time_masks": 2,
            "freq_width": 4,
            "time_width": 0.05,
        },  # fmt: skip
        "encoder": enc,
        "optim": {"name": "adamw", "lr": 1e-3},
    }
    ctc_decoder = {"_target_": "nemo.collections.asr.modules.ConvASRDecoder", "feat_in": d_model, "num_classes": -1,
                   "vocabulary": []}  # fmt: skip
    if kind == "ctc":
        cfg["decoder"] = ctc_decoder
        cfg["decoding"] = {"strategy": "greedy"}
        return cfg
    cfg["model_defaults"] = {"enc_hidden": d_model, "pred_hidden": 16, "joint_hidden": 16}
    cfg["decoder"] = {
        "_target_": "nemo.collections.asr.modules.RNNTDecoder",
        "normalization_mode": None,
        "random_state_sampling": False,
        "blank_as_pad": True,
        "prednet": {"pred_hidden": 16, "pred_rnn_layers": 2 if kind == "tdt" else 1, "t_max": None, "dropout": 0.1},
    }
    cfg["joint"] = {
        "_target_": "nemo.collections.asr.modules.RNNTJoint",
        "log_softmax": None,
        "preserve_memory": False,
        "fuse_loss_wer": False,
        "fused_batch_size": 4,
        "jointnet": {
            "joint_hidden": 16,
            "activation": "tanh" if kind == "tdt" else "relu",
            "dropout": 0.0 if kind == "hybrid_tdt" else 0.1,
        },  # 0: no Dropout module in NeMo's joint
    }
    cfg["decoding"] = {"strategy": "greedy_batch", "greedy": {"max_symbols": 5}}
    cfg["loss"] = {"loss_name": "default"}
    if kind in ("tdt", "hybrid_tdt"):
        cfg["model_defaults"]["tdt_durations"] = TDT_DURATIONS
        cfg["joint"]["num_extra_outputs"] = len(TDT_DURATIONS)
        cfg["decoding"].update({"model_type": "tdt", "durations": TDT_DURATIONS})
        cfg["loss"] = {
            "loss_name": "tdt",
            "tdt_kwargs": {
                "fastemit_lambda": 0.0,
                "clamp": -1.0,
                "durations": TDT_DURATIONS,
                "sigma": 0.05,
                "omega": 0.1,
            },
        }
    if not kind.startswith("hybrid"):
        return cfg
    cfg["aux_ctc"] = {"ctc_loss_weight": 0.3, "use_cer": False, "ctc_reduction": "mean_batch",
                      "decoder": ctc_decoder, "decoding": {"strategy": "greedy"}}  # fmt: skip
    return cfg  # fmt: skip


def randomise(model: torch.nn.Module, seed: int) -> None:
    """Draw every encoder/decoder tensor away from its initialisation (the preprocessor's buffers are kept)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.startswith("preprocessor.") or not tensor.is_floating_point():
                continue
            noise = torch.randn(tensor.shape, generator=generator)
            if name.endswith("running_var"):
                tensor.copy_(0.5 + torch.rand(tensor.shape, generator=generator))
            elif name.endswith("running_mean") or "pos_bias" in name:
                tensor.copy_(0.3 * noise)
            elif tensor.dim() == 1:
                tensor.add_(0.2 * noise)
            else:
                tensor.add_(0.5 * noise * tensor.std().clamp(min=0.05))


def vary_joint(model: torch.nn.Module) -> None:
    """A transducer's joint layers with no biases (but the blank's) and larger weights, so that greedy decoding
    follows its input and emits blanks too (with the randomised biases every cell picked the same token, which tests
    little of the decoding)."""
    with torch.no_grad():
        for layer in (model.joint.enc, model.joint.pred, model.joint.joint_net[-1]):
            layer.bias.zero_()
            layer.weight.mul_(JOINT_GAIN)
        model.joint.joint_net[-1].bias[model.decoder.blank_idx] = BLANK_BIAS
        # the blank's embedding is the padding row, zero in every trained NeMo model (NeMo's batched greedy decoding
        # reads it as the start symbol, its frame-by-frame one a zero vector: they agree only when it is zero)
        model.decoder.prediction.embed.weight[model.decoder.blank_idx] = 0.0


def make_inputs(out: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Two speech-like signals (harmonic tones with a moving pitch and noise), saved as 16-bit WAV and read back."""
    rng = np.random.default_rng(0)
    waves = []
    for index, length in enumerate(LENGTHS):
        t = np.arange(length) / SAMPLE_RATE
        pitch = 120 + 40 * index + 30 * np.sin(2 * math.pi * 3 * t)
        phase = 2 * math.pi * np.cumsum(pitch) / SAMPLE_RATE
        wave = sum(np.sin(k * phase) / k for k in range(1, 8)) * (0.6 + 0.4 * np.sin(2 * math.pi * 4 * t))
        wave = 0.2 * wave + 0.01 * rng.standard_normal(length)
        path = out / f"input_{'ab'[index]}.wav"
        sf.write(path, wave, SAMPLE_RATE, subtype="PCM_16")
        waves.append(torch.from_numpy(sf.read(path, dtype="float32")[0]))
    audio = torch.zeros(len(waves), max(LENGTHS))
    for i, wave in enumerate(waves):
        audio[i, : len(wave)] = wave
    return audio, torch.tensor(LENGTHS)


def gzip_archive(path: Path) -> None:
    """Recompress NeMo's plain tar with gzip, as NeMo 1.x wrote them (the loader reads both; smaller fixtures)."""
    with tarfile.open(path, "r:") as source:
        members = [(info, source.extractfile(info).read() if info.isfile() else None) for info in source]
    with tarfile.open(path, "w:gz") as target:
        for info, data in members:
            target.addfile(info, io.BytesIO(data) if data is not None else None)


def ctc_log_probs(model, audio: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        if hasattr(model, "ctc_decoder"):
            encoded, encoded_len = model.forward(input_signal=audio, input_signal_length=lengths)
            return model.ctc_decoder(encoder_output=encoded), encoded_len
        log_probs, encoded_len, _ = model.forward(input_signal=audio, input_signal_length=lengths)
        return log_probs, encoded_len


def transducer_outputs(model, audio: torch.Tensor, lengths: torch.Tensor) -> dict[str, torch.Tensor]:
    """The prediction network's output and the joint's raw logits on ``LABELS``, and NeMo's greedy token ids."""
    with torch.no_grad():
        encoded, encoded_len = model.forward(input_signal=audio, input_signal_length=lengths)  # (B, D, T)
        labels = torch.tensor(LABELS)
        pred, _ = model.decoder.predict(labels, state=None, add_sos=True, batch_size=labels.shape[0])  # (B, U+1, H)
        model.joint.log_softmax = False  # raw logits (NeMo applies log_softmax on the CPU when this is None)
        logits = model.joint.joint(encoded.transpose(1, 2), pred)  # (B, T, U+1, V+1+D)
        model.joint.log_softmax = None
        # Greedy decoding of a random encoder output (the random encoder's is nearly the same on every frame).
        generator = torch.Generator().manual_seed(7)
        frames = torch.randn(len(GREEDY_FRAMES), max(GREEDY_FRAMES), encoded.shape[1], generator=generator)
        frame_lens = torch.tensor(GREEDY_FRAMES)
        hypotheses = model.decoding.rnnt_decoder_predictions_tensor(encoder_output=frames.transpose(1, 2),
                                                                   encoded_lengths=frame_lens)  # fmt: skip
    out = {"labels": labels, "prediction": pred.float().contiguous(), "joint_logits": logits.float().contiguous(),
           "greedy_input": frames, "greedy_lengths": frame_lens}  # fmt: skip
    for i, hypothesis in enumerate(hypotheses):
        out[f"greedy_{i}"] = torch.as_tensor(hypothesis.y_sequence, dtype=torch.long).reshape(-1)
    return out


def stream_outputs(model, audio: torch.Tensor, lengths: torch.Tensor) -> dict[str, torch.Tensor]:
    """NeMo's cache-aware streaming run of each utterance alone, per look-ahead (see the module docstring)."""
    from nemo.collections.asr.parts.utils.streaming_utils import CacheAwareStreamingAudioBuffer

    out = {}
    encoder = model.encoder
    for index, context in enumerate(STREAMING_CONTEXTS):
        encoder.set_default_att_context_size(context)
        for i, length in enumerate(lengths.tolist()):
            with torch.no_grad():
                feats, feat_len = model.preprocessor(input_signal=audio[i : i + 1, :length],
                                                     length=torch.tensor([length]))  # fmt: skip
            with torch.no_grad():
                offline = model.forward(input_signal=audio[i : i + 1, :length],
                                        input_signal_length=torch.tensor([length]))  # fmt: skip
            out[f"offline{index}_enc_{i}"] = offline[0][0].T.float().contiguous()  # (D, T) -> (T, D)
            chunks, outputs = [], []
            for decoder in ("ctc", "rnnt"):
                model.change_decoding_strategy(decoder_type=decoder, verbose=False)
                buffer = CacheAwareStreamingAudioBuffer(model, online_normalization=False)
                buffer.append_processed_signal(feats[:, :, : int(feat_len[0])])
                channel, time, channel_len = encoder.get_initial_cache_state(batch_size=1)
                hypotheses, predictions = None, None
                for step, (chunk, chunk_len) in enumerate(buffer):
                    drop = 0 if step == 0 else encoder.streaming_cfg.drop_extra_pre_encoded
                    last = buffer.is_buffer_empty()
                    with torch.no_grad():
                        if decoder == "ctc":
                            enc, enc_len, *_ = encoder.cache_aware_stream_step(
                                processed_signal=chunk, processed_signal_length=chunk_len,
                                cache_last_channel=channel, cache_last_time=time, cache_last_channel_len=channel_len,
                                keep_all_outputs=last, drop_extra_pre_encoded=drop,
                            )  # fmt: skip
                            outputs.append(enc[0, :, : int(enc_len[0])].T)  # (D, T) -> (T, D)
                            chunks.append(int(enc_len[0]))
                        predictions, texts, channel, time, channel_len, hypotheses = model.conformer_stream_step(
                            processed_signal=chunk, processed_signal_length=chunk_len, cache_last_channel=channel,
                            cache_last_time=time, cache_last_channel_len=channel_len, keep_all_outputs=last,
                            previous_hypotheses=hypotheses, previous_pred_out=predictions,
                            drop_extra_pre_encoded=drop, return_transcription=True,
                        )  # fmt: skip
                if decoder == "ctc":
                    ids = [p for j, p in enumerate(predictions[0].tolist())
                           if p != model.ctc_decoder.num_classes_with_blank - 1
                           and (j == 0 or p != predictions[0][j - 1])]  # fmt: skip
                    out[f"stream{index}_ctc_{i}"] = torch.tensor(ids, dtype=torch.long)
                else:
                    out[f"stream{index}_tdt_{i}"] = torch.as_tensor(hypotheses[0].y_sequence, dtype=torch.long)
            out[f"stream{index}_enc_{i}"] = torch.cat(outputs).float().contiguous()
            out[f"stream{index}_chunks_{i}"] = torch.tensor(chunks, dtype=torch.long)
    encoder.set_default_att_context_size(STREAMING_CONTEXTS[0])
    model.change_decoding_strategy(decoder_type="rnnt", verbose=False)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("tests/fixtures/nemo"))
    parser.add_argument("--only", choices=sorted(FIXTURES), help="rebuild this fixture only")
    args = parser.parse_args()
    import nemo
    from nemo.collections.asr.models import EncDecCTCModelBPE, EncDecHybridRNNTCTCBPEModel, EncDecRNNTBPEModel

    classes = {"ctc": EncDecCTCModelBPE, "hybrid": EncDecHybridRNNTCTCBPEModel, "rnnt": EncDecRNNTBPEModel,
               "tdt": EncDecRNNTBPEModel, "hybrid_tdt": EncDecHybridRNNTCTCBPEModel}  # fmt: skip

    args.out.mkdir(parents=True, exist_ok=True)
    audio, lengths = make_inputs(args.out)
    manifest_path = args.out / "manifest.json"
    records = json.loads(manifest_path.read_text())["fixtures"] if args.only and manifest_path.exists() else {}
    with tempfile.TemporaryDirectory() as tmp:
        make_tokenizer(Path(tmp))
        for seed, (name, (encoder, preprocessor, kind)) in enumerate(FIXTURES.items()):
            if args.only and name != args.only:
                continue
            torch.manual_seed(seed)
            cfg = OmegaConf.create(model_config(Path(tmp), encoder, preprocessor, kind))
            model = classes[kind](cfg=cfg)
            randomise(model, seed)
            if kind != "ctc":
                vary_joint(model)
            model.eval()
            path = args.out / f"{name}.nemo"
            model.save_to(str(path))
            gzip_archive(path)
            expected = {}
            if kind in ("ctc", "hybrid", "hybrid_tdt"):
                log_probs, out_lengths = ctc_log_probs(model, audio, lengths)
                expected["log_probs"] = log_probs.float().contiguous()
            if kind != "ctc":
                expected.update(transducer_outputs(model, audio, lengths))
                with torch.no_grad():
                    out_lengths = model.forward(input_signal=audio, input_signal_length=lengths)[1]
            expected["lengths"] = out_lengths.long()
            if "att_context_size" in encoder:
                expected.update(stream_outputs(model, audio, lengths))
            save_file(expected, args.out / f"{name}.expected.safetensors")
            shapes = {key: list(value.shape) for key, value in expected.items() if key != "lengths"}
            records[name] = {"class": type(model).__name__, "encoder": encoder, "preprocessor": preprocessor,
                             "shapes": shapes, "lengths": out_lengths.tolist(),
                             "bytes": path.stat().st_size}  # fmt: skip
            print(name, records[name])
    manifest = {"nemo": nemo.__version__, "torch": torch.__version__, "inputs": ["input_a.wav", "input_b.wav"],
                "fixtures": records}  # fmt: skip
    manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")


if __name__ == "__main__":
    main()
