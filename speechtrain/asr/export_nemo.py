"""Export a Conformer CTC or transducer model to NeMo's ``.nemo`` format, for NeMo's ``ASRModel.restore_from``.

    python -m speechtrain.asr.export_nemo model.stm model.nemo

or ``model.save_to("model.nemo")`` on a :class:`~speechtrain.asr.ctc.ConformerCTCModel` or a
:class:`~speechtrain.asr.transducer.ConformerTransducerModel`. The file is a plain tar of ``model_config.yaml``
(NeMo's config of ``EncDecCTCModelBPE``: ``AudioToMelSpectrogramPreprocessor``, ``ConformerEncoder``,
``ConvASRDecoder``; of ``EncDecRNNTBPEModel`` for an RNN-T or TDT model: ``RNNTDecoder``, ``RNNTJoint``, the loss and
greedy decoding; of ``EncDecHybridRNNTCTCBPEModel`` for a hybrid, with ``aux_ctc``), ``model_weights.ckpt`` (NeMo's
tensor names, written with ``torch.save``: plain tensors only) and the sentencepiece tokenizer with the
``tokenizer.vocab`` and ``vocab.txt`` that NeMo's tokenizer set-up registers. NeMo computes the same log-probs and
joint outputs (see the tests and ``tools/check_nemo_export.py``).

Only what NeMo has is exported; refused by name: other model classes, character tokenizers (NeMo's character
models are another class), the ``torchaudio`` front-end (NeMo's features differ: HTK mel without pre-emphasis;
train with ``preprocessor.kind=nemo`` to export), an encoder with half-rate layers, self-conditioned CTC, and for
transducers a stateless prediction network, stacked frames (``joint.frame_stack``) or a ``silu`` joint.
"""

import argparse
import io
import os
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import torch
import yaml

from speechtrain.asr.conformer import ConformerConfig
from speechtrain.asr.nemo_import import NEMO_CONFIG, NEMO_WEIGHTS, name_pairs
from speechtrain.common.config import to_plain, with_env_interpolations
from speechtrain.common.tokenizers import SentencePieceTokenizer
from speechtrain.lightning.checkpoint import gather_full_state_dict

NEMO_CLASS = "nemo.collections.asr.models.ctc_bpe_models.EncDecCTCModelBPE"
RNNT_CLASS = "nemo.collections.asr.models.rnnt_bpe_models.EncDecRNNTBPEModel"
HYBRID_CLASS = "nemo.collections.asr.models.hybrid_rnnt_ctc_bpe_models.EncDecHybridRNNTCTCBPEModel"


def nemo_class(cfg: Any) -> str:
    """NeMo's class for our model config: CTC, RNN-T / TDT (``loss`` set), or hybrid (``hybrid: true``)."""
    if "loss" not in cfg:
        return NEMO_CLASS
    return HYBRID_CLASS if cfg["hybrid"] else RNNT_CLASS


def transducer_sections(cfg: Any, vocabulary: list[str]) -> dict[str, Any]:
    """Our transducer config -> NeMo's ``model_defaults``, ``decoder``, ``joint``, ``decoding`` and ``loss`` (the
    inverse of :func:`~speechtrain.asr.nemo_import.transducer_config`)."""
    pred, joint, d_model = cfg["prediction"], cfg["joint"], int(cfg["encoder"]["d_model"])
    durations = [int(d) for d in cfg["durations"]] if cfg["loss"] == "tdt" else []
    width = {"pred_hidden": int(pred["pred_hidden"]), "joint_hidden": int(joint["joint_hidden"])}
    sections: dict[str, Any] = {
        "model_defaults": {"enc_hidden": d_model, **width},
        "decoder": {
            "_target_": "nemo.collections.asr.modules.RNNTDecoder",
            "normalization_mode": None,
            "random_state_sampling": False,
            "blank_as_pad": True,
            "prednet": {
                "pred_hidden": width["pred_hidden"],
                "pred_rnn_layers": int(pred["pred_rnn_layers"]),
                "t_max": None,
                "dropout": float(pred["dropout"]),
            },  # fmt: skip
            "vocab_size": len(vocabulary),
        },
        "joint": {
            "_target_": "nemo.collections.asr.modules.RNNTJoint",
            "log_softmax": None,
            "preserve_memory": False,
            "fuse_loss_wer": False,
            "fused_batch_size": int(joint["fused_batch_size"]) or -1,
            "jointnet": {
                "joint_hidden": width["joint_hidden"],
                "activation": joint["activation"],
                "dropout": float(joint["dropout"]),
                "encoder_hidden": d_model,
                "pred_hidden": width["pred_hidden"],
            },  # fmt: skip
            "num_classes": len(vocabulary),
            "vocabulary": vocabulary,
        },
        "decoding": {"strategy": "greedy_batch", "greedy": {"max_symbols": int(cfg["decoding"]["max_symbols"])}},
        "loss": {"loss_name": "default"},
    }
    if durations:
        sections["model_defaults"]["tdt_durations"] = durations
        sections["joint"]["num_extra_outputs"] = len(durations)
        sections["decoding"].update(model_type="tdt", durations=durations)
        sections["loss"] = {"loss_name": "tdt", "tdt_kwargs": {"fastemit_lambda": 0.0, "clamp": -1.0,
                                                               "durations": durations, "sigma": float(cfg["sigma"]),
                                                               "omega": float(cfg["omega"])}}  # fmt: skip
    return sections


