"""On-the-fly waveform augmentation for training loaders: speed perturbation, gain, and noise mixing.

Configured under a dataset node (``train_ds.augmentation``); each augmentation fires with its own probability::

    augmentation:
      speed: {factors: [0.9, 1.1], prob: 0.5}       # resample by a factor: tempo and pitch change together
      gain: {min_db: -6.0, max_db: 6.0, prob: 0.5}  # uniform in dB
      noise: {manifest_filepath: noise.json, min_snr_db: 5.0, max_snr_db: 30.0, prob: 0.5}

They are applied in that order (speed, gain, noise) to the decoded waveform, in the loader process. The random
draws are a function of (seed, epoch, utterance id) only, so a resumed run augments exactly as the uninterrupted
run did, whatever the number of loader workers. Speed perturbation changes an utterance's length after the
sampler has packed the batch by its metadata duration: a batch can hold up to ``max(factors)`` times fewer
seconds than ``batch_duration`` says, or ``1 / min(factors)`` times more.
"""

import logging
import os
import random
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import numpy as np
import soundfile as sf
import torch

logger = logging.getLogger("speechtrain.data")


@dataclass
class SpeedConfig:
    """Speed perturbation: with probability ``prob``, one of ``factors`` (uniformly); >1 is faster/shorter."""

    factors: list[float] = field(default_factory=lambda: [0.9, 1.1])
    prob: float = 0.5


@dataclass
class GainConfig:
    """Gain: with probability ``prob``, a gain drawn uniformly in [min_db, max_db] decibels."""

    min_db: float = -6.0
    max_db: float = 6.0
    prob: float = 0.5


@dataclass
class NoiseConfig:
    """Noise mixing: with probability ``prob``, a random segment of a random noise recording (NeMo manifest or
    lhotse cuts; looped when shorter than the utterance) added at an SNR drawn in [min_snr_db, max_snr_db]."""

    manifest_filepath: str | None = None
    cuts_path: str | None = None
    min_snr_db: float = 5.0
    max_snr_db: float = 30.0
    prob: float = 0.5


@dataclass
class AugmentationConfig:
    """Which augmentations to apply (none by default)."""

    speed: SpeedConfig | None = None
    gain: GainConfig | None = None
    noise: NoiseConfig | None = None

    def enabled(self) -> bool:
        return any(a is not None for a in (self.speed, self.gain, self.noise))


def _check_prob(name: str, prob: float) -> None:
    if not 0.0 <= prob <= 1.0:
        raise ValueError(f"augmentation.{name}.prob must be within [0, 1], got {prob}.")


def _resample(audio: torch.Tensor, orig: int, new: int) -> torch.Tensor:
    import torchaudio.functional

    return torchaudio.functional.resample(audio, orig, new)


def resample(audio: torch.Tensor, orig_rate: int, new_rate: int) -> torch.Tensor:
    """``audio`` (T,) at ``orig_rate`` Hz, band-limited resampled to ``new_rate`` Hz."""
    return audio if orig_rate == new_rate else _resample(audio, orig_rate, new_rate)


def change_speed(audio: torch.Tensor, factor: float) -> torch.Tensor:
    """Play ``audio`` ``factor`` times faster (length / factor), pitch shifted with it (Kaldi-style perturbation)."""
    ratio = Fraction(factor).limit_denominator(100)
    return audio if ratio == 1 else _resample(audio, ratio.numerator, ratio.denominator)


