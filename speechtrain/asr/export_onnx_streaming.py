"""The streaming ONNX export of a cache-aware streaming Conformer (:mod:`speechtrain.asr.streaming`): one encoder step
as a graph with its caches as inputs and outputs, in the names of NeMo's cache-aware exports.

:func:`speechtrain.asr.export_onnx.export_onnx` writes it for a streaming model (``att_context_size`` picks which
trained context; default the model's first). The folder holds ``model.onnx`` (CTC, and a hybrid's CTC head) and/or
``encoder-model.onnx`` (transducers) as one step each, ``decoder_joint-model.onnx`` as the offline export, and a
``streaming`` entry in ``config.json`` with the chunk geometry. One step (B: batch, L: layers, M: cached frames,
C: encoder frames per chunk, k: the depthwise kernel):

- inputs: ``audio_signal`` (B, n_mels, W) float32, the feature frames ``factor x (done - 2)`` up to the chunk's
  last frame's look-ahead (W = ``pre_encode_cache_size + shift_size`` or fewer at the end; before the utterance's
  start, zeros: the graph treats them as the subsampling's padding), ``length`` (B,) int64 (valid frames of the
  window), ``cache_last_channel`` (B, L, M, D) (each layer's attention input of the last M frames),
  ``cache_last_time`` (B, L, D, k-1) (each depthwise convolution's input of the last k-1 frames) and
  ``cache_last_channel_len`` (B,) int64 (valid frames in the attention cache: 0 at the start);
- outputs: ``logprobs`` (B, C', V+1) (CTC) or ``outputs`` (B, D, C') (transducers: encoder frames; a
  ``frame_stack`` k > 1 stacks them in the client), ``encoded_lengths`` (B,), and ``cache_last_channel_next``,
  ``cache_last_time_next``, ``cache_last_channel_next_len``. C' = C, fewer on the last step.

:mod:`speechtrain.asr.onnx_stream` runs the folder with ONNX Runtime and NumPy alone.
"""

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from speechtrain.asr.conformer import context_allowed
from speechtrain.asr.onnx_graphs import MASKED, EncoderGraph, _frame_mask, _relative_positions

PRE_ENCODED = 2  # encoder frames the subsampling window starts before the chunk (its padding never reaches the chunk)


