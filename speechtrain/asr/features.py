"""Log-mel features, always computed in fp32 whatever the precision plugin.

Two front-ends (``PreprocessorConfig.kind``):

- ``torchaudio`` (the default): torchaudio's HTK mel spectrogram, log with a 2^-24 guard, per-utterance
  normalisation of each band.
- ``nemo``: NeMo's ``AudioToMelSpectrogramPreprocessor`` step for step, so that imported ``.nemo`` models see the
  features they were trained on: pre-emphasis, a symmetric Hann window, the power spectrum through a Slaney mel
  filterbank held as a buffer (imported models load NeMo's stored one), log with a 2^-24 guard, per-feature
  normalisation over the valid frames, padded frames zeroed, the time axis padded to a multiple of ``pad_to``.
  Frame count ``samples // hop`` (NeMo 3.0's; its last, half-empty STFT frame counts as padding).
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torchaudio

KINDS = ("torchaudio", "nemo")


@dataclass
class PreprocessorConfig:
    """Log-mel front-end (NeMo's FastConformer defaults).

    Attributes:
        n_mels: mel bands.
        window_size: analysis window in seconds.
        window_stride: hop in seconds.
        n_fft: FFT size.
        dither: white-noise amplitude added in training only (it would make evaluation non-deterministic).
        kind: ``torchaudio`` or ``nemo`` (see the module docstring).
        preemph: pre-emphasis coefficient (``nemo`` only; 0 turns it off).
        pad_to: pad the feature frames to a multiple of this (``nemo`` only; 0: no padding). Padded frames are
            zero and never change valid outputs.
        normalize: ``per_feature`` (each mel band of each utterance to zero mean, unit deviation over its frames) or
            ``none`` (the log-mel values as they are). Streaming models need ``none``: per-utterance statistics
            are not known until the utterance ends.
    """

    n_mels: int = 80
    window_size: float = 0.025
    window_stride: float = 0.01
    n_fft: int = 512
    dither: float = 1e-5
    kind: str = "torchaudio"
    preemph: float = 0.97
    pad_to: int = 0
    normalize: str = "per_feature"


NORMALIZE = ("per_feature", "none")


def build_preprocessor(cfg: PreprocessorConfig, sample_rate: int) -> torch.nn.Module:
    """The front-end that ``cfg.kind`` names."""
    if cfg.normalize not in NORMALIZE:
        raise ValueError(f"preprocessor.normalize must be one of {', '.join(NORMALIZE)}, got {cfg.normalize!r}.")
    if cfg.kind == "nemo":
        return NemoMelFeatures(cfg, sample_rate)
    if cfg.kind == "torchaudio":
        return LogMelFeatures(cfg, sample_rate)
    raise ValueError(f"preprocessor.kind must be one of {', '.join(KINDS)}, got {cfg.kind!r}.")


class LogMelFeatures(torch.nn.Module):
    """Waveforms to per-utterance normalised log-mel features.

    Args:
        cfg: see :class:`PreprocessorConfig`.
        sample_rate: input sample rate in Hz.
    """

    keep_fp32 = True  # features are computed in fp32 whatever the precision (bf16-true leaves these buffers fp32)

    def __init__(self, cfg: PreprocessorConfig, sample_rate: int) -> None:
        super().__init__()
        self.hop = int(round(cfg.window_stride * sample_rate))
        self.n_fft = cfg.n_fft
        self.dither = cfg.dither
        self.normalize = cfg.normalize
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
            # Centred windows: half a window of zeros on each side, then uncentred frames (what streaming computes).
            feats = self.log_mel_frames(F.pad(audio, (self.n_fft // 2, self.n_fft // 2)))  # (B, n_mels, F)
            lengths = self.frame_lengths(audio_lens)
            feats = _normalise_valid_frames(feats, lengths, self.normalize)
        return feats, lengths

    def emphasis(self, audio: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """No pre-emphasis here: ``audio`` as it is (``previous``, the sample before it, is not needed)."""
        return audio

    def log_mel_frames(self, audio: torch.Tensor) -> torch.Tensor:
        """Log-mel frames of (B, N) samples, one per hop of windows that fit whole: (B, n_mels, (N - n_fft) // hop +
        1), fp32, not normalised. The offline features are those of the audio with ``n_fft // 2`` zeros each side."""
        spec = torchaudio.functional.spectrogram(
            audio.float(), 0, self.mel.spectrogram.window, self.n_fft, self.hop, self.mel.spectrogram.win_length,
            power=2.0, normalized=False, center=False,
        )  # fmt: skip
        return torch.log(self.mel.mel_scale(spec) + 2.0**-24)


def _normalise_valid_frames(feats: torch.Tensor, lengths: torch.Tensor, normalize: str) -> torch.Tensor:
    """Each band of each utterance to zero mean, unit (unbiased) deviation + 1e-5 over its valid frames (``normalize``
    ``per_feature``; ``none`` leaves them); padded frames zeroed. feats (B, n_mels, F), lengths (B,)."""
    mask = (torch.arange(feats.shape[-1], device=feats.device)[None, :] < lengths[:, None])[:, None, :]  # (B, 1, F)
    if normalize == "none":
        return feats * mask
    count = lengths[:, None, None].clamp(min=1)
    mean = (feats * mask).sum(-1, keepdim=True) / count
    var = (((feats - mean) * mask) ** 2).sum(-1, keepdim=True) / (count - 1).clamp(min=1)
    return (feats - mean) / (var.sqrt() + 1e-5) * mask


class NemoMelFeatures(torch.nn.Module):
    """NeMo's mel front-end (``kind: nemo``; see the module docstring). Buffers ``window`` (win,) and ``fb``
    (1, n_mels, n_fft // 2 + 1), named and shaped as in NeMo's ``preprocessor.featurizer``.

    Args:
        cfg: see :class:`PreprocessorConfig`.
        sample_rate: input sample rate in Hz.
    """

    keep_fp32 = True  # features are computed in fp32 whatever the precision

    def __init__(self, cfg: PreprocessorConfig, sample_rate: int) -> None:
        super().__init__()
        # NeMo truncates the window and hop to whole samples (int(), not round()).
        self.win_length = int(cfg.window_size * sample_rate)
        self.hop = int(cfg.window_stride * sample_rate)
        self.n_fft = cfg.n_fft or 2 ** math.ceil(math.log2(self.win_length))
        if self.win_length > self.n_fft:
            raise ValueError(f"preprocessor: window_size={cfg.window_size} s is {self.win_length} samples, more than "
                             f"n_fft={self.n_fft}.")  # fmt: skip
        self.dither, self.preemph, self.pad_to, self.normalize = cfg.dither, cfg.preemph, cfg.pad_to, cfg.normalize
        self.register_buffer("window", torch.hann_window(self.win_length, periodic=False))
        fb = torchaudio.functional.melscale_fbanks(
            self.n_fft // 2 + 1, 0.0, sample_rate / 2, cfg.n_mels, sample_rate, norm="slaney", mel_scale="slaney"
        )  # (n_freqs, n_mels)
        self.register_buffer("fb", fb.T.unsqueeze(0).contiguous())  # (1, n_mels, n_freqs)

    def frame_lengths(self, audio_lens: torch.Tensor) -> torch.Tensor:
        """Valid feature frames of utterances of ``audio_lens`` samples."""
        return audio_lens // self.hop

    def forward(self, audio: torch.Tensor, audio_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """audio (B, T) zero-padded, audio_lens (B,) -> features (B, n_mels, F) (padded frames zero), lengths (B,)."""
        with torch.autocast(device_type=audio.device.type, enabled=False):
            audio = audio.float()
            if self.training and self.dither > 0:
                audio = audio + self.dither * torch.randn_like(audio)
            if self.preemph:
                valid = torch.arange(audio.shape[1], device=audio.device)[None, :] < audio_lens[:, None]
                audio = self.emphasis(audio, torch.zeros_like(audio[:, :1])) * valid
            # Centred windows: half a window of zeros on each side, then uncentred frames (what streaming computes).
            feats = self.log_mel_frames(F.pad(audio, (self.n_fft // 2, self.n_fft // 2)))  # (B, n_mels, F)
            lengths = self.frame_lengths(audio_lens)
            feats = _normalise_valid_frames(feats, lengths, self.normalize)
            if self.pad_to > 0 and feats.shape[-1] % self.pad_to:
                feats = torch.nn.functional.pad(feats, (0, self.pad_to - feats.shape[-1] % self.pad_to))
        return feats, lengths

    def emphasis(self, audio: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """Pre-emphasis of (B, N) samples, ``previous`` (B, 1) the sample before them (zeros at the start of an
        utterance: NeMo keeps the first sample unchanged)."""
        if not self.preemph:
            return audio
        return audio - self.preemph * torch.cat([previous, audio[:, :-1]], dim=1)

    def log_mel_frames(self, audio: torch.Tensor) -> torch.Tensor:
        """Log-mel frames of (B, N) pre-emphasised samples, one per hop of windows that fit whole: (B, n_mels,
        (N - n_fft) // hop + 1), fp32, not normalised."""
        spec = torch.stft(audio.float(), self.n_fft, self.hop, self.win_length, self.window, center=False,
                          return_complex=True)  # fmt: skip
        power = torch.view_as_real(spec).pow(2).sum(-1).sqrt().pow(2)  # (B, n_freqs, F), as NeMo rounds it
        return torch.log(torch.matmul(self.fb, power) + 2.0**-24)  # (B, n_mels, F)