def _ctc_config(cfg: Any, vocabulary: list[str]) -> dict[str, Any]:
    """Our Conformer-CTC config -> NeMo's ``EncDecCTCModelBPE`` config."""
    pre, enc, sample_rate = cfg["preprocessor"], cfg["encoder"], int(cfg["sample_rate"])
    spec = cfg.get("spec_augment")
    interctc = cfg.get("interctc") or {}
    return {
        "sample_rate": sample_rate,
        "log_prediction": False,
        "ctc_reduction": cfg["ctc_reduction"],
        "skip_nan_grad": False,
        "tokenizer": {
            "dir": None,
            "type": "bpe",
            "model_path": "nemo:tokenizer.model",
            "vocab_path": "nemo:vocab.txt",
            "spe_tokenizer_vocab": "nemo:tokenizer.vocab",
        },
        "preprocessor": {
            "_target_": "nemo.collections.asr.modules.AudioToMelSpectrogramPreprocessor",
            "sample_rate": sample_rate,
            "normalize": pre.get("normalize", "per_feature"),
            "window_size": float(pre["window_size"]),
            "window_stride": float(pre["window_stride"]),
            "window": "hann",
            "features": int(pre["n_mels"]),
            "n_fft": int(pre["n_fft"]),
            "log": True,
            "frame_splicing": 1,
            "dither": float(pre["dither"]),
            "preemph": float(pre["preemph"]) or None,
            "pad_to": int(pre["pad_to"]),
            "pad_value": 0.0,
        },
        "spec_augment": None
        if not spec
        else {
            "_target_": "nemo.collections.asr.modules.SpectrogramAugmentation",
            "freq_masks": int(spec["freq_masks"]),
            "time_masks": int(spec["time_masks"]),
            "freq_width": int(spec["freq_width"]),
            "time_width": spec["time_width"],
        },
        "encoder": {
            "_target_": "nemo.collections.asr.modules.ConformerEncoder",
            "feat_in": int(pre["n_mels"]),
            "feat_out": -1,
            "n_layers": int(enc["num_layers"]),
            "d_model": int(enc["d_model"]),
            "subsampling": enc["subsampling"],
            "subsampling_factor": int(enc["subsampling_factor"]),
            "subsampling_conv_channels": int(enc["subsampling_conv_channels"]),
            "causal_downsampling": bool(enc.get("causal_downsampling", False)),
            "ff_expansion_factor": int(enc["ff_expansion_factor"]),
            "self_attention_model": "rel_pos",
            "n_heads": int(enc["num_heads"]),
            "att_context_size": [list(c) for c in ConformerConfig(**enc).context_sizes()],
            "att_context_style": enc.get("att_context_style", "regular"),
            "att_context_probs": enc.get("att_context_probs"),
            "xscaling": bool(enc["xscaling"]),
            "untie_biases": bool(enc["untie_biases"]),
            "pos_emb_max_len": 5000,
            "conv_kernel_size": int(enc["conv_kernel_size"]),
            "conv_norm_type": enc["conv_norm_type"],
            "conv_context_size": enc.get("conv_context_size"),
            "dropout": float(enc["dropout"]),
            "dropout_pre_encoder": float(enc["dropout"]),
            "dropout_emb": 0.0,
            "dropout_att": float(enc["dropout_att"]),
        },
        "decoder": {
            "_target_": "nemo.collections.asr.modules.ConvASRDecoder",
            "feat_in": int(enc["d_model"]),
            "num_classes": len(vocabulary),
            "vocabulary": vocabulary,
        },
        "interctc": {key: list(interctc.get(key) or []) for key in ("loss_weights", "apply_at_layers")},
        "decoding": {"strategy": "greedy"},
        "target": NEMO_CLASS,
    }


