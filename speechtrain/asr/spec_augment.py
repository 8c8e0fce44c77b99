"""SpecAugment: random frequency and time masks on log-mel features, in training only."""

from dataclasses import dataclass

import torch


@dataclass
class SpecAugmentConfig:
    """Masks per utterance (NeMo's names).

    Attributes:
        freq_masks: number of frequency masks.
        freq_width: maximum width of a frequency mask, in mel bands.
        time_masks: number of time masks.
        time_width: maximum width of a time mask: frames if >= 1, else a fraction of each utterance's length.
    """

    freq_masks: int = 2
    freq_width: int = 27
    time_masks: int = 10
    time_width: float = 0.05


class SpecAugment(torch.nn.Module):
    """Zero random bands of ``(B, n_mels, F)`` features (the features are normalised, so zero is their mean).

    Masks are drawn per utterance inside its valid length; padded frames stay zero. Identity in eval mode.
    """

    def __init__(self, cfg: SpecAugmentConfig) -> None:
        super().__init__()
        if cfg.time_width < 0 or cfg.freq_width < 0 or cfg.freq_masks < 0 or cfg.time_masks < 0:
            raise ValueError("spec_augment widths and mask counts must be non-negative.")
        self.cfg = cfg

    @torch.no_grad()
    def forward(self, feats: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """feats (B, n_mels, F), lengths (B,) -> masked copy of feats."""
        if not self.training or (self.cfg.freq_masks == 0 and self.cfg.time_masks == 0):
            return feats
        batch, n_mels, frames = feats.shape
        device = feats.device
        keep = torch.ones(batch, n_mels, frames, dtype=torch.bool, device=device)
        mel_index = torch.arange(n_mels, device=device)[None, :]
        frame_index = torch.arange(frames, device=device)[None, :]
        for _ in range(self.cfg.freq_masks):
            width = torch.randint(0, self.cfg.freq_width + 1, (batch, 1), device=device)
            start = (torch.rand(batch, 1, device=device) * (n_mels - width + 1)).floor()
            keep &= ~((mel_index >= start) & (mel_index < start + width))[:, :, None]
        lengths = lengths.to(device)
        if self.cfg.time_width >= 1:
            max_width = torch.full((batch,), int(self.cfg.time_width), device=device)
        else:
            max_width = (lengths.float() * self.cfg.time_width).floor().long()
        max_width = torch.minimum(max_width, lengths)
        for _ in range(self.cfg.time_masks):
            width = (torch.rand(batch, device=device) * (max_width + 1).float()).floor()[:, None]
            start = (torch.rand(batch, 1, device=device) * (lengths[:, None] - width + 1).float()).floor()
            keep &= ~((frame_index >= start) & (frame_index < start + width))[:, None, :]
        return feats * keep
