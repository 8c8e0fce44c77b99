"""On-the-fly waveform augmentation for training loaders: what closes part of the gap between synthesisers and
people (speaker, room, noise, channel).

Configured under a dataset node (``train_ds.augmentation``); each augmentation fires with its own probability::

    augmentation:
      speed: {factors: [0.9, 1.1], prob: 0.5}       # resample by a factor: tempo and pitch change together
      pitch: {min_factor: 0.9, max_factor: 1.12, prob: 0.5}  # pitch and formants (vocal-tract length), tempo kept
      reverb: {min_rt60: 0.15, max_rt60: 0.7, min_drr_db: 0.0, max_drr_db: 15.0, prob: 0.3}  # a simulated room
      gain: {min_db: -6.0, max_db: 6.0, prob: 0.5}  # uniform in dB
      noise: {manifest_filepath: noise.json, min_snr_db: 5.0, max_snr_db: 30.0, prob: 0.5}  # no manifest: coloured
      eq: {bands: 3, max_db: 10.0, prob: 0.3}       # random peaking filters (microphones, rooms)
      band_limit: {min_low_hz: 50, max_low_hz: 400, min_high_hz: 3000, max_high_hz: 7500, prob: 0.2}
      telephone: {prob: 0.1}                        # 300-3400 Hz, 8 kHz, G.711 mu-law, and back

They are applied in that order to the decoded waveform, in the loader process. The random
draws are a function of (seed, epoch, utterance id) only, so a resumed run augments exactly as the uninterrupted
run did, whatever the number of loader workers. Speed perturbation changes an utterance's length after the
sampler has packed the batch by its metadata duration: a batch can hold up to ``max(factors)`` times fewer
seconds than ``batch_duration`` says, or ``1 / min(factors)`` times more.
"""

