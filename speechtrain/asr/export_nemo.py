"""Export a Conformer-CTC model to NeMo's ``.nemo`` format, for NeMo's ``EncDecCTCModelBPE.restore_from``.

    python -m speechtrain.asr.export_nemo model.stm model.nemo

or ``model.save_to("model.nemo")`` on a :class:`~speechtrain.asr.ctc.ConformerCTCModel`. The file is a plain tar
of ``model_config.yaml`` (NeMo's ``EncDecCTCModelBPE`` config: ``AudioToMelSpectrogramPreprocessor``,
``ConformerEncoder``, ``ConvASRDecoder``), ``model_weights.ckpt`` (NeMo's tensor names, written with
``torch.save``: plain tensors only) and the sentencepiece tokenizer with the ``tokenizer.vocab`` and ``vocab.txt``
that NeMo's tokenizer set-up registers. NeMo computes the same log-probs (see the tests).

Only what NeMo has is exported; refused by name: other model classes, character tokenizers (NeMo's character
models are another class), and the ``torchaudio`` front-end (NeMo's features differ: HTK mel without pre-emphasis;
train with ``preprocessor.kind=nemo`` to export).
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

from speechtrain.asr.nemo_import import NEMO_CONFIG, NEMO_WEIGHTS, name_pairs

NEMO_CLASS = "nemo.collections.asr.models.ctc_bpe_models.EncDecCTCModelBPE"


def nemo_config(cfg: Any, vocabulary: list[str]) -> dict[str, Any]:
    """Our Conformer-CTC config (a DictConfig or dict) -> NeMo's ``EncDecCTCModelBPE`` config (artifacts named
    ``nemo:tokenizer.model``, ``nemo:tokenizer.vocab``, ``nemo:vocab.txt``)."""
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
            "normalize": "per_feature",
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
            "causal_downsampling": False,
            "ff_expansion_factor": int(enc["ff_expansion_factor"]),
            "self_attention_model": "rel_pos",
            "n_heads": int(enc["num_heads"]),
            "att_context_size": [-1, -1],
            "xscaling": bool(enc["xscaling"]),
            "untie_biases": bool(enc["untie_biases"]),
            "pos_emb_max_len": 5000,
            "conv_kernel_size": int(enc["conv_kernel_size"]),
            "conv_norm_type": enc["conv_norm_type"],
            "conv_context_size": None,
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


def nemo_state_dict(state: dict[str, torch.Tensor], encoder: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Our full state dict -> NeMo's names and shapes (the inverse of
    :func:`~speechtrain.asr.nemo_import.nemo_to_speechtrain`; zero key biases, tied biases repeated per layer)."""
    out: dict[str, torch.Tensor] = {}
    for nemo, ours, conv in name_pairs(encoder):
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
    from speechtrain.asr.ctc import ConformerCTCModel
    from speechtrain.asr.tokenizers import SentencePieceTokenizer
    from speechtrain.core.config import to_plain
    from speechtrain.lightning.checkpoint import gather_full_state_dict

    path = Path(path)
    name = type(model).__name__
    if not isinstance(model, ConformerCTCModel):
        raise ValueError(f"{path}: a {name} cannot be exported to .nemo: NeMo has no such model (Conformer-CTC "
                         "models export).")  # fmt: skip
    if model.cfg.interctc.self_conditioning:
        raise ValueError(f"{path}: this {name} is self-conditioned (model.interctc.self_conditioning), which NeMo's "
                         "Conformer-CTC does not compute; export it as a .stm archive.")  # fmt: skip
    if model.cfg.encoder.time_reduce_idx >= 0:
        raise ValueError(f"{path}: this {name}'s encoder runs layers on half the frames (model.encoder."
                         "time_reduce_idx), which NeMo's Conformer encoder does not; export it as a .stm "
                         "archive.")  # fmt: skip
    if not isinstance(model.tokenizer, SentencePieceTokenizer):
        raise ValueError(f"{path}: this {name} has a {type(model.tokenizer).__name__}; the .nemo export writes "
                         "NeMo's EncDecCTCModelBPE, which needs a sentencepiece tokenizer.")  # fmt: skip
    cfg = to_plain(model.cfg)
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
    torch.save(nemo_state_dict(state, cfg["encoder"]), buffer)
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
        description="Export a speechtrain Conformer-CTC archive (.stm) to NeMo's .nemo format.",
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
    print(f"Wrote {written} (NeMo EncDecCTCModelBPE, {model.tokenizer.vocab_size} tokens).")


if __name__ == "__main__":
    main()