def nemo_config(cfg: Any, vocabulary: list[str]) -> dict[str, Any]:
    """Our Conformer CTC or transducer config (a DictConfig or dict) -> NeMo's config of :func:`nemo_class`
    (artifacts named ``nemo:tokenizer.model``, ``nemo:tokenizer.vocab``, ``nemo:vocab.txt``)."""
    config = _ctc_config(cfg, vocabulary)
    if "loss" not in cfg:
        return config
    ctc_head = config.pop("decoder")
    config.pop("interctc")
    config.update(transducer_sections(cfg, vocabulary), target=nemo_class(cfg))
    if cfg["hybrid"]:
        config["aux_ctc"] = {"ctc_loss_weight": float(cfg["ctc_loss_weight"]), "use_cer": False,
                             "ctc_reduction": cfg["ctc_reduction"], "decoder": ctc_head,
                             "decoding": {"strategy": "greedy"}}  # fmt: skip
    return config


def nemo_state_dict(state: dict[str, torch.Tensor], cfg: Any) -> dict[str, torch.Tensor]:
    """Our full state dict -> NeMo's names and shapes (the inverse of
    :func:`~speechtrain.asr.nemo_import.nemo_to_speechtrain`; zero key biases, tied biases repeated per layer)."""
    encoder = cfg["encoder"]
    head: str | None = "decoder"
    transducer = None
    if "loss" in cfg:
        head = "ctc_decoder" if cfg["hybrid"] else None
        transducer = (int(cfg["prediction"]["pred_rnn_layers"]), bool(cfg["joint"]["dropout"]))
    out: dict[str, torch.Tensor] = {}
    for nemo, ours, conv in name_pairs(encoder, head, transducer):
        tensor = state[ours].detach().cpu()
        out[nemo] = (tensor.unsqueeze(-1) if conv else tensor).clone().contiguous()
    for i in range(int(encoder["num_layers"])):
        layer = f"encoder.layers.{i}.self_attn."
        out[layer + "linear_k.bias"] = torch.zeros(int(encoder["d_model"]))
        for b in "uv":
            out.setdefault(layer + f"pos_bias_{b}", out[f"encoder.layers.0.self_attn.pos_bias_{b}"].clone())
    return out


def _tokenizer_files(model_file: Path) -> dict[str, bytes]:
    """``tokenizer.model`` and the two vocabulary listings NeMo's BPE set-up registers as artifacts."""
    import sentencepiece as spm

    data = model_file.read_bytes()
    sp = spm.SentencePieceProcessor(model_proto=data)
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    listing = "".join(f"{p}\t{sp.get_score(i):g}\n" for i, p in enumerate(pieces))
    words = []
    for i, piece in enumerate(pieces):
        if sp.is_control(i) or sp.is_unknown(i):
            continue
        token = piece[1:] if piece.startswith("\u2581") else f"##{piece}"
        words.append(token or piece[0])
    return {
        "tokenizer.model": data,
        "tokenizer.vocab": listing.encode(),
        "vocab.txt": "".join(f"{w}\n" for w in words).encode(),
    }


