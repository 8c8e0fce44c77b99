"""Export a Conformer CTC, RNN-T / TDT or hybrid model to ONNX, in the folder layout of onnx-asr's NeMo loaders.

    python -m speechtrain.asr.export_onnx model_path=model.stm out=model_onnx [quantize=int8]
        [att_context_size=[70,1]] [chunk=2]

or :func:`export_onnx` on a loaded model. The folder then transcribes without PyTorch, with ONNX Runtime through
``onnx-asr`` (``onnx_asr.load_model("nemo-conformer-tdt", "model_onnx")``; see docs/deployment.md) or any client that
reads NeMo's ONNX exports. What it holds (B: batch, T: feature frames, T': encoder frames; both dynamic):

- ``model.onnx`` (CTC models, and hybrids' CTC head): ``audio_signal`` (B, n_mels, T) float32 and ``length`` (B,)
  int64 -> ``logprobs`` (B, T', V+1) (blank last) and ``encoded_lengths`` (B,) int64.
- ``encoder-model.onnx`` (transducers): the same inputs -> ``outputs`` (B, D, T') and ``encoded_lengths`` (B,);
  with ``joint.frame_stack`` k > 1 the stacked frames, (B, k D, ceil(T' / k)).
- ``decoder_joint-model.onnx`` (transducers): ``encoder_outputs`` (B, D, T'), ``targets`` (B, U) int32,
  ``target_length`` (B,) int32, ``input_states_1`` and ``input_states_2`` (the LSTM's h and c, (layers, B, H))
  -> ``outputs`` (B, T', U, V+1 [+ durations]) (joint logits), ``prednet_lengths`` and ``output_states_1/2``.
  TDT: the duration logits follow the vocabulary, one slot per frame count 0 .. max(durations) (onnx-asr reads the
  argmax slot as the number of frames; slots of counts the model does not predict hold a very low logit).
- ``vocab.txt`` (``<token> <id>`` lines, ``▁`` for a space, ``<blk>`` last) and ``config.json`` (``model_type``,
  ``features_size``, ``subsampling_factor``, ``max_tokens_per_step``). A hybrid's ``model_type`` follows its
  ``decoder_type``; the other head loads by name (``onnx_asr.load_model("nemo-conformer-ctc", folder)``).
- ``quantize=int8``: each graph also as ``*.int8.onnx`` (ONNX Runtime's dynamic quantisation of the matrix
  products: int8 weights, activations quantised on the fly), which ``load_model(..., quantization="int8")`` reads.

A cache-aware streaming model (limited ``att_context_size``, :mod:`speechtrain.asr.streaming`) exports one encoder
step with its caches as inputs and outputs instead, for the context ``att_context_size`` (default: the model's first)
and ``chunk`` encoder frames per step (default: one attention chunk); see :mod:`speechtrain.asr.export_onnx_streaming`,
and :mod:`speechtrain.asr.onnx_stream` for a client (onnx-asr has no streaming loader).

Features are not in the graphs: onnx-asr computes NeMo's log-mel features itself (16 kHz, 0.025 s Hann window, 0.01 s
hop, 512-point FFT, pre-emphasis 0.97, Slaney mel filterbank of 80 or 128 bands, per-feature normalisation), which
is ``preprocessor.kind=nemo`` with those settings. Models with the ``torchaudio`` front-end (HTK mel, no
pre-emphasis) or other settings are refused by name: onnx-asr cannot compute their features.

The graphs are built from the model's full state dict (:func:`~speechtrain.lightning.checkpoint.
gather_full_state_dict`), so a model trained with tensor parallelism exports whole, as the ``.nemo`` export does:
in a distributed run every rank calls :func:`export_onnx` and global rank 0 writes. They restate the encoder's
arithmetic with operations ONNX has (a gathered relative shift instead of a strided view, masks instead of in-place
writes); the tests check them against the PyTorch model. Torch's TorchScript-based exporter writes them (the newer
one needs ``onnxscript``, which is not a dependency).
"""

