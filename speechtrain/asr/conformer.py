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

Padding never changes valid outputs: every convolution sees zeros past each utterance's end, attention never looks at
them, and the ``batch_norm`` option of the convolution module takes its statistics over valid frames only (in eval
mode, it uses running statistics, so batched and per-utterance outputs agree exactly).
"""

import contextlib
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from speechtrain import backends
from speechtrain.lightning import parallel_state
from speechtrain.nn.dropout import Dropout
from speechtrain.nn.init import seeded
from speechtrain.nn.parallel import ColumnParallelLinear, RowParallelLinear
from speechtrain.nn.transformer import FeedForward, MultiHeadAttention, relative_positions


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


def frame_mask(lengths: torch.Tensor, frames: int) -> torch.Tensor:
    """(B, frames) bool, True on valid frames."""
    return torch.arange(frames, device=lengths.device)[None, :] < lengths[:, None]


def _conv_out_length(lengths: torch.Tensor) -> torch.Tensor:
    """Output length of a kernel-3, stride-2, padding-1 convolution (a tensor's or a NumPy array's: host-side
    lengths are computed the same way)."""
    return (lengths - 1) // 2 + 1


def subsampled_lengths(lengths: torch.Tensor, factor: int) -> torch.Tensor:
    """Frames left of ``lengths`` after ``factor``x subsampling (log2(factor) stride-2 convolutions)."""
    for _ in range(int(math.log2(factor))):
        lengths = _conv_out_length(lengths)
    return lengths


class Subsampling(torch.nn.Module):
    """(B, n_mels, F) features -> (B, F / factor, d_model), with lengths.

    Args:
        kind: ``striding`` or ``dw_striding``.
        factor: power of two.
        n_mels: feature bands.
        channels: convolution channels.
        d_model: output width.
    """

    def __init__(self, kind: str, factor: int, n_mels: int, channels: int, d_model: int) -> None:
        super().__init__()
        if kind not in ("striding", "dw_striding"):
            raise ValueError(f"encoder.subsampling must be 'striding' or 'dw_striding', got {kind!r}.")
        if factor < 2 or factor & (factor - 1):
            raise ValueError(f"encoder.subsampling_factor must be a power of 2 (>= 2), got {factor}.")
        steps = int(math.log2(factor))
        layers: list[torch.nn.Module] = []
        in_channels = 1
        for step in range(steps):
            if kind == "striding" or step == 0:
                layers.append(torch.nn.Conv2d(in_channels, channels, kernel_size=3, stride=2, padding=1))
            else:
                layers.append(torch.nn.Sequential(
                    torch.nn.Conv2d(channels, channels, kernel_size=3, stride=2, padding=1, groups=channels),
                    torch.nn.Conv2d(channels, channels, kernel_size=1),
                ))  # fmt: skip
            in_channels = channels
        self.convs = torch.nn.ModuleList(layers)
        bands = n_mels
        for _ in range(steps):
            bands = (bands - 1) // 2 + 1
        self.out = torch.nn.Linear(channels * bands, d_model)

    def output_lengths(self, lengths: torch.Tensor) -> torch.Tensor:
        """The frames :meth:`forward` leaves of ``lengths`` feature frames (any device: the arithmetic alone)."""
        for _ in self.convs:
            lengths = _conv_out_length(lengths)
        return lengths

    def forward(self, feats: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Channels-last (B, F, bands, C) memory is what the oneDNN and cuDNN kernels of these convolutions run
        # fastest on. The weights keep their layout; the first convolution's output sets the layout of the rest.
        x = feats.transpose(1, 2)  # (B, n_mels, F) -> (B, F, n_mels)
        x = x * frame_mask(lengths, x.shape[1])[:, :, None]
        for index, conv in enumerate(self.convs):
            lengths = _conv_out_length(lengths)
            if index == 0:
                x = _first_conv(conv, x, lengths)
                continue
            x = backends.conv2d(conv, x) if isinstance(conv, torch.nn.Conv2d) else conv(x)
            _zero_first_padded_frame(x, lengths)
            x = x.relu_()  # in place: the convolution's backward does not need its output
        batch, channels, frames, bands = x.shape
        x = self.out(x.transpose(1, 2).reshape(batch, frames, channels * bands))  # (B, F', C*bands) -> (B, F', D)
        return x, lengths


def _first_conv(conv: torch.nn.Conv2d, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``conv`` (1 -> C channels, kernel 3, stride 2, padding 1) of x (B, F, n_mels) as one matrix product of the
    3 x 3 patches, its first padded frame zeroed and rectified (``lengths``: the output's): (B, C, F', bands) in
    channels-last memory. Faster than the convolution kernel for a single input channel, and its
    channels-last output is what makes the next convolutions take their fast kernels (a one-channel input leaves
    the convolution's output layout ambiguous, and PyTorch picks NCHW). The in-place ReLU acts on the product
    itself: on a view of it, autograd would copy the whole activation back in the backward pass."""
    x = F.pad(x, (1, 1, 1, 1))  # (B, F + 2, n_mels + 2)
    batch, frames, bands = x.shape
    out_frames, out_bands = (frames - 3) // 2 + 1, (bands - 3) // 2 + 1
    s = x.stride()
    patches = x.as_strided((batch, out_frames, out_bands, 3, 3), (s[0], 2 * s[1], 2 * s[2], s[1], s[2]))
    # (C, 1, 3, 3) -> (9, C), contiguous: the weight gradient is then computed as patches^T @ grad, not as the
    # slower (grad^T @ patches)^T that autograd picks for a transposed view.
    weight = conv.weight.view(conv.out_channels, 9).t().contiguous()
    out = torch.addmm(conv.bias, patches.reshape(-1, 9), weight)  # (B * F' * bands, C)
    _zero_first_padded_frame(out.view(batch, out_frames, out_bands, -1), lengths, time_dim=1)
    return out.relu_().view(batch, out_frames, out_bands, -1).permute(0, 3, 1, 2)  # (B, C, F', bands)