def streaming_geometry(model: Any, context: tuple[int, int], chunk: int | None) -> dict[str, Any]:
    """The ``streaming`` entry of config.json: the context, chunk and cache sizes and the feature window of a step."""
    encoder = model.encoder
    left, right = context
    size = right + 1 if encoder.context_style == "chunked_limited" else 1
    chunk = chunk or size
    if chunk < 1 or chunk % size:
        raise ValueError(f"chunk={chunk}: a step runs whole attention chunks, a multiple of right + 1 = {size} "
                         f"encoder frames (att_context_size {list(context)}).")  # fmt: skip
    memory = (left // size) * size
    if memory < PRE_ENCODED:
        raise ValueError(f"att_context_size={list(context)} caches {memory} frames of attention input; the streaming "
                         f"export needs at least {PRE_ENCODED} (a longer left context).")  # fmt: skip
    factor = 2 ** len(encoder.subsampling.convs)
    ahead = encoder.subsampling.receptive_field()[1]
    return {
        "att_context_size": [left, right],
        "att_context_style": encoder.context_style,
        "chunk_size": chunk,  # encoder frames per step
        "shift_size": factor * chunk,  # feature frames each step moves on
        "pre_encode_cache_size": factor * (PRE_ENCODED - 1) + ahead + 1,  # window frames before the new ones
        "drop_extra_pre_encoded": PRE_ENCODED,
        "last_channel_cache_size": memory,
        "last_time_cache_size": int(encoder.layers[0].conv.depthwise.kernel_size[0]) - 1,
        "num_layers": len(encoder.layers),
        "d_model": int(encoder.layers[0].out_norm.normalized_shape[0]),
        "subsampling_factor": factor,
        "causal_downsampling": bool(encoder.subsampling.causal),  # encoder frames of F features: F // 2 + 1 per
        # halving, else (F + 1) // 2
    }


class StreamingEncoderGraph(EncoderGraph):
    """One cache-aware encoder step (see the module docstring), from a full state dict.

    Args:
        cfg, state, head: as :class:`EncoderGraph` (frames are not stacked here).
        geometry: :func:`streaming_geometry`.
    """

    def __init__(self, cfg: Mapping[str, Any], state: Mapping[str, torch.Tensor], head: str,
                 geometry: Mapping[str, Any]) -> None:  # fmt: skip
        super().__init__(cfg, state, head)
        self.causal = bool(cfg["encoder"].get("causal_downsampling"))
        self.context = tuple(geometry["att_context_size"])
        self.style = geometry["att_context_style"]
        self.chunk, self.memory = int(geometry["chunk_size"]), int(geometry["last_channel_cache_size"])

    def _subsampling_window(self, feats: torch.Tensor, lengths: torch.Tensor,
                            start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The subsampling of a window that starts ``factor x start`` feature frames before the utterance ((B,),
        0 once it has begun): the frames before the utterance are zeroed after each convolution, as the offline
        padding is, and those past ``lengths`` as offline. Returns (B, T', D) and the valid frames."""
        pad = (2, 1) if self.causal else (1, 1)
        x = feats.transpose(1, 2)  # (B, n_mels, W) -> (B, W, n_mels)
        x = (x * _frame_mask(lengths, x.shape[1])[:, :, None]).unsqueeze(1)  # (B, 1, W, n_mels)
        steps = int(math.log2(self.factor))
        for step in range(steps):
            lengths = lengths // 2 + 1 if self.causal else (lengths + 1) // 2
            before = start * 2 ** (steps - step - 1)  # frames of this output before the utterance
            prefix = f"encoder.subsampling.convs.{step}."
            x = F.pad(x, (pad[0], pad[1], pad[0], pad[1]))  # (time and frequency)
            if self.kind == "striding" or step == 0:
                x = F.conv2d(x, self.w[prefix + "weight"], self.w[prefix + "bias"], stride=2)
            else:
                depthwise = self.w[prefix + "0.weight"]  # (C, 1, 3, 3)
                x = F.conv2d(x, depthwise, self.w[prefix + "0.bias"], stride=2, groups=depthwise.shape[0])
                x = F.conv2d(x, self.w[prefix + "1.weight"], self.w[prefix + "1.bias"])
            frames = torch.arange(x.shape[2], device=x.device)[None, :]
            valid = (frames < lengths[:, None]) & (frames >= before[:, None])  # (B, T)
            x = torch.relu(x * valid[:, None, :, None])
        x = x.transpose(1, 2).flatten(2)  # (B, C, T', bands) -> (B, T', C * bands)
        return F.linear(x, self.w["encoder.subsampling.out.weight"], self.w["encoder.subsampling.out.bias"]), lengths

    def _stream_attention(self, x: torch.Tensor, cache: torch.Tensor, allowed: torch.Tensor, positions: torch.Tensor,
                          index: int) -> torch.Tensor:  # fmt: skip
        """Relative-position attention of the chunk's queries x (B, T, D) over the cache (B, M, D) and x, keys
        ``allowed`` (B, T, M+T) -> (B, T, D)."""
        p = f"encoder.layers.{index}.attention."
        bias_layer = f"encoder.layers.{index if self.untie else 0}.attention."
        h, d = self.heads, self.d_model // self.heads
        batch, frames = x.shape[0], x.shape[1]
        both = torch.cat([cache, x], dim=1)  # (B, K, D), K = M + T

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(batch, t.shape[1], h, d).transpose(1, 2)  # (B, h, T or K, d)

        q = heads(F.linear(x, self.w[p + "query.linear.weight"], self.w[p + "query.linear.bias"]))
        k = heads(F.linear(both, self.w[p + "key.linear.weight"], None))
        v = heads(F.linear(both, self.w[p + "value.linear.weight"], self.w[p + "value.linear.bias"]))
        scale = 1.0 / math.sqrt(d)
        u, pos_v = self.w[bias_layer + "pos_bias_u"], self.w[bias_layer + "pos_bias_v"]
        pos = F.linear(positions, self.w[p + "position.linear.weight"], None)  # (K+T-1, D): distances K-1 .. 1-T
        pos = pos.reshape(-1, h, d).permute(1, 2, 0)  # (h, d, K+T-1)
        by_distance = torch.matmul((q + pos_v[:, None, :]) * scale, pos)  # (B, h, T, K+T-1)
        # Query i's distance to key j, M + i - j, sits in column T-1 - i + j.
        keys = both.shape[1]
        rows, columns = torch.arange(frames, device=x.device), torch.arange(keys, device=x.device)
        column = frames - 1 - rows[:, None] + columns[None, :]  # (T, K)
        position_scores = torch.gather(by_distance, 3, column.expand(batch, h, frames, keys))
        scores = torch.matmul(q + u[:, None, :], k.transpose(2, 3)) * scale + position_scores
        scores = scores.masked_fill(~allowed[:, None], MASKED)
        y = torch.matmul(torch.softmax(scores, dim=-1), v).transpose(1, 2).reshape(batch, frames, h * d)
        return F.linear(y, self.w[p + "out.linear.weight"], self.w[p + "out.linear.bias"])

    def _stream_convolution(
        self, x: torch.Tensor, cache: torch.Tensor, index: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The causal convolution module on x (B, T, D) after its cache (B, D, k-1) -> (B, T, D), the next cache."""
        p = f"encoder.layers.{index}.conv."
        x = self._pointwise_in(x, p)
        both = torch.cat([cache, x.transpose(1, 2)], dim=2)  # (B, D, k-1+T)
        weight = self.w[p + "depthwise.weight"]
        y = F.conv1d(both, weight, self.w[p + "depthwise.bias"], groups=int(weight.shape[0]))  # (B, D, T)
        return self._after_depthwise(y, p), both[:, :, x.shape[1] :]

    def forward(self, audio_signal: torch.Tensor, length: torch.Tensor, cache_last_channel: torch.Tensor,
                cache_last_time: torch.Tensor, cache_last_channel_len: torch.Tensor) -> tuple:  # fmt: skip
        # Encoder frames of the utterance before the chunk (the cache holds at least PRE_ENCODED once begun).
        begun = torch.clamp(cache_last_channel_len, max=PRE_ENCODED)
        x, lengths = self._subsampling_window(audio_signal, length, PRE_ENCODED - begun)
        x = x[:, PRE_ENCODED : PRE_ENCODED + self.chunk] * self.xscale  # (B, C', D)
        lengths = torch.clamp(lengths - PRE_ENCODED, min=0, max=self.chunk)
        frames, memory = x.shape[1], self.memory
        queries = memory + torch.arange(frames, device=x.device)
        keys = torch.arange(memory + frames, device=x.device)
        allowed = context_allowed(queries, keys, self.context, self.style)[None]  # (1, T, K)
        valid_keys = (keys[None, :] >= memory - cache_last_channel_len[:, None]) & (
            keys[None, :] < memory + lengths[:, None])  # fmt: skip
        allowed = allowed & valid_keys[:, None, :]  # (B, T, K)
        positions = _relative_positions_past(frames, memory, self.d_model)
        new_channel, new_time = [], []
        for index in range(self.layers):
            p = f"encoder.layers.{index}."
            x = x + 0.5 * self._feed_forward(self._layer_norm(x, p + "ff1_norm"), p + "ff1.")
            h = self._layer_norm(x, p + "attn_norm")
            channel = cache_last_channel[:, index]
            x = x + self._stream_attention(h, channel, allowed, positions, index)
            conv, time_cache = self._stream_convolution(self._layer_norm(x, p + "conv_norm"),
                                                        cache_last_time[:, index], index)  # fmt: skip
            x = x + conv
            x = x + 0.5 * self._feed_forward(self._layer_norm(x, p + "ff2_norm"), p + "ff2.")
            x = self._layer_norm(x, p + "out_norm")
            if index in self.condition:
                probs = torch.softmax(self._ctc_logits(x), dim=-1)
                x = x + F.linear(probs, self.w["conditioning.weight"], self.w["conditioning.bias"])
            new_channel.append(torch.cat([channel, h], dim=1)[:, frames:])
            new_time.append(time_cache)
        caches = (torch.stack(new_channel, 1), torch.stack(new_time, 1),
                  torch.clamp(cache_last_channel_len + lengths, max=memory))  # fmt: skip
        if self.head == "ctc":
            return torch.log_softmax(self._ctc_logits(x), dim=-1), lengths, *caches
        return x.transpose(1, 2), lengths, *caches


def _relative_positions_past(frames: Any, past: int, d_model: int) -> torch.Tensor:
    """(past + 2T-1, D) encodings of the distances past+T-1 .. -(T-1) (``_relative_positions`` with a cache)."""
    full = _relative_positions(frames + past, d_model)  # distances T+M-1 .. -(T+M-1)
    return full[: past + 2 * frames - 1]