import json
import logging
import math
import os
import sys
import tempfile
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from speechtrain.asr.onnx_graphs import DecoderJointGraph, EncoderGraph, model_kind
from speechtrain.common.cli import fail, parse_key_values
from speechtrain.common.config import ConfigError, to_plain
from speechtrain.lightning.checkpoint import gather_full_state_dict

OPSET = 17
CTC_FILE, ENCODER_FILE, DECODER_JOINT_FILE = "model.onnx", "encoder-model.onnx", "decoder_joint-model.onnx"
VOCAB_FILE, CONFIG_FILE = "vocab.txt", "config.json"
QUANTIZATIONS = ("int8",)
BLANK_TOKEN = "<blk>"
# What onnx-asr's NeMo preprocessor computes (its constants): the model's front-end must be this one.
ONNX_ASR_FEATURES = {"kind": "nemo", "window_size": 0.025, "window_stride": 0.01, "n_fft": 512, "preemph": 0.97}
ONNX_ASR_SAMPLE_RATE = 16000
ONNX_ASR_MELS = (80, 128)
EXTERNAL_DATA_BYTES = 1_800_000_000  # graphs with more weights keep them in ``<file>.data`` (protobuf: 2 GiB)


@dataclass
class ExportOnnxConfig:
    """Command-line options of ``python -m speechtrain.asr.export_onnx``.

    Attributes:
        model_path: a model archive (``.stm``) or a NeMo ``.nemo`` checkpoint.
        out: the folder to write (created; earlier exports' files in it are replaced).
        quantize: ``int8``: also write dynamically quantised copies (``*.int8.onnx``); null: none.
        opset: the ONNX opset of the graphs.
        att_context_size: a streaming model: which trained ``[left, right]`` context the step runs (None: the
            model's first).
        chunk: a streaming model: encoder frames per step (None: one attention chunk, ``right + 1``).
    """

    model_path: str | None = None
    out: str | None = None
    quantize: str | None = None
    opset: int = OPSET
    att_context_size: list[int] | None = None
    chunk: int | None = None


# ------------------------------------------------------------------------------------------------------ checks
def onnx_asr_model_type(cfg: Mapping[str, Any]) -> str:
    """The ``model_type`` onnx-asr loads this export as: ``nemo-conformer-ctc``, ``-rnnt`` or ``-tdt`` (a hybrid's
    follows its ``decoder_type``)."""
    kind = model_kind(cfg)
    if kind != "ctc" and cfg.get("decoder_type") == "ctc":
        kind = "ctc"
    return f"nemo-conformer-{kind}"


def check_exportable(model: Any) -> None:
    """Raise ValueError, naming the setting, if ``model`` cannot be exported for onnx-asr."""
    from speechtrain.asr.ctc import ConformerCTCModel

    name = type(model).__name__
    if not isinstance(model, ConformerCTCModel):
        raise ValueError(
            f"a {name} cannot be exported to ONNX: the export covers the Conformer / FastConformer "
            "CTC, RNN-T, TDT and hybrid models (ConformerCTCModel, ConformerTransducerModel)."
        )
    cfg = model.cfg
    pre = cfg.preprocessor
    if cfg.sample_rate != ONNX_ASR_SAMPLE_RATE:
        raise ValueError(f"this {name} takes {cfg.sample_rate} Hz audio (model.sample_rate); onnx-asr's NeMo models "
                         f"run at {ONNX_ASR_SAMPLE_RATE} Hz.")  # fmt: skip
    if pre.kind != "nemo":
        raise ValueError(f"this {name} uses the {pre.kind!r} front-end (model.preprocessor.kind), whose features "
                         "onnx-asr does not compute (it computes NeMo's: pre-emphasis, Slaney mel); train or "
                         "fine-tune with model.preprocessor.kind=nemo to export to ONNX.")  # fmt: skip
    for key, value in ONNX_ASR_FEATURES.items():
        if key != "kind" and not math.isclose(float(pre[key]), value):
            raise ValueError(f"this {name} has model.preprocessor.{key}={pre[key]}; onnx-asr computes NeMo's features "
                             f"with {key}={value} only.")  # fmt: skip
    if pre.n_mels not in ONNX_ASR_MELS:
        raise ValueError(f"this {name} has model.preprocessor.n_mels={pre.n_mels}; onnx-asr's NeMo front-end has "
                         f"{' or '.join(map(str, ONNX_ASR_MELS))} mel bands.")  # fmt: skip
    if "loss" in cfg and cfg.prediction.context_size:
        raise ValueError(f"this {name} has a stateless prediction network (model.prediction.context_size="
                         f"{cfg.prediction.context_size}); onnx-asr's transducers carry an LSTM's "
                         "two states.")  # fmt: skip
    for index, token in enumerate(model.tokenizer.vocab):
        if token == BLANK_TOKEN or any(c in token for c in "\r\n"):
            raise ValueError(f"this {name}'s token {index} ({token!r}) cannot be written to vocab.txt (a line break, "
                             f"or onnx-asr's blank name {BLANK_TOKEN}).")  # fmt: skip