def write_nemo(model: Any, path: str | Path) -> Path:
    """Write ``model`` (a :class:`~speechtrain.asr.ctc.ConformerCTCModel` with a sentencepiece tokenizer and the
    ``nemo`` front-end) as a ``.nemo`` file, atomically. In a distributed run every rank must call this (the
    weights are gathered); global rank 0 writes.

    Raises:
        ValueError: naming what NeMo cannot hold.
    """
    path = Path(path)
    name = type(model).__name__
    # The model modules call this from their save_to, so it tells a Conformer recogniser by its config, not by
    # importing their classes: a transducer's sets ``loss``.
    if not all(key in getattr(model, "cfg", {}) for key in ("encoder", "interctc", "preprocessor")):
        raise ValueError(f"{path}: a {name} cannot be exported to .nemo: NeMo has no such model (Conformer-CTC "
                         "models export).")  # fmt: skip
    if model.cfg.interctc.self_conditioning:
        raise ValueError(f"{path}: this {name} is self-conditioned (model.interctc.self_conditioning), which NeMo's "
                         "Conformer-CTC does not compute; export it as a .stm archive.")  # fmt: skip
    if model.cfg.encoder.time_reduce_idx >= 0:
        raise ValueError(f"{path}: this {name}'s encoder runs layers on half the frames (model.encoder."
                         "time_reduce_idx), which NeMo's Conformer encoder does not; export it as a .stm "
                         "archive.")  # fmt: skip
    if "loss" in model.cfg:
        pred, joint = model.cfg.prediction, model.cfg.joint
        if pred.context_size or joint.frame_stack != 1 or joint.activation not in ("relu", "tanh", "sigmoid"):
            raise ValueError(f"{path}: this {name} has a stateless prediction network (context_size "
                             f"{pred.context_size}), stacked frames (joint.frame_stack {joint.frame_stack}) or a "
                             f"{joint.activation!r} joint, which NeMo's RNNTDecoder / RNNTJoint do not compute; "
                             "export it as a .stm archive.")  # fmt: skip
    if not isinstance(model.tokenizer, SentencePieceTokenizer):
        raise ValueError(f"{path}: this {name} has a {type(model.tokenizer).__name__}; the .nemo export writes "
                         "NeMo's EncDecCTCModelBPE, which needs a sentencepiece tokenizer.")  # fmt: skip
    cfg = with_env_interpolations(to_plain(model.cfg), model.env_interpolations)
    if cfg["preprocessor"]["kind"] != "nemo":
        raise ValueError(f"{path}: this {name} uses the {cfg['preprocessor']['kind']!r} front-end, whose features "
                         "NeMo does not compute (HTK mel, no pre-emphasis); train with preprocessor.kind=nemo to "
                         "export to .nemo.")  # fmt: skip
    model.configure_model()
    state = gather_full_state_dict(model)
    trainer = model._trainer
    if trainer is not None and not trainer.is_global_zero:
        return path
    members = {NEMO_CONFIG: b"", NEMO_WEIGHTS: b""}
    members[NEMO_CONFIG] = yaml.safe_dump(nemo_config(cfg, model.tokenizer.vocab), sort_keys=False,
                                          allow_unicode=True).encode()  # fmt: skip
    buffer = io.BytesIO()
    torch.save(nemo_state_dict(state, cfg), buffer)
    members[NEMO_WEIGHTS] = buffer.getvalue()
    with tempfile.TemporaryDirectory() as tmp:
        model_file = Path(tmp) / "tokenizer.model"
        model.tokenizer.save(model_file)
        members.update(_tokenizer_files(model_file))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle, tarfile.open(fileobj=handle, mode="w") as tar:
            for member, data in members.items():
                info = tarfile.TarInfo(f"./{member}")
                info.size, info.mode = len(data), 0o644
                tar.addfile(info, io.BytesIO(data))
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m speechtrain.asr.export_nemo",
        description="Export a speechtrain Conformer CTC or transducer archive (.stm) to NeMo's .nemo format.",
    )
    parser.add_argument("model", help="the speechtrain archive (.stm)")
    parser.add_argument("output", help="the .nemo file to write")
    args = parser.parse_args(argv)
    if Path(args.output).suffix != ".nemo":
        parser.error(f"output {args.output!r} must end in .nemo")
    from speechtrain.core.model import SpeechModel

    model = SpeechModel.restore_from(args.model)
    try:
        written = write_nemo(model, args.output)
    except ValueError as error:
        sys.exit(f"error: {error}")
    kind = nemo_class(model.cfg).rsplit(".", 1)[-1]
    print(f"Wrote {written} (NeMo {kind}, {model.tokenizer.vocab_size} tokens).")


if __name__ == "__main__":
    main()
