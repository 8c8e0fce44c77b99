"""The Conformer's convolutional subsampling: 2-D convolutions of stride 2 over (time, mel bands), ``striding`` (full
convolutions) or ``dw_striding`` (FastConformer's: one full convolution, then depthwise-separable ones), then a
linear projection to the model width. ``causal`` pads each convolution as NeMo's ``causal_downsampling`` does, so
that no output frame reads a later feature frame (streaming).

Padding never changes valid outputs: each convolution sees zeros past each utterance's end.
"""

import math

import torch
import torch.nn.functional as F

from speechtrain import backends


def frame_mask(lengths: torch.Tensor, frames: int) -> torch.Tensor:
    """(B, frames) bool, True on valid frames."""
    return torch.arange(frames, device=lengths.device)[None, :] < lengths[:, None]


def _conv_out_length(lengths: torch.Tensor) -> torch.Tensor:
    """Output length of a kernel-3, stride-2, padding-1 convolution (a tensor's or a NumPy array's: host-side
    lengths are computed the same way)."""
    return (lengths - 1) // 2 + 1


def _causal_conv_out_length(lengths: torch.Tensor) -> torch.Tensor:
    """Output length of a kernel-3, stride-2 convolution padded 2 before and 1 after (causal subsampling)."""
    return lengths // 2 + 1


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
        causal: pad each convolution 2 before and 1 after (time and frequency) instead of 1 and 1, so that output
            frame t reads features up to ``factor * t`` only (NeMo's ``causal_downsampling``).
    """

    def __init__(self, kind: str, factor: int, n_mels: int, channels: int, d_model: int, causal: bool = False) -> None:
        super().__init__()
        if kind not in ("striding", "dw_striding"):
            raise ValueError(f"encoder.subsampling must be 'striding' or 'dw_striding', got {kind!r}.")
        if factor < 2 or factor & (factor - 1):
            raise ValueError(f"encoder.subsampling_factor must be a power of 2 (>= 2), got {factor}.")
        steps = int(math.log2(factor))
        layers: list[torch.nn.Module] = []
        in_channels = 1
        padding = 0 if causal else 1  # causal: padded explicitly (asymmetric) in forward
        for step in range(steps):
            if kind == "striding" or step == 0:
                layers.append(torch.nn.Conv2d(in_channels, channels, kernel_size=3, stride=2, padding=padding))
            else:
                layers.append(torch.nn.Sequential(
                    torch.nn.Conv2d(channels, channels, kernel_size=3, stride=2, padding=padding, groups=channels),
                    torch.nn.Conv2d(channels, channels, kernel_size=1),
                ))  # fmt: skip
            in_channels = channels
        self.convs = torch.nn.ModuleList(layers)
        self.causal = causal
        self._out_length = _causal_conv_out_length if causal else _conv_out_length
        bands = n_mels
        for _ in range(steps):
            bands = self._out_length(bands)
        self.out = torch.nn.Linear(channels * bands, d_model)

    def output_lengths(self, lengths: torch.Tensor) -> torch.Tensor:
        """The frames :meth:`forward` leaves of ``lengths`` feature frames (any device: the arithmetic alone)."""
        for _ in self.convs:
            lengths = self._out_length(lengths)
        return lengths

    def receptive_field(self) -> tuple[int, int]:
        """Feature frames before and after ``factor * t`` that output frame t reads."""
        factor = 2 ** len(self.convs)
        return (2 * (factor - 1), 0) if self.causal else (factor - 1, factor - 1)

    def forward(self, feats: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Channels-last (B, F, bands, C) memory is what the oneDNN and cuDNN kernels of these convolutions run
        # fastest on. The weights keep their layout; the first convolution's output sets the layout of the rest.
        x = feats.transpose(1, 2)  # (B, n_mels, F) -> (B, F, n_mels)
        x = x * frame_mask(lengths, x.shape[1])[:, :, None]
        for index, conv in enumerate(self.convs):
            lengths = self._out_length(lengths)
            if index == 0:
                x = _first_conv(conv, x, lengths, (2, 1) if self.causal else (1, 1))
                continue
            if self.causal:
                x = F.pad(x, (2, 1, 2, 1))  # (B, C, F, bands): 2 before and 1 after, on both axes
            x = backends.conv2d(conv, x) if isinstance(conv, torch.nn.Conv2d) else conv(x)
            _zero_first_padded_frame(x, lengths)
            x = x.relu_()  # in place: the convolution's backward does not need its output
        batch, channels, frames, bands = x.shape
        x = self.out(x.transpose(1, 2).reshape(batch, frames, channels * bands))  # (B, F', C*bands) -> (B, F', D)
        return x, lengths


def _first_conv(conv: torch.nn.Conv2d, x: torch.Tensor, lengths: torch.Tensor, pad: tuple[int, int]) -> torch.Tensor:
    """``conv`` (1 -> C channels, kernel 3, stride 2, padding ``pad``: before, after on both axes) of x (B, F,
    n_mels) as one matrix product of the
    3 x 3 patches, its first padded frame zeroed and rectified (``lengths``: the output's): (B, C, F', bands) in
    channels-last memory. Faster than the convolution kernel for a single input channel, and its
    channels-last output is what makes the next convolutions take their fast kernels (a one-channel input leaves
    the convolution's output layout ambiguous, and PyTorch picks NCHW). The in-place ReLU acts on the product
    itself: on a view of it, autograd would copy the whole activation back in the backward pass."""
    x = F.pad(x, (*pad, *pad))  # (B, F + pad, n_mels + pad)
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