# ---------------------------------------------------------------------------------------------------- writing
def _save(proto: Any, path: Path) -> None:
    """Write an ONNX model; one with more than ``EXTERNAL_DATA_BYTES`` of weights keeps them in ``<name>.data``."""
    import numpy as np
    import onnx

    size = sum(int(np.prod(t.dims)) * 4 for t in proto.graph.initializer)
    big = size > EXTERNAL_DATA_BYTES
    onnx.save_model(proto, str(path), save_as_external_data=big, all_tensors_to_one_file=True,
                    location=f"{path.name}.data" if big else None)  # fmt: skip


def _export_graph(module: torch.nn.Module, args: tuple, path: Path, inputs: list[str], outputs: list[str],
                  axes: dict[str, dict[int, str]], opset: int) -> Path:  # fmt: skip
    """Trace ``module`` on ``args`` and write it to ``path`` (via a temporary folder: a large graph's weights come out
    of the exporter as one file per tensor and are gathered into one)."""
    import onnx

    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice and tracer warnings
        traced = Path(tmp) / path.name
        with torch.no_grad():
            torch.onnx.export(module.eval(), args, str(traced), dynamo=False, input_names=inputs, output_names=outputs,
                              dynamic_axes=axes, opset_version=opset, do_constant_folding=True)  # fmt: skip
        _save(onnx.load(str(traced)), path)
    return path