def _zero_first_padded_frame(x: torch.Tensor, lengths: torch.Tensor, time_dim: int = 2) -> None:
    """Zero frame ``lengths[b]`` of each utterance of ``x`` (B, C, F, bands; frames on ``time_dim``) that has one,
    in place, before a ReLU.

    A kernel-3, stride-2, padding-1 convolution's last valid output reads at most one frame past its input's valid
    end, so this one frame is all the padding a valid output can see: valid outputs are as if unpadded (later
    frames are never read by them, and the encoder ignores padded frames), at the cost of B frames instead of a
    pass over the whole (largest) activation. Outside autograd: the ReLU that follows has output 0 there, so its
    backward already gives these frames the zero gradient that multiplying by 0 would (tracking the indexing would
    cost two passes over the activation in the backward). No host synchronisation: an utterance without padding
    rewrites its last frame with itself.
    """
    frames = x.shape[time_dim]
    index = lengths.clamp(max=frames - 1)
    keep = (lengths >= frames).to(x.dtype)[:, None, None]  # (B, 1, 1)
    batch = torch.arange(x.shape[0], device=x.device)
    view = x.movedim(time_dim, 1)  # (B, F, ...): the frames to zero are view[batch, index]
    with torch.no_grad():
        view[batch, index] = view[batch, index] * keep  # (B, C, bands) or (B, bands, C) frames


class MaskedBatchNorm1d(torch.nn.BatchNorm1d):
    """Batch norm over (B, C, T) whose training statistics use valid frames only."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if not self.training:
            return super().forward(x)
        batch, channels, frames = x.shape
        valid = mask.view(batch, 1, frames).to(x.dtype)
        count = valid.sum().clamp(min=1)
        mean = (x * valid).sum(dim=(0, 2)) / count
        centered = x - mean.view(1, channels, 1)  # (shared with the normalisation: one pass and its backward fewer)
        var = ((centered * valid) ** 2).sum(dim=(0, 2)) / count
        if not getattr(_recomputing, "active", False):  # activation recomputation: counted in the first forward
            with torch.no_grad():
                unbiased = var * count / (count - 1).clamp(min=1)
                self.running_mean.lerp_(mean.detach().to(self.running_mean.dtype), self.momentum)
                self.running_var.lerp_(unbiased.detach().to(self.running_var.dtype), self.momentum)
                self.num_batches_tracked += 1
        std = torch.sqrt(var + self.eps).view(1, channels, 1)
        return centered / std * self.weight.view(1, channels, 1) + self.bias.view(1, channels, 1)


def _depthwise_over_time(conv: torch.nn.Conv1d, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The depthwise ``conv`` over the frames of x (B, T, D), zeros past each utterance's end (``mask`` (B, T): True
    on valid frames), as a (k x 1) Conv2d on channels-last memory, which (B, T, D) already is: no transposed copies,
    and the channels-last depthwise kernels (much faster than Conv1d's). Returns (B, D, T')."""
    batch, frames, channels = x.shape
    x = (x * mask.view(batch, frames, 1)).view(batch, frames, 1, channels).permute(0, 3, 1, 2)  # -> (B, D, T, 1)
    weight, stride, padding = conv.weight.view(*conv.weight.shape, 1), (conv.stride[0], 1), (conv.padding[0], 0)
    out = backends.depthwise_conv2d(x, weight, conv.bias, stride, padding)  # (B, D, T', 1)
    return out.view(out.shape[:3])


