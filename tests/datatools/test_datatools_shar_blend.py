"""Data tools: NeMo manifests -> lhotse Shar shards (to_shar) and temperature blend weights (blend_weights)."""

import json
import math

import numpy as np
import pytest
import soundfile as sf
import yaml

from speechtrain.data.lhotse_loader import LoaderConfig, blend_sources, cuts_from_nemo_manifest, read_cuts
from speechtrain.datatools.blend_weights import estimate_blend, format_input_cfg, temperature_weights
from speechtrain.datatools.blend_weights import main as blend_main
from speechtrain.datatools.to_shar import convert_to_shar
from speechtrain.datatools.to_shar import main as shar_main

RATE = 16000
GOOD = 7


def _write_corpus(folder, count, seed, bad=()):
    """``count`` short 16-bit utterances (wav and flac alternating) and a manifest; ``bad`` adds broken lines.

    Returns the manifest path and the original samples (float32, as soundfile decodes 16-bit PCM) by file path.
    """
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    lines, samples = [], {}
    for i in range(count):
        audio = (rng.standard_normal(int(RATE * rng.uniform(0.2, 0.6))) * 3000).astype(np.int16)
        path = folder / f"utt{i}.{'flac' if i % 2 else 'wav'}"
        sf.write(path, audio, RATE, subtype="PCM_16")
        samples[str(path)] = audio.astype(np.float32) / 32768
        lines.append({"audio_filepath": str(path), "duration": len(audio) / RATE, "text": f"utterance {i}",
                      "speaker": f"spk{i % 3}", "lang": "en", "domain": f"d{i % 2}"})  # fmt: skip
    for name, duration in bad:
        lines.append({"audio_filepath": str(folder / name), "duration": duration, "text": "bad", "speaker": "x"})
    manifest = folder / "manifest.json"
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return manifest, samples


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    manifest, samples = _write_corpus(folder, GOOD, seed=0, bad=[("missing.wav", 0.5), ("garbage.wav", 0.5),
                                                                  ("utt0.wav", 9.0)])  # fmt: skip
    (folder / "garbage.wav").write_bytes(b"not audio at all")
    return manifest, samples


