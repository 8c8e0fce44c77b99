import json
import math

import numpy as np
import pytest
import soundfile as sf
import torch

from speechtrain.data.augment import (
    AugmentationConfig,
    Augmenter,
    GainConfig,
    NoiseConfig,
    SpeedConfig,
    change_speed,
    mix_at_snr,
)

SR = 16000


def _noise_manifest(tmp_path, seconds=0.3):
    noise = (0.1 * np.random.default_rng(3).standard_normal(int(seconds * SR))).astype(np.float32)
    sf.write(tmp_path / "noise.wav", noise, SR, subtype="FLOAT")
    path = tmp_path / "noise.json"
    path.write_text(json.dumps({"audio_filepath": "noise.wav", "duration": seconds, "text": ""}) + "\n")
    return str(path)


def _tone(seconds=1.0):
    return torch.sin(2 * torch.pi * 300 * torch.arange(int(seconds * SR)) / SR)


def test_speed_perturbation_changes_length_by_the_factor():
    audio = _tone()
    assert change_speed(audio, 1.1).shape[0] == math.ceil(SR / 1.1)
    assert change_speed(audio, 0.9).shape[0] == math.ceil(SR / 0.9)
    assert change_speed(audio, 1.0) is audio


def test_mix_at_snr_gives_the_requested_snr():
    audio, noise = _tone(), torch.randn(SR)
    mixed = mix_at_snr(audio, noise, 10.0)
    added = mixed - audio
    snr = 10 * torch.log10(audio.pow(2).mean() / added.pow(2).mean())
    assert abs(float(snr) - 10.0) < 1e-3


def test_gain_always_on_is_exact_and_draws_depend_only_on_seed_epoch_and_id():
    cfg = AugmentationConfig(gain=GainConfig(min_db=-6.0, max_db=6.0, prob=1.0))
    augment = Augmenter(cfg, SR, seed=1)
    audio = _tone(0.1)
    a = augment(audio, epoch=0, utterance_id="utt-1")
    ratio = float(a[10] / audio[10])
    assert -6.0 <= 20 * np.log10(ratio) <= 6.0 and torch.allclose(a, audio * ratio, atol=1e-6)
    # Same (seed, epoch, id): same result, in any process and in any order; another epoch or seed: another draw.
    assert torch.equal(Augmenter(cfg, SR, seed=1)(audio, 0, "utt-1"), a)
    assert not torch.equal(augment(audio, 1, "utt-1"), a)
    assert not torch.equal(Augmenter(cfg, SR, seed=2)(audio, 0, "utt-1"), a)


def test_probabilities_are_respected_and_each_augmentation_applies(tmp_path):
    cfg = AugmentationConfig(speed=SpeedConfig(factors=[1.25], prob=0.5),
                             noise=NoiseConfig(manifest_filepath=_noise_manifest(tmp_path), prob=0.3))  # fmt: skip
    augment = Augmenter(cfg, SR)
    audio = _tone(0.5)
    sped = noised = 0
    for i in range(400):
        out = augment(audio, 0, f"u{i}")
        sped += out.shape[0] == math.ceil(audio.shape[0] / 1.25)
        n = out.shape[0]
        clean = audio if n == audio.shape[0] else change_speed(audio, 1.25)
        noised += not torch.allclose(out, clean)
    assert 160 < sped < 240 and 85 < noised < 155  # 200 and 120 expected


def test_noise_is_looped_to_the_utterance_length_and_bad_configs_fail(tmp_path):
    cfg = AugmentationConfig(noise=NoiseConfig(manifest_filepath=_noise_manifest(tmp_path, 0.1), prob=1.0,
                                               min_snr_db=0.0, max_snr_db=0.0))  # fmt: skip
    audio = _tone(1.0)
    out = Augmenter(cfg, SR)(audio, 0, "x")
    added = out - audio
    assert out.shape == audio.shape and abs(float(added.pow(2).mean() / audio.pow(2).mean()) - 1.0) < 1e-4
    with pytest.raises(ValueError, match="prob must be within"):
        Augmenter(AugmentationConfig(gain=GainConfig(prob=1.5)), SR)
    with pytest.raises(ValueError, match="at most one of manifest_filepath or cuts_path"):
        Augmenter(AugmentationConfig(noise=NoiseConfig(manifest_filepath="a.json", cuts_path="b.jsonl.gz")), SR)
    with pytest.raises(ValueError, match="factors must be positive"):
        Augmenter(AugmentationConfig(speed=SpeedConfig(factors=[0.0])), SR)