class Augmenter:
    """Applies an :class:`AugmentationConfig` to waveforms.

    Args:
        cfg: The augmentations and their probabilities.
        sample_rate: The rate of the waveforms it is given (noise is read and resampled to it).
        seed: Base seed; each utterance's draws come from ``(seed, epoch, utterance id)``.
    """

    def __init__(self, cfg: AugmentationConfig, sample_rate: int, seed: int = 0) -> None:
        self.cfg = cfg
        self.sample_rate = sample_rate
        self.seed = seed
        for name in ("speed", "gain", "noise"):
            sub = getattr(cfg, name)
            if sub is not None:
                _check_prob(name, sub.prob)
        if cfg.speed is not None and (not cfg.speed.factors or min(cfg.speed.factors) <= 0):
            raise ValueError(f"augmentation.speed.factors must be positive numbers, got {cfg.speed.factors}.")
        if cfg.gain is not None and cfg.gain.min_db > cfg.gain.max_db:
            raise ValueError("augmentation.gain.min_db is larger than max_db.")
        self._noise: list[dict[str, Any]] = []
        if cfg.noise is not None:
            self._noise = _noise_records(cfg.noise)
            if cfg.noise.min_snr_db > cfg.noise.max_snr_db:
                raise ValueError("augmentation.noise.min_snr_db is larger than max_snr_db.")
        self.noise_failures = 0

    def rng(self, epoch: int, utterance_id: str) -> random.Random:
        return random.Random(f"{self.seed}:{epoch}:{utterance_id}")

    def __call__(self, audio: torch.Tensor, epoch: int, utterance_id: str) -> torch.Tensor:
        """The augmented copy of ``audio`` (T,) for this utterance in this epoch."""
        rng = self.rng(epoch, utterance_id)
        speed, gain, noise = self.cfg.speed, self.cfg.gain, self.cfg.noise
        # Every draw is made whether or not it is used, so one augmentation's settings do not shift another's.
        speed_on, factor = rng.random() < (speed.prob if speed else 0.0), rng.choice(speed.factors if speed else [1])
        gain_on, gain_db = rng.random() < (gain.prob if gain else 0.0), rng.uniform(*(_range(gain, "db")))
        noise_on, snr_db = rng.random() < (noise.prob if noise else 0.0), rng.uniform(*(_range(noise, "snr_db")))
        noise_pick, noise_start = rng.randrange(max(len(self._noise), 1)), rng.random()
        if speed_on:
            audio = change_speed(audio, factor)
        if gain_on:
            audio = audio * 10.0 ** (gain_db / 20.0)
        if noise_on and self._noise:
            noise_audio = self._read_noise(self._noise[noise_pick], audio.shape[0], noise_start)
            if noise_audio is not None:
                audio = mix_at_snr(audio, noise_audio, snr_db)
        return audio

    def _read_noise(self, record: dict[str, Any], length: int, start: float) -> torch.Tensor | None:
        path = record["audio_filepath"]
        try:
            with sf.SoundFile(path) as f:
                rate = f.samplerate
                total = f.frames if record["duration"] is None else min(f.frames, round(record["duration"] * rate))
                first = round(record["offset"] * rate)
                want = int(np.ceil(length * rate / self.sample_rate)) + 1
                skip = int(start * max(total - want, 0))
                f.seek(min(first + skip, f.frames))
                data = f.read(min(want, total), dtype="float32", always_2d=True).mean(axis=1)
        except (RuntimeError, OSError, ValueError) as e:
            self.noise_failures += 1
            if self.noise_failures == 1:
                logger.warning("noise file %s cannot be read (%s); such utterances are left without noise", path, e)
            return None
        noise = resample(torch.from_numpy(data), rate, self.sample_rate)
        if noise.numel() == 0 or not torch.isfinite(noise).all():
            return None
        repeats = -(-length // noise.shape[0])
        return noise.repeat(repeats)[:length]


def _range(sub: Any, suffix: str) -> tuple[float, float]:
    if sub is None:
        return (0.0, 0.0)
    return (getattr(sub, f"min_{suffix}"), getattr(sub, f"max_{suffix}"))


def mix_at_snr(audio: torch.Tensor, noise: torch.Tensor, snr_db: float) -> torch.Tensor:
    """``audio + k * noise`` with k chosen so that the signal-to-noise power ratio is ``snr_db`` decibels."""
    signal_power = audio.pow(2).mean()
    noise_power = noise.pow(2).mean()
    if noise_power <= 0 or signal_power <= 0:
        return audio
    scale = torch.sqrt(signal_power / (noise_power * 10.0 ** (snr_db / 10.0)))
    return audio + scale * noise


def _noise_records(cfg: NoiseConfig) -> list[dict[str, Any]]:
    from speechtrain.data.manifest import read_nemo_manifest

    if bool(cfg.manifest_filepath) == bool(cfg.cuts_path):
        raise ValueError("augmentation.noise needs exactly one of manifest_filepath or cuts_path.")
    if cfg.manifest_filepath:
        records = [
            {"audio_filepath": r["audio_filepath"], "offset": r["offset"], "duration": r["duration"]}
            for r in read_nemo_manifest(cfg.manifest_filepath)
        ]
    else:
        from lhotse import CutSet

        records = []
        for cut in CutSet.from_file(cfg.cuts_path):
            source = cut.recording.sources[0]
            if source.type != "file":
                raise ValueError(f"augmentation.noise.cuts_path: cut {cut.id} is not backed by a file.")
            records.append({"audio_filepath": source.source, "offset": cut.start, "duration": cut.duration})
    missing = [r["audio_filepath"] for r in records if not os.path.isfile(r["audio_filepath"])]
    if missing:
        logger.warning("augmentation.noise: %d of %d noise files are missing, e.g. %s", len(missing), len(records),
                       missing[0])  # fmt: skip
        records = [r for r in records if os.path.isfile(r["audio_filepath"])]
    if not records:
        raise ValueError("augmentation.noise: no readable noise recordings.")
    return records