def _quantize(path: Path) -> Path:
    """``<name>.int8.onnx`` next to ``path``: ONNX Runtime's dynamic int8 quantisation of its matrix products."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    target = path.with_name(path.name.removesuffix(".onnx") + ".int8.onnx")
    big = path.with_name(path.name + ".data").exists()
    root = logging.getLogger()  # the quantiser logs a line per tensor it leaves alone, on the root logger
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            quantize_dynamic(path, target, weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul", "Gemm"],
                             use_external_data_format=big)  # fmt: skip
    finally:
        root.setLevel(level)
    return target


def vocabulary_lines(vocab: Sequence[str]) -> str:
    """vocab.txt: ``<token> <id>`` per output, spaces written as ``▁`` (onnx-asr splits lines at the space and
    turns ``▁`` back into one), the blank (``<blk>``) last."""
    return "".join(f"{token.replace(' ', '▁')} {i}\n" for i, token in enumerate([*vocab, BLANK_TOKEN]))


def onnx_asr_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """config.json: the model type, feature bands, frames per encoder output frame and labels per frame."""
    factor = int(cfg["encoder"]["subsampling_factor"])
    if model_kind(cfg) != "ctc" and not cfg["hybrid"]:
        factor *= int(cfg["joint"]["frame_stack"])  # the transducer's frames (a hybrid's CTC head needs the encoder's)
    config = {"model_type": onnx_asr_model_type(cfg), "features_size": int(cfg["preprocessor"]["n_mels"]),
              "subsampling_factor": factor}  # fmt: skip
    if model_kind(cfg) != "ctc":
        config["max_tokens_per_step"] = int(cfg["decoding"]["max_symbols"])
    return config


def _export_files(cfg: Mapping[str, Any], state: Mapping[str, torch.Tensor], folder: Path, opset: int) -> list[Path]:
    """Write the graphs of a model (config ``cfg``, full state dict ``state``) into ``folder``."""
    n_mels, frames = int(cfg["preprocessor"]["n_mels"]), 64
    features = (torch.randn(2, n_mels, frames), torch.tensor([frames, frames // 2]))
    feature_axes = {"audio_signal": {0: "batch", 2: "time"}, "length": {0: "batch"}}
    written = []
    kind = model_kind(cfg)
    if kind == "ctc" or cfg["hybrid"]:
        graph = EncoderGraph(cfg, state, head="ctc")
        written.append(_export_graph(graph, features, folder / CTC_FILE, ["audio_signal", "length"],
                                     ["logprobs", "encoded_lengths"],
                                     {**feature_axes, "logprobs": {0: "batch", 1: "frames"},
                                      "encoded_lengths": {0: "batch"}}, opset))  # fmt: skip
    if kind == "ctc":
        return written
    encoder = EncoderGraph(cfg, state, head="frames", frame_stack=int(cfg["joint"]["frame_stack"]))
    written.append(_export_graph(encoder, features, folder / ENCODER_FILE, ["audio_signal", "length"],
                                 ["outputs", "encoded_lengths"],
                                 {**feature_axes, "outputs": {0: "batch", 2: "frames"},
                                  "encoded_lengths": {0: "batch"}}, opset))  # fmt: skip
    with torch.no_grad():
        enc, _ = encoder(*features)
    written.append(export_decoder_joint(cfg, state, folder, opset, enc))
    return written


def export_decoder_joint(cfg: Mapping[str, Any], state: Mapping[str, torch.Tensor], folder: Path, opset: int,
                         enc: torch.Tensor) -> Path:  # fmt: skip
    """Write ``decoder_joint-model.onnx``, traced on encoder outputs ``enc`` (2, D, T)."""
    pred = cfg["prediction"]
    layers, hidden = int(pred["pred_rnn_layers"]), int(pred["pred_hidden"])
    states = (torch.zeros(layers, 2, hidden), torch.zeros(layers, 2, hidden))
    targets = torch.zeros(2, 3, dtype=torch.int32)
    decoder = DecoderJointGraph(cfg, state)
    state_axes = {1: "batch"}
    return _export_graph(
        decoder, (enc, targets, torch.full((2,), 3, dtype=torch.int32), *states), folder / DECODER_JOINT_FILE,
        ["encoder_outputs", "targets", "target_length", "input_states_1", "input_states_2"],
        ["outputs", "prednet_lengths", "output_states_1", "output_states_2"],
        {"encoder_outputs": {0: "batch", 2: "frames"}, "targets": {0: "batch", 1: "labels"},
         "target_length": {0: "batch"}, "input_states_1": state_axes, "input_states_2": state_axes,
         "outputs": {0: "batch", 1: "frames", 2: "labels"}, "prednet_lengths": {0: "batch"},
         "output_states_1": state_axes, "output_states_2": state_axes}, opset)  # fmt: skip


def export_streaming_files(cfg: Mapping[str, Any], state: Mapping[str, torch.Tensor], folder: Path, opset: int,
                           geometry: Mapping[str, Any]) -> list[Path]:  # fmt: skip
    """Write the streaming step graphs (and the transducer's decoder + joint, as offline) into ``folder``."""
    from speechtrain.asr import export_onnx_streaming as streaming

    n_mels = int(cfg["preprocessor"]["n_mels"])
    layers, memory, d_model = geometry["num_layers"], geometry["last_channel_cache_size"], geometry["d_model"]
    width = geometry["pre_encode_cache_size"] + geometry["shift_size"]
    args = (torch.randn(2, n_mels, width), torch.tensor([width, width - 3]), torch.randn(2, layers, memory, d_model),
            torch.randn(2, layers, d_model, geometry["last_time_cache_size"]), torch.tensor([memory, 1]))  # fmt: skip
    inputs = ["audio_signal", "length", "cache_last_channel", "cache_last_time", "cache_last_channel_len"]
    cache_outputs = ["cache_last_channel_next", "cache_last_time_next", "cache_last_channel_next_len"]
    batch = {0: "batch"}
    axes = {"audio_signal": {0: "batch", 2: "time"}, **{n: batch for n in inputs[1:] + cache_outputs},
            "encoded_lengths": batch}  # fmt: skip
    written = []
    kind = model_kind(cfg)
    if kind == "ctc" or cfg["hybrid"]:
        graph = streaming.StreamingEncoderGraph(cfg, state, "ctc", geometry)
        written.append(_export_graph(graph, args, folder / CTC_FILE, inputs, ["logprobs", "encoded_lengths",
                                     *cache_outputs], {**axes, "logprobs": {0: "batch", 1: "frames"}},
                                     opset))  # fmt: skip
    if kind == "ctc":
        return written
    encoder = streaming.StreamingEncoderGraph(cfg, state, "frames", geometry)
    written.append(_export_graph(encoder, args, folder / ENCODER_FILE, inputs,
                                 ["outputs", "encoded_lengths", *cache_outputs],
                                 {**axes, "outputs": {0: "batch", 2: "frames"}}, opset))  # fmt: skip
    stack = int(cfg["joint"]["frame_stack"])
    written.append(export_decoder_joint(cfg, state, folder, opset, torch.randn(2, stack * d_model, 5)))
    return written


KNOWN_FILES = (CTC_FILE, ENCODER_FILE, DECODER_JOINT_FILE)


def _clear_earlier_export(folder: Path) -> None:
    """Remove the graphs (and their weights and int8 copies) an earlier export left in ``folder``: a stale file
    there would be loaded with this model's vocabulary."""
    for name in KNOWN_FILES:
        stem = name.removesuffix(".onnx")
        for candidate in (name, f"{name}.data", f"{stem}.int8.onnx", f"{stem}.int8.onnx.data"):
            (folder / candidate).unlink(missing_ok=True)


def export_onnx(model: Any, out: str | os.PathLike, quantize: str | None = None, opset: int = OPSET,
                att_context_size: Sequence[int] | None = None, chunk: int | None = None) -> list[Path]:  # fmt: skip
    """Export ``model`` (a :class:`~speechtrain.asr.ctc.ConformerCTCModel` or
    :class:`~speechtrain.asr.transducer.ConformerTransducerModel` with NeMo's front-end) to the folder ``out`` for
    onnx-asr (see the module docstring); a streaming model as one cache-aware step with ``att_context_size`` and
    ``chunk`` encoder frames. In a distributed run every rank must call this (the weights are gathered); global rank
    0 writes.

    Returns:
        The files written (none on other ranks).

    Raises:
        ValueError: naming what onnx-asr cannot run, or an unknown ``quantize``.
    """
    if quantize is not None and quantize not in QUANTIZATIONS:
        raise ValueError(f"quantize={quantize!r}: expected one of {', '.join(QUANTIZATIONS)}, or None.")
    if Path(out).exists() and not Path(out).is_dir():
        raise ValueError(f"out={out} is a file; the export writes a folder.")
    check_exportable(model)
    geometry = _streaming_geometry(model, att_context_size, chunk)
    model.configure_model()
    state = gather_full_state_dict(model)  # collective under model parallelism: every rank takes part
    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_rank():
        return []
    cfg = to_plain(model.cfg)
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    _clear_earlier_export(folder)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".export-") as tmp:
        if geometry is None:
            graphs = _export_files(cfg, state, Path(tmp), opset)
        else:
            graphs = export_streaming_files(cfg, state, Path(tmp), opset, geometry)
        if quantize == "int8":
            graphs += [_quantize(path) for path in list(graphs)]
        written = []
        for path in sorted(Path(tmp).iterdir()):
            os.replace(path, folder / path.name)
            written.append(folder / path.name)
    (folder / VOCAB_FILE).write_text(vocabulary_lines(model.tokenizer.vocab), encoding="utf-8")
    config = onnx_asr_config(cfg) if geometry is None else {**onnx_asr_config(cfg), "streaming": geometry}
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return [*written, folder / VOCAB_FILE, folder / CONFIG_FILE]


