"""Conformer encoder (Gulati et al. 2020) with FastConformer's 8x depthwise-striding subsampling.

Subsampling (``striding``: 2-D convolutions of stride 2, 4x by default; ``dw_striding``: one full convolution then
depthwise-separable ones, 8x by default), then ``num_layers`` Conformer layers::

    x = x + 1/2 FF(LN(x))           macaron feed-forward (Swish)
    x = x + MHSA(LN(x))             Transformer-XL relative-position self-attention
    x = x + Conv(LN(x))             pointwise -> GLU -> depthwise -> norm -> Swish -> pointwise
    x = x + 1/2 FF(LN(x))
    x = LN(x)

Optionally (``time_reduce_idx`` / ``time_recovery_idx``, Squeezeformer's temporal U-Net), a span of middle layers runs
on half the frames and the output comes back at the subsampling's frame rate.

Tensor parallelism: attention heads, feed-forward hidden units and the convolution module's pointwise layers are
split over the TP ranks (the blocks of :mod:`speechtrain.nn`); subsampling, norms and the depthwise convolution are
replicated. Every weight is drawn from its own seeded stream, so TP=2 holds the same model as TP=1.

Streaming (NeMo's cache-aware FastConformer): ``att_context_size`` limits what each frame attends to (``regular``, or
``chunked_limited``: chunks of ``right + 1`` frames and whole chunks of left context), ``conv_context_size: causal``
makes the depthwise convolutions causal and ``causal_downsampling`` the subsampling; :meth:`ConformerLayer.stream`
then runs one chunk at a time with its caches (:mod:`speechtrain.asr.streaming`), giving the offline frames.

Padding never changes valid outputs: every convolution sees zeros past each utterance's end, attention never looks at
them, and the ``batch_norm`` option of the convolution module takes its statistics over valid frames only (in eval
mode, it uses running statistics, so batched and per-utterance outputs agree exactly).
"""

import contextlib
import math
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from speechtrain import backends
from speechtrain.asr.subsampling import (  # noqa: F401  (frame_mask, subsampled_lengths: this module's API too)
    Subsampling,
    _conv_out_length,
    frame_mask,
    subsampled_lengths,
)
from speechtrain.lightning import parallel_state
from speechtrain.nn.dropout import Dropout
from speechtrain.nn.init import seeded
from speechtrain.nn.parallel import ColumnParallelLinear, RowParallelLinear
from speechtrain.nn.transformer import (
    FeedForward,
    MultiHeadAttention,
    key_padding_bias,
    logits_dtype,
    relative_positions,
)

CONTEXT_STYLES = ("regular", "chunked_limited")


