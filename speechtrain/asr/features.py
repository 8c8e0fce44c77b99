"""Log-mel features, always computed in fp32 whatever the precision plugin."""

from dataclasses import dataclass

import torch
import torchaudio


@dataclass
class PreprocessorConfig:
    """Log-mel front-end (NeMo's FastConformer defaults).

    Attributes:
        n_mels: mel bands.
        window_size: analysis window in seconds.
        window_stride: hop in seconds.
        n_fft: FFT size.
        dither: white-noise amplitude added in training only (it would make evaluation non-deterministic).
    """

    n_mels: int = 80
    window_size: float = 0.025
    window_stride: float = 0.01
    n_fft: int = 512
    dither: float = 1e-5


class LogMelFeatures(torch.nn.Module):
    """Waveforms to per-utterance normalised log-mel features.

    Args:
        cfg: see :class:`PreprocessorConfig`.
        sample_rate: input sample rate in Hz.
    """

    def __init__(self, cfg: PreprocessorConfig, sample_rate: int) -> None:
        super().__init__()
        self.hop = int(round(cfg.window_stride * sample_rate))
        self.dither = cfg.dither
        self.mel = torchaudio.transforms.MelSpectrogram(
            sample_rate=sample_rate,
            n_fft=cfg.n_fft,
            win_length=int(round(cfg.window_size * sample_rate)),
            hop_length=self.hop,
            n_mels=cfg.n_mels,
            window_fn=torch.hann_window,
            pad_mode="constant",  # zeros past the end, exactly what batch padding adds: batched == per-utterance
        )

    def frame_lengths(self, audio_lens: torch.Tensor) -> torch.Tensor:
        """Feature frames of utterances of ``audio_lens`` samples (centred windows: one per hop, plus one)."""
        return audio_lens // self.hop + 1

    def forward(self, audio: torch.Tensor, audio_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Compute features.

        Args:
            audio: (B, T) waveforms, zero-padded.
            audio_lens: (B,) valid samples per waveform.

        Returns:
            features (B, n_mels, F) and their valid lengths (B,); padded frames are zero.
        """
        with torch.autocast(device_type=audio.device.type, enabled=False):
            audio = audio.float()
            if self.training and self.dither > 0:
                audio = audio + self.dither * torch.randn_like(audio)
            feats = torch.log(self.mel(audio) + 2.0**-24)  # (B, n_mels, F)
            lengths = self.frame_lengths(audio_lens)
            mask = torch.arange(feats.shape[-1], device=feats.device)[None, :] < lengths[:, None]  # (B, F)
            mask = mask[:, None, :]  # (B, 1, F)
            count = lengths[:, None, None].clamp(min=1)
            mean = (feats * mask).sum(-1, keepdim=True) / count
            var = (((feats - mean) * mask) ** 2).sum(-1, keepdim=True) / (count - 1).clamp(min=1)
            feats = (feats - mean) / (var.sqrt() + 1e-5) * mask
        return feats, lengths
