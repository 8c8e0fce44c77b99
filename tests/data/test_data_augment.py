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
    with pytest.raises(ValueError, match="exactly one of manifest_filepath or cuts_path"):
        Augmenter(AugmentationConfig(noise=NoiseConfig()), SR)
    with pytest.raises(ValueError, match="factors must be positive"):
        Augmenter(AugmentationConfig(speed=SpeedConfig(factors=[0.0])), SR)
