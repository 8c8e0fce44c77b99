"""Export a Conformer CTC, RNN-T / TDT or hybrid model to ONNX, in the folder layout of onnx-asr's NeMo loaders.

    python -m speechtrain.asr.export_onnx model_path=model.stm out=model_onnx [quantize=int8]

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
import torch.nn.functional as F

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
MASKED = -1e9  # the attention logit of padded keys, and the logit of duration slots a TDT model does not predict
ACTIVATIONS = {"relu": torch.relu, "tanh": torch.tanh, "silu": F.silu, "sigmoid": torch.sigmoid}


@dataclass
class ExportOnnxConfig:
    """Command-line options of ``python -m speechtrain.asr.export_onnx``.

    Attributes:
        model_path: a model archive (``.stm``) or a NeMo ``.nemo`` checkpoint.
        out: the folder to write (created; earlier exports' files in it are replaced).
        quantize: ``int8``: also write dynamically quantised copies (``*.int8.onnx``); null: none.
        opset: the ONNX opset of the graphs.
    """

    model_path: str | None = None
    out: str | None = None
    quantize: str | None = None
    opset: int = OPSET


# ------------------------------------------------------------------------------------------------------ checks
def model_kind(cfg: Mapping[str, Any]) -> str:
    """``ctc``, ``rnnt`` or ``tdt`` (the transducer of a hybrid too) of a Conformer model's config."""
    return str(cfg["loss"]) if "loss" in cfg else "ctc"


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


# ------------------------------------------------------------------------------------------------ the graphs
def _frame_mask(lengths: torch.Tensor, frames: Any) -> torch.Tensor:
    """(B, frames) bool, True on valid frames (``frames`` may be a traced size)."""
    return torch.arange(frames, device=lengths.device)[None, :] < lengths[:, None]


def _halved(lengths: torch.Tensor) -> torch.Tensor:
    """Frames after a kernel-3, stride-2, padding-1 convolution: ceil(n / 2), written for non-negative integers
    (ONNX's integer division truncates)."""
    return (lengths + 1) // 2


def _relative_positions(frames: Any, d_model: int) -> torch.Tensor:
    """(2T-1, D) sinusoidal encodings of the distances T-1 .. -(T-1), sine and cosine interleaved."""
    distances = torch.arange(frames - 1, -frames, -1).to(torch.float32)[:, None]
    frequencies = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    angles = distances * frequencies[None, :]
    return torch.stack([torch.sin(angles), torch.cos(angles)], dim=-1).flatten(1)


class _Weights(torch.nn.Module):
    """Named tensors of a state dict as buffers (dots in names become ``__``)."""

    def __init__(self, state: Mapping[str, torch.Tensor], names: Sequence[str]) -> None:
        super().__init__()
        for name in names:
            self.register_buffer(name.replace(".", "__"), state[name].detach().float().clone().contiguous())

    def __getitem__(self, name: str) -> torch.Tensor:
        return getattr(self, name.replace(".", "__"))


def _prefixed(state: Mapping[str, torch.Tensor], prefixes: Sequence[str]) -> list[str]:
    return [n for n in state if n.startswith(tuple(prefixes)) and state[n].is_floating_point()]


class EncoderGraph(torch.nn.Module):
    """The Conformer encoder (and, for ``head="ctc"``, the CTC head's log-probabilities), from a full state dict.

    ``forward(audio_signal (B, n_mels, T), length (B,))`` -> (encoder frames (B, D, T'), or log-probabilities
    (B, T', V+1)), lengths (B,). ``frame_stack`` k > 1: k consecutive frames side by side, (B, k D, ceil(T' / k)).
    """

    def __init__(self, cfg: Mapping[str, Any], state: Mapping[str, torch.Tensor], head: str, frame_stack: int = 1):
        super().__init__()
        enc = cfg["encoder"]
        self.d_model, self.heads = int(enc["d_model"]), int(enc["num_heads"])
        self.layers = int(enc["num_layers"])
        self.kind, self.factor = enc["subsampling"], int(enc["subsampling_factor"])
        self.kernel = int(enc["conv_kernel_size"])
        self.batch_norm = enc["conv_norm_type"] == "batch_norm"
        self.untie = bool(enc["untie_biases"])
        self.xscale = math.sqrt(self.d_model) if enc["xscaling"] else 1.0
        reduce, recover = int(enc.get("time_reduce_idx", -1)), int(enc.get("time_recovery_idx", -1))
        self.reduced = range(reduce, recover) if reduce >= 0 else range(0)
        interctc = cfg.get("interctc") or {}
        self.condition = tuple(interctc.get("apply_at_layers") or []) if interctc.get("self_conditioning") else ()
        self.head, self.frame_stack = head, frame_stack
        names = _prefixed(state, ["encoder."])
        if head == "ctc" or self.condition:
            names += _prefixed(state, ["decoder."])
        if self.condition:
            names += _prefixed(state, ["conditioning."])
        self.w = _Weights(state, names)

    # ---------------------------------------------------------------------------------------------- pieces
    def _subsampling(self, feats: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = feats.transpose(1, 2)  # (B, T, n_mels)
        x = (x * _frame_mask(lengths, x.shape[1])[:, :, None]).unsqueeze(1)  # (B, 1, T, n_mels)
        for step in range(int(math.log2(self.factor))):
            lengths = _halved(lengths)
            prefix = f"encoder.subsampling.convs.{step}."
            if self.kind == "striding" or step == 0:
                x = F.conv2d(x, self.w[prefix + "weight"], self.w[prefix + "bias"], stride=2, padding=1)
            else:
                depthwise = self.w[prefix + "0.weight"]  # (C, 1, 3, 3)
                x = F.conv2d(x, depthwise, self.w[prefix + "0.bias"], stride=2, padding=1, groups=depthwise.shape[0])
                x = F.conv2d(x, self.w[prefix + "1.weight"], self.w[prefix + "1.bias"])
            # Padded frames zeroed before the ReLU: a valid output never reads past one padded frame, so the
            # model's zeroing of that one frame and this give the same valid outputs.
            x = torch.relu(x * _frame_mask(lengths, x.shape[2])[:, None, :, None])
        x = x.transpose(1, 2).flatten(2)  # (B, C, T', bands) -> (B, T', C * bands)
        return F.linear(x, self.w["encoder.subsampling.out.weight"], self.w["encoder.subsampling.out.bias"]), lengths

    def _layer_norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        weight = self.w[name + ".weight"]
        return F.layer_norm(x, (int(weight.shape[0]),), weight, self.w[name + ".bias"], 1e-5)

    def _feed_forward(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        hidden = F.silu(F.linear(x, self.w[prefix + "up.linear.weight"], self.w[prefix + "up.linear.bias"]))
        return F.linear(hidden, self.w[prefix + "down.linear.weight"], self.w[prefix + "down.linear.bias"])

    def _attention(self, x: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, index: int) -> torch.Tensor:
        """Transformer-XL relative-position self-attention of layer ``index``: x (B, T, D) -> (B, T, D)."""
        p = f"encoder.layers.{index}.attention."
        bias_layer = f"encoder.layers.{index if self.untie else 0}.attention."
        h, d = self.heads, self.d_model // self.heads
        batch, frames = x.shape[0], x.shape[1]

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(batch, frames, h, d).transpose(1, 2)  # (B, h, T, d)

        q = heads(F.linear(x, self.w[p + "query.linear.weight"], self.w[p + "query.linear.bias"]))
        k = heads(F.linear(x, self.w[p + "key.linear.weight"], None))
        v = heads(F.linear(x, self.w[p + "value.linear.weight"], self.w[p + "value.linear.bias"]))
        scale = 1.0 / math.sqrt(d)
        u, pos_v = self.w[bias_layer + "pos_bias_u"], self.w[bias_layer + "pos_bias_v"]
        pos = F.linear(positions, self.w[p + "position.linear.weight"], None)  # (2T-1, D)
        pos = pos.reshape(-1, h, d).permute(1, 2, 0)  # (h, d, 2T-1)
        by_distance = torch.matmul((q + pos_v[:, None, :]) * scale, pos)  # (B, h, T, 2T-1): distances T-1 .. 1-T
        # Query i's score for key j sits at column T-1 - i + j: with a zero column in front, the rows laid end to end
        # and read again in rows of 2T-1 after dropping the first T values, it sits at column j (no index tensor).
        padded = F.pad(by_distance, (1, 0)).reshape(batch, h, -1, frames)[:, :, 1:]  # (B, h, 2T-1, T)
        position_scores = padded.reshape(batch, h, frames, -1)[..., :frames]  # (B, h, T, 2T-1) -> (B, h, T, T)
        scores = torch.matmul(q + u[:, None, :], k.transpose(2, 3)) * scale + position_scores
        scores = scores.masked_fill(~mask[:, None, None, :], MASKED)
        y = torch.matmul(torch.softmax(scores, dim=-1), v)  # (B, h, T, d)
        y = y.transpose(1, 2).reshape(batch, frames, h * d)
        return F.linear(y, self.w[p + "out.linear.weight"], self.w[p + "out.linear.bias"])

    def _depthwise(self, x: torch.Tensor, mask: torch.Tensor, prefix: str, stride: int) -> torch.Tensor:
        """The depthwise convolution ``prefix`` over the frames of x (B, T, D), zeros past each end -> (B, D, T')."""
        weight = self.w[prefix + "weight"]
        x = (x * mask[:, :, None]).transpose(1, 2)
        return F.conv1d(x, weight, self.w[prefix + "bias"], stride=stride, padding=weight.shape[-1] // 2,
                        groups=int(weight.shape[0]))  # fmt: skip

    def _convolution(self, x: torch.Tensor, mask: torch.Tensor, index: int) -> torch.Tensor:
        p = f"encoder.layers.{index}.conv."
        x = F.glu(F.linear(x, self.w[p + "pointwise_in.linear.weight"], self.w[p + "pointwise_in.linear.bias"]), -1)
        x = self._depthwise(x, mask, p + "depthwise.", 1)  # (B, D, T)
        if self.batch_norm:
            x = F.batch_norm(x, self.w[p + "norm.running_mean"], self.w[p + "norm.running_var"],
                             self.w[p + "norm.weight"], self.w[p + "norm.bias"], False, 0.0, 1e-5)  # fmt: skip
        else:
            x = self._layer_norm(x.transpose(1, 2), p + "norm").transpose(1, 2)
        x = F.silu(x).transpose(1, 2)
        return F.linear(x, self.w[p + "pointwise_out.linear.weight"], self.w[p + "pointwise_out.linear.bias"])

    def _layer(self, x: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, index: int) -> torch.Tensor:
        p = f"encoder.layers.{index}."
        x = x + 0.5 * self._feed_forward(self._layer_norm(x, p + "ff1_norm"), p + "ff1.")
        x = x + self._attention(self._layer_norm(x, p + "attn_norm"), mask, positions, index)
        x = x + self._convolution(self._layer_norm(x, p + "conv_norm"), mask, index)
        x = x + 0.5 * self._feed_forward(self._layer_norm(x, p + "ff2_norm"), p + "ff2.")
        return self._layer_norm(x, p + "out_norm")

    def _ctc_logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.w["decoder.weight"], self.w["decoder.bias"])

    # ----------------------------------------------------------------------------------------------- forward
    def encode(self, audio_signal: torch.Tensor, length: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Features -> encoder frames (B, T', D) (padded frames zero) and their lengths."""
        x, lengths = self._subsampling(audio_signal, length)
        x = x * self.xscale
        mask = full = _frame_mask(lengths, x.shape[1])
        positions = full_positions = _relative_positions(x.shape[1], self.d_model)
        skip = x
        for index in range(self.layers):
            if self.reduced and index == self.reduced.start:
                skip = x
                x = F.linear(self._depthwise(x, mask, "encoder.time_reduction.depthwise.", 2).transpose(1, 2),
                            self.w["encoder.time_reduction.pointwise.weight"],
                            self.w["encoder.time_reduction.pointwise.bias"])  # fmt: skip
                mask = _frame_mask(_halved(lengths), x.shape[1])
                positions = _relative_positions(x.shape[1], self.d_model)
            x = self._layer(x, mask, positions, index)
            if index in self.condition:
                hidden = x * mask[:, :, None]
                probs = torch.softmax(self._ctc_logits(hidden), dim=-1)
                x = x + F.linear(probs, self.w["conditioning.weight"], self.w["conditioning.bias"])
            if self.reduced and index == self.reduced.stop - 1:
                up = F.linear(x, self.w["encoder.time_recovery.weight"], self.w["encoder.time_recovery.bias"])
                twice = up.unsqueeze(2).expand(-1, -1, 2, -1).flatten(1, 2)[:, : skip.shape[1]]
                x, mask, positions = skip + twice, full, full_positions
        return x * full[:, :, None], lengths

    def forward(self, audio_signal: torch.Tensor, length: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, lengths = self.encode(audio_signal, length)
        if self.head == "ctc":
            return torch.log_softmax(self._ctc_logits(x), dim=-1), lengths
        k = self.frame_stack
        if k > 1:
            batch, frames, width = x.shape
            stacked = (frames + k - 1) // k
            x = F.pad(x, (0, 0, 0, k - 1))[:, : stacked * k].reshape(batch, stacked, k * width)
            lengths = (lengths + k - 1) // k
        return x.transpose(1, 2), lengths


class DecoderJointGraph(torch.nn.Module):
    """One step of the LSTM prediction network and the joint, from a full state dict (NeMo's decoder-joint).

    ``forward(encoder_outputs (B, D, T), targets (B, U) int, target_length (B,), input_states_1, input_states_2
    ((L, B, H) each))`` -> joint logits (B, T, U, V+1 [+ duration slots]), target_length, the LSTM's h and c after
    reading ``targets``.
    """

    def __init__(self, cfg: Mapping[str, Any], state: Mapping[str, torch.Tensor]) -> None:
        super().__init__()
        pred, joint = cfg["prediction"], cfg["joint"]
        hidden, layers = int(pred["pred_hidden"]), int(pred["pred_rnn_layers"])
        self.activation = ACTIVATIONS[joint["activation"]]
        self.w = _Weights(state, _prefixed(state, ["prediction.embed.", "joint."]))
        self.lstm = torch.nn.LSTM(hidden, hidden, layers, batch_first=True)
        self.lstm.load_state_dict({k.removeprefix("prediction.lstm."): v.float()
                                   for k, v in state.items() if k.startswith("prediction.lstm.")})  # fmt: skip
        weight, bias = state["joint.out.weight"].float(), state["joint.out.bias"].float()
        if model_kind(cfg) == "tdt":  # duration logits at the slots of their frame counts
            durations = [int(d) for d in cfg["durations"]]
            tokens = weight.shape[0] - len(durations)
            slots = max(durations) + 1
            slot_weight = weight.new_zeros(slots, weight.shape[1])
            slot_bias = bias.new_full((slots,), MASKED)
            for i, duration in enumerate(durations):
                slot_weight[duration], slot_bias[duration] = weight[tokens + i], bias[tokens + i]
            weight, bias = torch.cat([weight[:tokens], slot_weight]), torch.cat([bias[:tokens], slot_bias])
        self.register_buffer("out_weight", weight.contiguous())
        self.register_buffer("out_bias", bias.contiguous())

    def forward(
        self,
        encoder_outputs: torch.Tensor,
        targets: torch.Tensor,
        target_length: torch.Tensor,
        input_states_1: torch.Tensor,
        input_states_2: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        embedded = F.embedding(targets.long(), self.w["prediction.embed.weight"])  # (B, U, H)
        g, (h, c) = self.lstm(embedded, (input_states_1, input_states_2))
        f = F.linear(encoder_outputs.transpose(1, 2), self.w["joint.enc_proj.weight"], self.w["joint.enc_proj.bias"])
        g = F.linear(g, self.w["joint.pred_proj.weight"], self.w["joint.pred_proj.bias"])
        logits = F.linear(self.activation(f[:, :, None, :] + g[:, None, :, :]), self.out_weight, self.out_bias)
        return logits, target_length, h, c


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
    pred = cfg["prediction"]
    layers, hidden = int(pred["pred_rnn_layers"]), int(pred["pred_hidden"])
    states = (torch.zeros(layers, 2, hidden), torch.zeros(layers, 2, hidden))
    targets = torch.zeros(2, 3, dtype=torch.int32)
    decoder = DecoderJointGraph(cfg, state)
    state_axes = {1: "batch"}
    written.append(_export_graph(
        decoder, (enc, targets, torch.full((2,), 3, dtype=torch.int32), *states), folder / DECODER_JOINT_FILE,
        ["encoder_outputs", "targets", "target_length", "input_states_1", "input_states_2"],
        ["outputs", "prednet_lengths", "output_states_1", "output_states_2"],
        {"encoder_outputs": {0: "batch", 2: "frames"}, "targets": {0: "batch", 1: "labels"},
         "target_length": {0: "batch"}, "input_states_1": state_axes, "input_states_2": state_axes,
         "outputs": {0: "batch", 1: "frames", 2: "labels"}, "prednet_lengths": {0: "batch"},
         "output_states_1": state_axes, "output_states_2": state_axes}, opset))  # fmt: skip
    return written


KNOWN_FILES = (CTC_FILE, ENCODER_FILE, DECODER_JOINT_FILE)


def _clear_earlier_export(folder: Path) -> None:
    """Remove the graphs (and their weights and int8 copies) an earlier export left in ``folder``: a stale file
    there would be loaded with this model's vocabulary."""
    for name in KNOWN_FILES:
        stem = name.removesuffix(".onnx")
        for candidate in (name, f"{name}.data", f"{stem}.int8.onnx", f"{stem}.int8.onnx.data"):
            (folder / candidate).unlink(missing_ok=True)


def export_onnx(model: Any, out: str | os.PathLike, quantize: str | None = None, opset: int = OPSET) -> list[Path]:
    """Export ``model`` (a :class:`~speechtrain.asr.ctc.ConformerCTCModel` or
    :class:`~speechtrain.asr.transducer.ConformerTransducerModel` with NeMo's front-end) to the folder ``out`` for
    onnx-asr (see the module docstring). In a distributed run every rank must call this (the weights are gathered);
    global rank 0 writes.

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
    model.configure_model()
    state = gather_full_state_dict(model)  # collective under model parallelism: every rank takes part
    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_rank():
        return []
    cfg = to_plain(model.cfg)
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    _clear_earlier_export(folder)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".export-") as tmp:
        graphs = _export_files(cfg, state, Path(tmp), opset)
        if quantize == "int8":
            graphs += [_quantize(path) for path in list(graphs)]
        written = []
        for path in sorted(Path(tmp).iterdir()):
            os.replace(path, folder / path.name)
            written.append(folder / path.name)
    (folder / VOCAB_FILE).write_text(vocabulary_lines(model.tokenizer.vocab), encoding="utf-8")
    (folder / CONFIG_FILE).write_text(json.dumps(onnx_asr_config(cfg), indent=2) + "\n", encoding="utf-8")
    return [*written, folder / VOCAB_FILE, folder / CONFIG_FILE]


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
        written = export_onnx(model, cfg.out, cfg.quantize, cfg.opset)
    except ValueError as e:
        fail(f"{cfg.model_path}: {e}")
    model_type = onnx_asr_model_type(model.cfg)
    print(f"Wrote {cfg.out}: {', '.join(p.name for p in written)} ({model_type}, "
          f"{model.tokenizer.vocab_size} tokens + blank).")  # fmt: skip
    print(f"Transcribe with onnx-asr: onnx_asr.load_model({model_type!r}, {str(cfg.out)!r}"
          f"{', quantization=' + repr(cfg.quantize) if cfg.quantize else ''}).recognize('audio.wav')")  # fmt: skip


if __name__ == "__main__":
    main()