@dataclass
class ConformerConfig:
    """Encoder shape (NeMo's names where they exist).

    Attributes:
        d_model: width.
        num_layers: Conformer layers.
        num_heads: attention heads (divisible by the TP size).
        ff_expansion_factor: feed-forward hidden width = ``ff_expansion_factor * d_model``.
        conv_kernel_size: depthwise convolution kernel (odd).
        conv_norm_type: ``layer_norm`` or ``batch_norm`` (masked) inside the convolution module.
        subsampling: ``striding`` (2-D convolutions) or ``dw_striding`` (depthwise-separable, FastConformer).
        subsampling_factor: time reduction, a power of 2 (4 for striding, 8 for dw_striding are the usual ones).
        subsampling_conv_channels: channels of the subsampling convolutions (-1: d_model).
        dropout: residual, feed-forward and pre-encoder dropout.
        dropout_att: dropout on attention probabilities.
        xscaling: multiply the subsampled input by sqrt(d_model) (NeMo's default is true; off here: with it, the
            CPU demo model left the CTC plateau later).
        untie_biases: each layer learns its own relative-position biases ``u`` and ``v`` (NeMo's default); false
            shares layer 0's pair with all layers (only layer 0's are in the state dict).
        activation_checkpointing: keep only each layer's input in training and recompute the layer in the backward
            pass (about a third more compute for a fraction of the activation memory; dropout masks are redrawn
            identically, the model-parallel RNG streams included).
        compile: ``torch.compile`` each Conformer layer (the first steps pay the compilation).
        time_reduce_idx: Squeezeformer's temporal U-Net (Kim et al. 2022; NeMo's Squeezeformer key): layers
            ``time_reduce_idx`` to ``time_recovery_idx - 1`` run on half the frames (a stride-2 depthwise-separable
            convolution before them; after them, each frame repeated twice, projected and added to the activation
            they started from), so the encoder's output keeps the subsampling's frame rate at about
            ``(num_layers - span / 2) / num_layers`` of the layers' compute. -1: off.
        time_recovery_idx: the first layer back at the full frame rate (``time_reduce_idx`` < it <= ``num_layers``).
        att_context_size: NeMo's limited attention context ``[left, right]`` in encoder frames (-1: unlimited), or a
            list of them trained together: each training step uses one, drawn from the step number (the same on
            every rank; ``att_context_probs`` weights them); evaluation and export use the first. Needed, with a
            finite left, for cache-aware streaming (:mod:`speechtrain.asr.streaming`).
        att_context_style: ``regular`` (frame i sees frames i-left .. i+right) or ``chunked_limited`` (NeMo's: the
            frames fall into chunks of ``right + 1``; a frame sees its whole chunk and the ``left // (right + 1)``
            chunks before it, so streaming runs one chunk per step with no look-ahead growing over the layers).
        att_context_probs: probabilities of the ``att_context_size`` entries in training (None: uniform).
        conv_context_size: the depthwise convolution's frames ``[before, after]`` (summing to kernel - 1); None:
            symmetric; ``causal``: ``[kernel - 1, 0]`` (what streaming needs).
        causal_downsampling: subsampling convolutions read no future frame (padding 2 before and 1 after, on time
            and frequency, as NeMo's): streaming then waits for no feature past a frame's own.
    """

    d_model: int = 176
    num_layers: int = 16
    num_heads: int = 4
    ff_expansion_factor: int = 4
    conv_kernel_size: int = 9
    conv_norm_type: str = "batch_norm"
    subsampling: str = "dw_striding"
    subsampling_factor: int = 8
    subsampling_conv_channels: int = 256
    dropout: float = 0.1
    dropout_att: float = 0.1
    xscaling: bool = False
    untie_biases: bool = True
    activation_checkpointing: bool = False
    compile: bool = False
    time_reduce_idx: int = -1
    time_recovery_idx: int = -1
    att_context_size: list[Any] = field(default_factory=lambda: [-1, -1])
    att_context_style: str = "regular"
    att_context_probs: list[float] | None = None
    conv_context_size: Any = None
    causal_downsampling: bool = False

    def context_sizes(self) -> list[tuple[int, int]]:
        """The ``att_context_size`` entries as ``(left, right)`` pairs, checked (ConfigError-friendly ValueError)."""
        sizes = list(self.att_context_size)
        if sizes and all(isinstance(v, int) for v in sizes):
            sizes = [sizes]
        where = f"encoder.att_context_size={self.att_context_size}"
        pairs = []
        for size in sizes:
            size = list(size) if not isinstance(size, int) else [size]
            if len(size) != 2 or not all(isinstance(v, int) and v >= -1 for v in size):
                raise ValueError(f"{where}: expected [left, right] (frames, -1: unlimited) or a list of them.")
            if self.att_context_style == "chunked_limited" and size[1] < 0:
                raise ValueError(f"{where}: chunked_limited needs right >= 0 (chunks of right + 1 frames).")
            pairs.append((size[0], size[1]))
        if not pairs:
            raise ValueError(f"{where}: give at least one [left, right].")
        if self.att_context_style not in CONTEXT_STYLES:
            raise ValueError(f"encoder.att_context_style must be one of {', '.join(CONTEXT_STYLES)}, got "
                             f"{self.att_context_style!r}.")  # fmt: skip
        probs = self.att_context_probs
        if probs is not None and (len(probs) != len(pairs) or min(probs) < 0 or abs(sum(probs) - 1) > 1e-6):
            raise ValueError(f"encoder.att_context_probs={list(probs)}: one probability per att_context_size entry "
                             f"({len(pairs)}), summing to 1.")  # fmt: skip
        if self.limited_context(pairs) and self.reduced_layers():
            raise ValueError(
                "encoder.att_context_size limits the attention context, which the temporal U-Net "
                "(time_reduce_idx) does not support: set time_reduce_idx=-1 time_recovery_idx=-1."
            )
        return pairs

    def limited_context(self, pairs: list[tuple[int, int]] | None = None) -> bool:
        """Whether any attention context is limited (else attention is the offline model's, unchanged)."""
        pairs = self.context_sizes() if pairs is None else pairs
        return self.att_context_style != "regular" or any(p != (-1, -1) for p in pairs)

    def conv_padding(self) -> tuple[int, int]:
        """The depthwise convolution's (frames before, frames after)."""
        k, context = self.conv_kernel_size, self.conv_context_size
        if context is None:
            return k // 2, k // 2
        if context == "causal":
            return k - 1, 0
        context = list(context) if not isinstance(context, str) else context
        if isinstance(context, str) or len(context) != 2 or sum(context) != k - 1 or min(context) < 0:
            raise ValueError(f"encoder.conv_context_size={self.conv_context_size}: expected null, 'causal' or "
                             f"[before, after] with before + after = conv_kernel_size - 1 = {k - 1}.")  # fmt: skip
        return int(context[0]), int(context[1])

    def reduced_layers(self) -> range:
        """The layers that run on half the frames (empty without a temporal U-Net)."""
        if self.time_reduce_idx < 0 and self.time_recovery_idx < 0:
            return range(0)
        if not 0 <= self.time_reduce_idx < self.time_recovery_idx <= self.num_layers:
            raise ValueError(
                f"encoder.time_reduce_idx={self.time_reduce_idx} and time_recovery_idx={self.time_recovery_idx}: "
                f"need 0 <= time_reduce_idx < time_recovery_idx <= num_layers={self.num_layers} (layers "
                "time_reduce_idx .. time_recovery_idx - 1 run on half the frames), or both -1 (off)."
            )
        return range(self.time_reduce_idx, self.time_recovery_idx)