@pytest.fixture(scope="module")
def shar_dir(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("shar")
    summary = convert_to_shar([corpus[0]], out, shard_size=3)
    return out, summary


def test_shar_round_trip_keeps_text_fields_and_exact_audio(corpus, shar_dir):
    from lhotse import CutSet

    manifest, samples = corpus
    out, summary = shar_dir
    expected = [c for c in cuts_from_nemo_manifest(manifest, RATE)][:GOOD]
    cuts = list(CutSet.from_shar(in_dir=out))
    assert [c.id for c in cuts] == [c.id for c in expected], "all good utterances, in input order"
    for cut, ref in zip(cuts, expected):
        path = ref.recording.sources[0].source
        assert cut.supervisions[0].text == ref.supervisions[0].text
        assert cut.supervisions[0].language == "en"
        assert cut.supervisions[0].speaker == ref.supervisions[0].speaker
        assert cut.custom["domain"] == ref.custom["domain"], "extra manifest keys stay custom fields"
        assert cut.duration == pytest.approx(ref.duration, abs=1e-6)
        assert cut.recording.sources[0].type == "memory", "the audio lives in the shard, not in the source file"
        audio = cut.load_audio()  # (1, T)
        assert audio.shape == (1, len(samples[path]))
        np.testing.assert_array_equal(audio[0], samples[path])  # flac is lossless
    assert (summary.utterances, summary.skipped) == (GOOD, 3)
    assert summary.seconds == pytest.approx(sum(c.duration for c in expected))


def test_skipped_utterances_are_named_with_a_reason(shar_dir):
    reasons = dict(shar_dir[1].skipped_examples)
    [missing] = [why for path, why in reasons.items() if path.endswith("missing.wav")]
    [garbage] = [why for path, why in reasons.items() if path.endswith("garbage.wav")]
    [short] = [why for path, why in reasons.items() if path.endswith("utt0.wav")]
    assert missing == "file not found"
    assert garbage.startswith("unreadable") and "Format not recognised" in garbage
    assert "the manifest asks for 0.000-9.000 s" in short


def test_shard_files_and_the_loader_see_the_shards(shar_dir):
    out, summary = shar_dir
    assert summary.shards == math.ceil(GOOD / 3)
    assert sorted(p.name for p in out.iterdir()) == [
        *(f"cuts.{i:06d}.jsonl.gz" for i in range(summary.shards)),
        *(f"recording.{i:06d}.tar" for i in range(summary.shards)),
    ]
    cuts = read_cuts(LoaderConfig(shar_path=str(out)))
    assert len({c.id for c in cuts}) == GOOD


@pytest.mark.parametrize("shard_size", [1, 4, 100])
def test_shard_count_follows_shard_size(tmp_path, shard_size):
    manifest, _ = _write_corpus(tmp_path / "c", 5, seed=1)
    summary = convert_to_shar([manifest], tmp_path / "out", shard_size=shard_size, audio_format="wav")
    assert summary.shards == math.ceil(5 / shard_size)
    assert len(list((tmp_path / "out").glob("recording.*.tar"))) == summary.shards


def test_shuffle_is_seeded_and_inputs_mix_manifests_and_cuts_files(tmp_path):
    from lhotse import CutSet

    first, _ = _write_corpus(tmp_path / "a", 6, seed=2)
    second, _ = _write_corpus(tmp_path / "b", 6, seed=3)
    cuts_file = tmp_path / "b.jsonl.gz"
    cuts_from_nemo_manifest(second, RATE).to_file(cuts_file)
    orders = []
    for name, shuffle, seed in (("plain", False, 0), ("s0", True, 0), ("s0_again", True, 0), ("s1", True, 1)):
        convert_to_shar([first, cuts_file], tmp_path / name, shard_size=5, shuffle=shuffle, seed=seed)
        orders.append([c.id for c in CutSet.from_shar(in_dir=tmp_path / name)])
    plain, s0, s0_again, s1 = orders
    assert len(plain) == 12 and sorted(s0) == sorted(plain)
    assert s0 == s0_again and s0 != plain and s1 != s0


def test_to_shar_cli_prints_a_summary_and_refuses_a_used_folder(corpus, tmp_path, capsys):
    out = tmp_path / "out"
    shar_main([str(corpus[0]), "--out", str(out), "--shard-size", "5"])
    printed = capsys.readouterr().out
    assert f"{out}: 2 shards, {GOOD} utterances" in printed and "3 skipped" in printed
    assert "missing.wav: file not found" in printed
    with pytest.raises(SystemExit, match="already holds Shar shards"):
        shar_main([str(corpus[0]), "--out", str(out)])


def test_temperature_weights_values():
    assert temperature_weights([1.0, 3.0], 1.0) == pytest.approx([0.25, 0.75], rel=1e-12)
    assert temperature_weights([1.0, 3.0], 0.5) == pytest.approx([0.1, 0.9], rel=1e-12)  # squares
    assert temperature_weights([4.0, 1.0], 2.0) == pytest.approx([2 / 3, 1 / 3], rel=1e-12)  # square roots
    assert temperature_weights([1.0, 100.0, 10000.0], 1e6) == pytest.approx([1 / 3] * 3, abs=1e-5)
    assert temperature_weights([5000.0, 1.0], 0.01) == pytest.approx([1.0, 0.0], abs=1e-12), "no overflow"
    assert temperature_weights([7.0], 3.0) == [1.0]


@pytest.mark.parametrize(
    ("sizes", "temperature", "message"),
    [
        ([], 1.0, "sizes is empty"),
        ([1.0, 0.0], 1.0, r"sizes\[1\] must be a finite number > 0, got 0.0"),
        ([-2.0], 1.0, r"sizes\[0\] must be"),
        ([float("nan")], 1.0, r"sizes\[0\] must be"),
        ([float("inf")], 1.0, r"sizes\[0\] must be"),
        ([1.0], 0.0, "temperature must be a finite number > 0, got 0.0"),
        ([1.0], -1.0, "temperature must be"),
        ([1.0], float("nan"), "temperature must be"),
    ],
)
def test_temperature_weights_reject_bad_input(sizes, temperature, message):
    with pytest.raises(ValueError, match=message):
        temperature_weights(sizes, temperature)


def _metadata_manifest(path, durations):
    path.write_text("".join(json.dumps({"audio_filepath": f"/nowhere/{i}.wav", "duration": d, "text": "x"}) + "\n"
                            for i, d in enumerate(durations)))  # fmt: skip
    return path


def test_estimate_blend_sizes_manifests_cuts_files_and_shar_folders(tmp_path, shar_dir):
    one_hour = _metadata_manifest(tmp_path / "a.json", [1800.0, 1800.0])
    quarter = tmp_path / "b.jsonl.gz"
    cuts_from_nemo_manifest(_metadata_manifest(tmp_path / "b.json", [900.0]), RATE).to_file(quarter)
    shar_hours = shar_dir[1].hours
    entries = estimate_blend([one_hour, quarter, shar_dir[0]], temperature=2.0)
    assert [e["type"] for e in entries] == ["nemo", "lhotse", "lhotse_shar"]
    assert [e.get("manifest_filepath") or e.get("cuts_path") or e.get("shar_path") for e in entries] == [
        str(one_hour), str(quarter), str(shar_dir[0])]  # fmt: skip
    roots = [1.0, 0.5, math.sqrt(shar_hours)]
    assert [e["weight"] for e in entries] == pytest.approx([r / sum(roots) for r in roots], rel=1e-6)
    with pytest.raises(ValueError, match="holds no audio"):
        estimate_blend([one_hour, _metadata_manifest(tmp_path / "empty.json", [0.0])], 1.0)


def test_blend_cli_prints_yaml_that_blend_sources_accepts(tmp_path, capsys):
    a = _metadata_manifest(tmp_path / "a.json", [3600.0, 3600.0, 1800.0])
    b = _metadata_manifest(tmp_path / "b.json", [900.0])
    blend_main([str(a), str(b), "--temperature", "1"])
    printed = capsys.readouterr().out
    assert f"# {a}: 2.5 h" in printed and f"# {b}: 0.25 h" in printed
    cfg = yaml.safe_load(printed)
    assert cfg["input_cfg"] == [
        {"type": "nemo", "manifest_filepath": str(a), "weight": 0.9091},
        {"type": "nemo", "manifest_filepath": str(b), "weight": 0.0909},
    ]
    assert sum(1 for _ in blend_sources(cfg["input_cfg"], RATE)) == 4


def test_yaml_never_rounds_a_weight_to_zero():
    entries = [{"type": "nemo", "manifest_filepath": "tiny.json", "weight": 2e-7},
               {"type": "nemo", "manifest_filepath": "huge.json", "weight": 1 - 2e-7}]  # fmt: skip
    weights = [e["weight"] for e in yaml.safe_load(format_input_cfg(entries, [1e-3, 5e3], 1.0))["input_cfg"]]
    assert weights == [2e-7, 1.0]