import logging
import math
import os
import random
from dataclasses import dataclass, field, fields
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
    lhotse cuts; looped when shorter than the utterance) added at an SNR drawn in [min_snr_db, max_snr_db]. With
    neither a manifest nor cuts, generated coloured noise: power spectrum ~ 1/f^beta, beta uniform in
    [min_exponent, max_exponent] (0 white, 1 pink, 2 brown)."""

    manifest_filepath: str | None = None
    cuts_path: str | None = None
    min_snr_db: float = 5.0
    max_snr_db: float = 30.0
    prob: float = 0.5
    min_exponent: float = 0.0
    max_exponent: float = 2.0


@dataclass
class PitchConfig:
    """Pitch and vocal-tract-length perturbation: with probability ``prob``, every frequency (pitch and formants) is
    scaled by a factor drawn uniformly in [min_factor, max_factor] while the duration stays (resampling, then a
    phase-vocoder time stretch back to the original length)."""

    min_factor: float = 0.9
    max_factor: float = 1.12
    prob: float = 0.5


@dataclass
class ReverbConfig:
    """A simulated room: with probability ``prob``, the utterance convolved with a synthetic impulse response (the
    direct path plus exponentially decaying, low-passed noise reaching -60 dB after RT60 seconds, RT60 uniform in
    [min_rt60, max_rt60]; direct-to-reverberant energy ratio uniform in [min_drr_db, max_drr_db])."""

    min_rt60: float = 0.15
    max_rt60: float = 0.7
    min_drr_db: float = 0.0
    max_drr_db: float = 15.0
    prob: float = 0.3


@dataclass
class EqConfig:
    """Random equaliser: with probability ``prob``, ``bands`` peaking filters at log-uniform centres (100 Hz - 6 kHz),
    gains uniform in [-max_db, max_db], Q uniform in [0.5, 2]."""

    bands: int = 3
    max_db: float = 10.0
    prob: float = 0.3


@dataclass
class BandLimitConfig:
    """Band limiting: with probability ``prob``, a high-pass at a cut-off uniform in [min_low_hz, max_low_hz] and a
    low-pass at one uniform in [min_high_hz, max_high_hz] (cheap microphones, narrow channels)."""

    min_low_hz: float = 50.0
    max_low_hz: float = 400.0
    min_high_hz: float = 3000.0
    max_high_hz: float = 7500.0
    prob: float = 0.2


@dataclass
class TelephoneConfig:
    """Telephone channel: with probability ``prob``, 300-3400 Hz, resampled to 8 kHz, G.711 mu-law coded (8 bits),
    and back to the input rate."""

    prob: float = 0.1


@dataclass
class AugmentationConfig:
    """Which augmentations to apply (none by default)."""

    speed: SpeedConfig | None = None
    gain: GainConfig | None = None
    noise: NoiseConfig | None = None
    pitch: PitchConfig | None = None
    reverb: ReverbConfig | None = None
    eq: EqConfig | None = None
    band_limit: BandLimitConfig | None = None
    telephone: TelephoneConfig | None = None

    def enabled(self) -> bool:
        return any(getattr(self, f.name) is not None for f in fields(self))


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
        for f in fields(cfg):
            sub = getattr(cfg, f.name)
            if sub is not None:
                _check_prob(f.name, sub.prob)
        ranges = (("pitch", "min_factor", "max_factor"), ("reverb", "min_rt60", "max_rt60"),
                  ("band_limit", "min_low_hz", "max_low_hz"), ("band_limit", "min_high_hz", "max_high_hz"),
                  ("noise", "min_exponent", "max_exponent"))  # fmt: skip
        for name, low, high in ranges:
            sub = getattr(cfg, name)
            if sub is not None and not 0 <= getattr(sub, low) <= getattr(sub, high):
                raise ValueError(f"augmentation.{name}: {low} must be >= 0 and <= {high}.")
        if cfg.speed is not None and (not cfg.speed.factors or min(cfg.speed.factors) <= 0):
            raise ValueError(f"augmentation.speed.factors must be positive numbers, got {cfg.speed.factors}.")
        if cfg.gain is not None and cfg.gain.min_db > cfg.gain.max_db:
            raise ValueError("augmentation.gain.min_db is larger than max_db.")
        self._noise: list[dict[str, Any]] = []
        if cfg.noise is not None and (cfg.noise.manifest_filepath or cfg.noise.cuts_path):
            self._noise = _noise_records(cfg.noise)
        if cfg.noise is not None:
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
        c = self.cfg
        pitch_on, pitch = rng.random() < (c.pitch.prob if c.pitch else 0.0), rng.uniform(*_range(c.pitch, "factor"))
        reverb_on, rt60 = rng.random() < (c.reverb.prob if c.reverb else 0.0), rng.uniform(*_range(c.reverb, "rt60"))
        drr_db, sub_seed = rng.uniform(*_range(c.reverb, "drr_db")), rng.getrandbits(32)
        exponent = rng.uniform(*_range(noise, "exponent"))
        eq_on = rng.random() < (c.eq.prob if c.eq else 0.0)
        eq = [(math.exp(rng.uniform(math.log(100.0), math.log(6000.0))), rng.uniform(-1.0, 1.0), rng.uniform(0.5, 2.0))
              for _ in range(c.eq.bands if c.eq else 0)]  # fmt: skip
        band_on = rng.random() < (c.band_limit.prob if c.band_limit else 0.0)
        low_hz, high_hz = rng.uniform(*_range(c.band_limit, "low_hz")), rng.uniform(*_range(c.band_limit, "high_hz"))
        phone_on = rng.random() < (c.telephone.prob if c.telephone else 0.0)
        if speed_on:
            audio = change_speed(audio, factor)
        if pitch_on:
            audio = shift_pitch(audio, pitch, self.sample_rate)
        if reverb_on:
            audio = reverberate(audio, self.sample_rate, rt60, drr_db, sub_seed)
        if gain_on:
            audio = audio * 10.0 ** (gain_db / 20.0)
        if noise_on:
            if self._noise:
                noise_audio = self._read_noise(self._noise[noise_pick], audio.shape[0], noise_start)
            else:
                noise_audio = coloured_noise(audio.shape[0], exponent, sub_seed).to(audio)
            if noise_audio is not None:
                audio = mix_at_snr(audio, noise_audio, snr_db)
        if eq_on:
            import torchaudio.functional as F

            for centre, gain, q in eq:
                if centre < 0.45 * self.sample_rate:
                    audio = F.equalizer_biquad(audio, self.sample_rate, centre, gain * c.eq.max_db, q)
        if band_on:
            audio = band_limit(audio, self.sample_rate, low_hz, high_hz)
        if phone_on:
            audio = telephone(audio, self.sample_rate)
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


def shift_pitch(audio: torch.Tensor, factor: float, sample_rate: int) -> torch.Tensor:
    """Every frequency of ``audio`` scaled by about ``factor``, the length kept: resampled to ``sample_rate / factor``
    (rounded to 100 Hz, which keeps the resampling kernel small), then time-stretched back with a phase vocoder."""
    import torchaudio.functional as F

    rate = max(100, round(sample_rate / factor / 100) * 100)
    if rate == sample_rate or audio.shape[0] < 1024:
        return audio
    shifted = F.resample(audio, sample_rate, rate)
    window = torch.hann_window(512, device=audio.device)
    spec = torch.stft(shifted, 512, 128, window=window, return_complex=True)
    advance = torch.linspace(0, math.pi * 128, spec.shape[0], device=audio.device)[:, None]
    stretched = F.phase_vocoder(spec, shifted.shape[0] / audio.shape[0], advance)
    return torch.istft(stretched, 512, 128, window=window, length=audio.shape[0])


def room_impulse_response(sample_rate: int, rt60: float, drr_db: float, seed: int) -> torch.Tensor:
    """A synthetic room impulse response: a unit direct path, then (after 2-5 ms) Gaussian noise decaying by 60 dB
    over ``rt60`` seconds, its high frequencies damped over time, scaled to a direct-to-reverberant ratio of
    ``drr_db``. Hand-written: the RIR simulators on PyPI (image method) cost far more per utterance than a loader
    process can spend, and a statistical tail is what a recogniser needs to become robust to rooms."""
    generator = torch.Generator().manual_seed(seed)
    length = max(int(rt60 * sample_rate), 16)
    delay = int(sample_rate * (0.002 + 0.003 * torch.rand((), generator=generator).item()))
    t = torch.arange(length) / sample_rate
    tail = torch.randn(length, generator=generator) * torch.exp(-6.9078 * t / rt60)  # ln(1000) = 60 dB
    # the tail fades from white into a 5-tap moving average: air and walls absorb high frequencies first
    smooth = torch.nn.functional.avg_pool1d(tail[None, None], 5, stride=1, padding=2)[0, 0]
    fade = t / t[-1]
    tail = (1.0 - fade) * tail + fade * smooth
    tail = tail / tail.pow(2).sum().sqrt().clamp(min=1e-8) * 10.0 ** (-drr_db / 20.0)
    rir = torch.zeros(delay + length)
    rir[0] = 1.0
    rir[delay:] += tail
    return rir


def reverberate(audio: torch.Tensor, sample_rate: int, rt60: float, drr_db: float, seed: int) -> torch.Tensor:
    """``audio`` in a simulated room (:func:`room_impulse_response`), same length, same peak level."""
    rir = room_impulse_response(sample_rate, rt60, drr_db, seed).to(audio)
    n = 1 << (audio.shape[0] + rir.shape[0] - 1).bit_length()  # a power of two: the FFT's fast sizes
    wet = torch.fft.irfft(torch.fft.rfft(audio, n) * torch.fft.rfft(rir, n), n)[: audio.shape[0]]
    return wet * (audio.abs().max() / wet.abs().max().clamp(min=1e-8))


def coloured_noise(length: int, exponent: float, seed: int) -> torch.Tensor:
    """Gaussian noise whose power spectrum falls as 1/f^``exponent`` (0 white, 1 pink, 2 brown), unit variance."""
    generator = torch.Generator().manual_seed(seed)
    spectrum = torch.fft.rfft(torch.randn(length, generator=generator))
    f = torch.arange(spectrum.shape[0], dtype=torch.float32).clamp(min=1.0)
    noise = torch.fft.irfft(spectrum / f.pow(exponent / 2.0), n=length)
    return noise / noise.std().clamp(min=1e-8)


def band_limit(audio: torch.Tensor, sample_rate: int, low_hz: float, high_hz: float) -> torch.Tensor:
    """A high-pass at ``low_hz`` and a low-pass at ``high_hz`` (second order each)."""
    import torchaudio.functional as F

    audio = F.highpass_biquad(audio, sample_rate, low_hz)
    return F.lowpass_biquad(audio, sample_rate, min(high_hz, 0.45 * sample_rate))


def telephone(audio: torch.Tensor, sample_rate: int) -> torch.Tensor:
    """A telephone channel: 300-3400 Hz, 8 kHz, G.711 mu-law (8 bits), back at ``sample_rate``."""
    import torchaudio.functional as F

    narrow = resample(band_limit(audio, sample_rate, 300.0, 3400.0), sample_rate, 8000)
    scale = narrow.abs().max().clamp(min=1e-8)
    coded = F.mu_law_decoding(F.mu_law_encoding(narrow / scale, 256), 256) * scale
    return resample(coded, 8000, sample_rate)


def _noise_records(cfg: NoiseConfig) -> list[dict[str, Any]]:
    from speechtrain.data.manifest import read_nemo_manifest

    if bool(cfg.manifest_filepath) == bool(cfg.cuts_path):
        raise ValueError(
            "augmentation.noise takes at most one of manifest_filepath or cuts_path (neither: generated "
            "coloured noise)."
        )
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