def context_allowed(queries: torch.Tensor, keys: torch.Tensor, context: tuple[int, int], style: str) -> torch.Tensor:
    """(T, K) bool: may the query at frame ``queries[i]`` attend to the key at frame ``keys[j]`` (absolute frame
    numbers, (T,) and (K,)) under the limited ``context`` (left, right) of ``style`` (``regular`` or
    ``chunked_limited``, see :class:`ConformerConfig`). Built from the shapes alone: no host synchronisation."""
    left, right = context
    if style == "chunked_limited":
        size = right + 1
        back = (torch.div(queries, size, rounding_mode="floor")[:, None]
                - torch.div(keys, size, rounding_mode="floor")[None, :])  # fmt: skip  # chunks back
        allowed = back >= 0
        return allowed & (back <= left // size) if left >= 0 else allowed
    back = queries[:, None] - keys[None, :]  # frames back
    allowed = torch.ones_like(back, dtype=torch.bool)
    if left >= 0:
        allowed = allowed & (back <= left)
    if right >= 0:
        allowed = allowed & (back >= -right)
    return allowed


class MaskedBatchNorm1d(torch.nn.BatchNorm1d):
    """Batch norm over (B, C, T) whose training statistics use valid frames only (``mask`` (B, T): True or 1 on
    them)."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if not self.training:
            return super().forward(x)
        batch, channels, frames = x.shape
        valid = mask.view(batch, 1, frames)
        valid = valid if valid.dtype == x.dtype else valid.to(x.dtype)  # (the conv module's is already)
        count = valid.sum().clamp(min=1)
        mean = (x * valid).sum(dim=(0, 2)) / count
        centered = x - mean.view(1, channels, 1)  # (shared with the normalisation: one pass and its backward fewer)
        kept = centered * valid
        var = (kept * kept).sum(dim=(0, 2)) / count  # (``kept * kept``: ``** 2``'s backward is twice the operators)
        if not getattr(_recomputing, "active", False):  # activation recomputation: counted in the first forward
            with torch.no_grad():
                unbiased = var * count / (count - 1).clamp(min=1)
                self.running_mean.lerp_(mean.detach().to(self.running_mean.dtype), self.momentum)
                self.running_var.lerp_(unbiased.detach().to(self.running_var.dtype), self.momentum)
                self.num_batches_tracked += 1
        std = torch.sqrt(var + self.eps).view(1, channels, 1)
        return centered / std * self.weight.view(1, channels, 1) + self.bias.view(1, channels, 1)


def _depthwise_over_time(
    conv: torch.nn.Conv1d, x: torch.Tensor, mask: torch.Tensor, before: torch.Tensor | None = None
) -> torch.Tensor:
    """The depthwise ``conv`` over the frames of x (B, T, D), zeros past each utterance's end (``mask`` (B, T): True
    or 1 on valid frames), as a (k x 1) Conv2d on channels-last memory, which (B, T, D) already is: no transposed
    copies, and the channels-last depthwise kernels (much faster than Conv1d's). ``before``: (B, P, D) frames put
    before x in place of the convolution's padding there (a streaming cache; ``conv`` then pads nothing). Returns
    (B, D, T')."""
    batch, frames, channels = x.shape
    x = x * mask.view(batch, frames, 1)
    if before is not None:
        x = torch.cat([before, x], dim=1)
        frames = x.shape[1]
    x = x.view(batch, frames, 1, channels).permute(0, 3, 1, 2)  # (B, T, 1, D) -> (B, D, T, 1)
    weight, stride, padding = conv.weight.view(*conv.weight.shape, 1), (conv.stride[0], 1), (conv.padding[0], 0)
    out = backends.depthwise_conv2d(x, weight, conv.bias, stride, padding)  # (B, D, T', 1)
    return out.view(out.shape[:3])


class ConvolutionModule(torch.nn.Module):
    """Pointwise (2x, GLU) -> depthwise conv -> norm -> Swish -> pointwise, on (B, T, D).

    The first pointwise layer is column-parallel with a gathered output (the GLU pairs channel i with i + D), the
    depthwise convolution and norm run on all channels, and the last pointwise layer is row-parallel.
    """

    def __init__(
        self, d_model: int, kernel_size: int, norm_type: str, dropout: float, padding: tuple[int, int] | None = None
    ) -> None:
        super().__init__()
        if kernel_size % 2 == 0:
            raise ValueError(f"encoder.conv_kernel_size must be odd, got {kernel_size}.")
        if norm_type not in ("batch_norm", "layer_norm"):
            raise ValueError(f"encoder.conv_norm_type must be 'batch_norm' or 'layer_norm', got {norm_type!r}.")
        self.pointwise_in = ColumnParallelLinear(d_model, 2 * d_model, gather_output=True)
        # Asymmetric padding (a causal convolution) is added as frames before or after the input, not by the conv.
        self.padding = padding or (kernel_size // 2, kernel_size // 2)
        symmetric = self.padding[0] if self.padding[0] == self.padding[1] else 0
        self.depthwise = torch.nn.Conv1d(d_model, d_model, kernel_size, padding=symmetric, groups=d_model)
        self.norm_type = norm_type
        self.norm = MaskedBatchNorm1d(d_model) if norm_type == "batch_norm" else torch.nn.LayerNorm(d_model)
        self.pointwise_out = RowParallelLinear(d_model, d_model, input_is_parallel=False)
        self.dropout = Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x (B, T, D), mask (B, T) True (or 1) on valid frames -> (B, T, D)."""
        x = F.glu(self.pointwise_in(x), dim=-1)  # (B, T, 2D) -> (B, T, D)
        if self.norm_type == "batch_norm":  # once for the convolution's and the norm's masking (and their backward)
            mask = mask.to(x.dtype)
        before, after = self.padding
        if before != after:
            zeros = x.new_zeros(x.shape[0], before, x.shape[2])
            x = _depthwise_over_time(self.depthwise, F.pad(x, (0, 0, 0, after)), F.pad(mask, (0, after)), zeros)
        else:
            x = _depthwise_over_time(self.depthwise, x, mask)  # (B, D, T)
        return self._after_depthwise(x, mask)

    def stream(self, x: torch.Tensor, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One streaming chunk (a causal convolution): x (B, T, D), every frame valid, and ``cache`` (B, k-1, D),
        the depthwise input of the k-1 frames before x (zeros at the start, as the offline padding) -> (B, T, D)
        and the next chunk's cache."""
        x = F.glu(self.pointwise_in(x), dim=-1)  # (B, T, 2D) -> (B, T, D)
        mask = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
        out = _depthwise_over_time(self.depthwise, x, mask, before=cache)
        return self._after_depthwise(out, mask), torch.cat([cache, x], dim=1)[:, x.shape[1] :]

    def _after_depthwise(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(B, D, T) depthwise output -> norm -> Swish -> pointwise -> (B, T, D)."""
        if self.norm_type == "batch_norm":
            x = self.norm(x, mask)
        else:
            x = self.norm(x.transpose(1, 2)).transpose(1, 2)
        x = F.silu(x).transpose(1, 2)  # (B, T, D)
        return self.dropout(self.pointwise_out(x))


class TimeReduction(torch.nn.Module):
    """Halve the frame rate: a kernel-3, stride-2 depthwise convolution (zeros past each utterance's end, so valid
    outputs are as if unpadded), then a pointwise projection; (B, T, D) -> (B, ceil(T / 2), D)."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.depthwise = torch.nn.Conv1d(d_model, d_model, 3, stride=2, padding=1, groups=d_model)
        self.pointwise = torch.nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.pointwise(_depthwise_over_time(self.depthwise, x, mask).transpose(1, 2))


class ConformerLayer(torch.nn.Module):
    """One macaron Conformer layer (see the module docstring)."""

    def __init__(self, cfg: ConformerConfig) -> None:
        super().__init__()
        d, d_ff = cfg.d_model, cfg.ff_expansion_factor * cfg.d_model
        self.ff1_norm = torch.nn.LayerNorm(d)
        self.ff1 = FeedForward(d, d_ff, activation="swish", dropout=cfg.dropout)
        self.attn_norm = torch.nn.LayerNorm(d)
        self.attention = MultiHeadAttention(d, cfg.num_heads, cfg.dropout_att, relative_positions=True)
        self.conv_norm = torch.nn.LayerNorm(d)
        self.conv = ConvolutionModule(d, cfg.conv_kernel_size, cfg.conv_norm_type, cfg.dropout, cfg.conv_padding())
        self.ff2_norm = torch.nn.LayerNorm(d)
        self.ff2 = FeedForward(d, d_ff, activation="swish", dropout=cfg.dropout)
        self.out_norm = torch.nn.LayerNorm(d)
        self.dropout = Dropout(cfg.dropout)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor | None = None,
        pad_mask: torch.Tensor | None = None,
        allowed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x (B, T, D), mask (B, T) True on valid frames, positions (2T-1, D) relative-position encodings (computed
        by the attention when None), pad_mask ``~mask`` (computed here when None; the encoder makes it once for
        all layers, additive: :func:`~speechtrain.nn.transformer.key_padding_bias`) -> (B, T, D). ``allowed``:
        (B, 1, T, T) bool, the keys each query may attend to (limited context, padding included; ``pad_mask`` is
        then not used); None: every valid frame."""
        x = torch.add(x, self.dropout(self.ff1(self.ff1_norm(x))), alpha=0.5)  # one operator for x + 0.5 * ff
        if allowed is not None:
            pad_mask = None
        elif pad_mask is None:
            pad_mask = ~mask
        attended = self.attention(self.attn_norm(x), pad_mask=pad_mask, positions=positions, allowed=allowed)
        x = x + self.dropout(attended)
        x = x + self.conv(self.conv_norm(x), mask)
        x = torch.add(x, self.dropout(self.ff2(self.ff2_norm(x))), alpha=0.5)
        return self.out_norm(x)

    def stream(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        allowed: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """One streaming chunk, in eval mode: x (B, T, D) (every frame valid), the (M+2T-1, D) relative-position
        encodings of :func:`relative_positions` with ``past=M``, ``allowed`` (T, M+T) and ``cache``: the attention
        input of the M frames before x (B, M, D) and the convolution's (B, k-1, D). Returns (B, T, D) and the next
        chunk's cache."""
        attention_cache, conv_cache = cache
        x = x + 0.5 * self.ff1(self.ff1_norm(x))
        h = self.attn_norm(x)
        x = x + self.attention(h, positions=positions, allowed=allowed, memory=attention_cache)
        conv, conv_cache = self.conv.stream(self.conv_norm(x), conv_cache)
        x = x + conv
        x = x + 0.5 * self.ff2(self.ff2_norm(x))
        attention_cache = torch.cat([attention_cache, h], dim=1)[:, h.shape[1] :]
        return self.out_norm(x), (attention_cache, conv_cache)


def _run_layer(
    layer: ConformerLayer,
    x: torch.Tensor,
    mask: torch.Tensor,
    positions: torch.Tensor,
    pad_mask: torch.Tensor,
    allowed: torch.Tensor | None,
) -> torch.Tensor:
    return layer(x, mask, positions, pad_mask, allowed)


_recomputing = threading.local()


def _checkpoint_contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """Contexts of a checkpointed layer's forward and of its recomputation. The recomputation runs on the
    model-parallel RNG streams the forward saw (torch's checkpoint restores only the default generators), and
    batch norm does not count its statistics a second time."""
    seen = None
    if parallel_state.tensor_parallel_world_size() > 1:
        from speechtrain.lightning.megatron_compat import rng_tracker_states, set_rng_tracker_states

        seen = rng_tracker_states()

    @contextlib.contextmanager
    def recompute():  # noqa: ANN202
        now = rng_tracker_states() if seen is not None else None
        if seen is not None:
            set_rng_tracker_states(seen)
        _recomputing.active = True
        try:
            yield
        finally:
            _recomputing.active = False
            if now is not None:
                set_rng_tracker_states(now)

    return contextlib.nullcontext(), recompute()


def conformer_forward_flops(cfg: ConformerConfig, n_mels: int, frames: torch.Tensor) -> torch.Tensor:
    """Forward-pass FLOPs (2 per multiply-add) of the encoder on utterances of ``frames`` feature frames (B,).

    Counts the matrix products and convolutions on valid frames (padding is not useful work); norms, activations
    and softmax are left out. A tensor, so that a GPU run does not synchronise to count.
    """
    d, ff, k = cfg.d_model, cfg.ff_expansion_factor * cfg.d_model, cfg.conv_kernel_size
    channels = cfg.subsampling_conv_channels if cfg.subsampling_conv_channels > 0 else d
    frames = frames.to(torch.float64)
    total = torch.zeros((), dtype=torch.float64, device=frames.device)
    bands = n_mels
    for step in range(int(math.log2(cfg.subsampling_factor))):
        frames = _conv_out_length(frames)
        bands = (bands - 1) // 2 + 1
        if step == 0:
            per_position = 9 * channels
        elif cfg.subsampling == "striding":
            per_position = 9 * channels * channels
        else:
            per_position = 9 * channels + channels * channels
        total = total + 2 * (frames * bands).sum() * per_position
    n = frames
    total = total + 2 * n.sum() * channels * bands * d  # subsampling output projection
    per_frame = 2 * (2 * d * ff) * 2  # two half-step feed-forward modules
    per_frame += 2 * 4 * d * d + 2 * 2 * d * d  # q, k, v, out; positional projection (2n positions)
    per_frame += 2 * (2 * d * d + d * k + d * d)  # convolution module: pointwise in (2d), depthwise, pointwise out
    reduced = len(cfg.reduced_layers())

    def layers(count: int, n: torch.Tensor) -> torch.Tensor:
        attention = 2 * 4 * d * (n * n).sum()  # content and positional scores (2n positions), weighted values
        return count * (per_frame * n.sum() + attention)

    total = total + layers(cfg.num_layers - reduced, n)
    if reduced:  # the temporal U-Net: its layers on half the frames, its depthwise, pointwise and recovery projections
        half = _conv_out_length(n)
        total = total + layers(reduced, half) + 2 * half.sum() * (3 * d + 2 * d * d)
    return total


class ConformerEncoder(torch.nn.Module):
    """Log-mel features (B, n_mels, F) -> encoded frames (B, F', d_model) and their lengths (B,).

    Args:
        cfg: encoder shape.
        n_mels: feature bands.
        seed: base of the per-layer initialisation streams (the same on every rank).
    """

    def __init__(self, cfg: ConformerConfig, n_mels: int, seed: int) -> None:
        super().__init__()
        channels = cfg.subsampling_conv_channels if cfg.subsampling_conv_channels > 0 else cfg.d_model
        with seeded(seed):
            self.subsampling = Subsampling(cfg.subsampling, cfg.subsampling_factor, n_mels, channels, cfg.d_model,
                                           cfg.causal_downsampling)  # fmt: skip
        layers = []
        for index in range(cfg.num_layers):
            with seeded(seed + 1 + index):
                layers.append(ConformerLayer(cfg))
        if not cfg.untie_biases:
            # Layer 0 owns the shared pair; the others hold plain references, so each tensor has one state-dict name
            # (tensor-parallel gathering and slicing look parameters up by their first name only).
            for layer in layers[1:]:
                for name in ("pos_bias_u", "pos_bias_v"):
                    del layer.attention._parameters[name]
                    object.__setattr__(layer.attention, name, getattr(layers[0].attention, name))
        self.layers = torch.nn.ModuleList(layers)
        self.reduced = cfg.reduced_layers()
        if self.reduced:
            with seeded(seed + 1 + cfg.num_layers):
                self.time_reduction = TimeReduction(cfg.d_model)
                self.time_recovery = torch.nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = Dropout(cfg.dropout)
        self.subsampling_factor = cfg.subsampling_factor
        self.xscale = math.sqrt(cfg.d_model) if cfg.xscaling else 1.0
        self.activation_checkpointing = cfg.activation_checkpointing
        self._run_layer = torch.compile(_run_layer, dynamic=True) if cfg.compile else _run_layer
        self.contexts = cfg.context_sizes()
        self.context_style = cfg.att_context_style
        self.context_probs = cfg.att_context_probs
        self.limited_context = cfg.limited_context(self.contexts)
        self.context = self.contexts[0]  # evaluation's (and streaming's) context: set_context changes it
        self.training_step_index = 0  # the model sets it before each training forward: the context is drawn from it
        self._context_seed = seed

    def set_context(self, context: tuple[int, int] | list[int]) -> None:
        """Evaluate (and stream) with ``context`` (left, right), one of the trained ``att_context_size`` entries."""
        context = (int(context[0]), int(context[1]))
        if context not in self.contexts:
            raise ValueError(f"att_context_size={list(context)} is not one this model was trained with: "
                             f"{[list(c) for c in self.contexts]}.")  # fmt: skip
        self.context = context

    def training_context(self) -> tuple[int, int]:
        """The context of this training step: drawn from the step number and the model's seed, so every
        data-parallel rank picks the same without communicating (and a resumed run picks as the uninterrupted one)."""
        if len(self.contexts) == 1:
            return self.contexts[0]
        draw = random.Random(f"{self._context_seed}-{self.training_step_index}")
        return draw.choices(self.contexts, weights=self.context_probs)[0]

    def _allowed(self, mask: torch.Tensor) -> torch.Tensor | None:
        """(B, 1, T, T) keys each query may attend to under the limited context (None: unlimited): valid keys in
        the context, and each frame itself, so that a padded frame with no valid key in its context attends to
        something (softmax over nothing is NaN, which padding would carry on through the convolutions)."""
        if not self.limited_context:
            return None
        context = self.training_context() if self.training else self.context
        frames = torch.arange(mask.shape[1], device=mask.device)
        allowed = context_allowed(frames, frames, context, self.context_style)[None] & mask[:, None, :]  # (B, T, T)
        return (allowed | torch.eye(mask.shape[1], dtype=torch.bool, device=mask.device))[:, None]

    def output_lengths(self, lengths: torch.Tensor) -> torch.Tensor:
        """The output frames of utterances of ``lengths`` feature frames (the temporal U-Net keeps them)."""
        return self.subsampling.output_lengths(lengths)

    def forward(self, feats: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, lengths, _ = self.forward_with_layers(feats, lengths, ())
        return x, lengths

    def forward_with_layers(
        self,
        feats: torch.Tensor,
        lengths: torch.Tensor,
        capture: tuple[int, ...],
        condition: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """:meth:`forward`, and the outputs of the layers ``capture`` (0-based, in that order; padded frames
        zeroed), e.g. for intermediate CTC losses. ``condition``: what to add to each captured output before the
        next layer reads it (self-conditioned CTC)."""
        captured: dict[int, torch.Tensor] = {}
        x, lengths = self.subsampling(feats, lengths)
        x = self.dropout(x * self.xscale)
        mask = frame_mask(lengths, x.shape[1])
        dtype = logits_dtype(x)
        pad_mask = key_padding_bias(~mask, dtype)  # once for all layers (of a frame rate), as the positions
        positions = relative_positions(x.shape[1], x.shape[2], x.device)
        full, full_pad = mask, pad_mask  # the output's frame mask
        allowed = self._allowed(mask)
        recompute = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        for index, layer in enumerate(self.layers):
            if self.reduced and index == self.reduced.start:
                skip, full_positions = x, positions
                x = self.time_reduction(x, mask)
                mask = frame_mask(_conv_out_length(lengths), x.shape[1])
                pad_mask = key_padding_bias(~mask, dtype)
                positions = relative_positions(x.shape[1], x.shape[2], x.device)
            if recompute:
                x = torch.utils.checkpoint.checkpoint(
                    self._run_layer, layer, x, mask, positions, pad_mask, allowed, use_reentrant=False,
                    context_fn=_checkpoint_contexts,
                )  # fmt: skip
            else:
                x = self._run_layer(layer, x, mask, positions, pad_mask, allowed)
            if index in capture:
                hidden = x * mask[:, :, None]
                if condition is not None:
                    x = x + condition(hidden)
                # On half the frames, each frame twice: every captured output has the encoder output's frames.
                captured[index] = (
                    hidden if index not in self.reduced else _twice(hidden, full.shape[1]) * full[..., None]
                )
            if self.reduced and index == self.reduced.stop - 1:
                # The end of the temporal U-Net: the half-rate activation, each frame twice and projected, added to
                # the full-rate one it started from.
                x, mask, pad_mask = skip + _twice(self.time_recovery(x), skip.shape[1]), full, full_pad
                positions = full_positions
        return x * full[:, :, None], lengths, [captured[index] for index in capture]


def _twice(x: torch.Tensor, frames: int) -> torch.Tensor:
    """Half-rate frames (B, T', D) back to ``frames`` frames, each repeated twice (frame t reads half-rate frame
    t // 2, which is valid wherever t is)."""
    return x.repeat_interleave(2, dim=1)[:, :frames]