def _peak_hz(audio):
    spectrum = torch.fft.rfft(audio * torch.hann_window(audio.shape[0]))
    return float(spectrum.abs().argmax()) * SR / audio.shape[0]


def test_pitch_shift_scales_frequencies_and_keeps_the_length():
    from speechtrain.data.augment import shift_pitch

    audio = torch.sin(2 * torch.pi * 500 * torch.arange(SR) / SR)
    shifted = shift_pitch(audio, 1.12, SR)
    assert shifted.shape == audio.shape
    # resampled to 14300 Hz (16000 / 1.12 rounded to 100 Hz): 500 Hz becomes 500 * 16000 / 14300 = 559 Hz
    assert abs(_peak_hz(shifted) - 500 * SR / 14300) < 3.0
    assert abs(_peak_hz(shift_pitch(audio, 0.9, SR)) - 500 * SR / 17800) < 3.0


def test_coloured_noise_slopes_and_telephone_band():
    from speechtrain.data.augment import coloured_noise, telephone

    def low_to_high(x):
        power = torch.fft.rfft(x).abs().pow(2)
        return float(power[50:500].mean() / power[-5000:].mean())

    white, pink, brown = (coloured_noise(SR, e, seed=1) for e in (0.0, 1.0, 2.0))
    assert all(abs(float(n.std()) - 1.0) < 1e-4 for n in (white, pink, brown))
    assert low_to_high(white) < 2 < low_to_high(pink) < low_to_high(brown)
    phone = telephone(torch.randn(SR), SR)
    power = torch.fft.rfft(phone).abs().pow(2)  # 1 Hz bins
    assert phone.shape == (SR,) and float(power[4200:].sum() / power[300:3400].sum()) < 5e-3


def test_room_impulse_response_decays_by_60_db_over_rt60():
    from speechtrain.data.augment import room_impulse_response

    rir = room_impulse_response(SR, rt60=0.4, drr_db=6.0, seed=0)
    assert rir[0] == 1.0
    energy = rir[1:].pow(2)
    tail = float(energy.sum())
    assert abs(10 * math.log10(1.0 / tail) - 6.0) < 1e-3  # direct-to-reverberant ratio
    early, late = float(energy[: SR // 20].mean()), float(energy[int(0.35 * SR) : int(0.4 * SR)].mean())
    assert 35 < 10 * math.log10(early / late) < 70  # ~52 dB down between 0-50 ms and 350-400 ms


def test_every_augmentation_keeps_length_is_finite_and_reproducible():
    from speechtrain.data.augment import BandLimitConfig, EqConfig, PitchConfig, ReverbConfig, TelephoneConfig

    cfg = AugmentationConfig(pitch=PitchConfig(prob=1.0), reverb=ReverbConfig(prob=1.0), gain=GainConfig(prob=1.0),
                             noise=NoiseConfig(prob=1.0), eq=EqConfig(prob=1.0), band_limit=BandLimitConfig(prob=1.0),
                             telephone=TelephoneConfig(prob=1.0))  # fmt: skip
    augment = Augmenter(cfg, SR, seed=4)
    audio = 0.3 * _tone(2.0)
    outputs = [augment(audio, 0, f"u{i}") for i in range(4)]
    assert all(o.shape == audio.shape and torch.isfinite(o).all() for o in outputs)
    assert torch.equal(Augmenter(cfg, SR, seed=4)(audio, 0, "u2"), outputs[2])
    assert not torch.equal(outputs[0], outputs[1])
    with pytest.raises(ValueError, match="reverb: min_rt60"):
        Augmenter(AugmentationConfig(reverb=ReverbConfig(min_rt60=0.9, max_rt60=0.2)), SR)


def test_speed_gain_noise_draws_are_unchanged_by_the_new_augmentations(tmp_path):
    # A run resumed across this change augments its speed/gain/noise exactly as before: those draws come first.
    old = AugmentationConfig(speed=SpeedConfig(prob=0.5), gain=GainConfig(prob=0.5))
    from speechtrain.data.augment import EqConfig

    new = AugmentationConfig(speed=SpeedConfig(prob=0.5), gain=GainConfig(prob=0.5), eq=EqConfig(prob=0.0))
    audio = _tone(0.5)
    for i in range(5):
        assert torch.equal(Augmenter(old, SR, 1)(audio, 2, f"x{i}"), Augmenter(new, SR, 1)(audio, 2, f"x{i}"))