def _streaming_geometry(model: Any, att_context_size: Sequence[int] | None, chunk: int | None) -> dict | None:
    """The chunk geometry of a streaming model's export (None: an offline model); ValueError on a limited-context
    model that cannot stream, or streaming options for an offline one."""
    encoder = model.encoder
    if not getattr(encoder, "limited_context", False):
        if att_context_size is not None or chunk is not None:
            raise ValueError("att_context_size and chunk are options of a streaming model's export; this model "
                             "attends to the whole utterance (encoder.att_context_size [-1, -1]).")  # fmt: skip
        return None
    from speechtrain.asr.export_onnx_streaming import streaming_geometry
    from speechtrain.asr.streaming import check_streamable

    context = tuple(int(c) for c in (att_context_size or encoder.contexts[0]))
    if context not in encoder.contexts:
        raise ValueError(f"att_context_size={list(context)} is not one this model was trained with: "
                         f"{[list(c) for c in encoder.contexts]}.")  # fmt: skip
    previous = encoder.context
    encoder.context = context
    try:
        check_streamable(model)  # the offline graph has no limited context: such a model exports as a stream only
    finally:
        encoder.context = previous
    return streaming_geometry(model, context, chunk)


# ---------------------------------------------------------------------------------------------------------- CLI
def parse_args(argv: Sequence[str]) -> ExportOnnxConfig:
    """``key=value`` arguments as a checked :class:`ExportOnnxConfig` (SystemExit on a malformed one; ConfigError
    on a missing ``model_path`` / ``out`` or an unknown ``quantize``)."""
    cfg = parse_key_values(argv, ExportOnnxConfig, __doc__.split("\n\n")[0])
    missing = [k for k in ("model_path", "out") if not getattr(cfg, k)]
    if missing:
        raise ConfigError(f"Missing {' and '.join(f'{k}=...' for k in missing)}.")
    if cfg.quantize is not None and cfg.quantize not in QUANTIZATIONS:
        raise ConfigError(f"quantize={cfg.quantize}: expected one of {', '.join(QUANTIZATIONS)}, or null.")
    return cfg


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry point (see the module docstring)."""
    try:
        cfg = parse_args(sys.argv[1:] if argv is None else argv)
        if not Path(cfg.model_path).is_file():
            raise FileNotFoundError(f"model_path={cfg.model_path}: no such file.")
    except (ConfigError, FileNotFoundError) as e:
        fail(str(e))
    from speechtrain.core.model import SpeechModel

    try:
        model = SpeechModel.restore_from(cfg.model_path).eval()
        written = export_onnx(model, cfg.out, cfg.quantize, cfg.opset, cfg.att_context_size, cfg.chunk)
    except ValueError as e:
        fail(f"{cfg.model_path}: {e}")
    model_type = onnx_asr_model_type(model.cfg)
    print(f"Wrote {cfg.out}: {', '.join(p.name for p in written)} ({model_type}, "
          f"{model.tokenizer.vocab_size} tokens + blank).")  # fmt: skip
    if (Path(cfg.out) / CONFIG_FILE).is_file() and "streaming" in json.loads(
        (Path(cfg.out) / CONFIG_FILE).read_text()
    ):
        print(f"A streaming step; run it with speechtrain.asr.onnx_stream.OnnxStreamingRecognizer({str(cfg.out)!r}).")
        return
    print(f"Transcribe with onnx-asr: onnx_asr.load_model({model_type!r}, {str(cfg.out)!r}"
          f"{', quantization=' + repr(cfg.quantize) if cfg.quantize else ''}).recognize('audio.wav')")  # fmt: skip


if __name__ == "__main__":
    main()
