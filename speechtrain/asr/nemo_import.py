"""Read NeMo ``.nemo`` Conformer / FastConformer CTC, RNN-T, TDT and hybrid checkpoints as speechtrain models, and
name NeMo's tensors.

A ``.nemo`` file (NeMo 1.x-3.x ASR) is a tar, plain or gzip, of ``model_config.yaml``, ``model_weights.ckpt`` (a
torch state dict) and artifacts that the config names as ``nemo:<member>`` (the sentencepiece ``tokenizer.model``,
``vocab.txt``, ...), members often under ``./``. :func:`read_nemo` turns one into an
:class:`~speechtrain.core.archive.Archive` of a :class:`~speechtrain.asr.ctc.ConformerCTCModel`: the config
translated (:func:`translate_config`), the weights renamed (:func:`nemo_to_speechtrain`), the tokenizer extracted,
and the front-end set to ``preprocessor.kind: nemo`` so that the model sees the features it was trained on.

What loads, each with a ``ConformerEncoder`` (``striding`` or ``dw_striding`` subsampling, ``rel_pos`` attention,
full context):

- ``EncDecCTCModelBPE`` (sentencepiece) and ``EncDecCTCModel`` (characters): a
  :class:`~speechtrain.asr.ctc.ConformerCTCModel`;
- ``EncDecRNNTBPEModel`` / ``EncDecRNNTModel`` with an LSTM ``RNNTDecoder`` and an ``RNNTJoint``, RNN-T or TDT loss
  (``loss.loss_name: tdt``, e.g. Parakeet-TDT): a :class:`~speechtrain.asr.transducer.ConformerTransducerModel`;
- the hybrids ``EncDecHybridRNNTCTC[BPE]Model`` (RNN-T-CTC and TDT-CTC): the same transducer with ``hybrid: true``,
  its CTC head the hybrid's ``ctc_decoder`` (``decoder_type: ctc`` decodes with it, as NeMo's ``cur_decoder``).

NeMo's cache-aware streaming models load too (``att_context_size``, one ``[left, right]`` or a list of them, in the
``regular`` or ``chunked_limited`` style; causal or asymmetric convolutions, ``conv_context_size``; causal
subsampling, ``causal_downsampling``; ``preprocessor.normalize: none``) and stream with
:mod:`speechtrain.asr.streaming`.

Everything else is refused with the file and the setting named: other encoders, local attention,
``chunked_limited_with_rc``, stateless or layer-normalised prediction networks, multi-blank losses,
WordPiece tokenizers, front-end settings other than NeMo's log-mel defaults.

Safety: the weights are read with ``torch.load(weights_only=True)`` after their zip CRCs are checked
(:func:`speechtrain.lightning.checkpoint.load_verified`: plain tensors only; nothing in the file is executed); tar
members with absolute paths, ``..`` or links are refused, and so are truncated files and archives over the size
limits of :func:`speechtrain.core.archive.read_tar` (a decompression bomb).

Two exact re-writings keep the mapping honest: NeMo's key-projection bias is dropped (it adds the same amount to
every score of a query, which softmax ignores; the export writes zeros), and a NeMo encoder with ``use_bias: false``
gets zero biases (they train from zero when fine-tuned).
"""

import logging
import math
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import torch
import yaml

from speechtrain.asr.nemo_config import JOINT_ACTIVATIONS, RNNT_LOSSES
from speechtrain.core.archive import MODEL_FILE_READERS, Archive, ArchiveError, read_tar
from speechtrain.lightning.checkpoint import CorruptCheckpointError, load_verified

logger = logging.getLogger(__name__)

NEMO_CONFIG = "model_config.yaml"
NEMO_WEIGHTS = "model_weights.ckpt"
ARTIFACT_PREFIX = "nemo:"
TARGET = "speechtrain.asr.ctc.ConformerCTCModel"
TRANSDUCER_TARGET = "speechtrain.asr.transducer.ConformerTransducerModel"

CTC_CLASSES = ("EncDecCTCModelBPE", "EncDecCTCModel")
HYBRID_CLASSES = ("EncDecHybridRNNTCTCBPEModel", "EncDecHybridRNNTCTCModel")
RNNT_CLASSES = ("EncDecRNNTBPEModel", "EncDecRNNTModel")


class NemoImportError(ArchiveError):
    """A ``.nemo`` file that is unreadable, unsafe, or holds a model speechtrain cannot represent."""


def is_nemo_file(path: str | Path) -> bool:
    """True for a ``.nemo`` path (NeMo's checkpoint format)."""
    return Path(path).suffix == ".nemo"


