"""The ONNX graphs of :mod:`speechtrain.asr.export_onnx`: the Conformer encoder (with the CTC head) and the
transducer's decoder + joint, restated from a full state dict with operations ONNX has (see that module)."""

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

MASKED = -1e9  # the attention logit of padded keys, and the logit of duration slots a TDT model does not predict
ACTIVATIONS = {"relu": torch.relu, "tanh": torch.tanh, "silu": F.silu, "sigmoid": torch.sigmoid}


def model_kind(cfg: Mapping[str, Any]) -> str:
    """``ctc``, ``rnnt`` or ``tdt`` (the transducer of a hybrid too) of a Conformer model's config."""
    return str(cfg["loss"]) if "loss" in cfg else "ctc"


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
        return self._after_depthwise(self._depthwise(self._pointwise_in(x, p), mask, p + "depthwise.", 1), p)

    def _pointwise_in(self, x: torch.Tensor, p: str) -> torch.Tensor:
        """The convolution module's input projection and GLU: (B, T, D) -> (B, T, D)."""
        return F.glu(F.linear(x, self.w[p + "pointwise_in.linear.weight"], self.w[p + "pointwise_in.linear.bias"]), -1)

    def _after_depthwise(self, x: torch.Tensor, p: str) -> torch.Tensor:
        """The convolution module after its depthwise convolution (the offline and the streaming graph share it):
        norm, SiLU and output projection, (B, D, T) -> (B, T, D)."""
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