class ConvolutionModule(torch.nn.Module):
    """Pointwise (2x, GLU) -> depthwise conv -> norm -> Swish -> pointwise, on (B, T, D).

    The first pointwise layer is column-parallel with a gathered output (the GLU pairs channel i with i + D), the
    depthwise convolution and norm run on all channels, and the last pointwise layer is row-parallel.
    """

    def __init__(self, d_model: int, kernel_size: int, norm_type: str, dropout: float) -> None:
        super().__init__()
        if kernel_size % 2 == 0:
            raise ValueError(f"encoder.conv_kernel_size must be odd, got {kernel_size}.")
        if norm_type not in ("batch_norm", "layer_norm"):
            raise ValueError(f"encoder.conv_norm_type must be 'batch_norm' or 'layer_norm', got {norm_type!r}.")
        self.pointwise_in = ColumnParallelLinear(d_model, 2 * d_model, gather_output=True)
        self.depthwise = torch.nn.Conv1d(d_model, d_model, kernel_size, padding=kernel_size // 2, groups=d_model)
        self.norm_type = norm_type
        self.norm = MaskedBatchNorm1d(d_model) if norm_type == "batch_norm" else torch.nn.LayerNorm(d_model)
        self.pointwise_out = RowParallelLinear(d_model, d_model, input_is_parallel=False)
        self.dropout = Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x (B, T, D), mask (B, T) True on valid frames -> (B, T, D)."""
        x = F.glu(self.pointwise_in(x), dim=-1)  # (B, T, 2D) -> (B, T, D)
        x = _depthwise_over_time(self.depthwise, x, mask)  # (B, D, T)
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
        self.conv = ConvolutionModule(d, cfg.conv_kernel_size, cfg.conv_norm_type, cfg.dropout)
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
    ) -> torch.Tensor:
        """x (B, T, D), mask (B, T) True on valid frames, positions (2T-1, D) relative-position encodings (computed
        by the attention when None), pad_mask ``~mask`` (computed here when None; the encoder makes it once for
        all layers) -> (B, T, D)."""
        x = torch.add(x, self.dropout(self.ff1(self.ff1_norm(x))), alpha=0.5)  # one operator for x + 0.5 * ff
        pad_mask = ~mask if pad_mask is None else pad_mask
        x = x + self.dropout(self.attention(self.attn_norm(x), pad_mask=pad_mask, positions=positions))
        x = x + self.conv(self.conv_norm(x), mask)
        x = torch.add(x, self.dropout(self.ff2(self.ff2_norm(x))), alpha=0.5)
        return self.out_norm(x)


def _run_layer(
    layer: ConformerLayer, x: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, pad_mask: torch.Tensor
) -> torch.Tensor:
    return layer(x, mask, positions, pad_mask)


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
            self.subsampling = Subsampling(cfg.subsampling, cfg.subsampling_factor, n_mels, channels, cfg.d_model)
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
        pad_mask = ~mask
        positions = relative_positions(x.shape[1], x.shape[2], x.device)  # once for all layers (of a frame rate)
        full, full_pad = mask, pad_mask  # the output's frame mask
        recompute = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        for index, layer in enumerate(self.layers):
            if self.reduced and index == self.reduced.start:
                skip, full_positions = x, positions
                x = self.time_reduction(x, mask)
                mask = frame_mask(_conv_out_length(lengths), x.shape[1])
                pad_mask = ~mask
                positions = relative_positions(x.shape[1], x.shape[2], x.device)
            if recompute:
                x = torch.utils.checkpoint.checkpoint(
                    self._run_layer, layer, x, mask, positions, pad_mask, use_reentrant=False,
                    context_fn=_checkpoint_contexts,
                )  # fmt: skip
            else:
                x = self._run_layer(layer, x, mask, positions, pad_mask)
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