# --------------------------------------------------------------------------------------------- the tar itself
def _member_name(path: Path, info: tarfile.TarInfo) -> str | None:
    """The member's name without a leading ``./`` (None for the root folder); unsafe names are refused."""
    name = info.name
    pure = PurePosixPath(name)
    if pure.is_absolute() or name.startswith("/") or ".." in pure.parts or "\\" in name:
        raise NemoImportError(f"{path}: refusing tar member with an unsafe path {name!r} (absolute or '..').")
    if info.issym() or info.islnk():
        raise NemoImportError(f"{path}: refusing tar member {name!r}: it is a link ({info.linkname!r}).")
    parts = [p for p in pure.parts if p != "."]
    if info.isdir():
        return None
    if not info.isfile():
        raise NemoImportError(f"{path}: refusing tar member {name!r}: only regular files are allowed.")
    return "/".join(parts)


def read_members(path: str | Path) -> dict[str, bytes]:
    """Every regular file of a ``.nemo`` tar (plain or gzip), by name without ``./``, read in bounded memory
    (:func:`speechtrain.core.archive.read_tar`).

    Raises:
        FileNotFoundError: no such file.
        NemoImportError: not a tar, truncated, an unsafe member (absolute path, ``..``, link, device), or more
            bytes than the archive limits allow.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"No .nemo file at {path}.")
    members = read_tar(path, _member_name, NemoImportError)
    for required in (NEMO_CONFIG, NEMO_WEIGHTS):
        if required not in members:
            raise NemoImportError(f"{path} is not a complete .nemo archive: it has no {required} (truncated?).")
    return members


def load_weights(path: Path, data: bytes) -> dict[str, torch.Tensor]:
    """The state dict in ``model_weights.ckpt``, read with ``weights_only=True``: only tensors and plain containers
    are accepted, so nothing in the file can run code."""
    try:
        obj = load_verified(data, name=f"{path}:{NEMO_WEIGHTS}")
    except CorruptCheckpointError as error:
        raise NemoImportError(str(error)) from None
    except Exception as error:  # torch raises UnpicklingError, RuntimeError, ... for anything else
        # torch's message opens with advice to retry with weights_only=False; keep only what it found.
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        found = [line for line in lines if "GLOBAL" in line or line.startswith("Unsupported")]
        reason = (found or lines or [type(error).__name__])[0]
        raise NemoImportError(
            f"{path}: {NEMO_WEIGHTS} is not a plain state dict of tensors; torch.load(weights_only=True) refused it "
            f"({reason}). Nothing from it was executed."
        ) from None
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        obj = obj["state_dict"]
    plain = isinstance(obj, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items())
    if not plain:
        raise NemoImportError(f"{path}: {NEMO_WEIGHTS} does not hold a state dict (names -> tensors).")
    return obj


# --------------------------------------------------------------------------------------------- config translation
@dataclass
class NemoModelInfo:
    """What :func:`translate_config` found out about a NeMo model.

    Attributes:
        model_class: NeMo's class name (``EncDecCTCModelBPE``, ...).
        hybrid: a hybrid RNN-T/CTC model.
        head: the CTC head's state-dict prefix (``decoder`` or ``ctc_decoder``; None for an RNN-T-only model).
        transducer: the prediction network's LSTM layers and whether NeMo's joint has a dropout module (which
            shifts the index of its output layer), for a model with a transducer; else None.
        tokenizer: ``bpe`` (a sentencepiece artifact) or ``char`` (the decoder's vocabulary).
        use_bias: NeMo's ``encoder.use_bias``.
        notes: what was left out or changed, for the log.
    """

    model_class: str
    hybrid: bool
    head: str | None
    tokenizer: str
    transducer: tuple[int, bool] | None = None
    use_bias: bool = True
    notes: list[str] = field(default_factory=list)


def _class_name(cfg: dict[str, Any]) -> str:
    target = cfg.get("target") or cfg.get("_target_") or ""
    if target:
        return str(target).rsplit(".", 1)[-1]
    decoder = str((cfg.get("decoder") or {}).get("_target_", ""))
    if "aux_ctc" in cfg:
        return HYBRID_CLASSES[0] if "tokenizer" in cfg else HYBRID_CLASSES[1]
    if decoder.endswith("RNNTDecoder"):
        return RNNT_CLASSES[0] if "tokenizer" in cfg else RNNT_CLASSES[1]
    return CTC_CLASSES[0] if "tokenizer" in cfg else CTC_CLASSES[1]


def _refuse(path: Path, what: str) -> NemoImportError:
    return NemoImportError(f"{path}: {what}; speechtrain cannot represent it, so the file is refused.")


def _encoder(path: Path, enc: dict[str, Any], n_mels: int) -> dict[str, Any]:
    target = str(enc.get("_target_", "ConformerEncoder"))
    if not target.endswith("ConformerEncoder"):
        raise _refuse(path, f"encoder._target_ is {target!r} (only NeMo's ConformerEncoder loads)")
    attention = enc.get("self_attention_model", "rel_pos")
    if attention != "rel_pos":
        raise _refuse(path, f"encoder.self_attention_model is {attention!r} (only rel_pos attention loads)")
    kernel = int(enc.get("conv_kernel_size", 31))
    streaming = _streaming_keys(path, enc, kernel)
    subsampling = enc.get("subsampling", "striding")
    if subsampling not in ("striding", "dw_striding"):
        raise _refuse(path, f"encoder.subsampling is {subsampling!r} (striding and dw_striding load)")
    norm = enc.get("conv_norm_type", "batch_norm")
    if norm not in ("batch_norm", "layer_norm"):
        raise _refuse(path, f"encoder.conv_norm_type is {norm!r} (batch_norm and layer_norm load)")
    for key, neutral in (("feat_out", -1), ("reduction", None), ("global_tokens", 0)):
        if enc.get(key, neutral) not in (neutral, None):
            raise _refuse(path, f"encoder.{key} is {enc[key]!r}")
    if int(enc.get("feat_in", n_mels)) != n_mels:
        raise NemoImportError(f"{path}: encoder.feat_in={enc['feat_in']}, but the preprocessor makes {n_mels} "
                              "features.")  # fmt: skip
    channels = int(enc.get("subsampling_conv_channels", -1))
    return {
        "d_model": int(enc["d_model"]),
        "num_layers": int(enc["n_layers"]),
        "num_heads": int(enc.get("n_heads", 4)),
        "ff_expansion_factor": int(enc.get("ff_expansion_factor", 4)),
        "conv_kernel_size": kernel,
        "conv_norm_type": norm,
        "subsampling": subsampling,
        "subsampling_factor": int(enc.get("subsampling_factor", 4)),
        "subsampling_conv_channels": channels if channels > 0 else int(enc["d_model"]),
        "dropout": float(enc.get("dropout", 0.1)),
        "dropout_att": float(enc.get("dropout_att", 0.0)),
        "xscaling": bool(enc.get("xscaling", True)),
        "untie_biases": bool(enc.get("untie_biases", True)),
        **streaming,
    }


def _streaming_keys(path: Path, enc: dict[str, Any], kernel: int) -> dict[str, Any]:
    """NeMo's cache-aware streaming keys (``att_context_size``, ``att_context_style``, ``att_context_probs``,
    ``conv_context_size``, ``causal_downsampling``) -> ours (:class:`~speechtrain.asr.conformer.ConformerConfig`);
    ``chunked_limited_with_rc`` and malformed values are refused, naming the key."""
    from speechtrain.asr.conformer import ConformerConfig
    from speechtrain.asr.nemo_config import _Refuse, nemo_context_sizes, nemo_conv_context

    style = enc.get("att_context_style", "regular")
    if style not in ("regular", "chunked_limited"):
        raise _refuse(path, f"encoder.att_context_style is {style!r} (regular and chunked_limited load)")
    out: dict[str, Any] = {"att_context_style": style, "causal_downsampling": bool(enc.get("causal_downsampling"))}
    for key, convert in (("att_context_size", lambda v: nemo_context_sizes(v, style)),
                         ("conv_context_size", nemo_conv_context)):  # fmt: skip
        try:
            out[key] = convert(enc.get(key))
        except _Refuse as error:
            raise _refuse(path, f"encoder.{key} is {enc.get(key)!r} ({error})") from None
    if enc.get("att_context_probs") is not None:
        out["att_context_probs"] = [float(p) for p in enc["att_context_probs"]]
    try:
        check = ConformerConfig(conv_kernel_size=kernel, **out)
        check.context_sizes()
        check.conv_padding()
    except ValueError as error:
        raise _refuse(path, str(error)) from None
    return out


def _preprocessor(path: Path, pre: dict[str, Any], sample_rate: int) -> dict[str, Any]:
    target = str(pre.get("_target_", "AudioToMelSpectrogramPreprocessor"))
    if not target.endswith("AudioToMelSpectrogramPreprocessor"):
        raise _refuse(path, f"preprocessor._target_ is {target!r} (only AudioToMelSpectrogramPreprocessor loads)")
    normalize = pre.get("normalize", "per_feature")
    if normalize not in ("per_feature", "none"):
        raise _refuse(path, f"preprocessor.normalize is {normalize!r} (per_feature and none load)")
    expected = {"window": "hann", "log": True, "log_zero_guard_type": "add",
                "log_zero_guard_value": 2**-24, "mag_power": 2.0, "frame_splicing": 1, "exact_pad": False,
                "pad_value": 0.0, "stft_conv": False, "stft_exact_pad": False}  # fmt: skip
    for key, value in expected.items():
        if key in pre and pre[key] != value:
            raise _refuse(path, f"preprocessor.{key} is {pre[key]!r} (the NeMo front-end here supports {value!r})")
    window = pre.get("n_window_size") or int(float(pre.get("window_size", 0.02)) * sample_rate)
    hop = pre.get("n_window_stride") or int(float(pre.get("window_stride", 0.01)) * sample_rate)
    n_fft = pre.get("n_fft") or 2 ** math.ceil(math.log2(window))
    pad_to = pre.get("pad_to", 16)
    if not isinstance(pad_to, int):
        raise _refuse(path, f"preprocessor.pad_to is {pad_to!r} (an integer loads)")
    return {
        "kind": "nemo",
        "n_mels": int(pre.get("features", pre.get("nfilt", 64))),
        "window_size": window / sample_rate,
        "window_stride": hop / sample_rate,
        "n_fft": int(n_fft),
        "dither": float(pre.get("dither", 1e-5)),
        "preemph": float(pre.get("preemph", 0.97) or 0.0),
        "pad_to": pad_to,
        "normalize": normalize,
    }


def _spec_augment(aug: dict[str, Any] | None) -> dict[str, Any] | None:
    if not aug or not (aug.get("freq_masks", 0) or aug.get("time_masks", 0)):
        return None
    return {"freq_masks": int(aug.get("freq_masks", 0)), "freq_width": int(aug.get("freq_width", 10)),
            "time_masks": int(aug.get("time_masks", 0)), "time_width": aug.get("time_width", 10)}  # fmt: skip


def translate_config(nemo_cfg: dict[str, Any], path: str | Path) -> tuple[dict[str, Any], NemoModelInfo]:
    """A NeMo model config -> a :class:`~speechtrain.asr.ctc.ConformerCTCConfig` dict (without the tokenizer
    file, which :func:`read_nemo` fills in) and what was found. ``train_ds``, ``validation_ds`` and ``optim`` are
    not taken (they name the original run's data and schedule): the fine-tuning config sets them.

    Raises:
        NemoImportError: naming the class or setting that speechtrain cannot represent.
    """
    path = Path(path)
    if not isinstance(nemo_cfg, dict):
        raise NemoImportError(f"{path}: {NEMO_CONFIG} is not a mapping.")
    name = _class_name(nemo_cfg)
    if name not in CTC_CLASSES + HYBRID_CLASSES + RNNT_CLASSES:
        raise _refuse(path, f"it holds a {name or 'model of unknown class'} (supported: "
                            f"{', '.join(CTC_CLASSES + RNNT_CLASSES + HYBRID_CLASSES)})")  # fmt: skip
    hybrid = name in HYBRID_CLASSES
    head = "ctc_decoder" if hybrid else None if name in RNNT_CLASSES else "decoder"
    info = NemoModelInfo(name, hybrid, head, "bpe" if "BPE" in name else "char")
    sample_rate = int(nemo_cfg.get("sample_rate", 16000))
    preprocessor = _preprocessor(path, dict(nemo_cfg.get("preprocessor") or {}), sample_rate)
    enc = dict(nemo_cfg.get("encoder") or {})
    if "d_model" not in enc or "n_layers" not in enc:
        raise NemoImportError(f"{path}: {NEMO_CONFIG} has no encoder.d_model / encoder.n_layers.")
    encoder = _encoder(path, enc, preprocessor["n_mels"])
    info.use_bias = bool(enc.get("use_bias", True))
    if not info.use_bias:
        info.notes.append("encoder.use_bias is false: the encoder's biases start at zero")
    if float(enc.get("stochastic_depth_drop_prob", 0.0) or 0.0) > 0:
        info.notes.append("stochastic depth is not applied when fine-tuning here (it never is at inference)")
    head = (nemo_cfg.get("aux_ctc") or {}).get("decoder") if hybrid else nemo_cfg.get("decoder")
    head = dict(head or {}) if info.head else {}
    if not str(head.get("_target_", "ConvASRDecoder")).endswith("ConvASRDecoder"):
        raise _refuse(path, f"its CTC decoder is a {head['_target_']!r} (only ConvASRDecoder loads)")
    reduction_key = "ctc_reduction" if info.head == "decoder" else "rnnt_reduction"  # a transducer's whole loss
    reduction = "mean_volume" if nemo_cfg.get(reduction_key, "mean_batch") == "mean_volume" else "mean_batch"
    config: dict[str, Any] = {
        "sample_rate": sample_rate,
        "preprocessor": preprocessor,
        "spec_augment": _spec_augment(nemo_cfg.get("spec_augment")),
        "encoder": encoder,
        "ctc_reduction": reduction,
    }
    if info.head != "decoder":  # a transducer: RNN-T, TDT, or a hybrid's
        transducer, info.transducer = transducer_config(nemo_cfg, path, hybrid, info.notes)
        config.update(transducer)
    # a character model's symbols: its CTC head's, or its joint's, or the model's labels
    vocabulary = list(head.get("vocabulary") or (nemo_cfg.get("joint") or {}).get("vocabulary")
                      or nemo_cfg.get("labels") or [])  # fmt: skip
    if info.tokenizer == "char":
        if not vocabulary:
            raise NemoImportError(f"{path}: a character model without decoder.vocabulary.")
        config["tokenizer"] = {"vocab": vocabulary}
    else:
        kind = (nemo_cfg.get("tokenizer") or {}).get("type", "bpe")
        if kind != "bpe":
            what = "a WordPiece tokenizer" if kind == "wpe" else f"a {kind!r} tokenizer"
            raise _refuse(path, f"tokenizer.type is {kind!r} ({what}; sentencepiece 'bpe' tokenizers load)")
    return config, info


def transducer_config(
    nemo_cfg: dict[str, Any], path: str | Path, hybrid: bool, notes: list[str]
) -> tuple[dict[str, Any], tuple[int, bool]]:
    """NeMo's ``decoder`` (``RNNTDecoder``), ``joint`` (``RNNTJoint``), ``loss``, ``decoding`` and, for a hybrid,
    ``aux_ctc`` -> the keys of a :class:`~speechtrain.asr.transducer.ConformerTransducerConfig`, and the LSTM's
    layers and whether NeMo's joint has a dropout module (see :class:`NemoModelInfo`). Training-only settings that
    speechtrain does not have (FastEmit) are noted, not refused: the weights decode the same.

    Raises:
        NemoImportError: naming the setting that speechtrain cannot represent.
    """
    path = Path(path)
    dec, joint = dict(nemo_cfg.get("decoder") or {}), dict(nemo_cfg.get("joint") or {})
    kind = str(dec.get("_target_", "RNNTDecoder")).rsplit(".", 1)[-1]
    if kind != "RNNTDecoder":
        raise _refuse(path, f"decoder._target_ is {kind!r} (only the LSTM RNNTDecoder loads)")
    if dec.get("normalization_mode") is not None:
        raise _refuse(path, f"decoder.normalization_mode is {dec['normalization_mode']!r} (a layer-normalised LSTM)")
    if not dec.get("blank_as_pad", True):
        raise _refuse(path, "decoder.blank_as_pad is false (the blank must be the embedding's padding row)")
    prednet = dict(dec.get("prednet") or {})
    if "pred_hidden" not in prednet:
        raise NemoImportError(f"{path}: {NEMO_CONFIG} has no decoder.prednet.pred_hidden.")
    pred_hidden, layers = int(prednet["pred_hidden"]), int(prednet.get("pred_rnn_layers", 1))
    rnn_hidden = int(prednet.get("rnn_hidden_size", -1) or -1)
    if rnn_hidden > 0 and rnn_hidden != pred_hidden:
        raise _refuse(path, f"decoder.prednet.rnn_hidden_size is {rnn_hidden}, not pred_hidden {pred_hidden} (an "
                            "LSTM with a projection)")  # fmt: skip
    kind = str(joint.get("_target_", "RNNTJoint")).rsplit(".", 1)[-1]
    if kind != "RNNTJoint":
        raise _refuse(path, f"joint._target_ is {kind!r} (only RNNTJoint loads)")
    jointnet = dict(joint.get("jointnet") or {})
    activation = str(jointnet.get("activation", "relu")).lower()
    if activation not in JOINT_ACTIVATIONS:
        raise _refuse(path, f"joint.jointnet.activation is {activation!r}")
    dropout = float(jointnet.get("dropout", 0.0) or 0.0)
    joint_hidden = jointnet.get("joint_hidden") or (nemo_cfg.get("model_defaults") or {}).get("joint_hidden")
    if not joint_hidden:
        raise NemoImportError(f"{path}: {NEMO_CONFIG} has no joint.jointnet.joint_hidden.")
    loss = dict(nemo_cfg.get("loss") or {})
    loss_name = str(loss.get("loss_name", "default"))
    extra = int(joint.get("num_extra_outputs", 0) or 0)
    config: dict[str, Any] = {}
    if loss_name == "tdt":
        kwargs = dict(loss.get("tdt_kwargs") or {})
        durations = kwargs.get("durations") or (nemo_cfg.get("model_defaults") or {}).get("tdt_durations")
        if not durations or extra != len(durations):
            raise NemoImportError(f"{path}: a TDT model needs loss.tdt_kwargs.durations with one entry per "
                                  f"joint.num_extra_outputs ({extra}); found {durations!r}.")  # fmt: skip
        config.update(loss="tdt", durations=[int(d) for d in durations], sigma=float(kwargs.get("sigma", 0.0)),
                      omega=float(kwargs.get("omega", 0.0)))  # fmt: skip
        fastemit = float(kwargs.get("fastemit_lambda", 0.0) or 0.0)
    elif loss_name in RNNT_LOSSES:
        if extra:
            raise _refuse(path, f"joint.num_extra_outputs is {extra} with the {loss_name!r} RNN-T loss")
        config["loss"] = "rnnt"
        fastemit = float(dict(loss.get(f"{loss_name}_kwargs") or {}).get("fastemit_lambda", 0.0) or 0.0)
    else:
        raise _refuse(path, f"loss.loss_name is {loss_name!r} (RNN-T and TDT losses load)")
    if fastemit:
        notes.append(f"FastEmit (fastemit_lambda={fastemit}) is not applied when fine-tuning here")
    greedy = dict((nemo_cfg.get("decoding") or {}).get("greedy") or {})
    max_symbols = greedy.get("max_symbols", greedy.get("max_symbols_per_step"))
    config.update(
        hybrid=hybrid,
        decoder_type="transducer",
        prediction={"pred_hidden": pred_hidden, "pred_rnn_layers": layers,
                    "dropout": float(prednet.get("dropout", 0.0) or 0.0)},
        joint={"joint_hidden": int(joint_hidden), "activation": JOINT_ACTIVATIONS[activation],
               "dropout": dropout, "frame_stack": 1},
        decoding={"strategy": "greedy", "max_symbols": int(max_symbols) if max_symbols else 10},
    )  # fmt: skip
    if hybrid:
        config["ctc_loss_weight"] = float((nemo_cfg.get("aux_ctc") or {}).get("ctc_loss_weight", 0.3))
    return config, (layers, bool(dropout))


# --------------------------------------------------------------------------------------------- weight names
NORMS = (("norm_feed_forward1", "ff1_norm"), ("norm_self_att", "attn_norm"), ("norm_conv", "conv_norm"),
         ("norm_feed_forward2", "ff2_norm"), ("norm_out", "out_norm"))  # fmt: skip


def name_pairs(
    encoder: dict[str, Any], head: str | None = "decoder", transducer: tuple[int, bool] | None = None
) -> list[tuple[str, str, bool]]:
    """``(NeMo name, speechtrain name, is_conv1x1)`` for every tensor both models hold; ``is_conv1x1`` marks NeMo
    Conv1d weights (out, in, 1) that are our linear weights (out, in). Tied relative-position biases are listed for
    layer 0 only; NeMo's key-projection bias has no counterpart (see the module docstring). ``head``: the CTC
    head's prefix (None: no CTC head); ``transducer``: see :class:`NemoModelInfo`."""
    pairs = [("preprocessor.featurizer.window", "preprocessor.window", False),
             ("preprocessor.featurizer.fb", "preprocessor.fb", False)]  # fmt: skip

    def both(nemo: str, ours: str, conv: bool = False) -> None:
        pairs.extend([(f"{nemo}.weight", f"{ours}.weight", conv), (f"{nemo}.bias", f"{ours}.bias", False)])

    for step in range(int(math.log2(encoder["subsampling_factor"]))):
        if encoder["subsampling"] == "striding":
            both(f"encoder.pre_encode.conv.{2 * step}", f"encoder.subsampling.convs.{step}")
        elif step == 0:
            both("encoder.pre_encode.conv.0", "encoder.subsampling.convs.0")
        else:
            both(f"encoder.pre_encode.conv.{3 * step - 1}", f"encoder.subsampling.convs.{step}.0")
            both(f"encoder.pre_encode.conv.{3 * step}", f"encoder.subsampling.convs.{step}.1")
    both("encoder.pre_encode.out", "encoder.subsampling.out")
    for i in range(encoder["num_layers"]):
        n, o = f"encoder.layers.{i}.", f"encoder.layers.{i}."
        for nemo, ours in NORMS:
            both(n + nemo, o + ours)
        for ff in ("1", "2"):
            both(f"{n}feed_forward{ff}.linear1", f"{o}ff{ff}.up.linear")
            both(f"{n}feed_forward{ff}.linear2", f"{o}ff{ff}.down.linear")
        both(n + "self_attn.linear_q", o + "attention.query.linear")
        pairs.append((n + "self_attn.linear_k.weight", o + "attention.key.linear.weight", False))
        both(n + "self_attn.linear_v", o + "attention.value.linear")
        both(n + "self_attn.linear_out", o + "attention.out.linear")
        pairs.append((n + "self_attn.linear_pos.weight", o + "attention.position.linear.weight", False))
        if encoder.get("untie_biases", True) or i == 0:
            pairs += [(n + f"self_attn.pos_bias_{b}", o + f"attention.pos_bias_{b}", False) for b in "uv"]
        both(n + "conv.pointwise_conv1", o + "conv.pointwise_in.linear", conv=True)
        both(n + "conv.depthwise_conv", o + "conv.depthwise")
        both(n + "conv.batch_norm", o + "conv.norm")
        if encoder.get("conv_norm_type", "batch_norm") == "batch_norm":
            pairs += [(f"{n}conv.batch_norm.{s}", f"{o}conv.norm.{s}", False)
                      for s in ("running_mean", "running_var", "num_batches_tracked")]  # fmt: skip
        both(n + "conv.pointwise_conv2", o + "conv.pointwise_out.linear", conv=True)
    if head:
        both(f"{head}.decoder_layers.0", "decoder", conv=True)
    if transducer:
        layers, joint_dropout = transducer
        pairs.append(("decoder.prediction.embed.weight", "prediction.embed.weight", False))
        for layer in range(layers):
            pairs += [(f"decoder.prediction.dec_rnn.lstm.{kind}_l{layer}", f"prediction.lstm.{kind}_l{layer}", False)
                      for kind in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")]  # fmt: skip
        both("joint.enc", "joint.enc_proj")
        both("joint.pred", "joint.pred_proj")
        both(f"joint.joint_net.{2 if joint_dropout else 1}", "joint.out")  # after the activation (and dropout)
    return pairs


def _layer_extras(name: str) -> bool:
    """NeMo tensors with no counterpart here that an import may drop (checked by the caller)."""
    return name.endswith("self_attn.linear_k.bias") or "pos_bias_" in name


def nemo_to_speechtrain(
    state: dict[str, torch.Tensor], encoder: dict[str, Any], info: NemoModelInfo, path: str | Path
) -> dict[str, torch.Tensor]:
    """NeMo's state dict -> ours (full, unsharded tensors).

    Raises:
        NemoImportError: a tensor is missing, or the file holds tensors that match nothing (named).
    """
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    missing = []
    for nemo, ours, conv in name_pairs(encoder, info.head, info.transducer):
        tensor = state.get(nemo)
        if tensor is None and not info.use_bias and nemo.startswith("encoder.layers.") and nemo.endswith(".bias"):
            weight = state.get(nemo[: -len("bias")] + "weight")
            tensor = torch.zeros(weight.shape[0]) if weight is not None else None
        if tensor is None:
            missing.append(nemo)
            continue
        used.add(nemo)
        out[ours] = tensor.squeeze(-1) if conv else tensor
    if missing:
        raise NemoImportError(f"{path}: {NEMO_WEIGHTS} lacks {len(missing)} tensors the config implies, e.g. "
                              f"{', '.join(missing[:4])}.")  # fmt: skip
    left = [k for k in state if k not in used]
    if not encoder.get("untie_biases", True):
        for i in range(1, encoder["num_layers"]):
            for b in "uv":
                key = f"encoder.layers.{i}.self_attn.pos_bias_{b}"
                if key in state and not torch.equal(state[key], state[f"encoder.layers.0.self_attn.pos_bias_{b}"]):
                    raise NemoImportError(f"{path}: untie_biases is false but {key} differs from layer 0's.")
    unknown = [k for k in left if not _layer_extras(k)]
    if unknown:
        raise NemoImportError(
            f"{path}: {NEMO_WEIGHTS} holds {len(unknown)} tensors that a {info.model_class} of this config does not "
            f"have here (adapters or another architecture?), e.g. {', '.join(unknown[:4])}."
        )
    if "prediction.embed.weight" in out:
        # NeMo starts the prediction network from a zero vector, and never reads the blank's (padding) row of the
        # embedding; ours reads that row as the start symbol, so it must be zero (it is, unless the file says other).
        embed = out["prediction.embed.weight"].clone()
        embed[-1] = 0.0
        out["prediction.embed.weight"] = embed
    return out


# --------------------------------------------------------------------------------------------- the whole file
def _artifact(path: Path, members: dict[str, bytes], key: str, value: Any) -> bytes:
    if not isinstance(value, str) or not value:
        raise NemoImportError(f"{path}: {key} is missing from {NEMO_CONFIG} (the tokenizer artifact).")
    name = value[len(ARTIFACT_PREFIX) :] if value.startswith(ARTIFACT_PREFIX) else PurePosixPath(value).name
    name = name[2:] if name.startswith("./") else name
    if name not in members:
        raise NemoImportError(f"{path}: {key} names {value!r}, but the archive has no member {name!r} (missing "
                              "tokenizer artifact).")  # fmt: skip
    return members[name]


def read_nemo(path: str | Path) -> Archive:
    """Read a ``.nemo`` file as the archive of a :class:`~speechtrain.asr.ctc.ConformerCTCModel` or, for an RNN-T,
    TDT or hybrid checkpoint, a :class:`~speechtrain.asr.transducer.ConformerTransducerModel` (config with
    ``_target_``, full state dict, the tokenizer extracted to a temporary folder that lives with the result).

    Raises:
        FileNotFoundError, NemoImportError: see :func:`read_members`, :func:`load_weights`, :func:`translate_config`.
    """
    path = Path(path)
    members = read_members(path)
    try:
        nemo_cfg = yaml.safe_load(members[NEMO_CONFIG])
    except yaml.YAMLError as error:
        raise NemoImportError(f"{path}: {NEMO_CONFIG} is not valid YAML: {error}") from None
    config, info = translate_config(nemo_cfg, path)
    state = load_weights(path, members[NEMO_WEIGHTS])
    weights = nemo_to_speechtrain(state, config["encoder"], info, path)
    artifact_dir, artifacts = None, {}
    if info.tokenizer == "bpe":
        data = _artifact(path, members, "tokenizer.model_path", (nemo_cfg.get("tokenizer") or {}).get("model_path"))
        artifact_dir = tempfile.TemporaryDirectory(prefix="speechtrain-nemo-")
        target = Path(artifact_dir.name) / "tokenizer.model"
        target.write_bytes(data)
        from speechtrain.common.tokenizers import SentencePieceTokenizer

        try:
            tokens = SentencePieceTokenizer(target).vocab_size
        except ValueError:
            raise NemoImportError(f"{path}: the tokenizer artifact is not a SentencePiece model.") from None
        config["tokenizer"] = {"path": str(target)}
        artifacts["tokenizer.path"] = target
    else:
        tokens = len(config["tokenizer"]["vocab"])
    if "decoder.weight" in weights and weights["decoder.weight"].shape[0] != tokens + 1:
        raise NemoImportError(f"{path}: the CTC head has {weights['decoder.weight'].shape[0]} outputs but the "
                              f"tokenizer has {tokens} tokens (expected tokens + 1, the blank last).")  # fmt: skip
    if info.transducer:
        extra = len(config["durations"]) if config["loss"] == "tdt" else 0
        outputs, rows = weights["joint.out.weight"].shape[0], weights["prediction.embed.weight"].shape[0]
        if outputs != tokens + 1 + extra or rows != tokens + 1:
            raise NemoImportError(f"{path}: the joint has {outputs} outputs and the prediction network embeds {rows} "
                                  f"symbols, but the tokenizer has {tokens} tokens (expected tokens + 1 + {extra} "
                                  f"durations, and tokens + 1).")  # fmt: skip
    for note in info.notes:
        logger.warning("%s: %s.", path, note)
    decoder = f", {config['loss'].upper()} decoder" if info.transducer else ""
    logger.info("Imported NeMo %s from %s: %d layers, d_model %d, %s x%d, %d tokens%s.", info.model_class, path,
                config["encoder"]["num_layers"], config["encoder"]["d_model"], config["encoder"]["subsampling"],
                config["encoder"]["subsampling_factor"], tokens, decoder)  # fmt: skip
    target = TRANSDUCER_TARGET if info.transducer else TARGET
    return Archive({"_target_": target, **config}, weights, artifacts, None, artifact_dir)


MODEL_FILE_READERS[".nemo"] = read_nemo
