import json
import shutil

import numpy as np
import pytest
import soundfile as sf

from speechtrain.corpora.speech_corpus import SAMPLE_RATE, build_corpus, plan, split_voices
from speechtrain.data.manifest import read_nemo_manifest


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("espeak")
    return root, build_corpus(root, hours=0.03, seed=3, workers=2)


def test_plan_is_deterministic_and_splits_are_disjoint():
    first, second = plan(0.05, seed=1), plan(0.05, seed=1)
    assert first == second and plan(0.05, seed=2) != first
    texts = {split: {u.text for u in first if u.split == split} for split in ("train", "dev", "test")}
    assert (
        not texts["train"] & texts["dev"] and not texts["train"] & texts["test"] and not texts["dev"] & texts["test"]
    )
    voices = split_voices(1)
    assert voices["train"] == voices["dev"] and not set(voices["train"]) & set(voices["test"])
    assert {v.split("+")[1] for v in voices["train"]}.isdisjoint({v.split("+")[1] for v in voices["test"]})
    assert len(voices["train"]) >= 100


def test_corpus_files_match_their_manifests(corpus):
    root, record = corpus
    assert record["splits"]["train"]["utterances"] > record["splits"]["test"]["utterances"] > 0
    for split in ("train", "dev", "test"):
        records = read_nemo_manifest(root / split / "manifest.json")
        assert len(records) == record["splits"][split]["utterances"]
        for r in records[:10]:
            audio, rate = sf.read(r["audio_filepath"])
            assert rate == SAMPLE_RATE and abs(len(audio) / rate - r["duration"]) < 1e-3
            assert np.abs(audio).max() > 0.01, "silent audio"
            assert r["text"] and r["text"] == r["text"].lower()
    test_voices = {r["voice"] for r in read_nemo_manifest(root / "test" / "manifest.json")}
    train_voices = {r["voice"] for r in read_nemo_manifest(root / "train" / "manifest.json")}
    assert not test_voices & train_voices


def test_lhotse_cuts_load(corpus):
    from lhotse import CutSet

    root, record = corpus
    cuts = CutSet.from_file(root / "dev" / "cuts.jsonl.gz")
    assert len(cuts) == record["splits"]["dev"]["utterances"]
    cut = next(iter(cuts))
    assert cut.sampling_rate == SAMPLE_RATE and cut.supervisions[0].text
    assert cut.load_audio().shape == (1, cut.num_samples)


def test_finished_corpus_is_reused(corpus, monkeypatch):
    root, record = corpus
    import speechtrain.corpora.speech_corpus as module

    monkeypatch.setattr(module, "plan", lambda *a, **k: pytest.fail("a finished corpus must not be rebuilt"))
    assert build_corpus(root, hours=0.03, seed=3) == record
    assert json.loads((root / "corpus.json").read_text()) == record


def test_speech_plan_mixes_engines_and_keeps_the_heldout_engine_out_of_training():
    from speechtrain.corpora.speech_corpus import HELDOUT_SPLITS, plan_speech

    planned = plan_speech(0.3, seed=2, engines={"espeak": 3, "piper": 1}, heldout="flite", heldout_utterances=12)
    assert planned == plan_speech(0.3, seed=2, engines={"espeak": 3, "piper": 1}, heldout="flite",
                                  heldout_utterances=12)  # fmt: skip
    main = [u for u in planned if u.split not in HELDOUT_SPLITS]
    share = sum(u.engine == "piper" for u in main) / len(main)
    assert {u.engine for u in main} == {"espeak", "piper"} and 0.15 < share < 0.35
    held = [u for u in planned if u.split in HELDOUT_SPLITS]
    assert {u.engine for u in held} == {"flite"} and len(held) == 24
    assert all(0.88 <= u.warp <= 1.15 for u in planned if u.engine != "espeak")
    train_texts = {u.text for u in planned if u.split == "train"}
    heldout_texts = {u.text for u in held}
    assert not train_texts & heldout_texts, "held-out sentences must never be read in training"
    with pytest.raises(ValueError, match="cannot also be a training engine"):
        plan_speech(0.1, engines={"espeak": 1, "flite": 1}, heldout="flite")
    with pytest.raises(ValueError, match="Unknown synthesiser"):
        plan_speech(0.1, engines={"mbrola": 1}, heldout=None)


def test_extra_training_speech_leaves_every_other_split_unchanged_and_reads_only_new_train_pool_sentences():
    from speechtrain.corpora.sentences import split_of
    from speechtrain.corpora.speech_corpus import EXTRA_SPLIT, SPLITS, plan_speech

    engines = {"espeak": 3, "piper": 1}
    base = plan_speech(0.1, seed=2, engines=engines, heldout="flite", heldout_utterances=5)
    planned = plan_speech(0.1, seed=2, engines=engines, heldout="flite", heldout_utterances=5,
                          extra={"espeak": 0.2, "piper": 0.05})  # fmt: skip
    assert planned[: len(base)] == base, "extra speech must not change the other splits"
    extra = planned[len(base) :]
    assert extra and all(u.split == EXTRA_SPLIT for u in extra)
    assert {u.engine for u in extra} == {"espeak", "piper"}
    seconds = sum(len(u.text.split()) * 60.0 / u.rate + 0.4 for u in extra)
    assert 0.25 * 3600 <= seconds < 0.25 * 3600 + 10
    assert not {u.text for u in extra} & {u.text for u in base}
    assert all(split_of(u.text, SPLITS, 2) == "train" for u in extra)
    train_voices = {u.voice for u in base if u.split == "train"}
    test_only = {u.voice for u in base if u.split == "test"} - train_voices
    assert test_only and not {u.voice for u in extra} & test_only, "extra speech is read by training voices only"
    with pytest.raises(ValueError, match="training engines"):
        plan_speech(0.1, engines=engines, heldout="flite", extra={"flite": 1.0})


def test_builtin_train_extra_names_resolve_to_the_extra_corpus(monkeypatch, tmp_path):
    import speechtrain.corpora.builtin as builtin
    from speechtrain.corpora.builtin import SPEECH_DEFAULT_HOURS, SPEECH_EXTRA, resolve_manifest

    calls = []

    def fake_extra(extra, hours, seed):
        calls.append((extra, hours, seed))
        return {"splits": {"train_extra": {"manifest": str(tmp_path / "manifest.json")}}}

    monkeypatch.setattr(builtin, "build_speech_extra", fake_extra)
    assert resolve_manifest("builtin:speech/train_extra") == tmp_path / "manifest.json"
    resolve_manifest("builtin:speech-2h/train_extra-espeak6h-piper1.5h")
    assert calls == [(SPEECH_EXTRA, SPEECH_DEFAULT_HOURS, 0), ({"espeak": 6.0, "piper": 1.5}, 2.0, 0)]
    with pytest.raises(ValueError, match="train_extra"):
        resolve_manifest("builtin:speech/train_extra-espeak")


def test_an_extra_corpus_renders_only_its_own_utterances(tmp_path, monkeypatch):
    import speechtrain.corpora.speech_corpus as speech_corpus
    from speechtrain.corpora.speech_corpus import build_speech_extra

    monkeypatch.setattr(speech_corpus, "default_datasets_cache", lambda: tmp_path)
    record = build_speech_extra({"espeak": 0.01}, hours=0.02, seed=1, workers=1, engines={"espeak": 1},
                                heldout=None)  # fmt: skip
    assert set(record["splits"]) == {"train_extra"} and record["params"]["extra"] == {"espeak": 0.01}
    rows = read_nemo_manifest(record["splits"]["train_extra"]["manifest"])
    assert rows and all(r["engine"] == "espeak" for r in rows)


def test_a_heldout_engine_keeps_only_people_that_no_training_engine_reads_with():
    """Festival's kal diphones are Flite's kal and kal16, and both have an slt voice: with Festival in training,
    the held-out Flite sets are read by awb and rms alone."""
    from speechtrain.corpora.speech_corpus import HELDOUT_SPLITS, plan_speech

    def heldout_voices(engines):
        planned = plan_speech(0.05, seed=1, engines=engines, heldout="flite", heldout_utterances=60)
        return {u.voice for u in planned if u.split in HELDOUT_SPLITS}

    assert heldout_voices({"espeak": 1, "piper": 1}) == {"kal", "kal16", "awb", "rms", "slt"}
    assert heldout_voices({"espeak": 1, "festival": 1}) == {"awb", "rms"}
    planned = plan_speech(0.2, seed=1, engines={"espeak": 1, "festival": 1}, heldout=None)
    assert {u.voice for u in planned if u.engine == "festival"} == {
        "kal_diphone", "ked_diphone", "cmu_us_slt_arctic_hts"}  # fmt: skip


def test_a_tiny_multi_engine_corpus_records_engine_voice_and_warp(tmp_path):
    import shutil

    from speechtrain.corpora.speech_corpus import build_speech_corpus

    heldout = "flite" if shutil.which("flite") else None
    record = build_speech_corpus(tmp_path, hours=0.02, seed=1, workers=2, engines={"espeak": 1, "piper": 1},
                                 heldout=heldout, heldout_utterances=3)  # fmt: skip
    train = read_nemo_manifest(tmp_path / "train" / "manifest.json")
    engines = {r["engine"] for r in train}
    assert engines == {"espeak", "piper"} and set(record["splits"]["train"]["engines"]) == engines
    for r in train:
        audio, rate = sf.read(r["audio_filepath"])
        assert rate == SAMPLE_RATE and np.abs(audio).max() > 0.01 and abs(len(audio) / rate - r["duration"]) < 1e-3
        if r["engine"] == "piper":
            assert r["voice"] == "piper:joe" and 0.88 <= r["warp"] <= 1.15
            # ~2.5 words per second whatever the warp: the duration is kept
            assert 1.2 < len(r["text"].split()) / r["duration"] < 4.5
    if heldout:
        held = read_nemo_manifest(tmp_path / "heldout_engine" / "manifest.json")
        assert len(held) == 3 and {r["engine"] for r in held} == {"flite"}
        assert all(r["voice"].startswith("flite:") for r in held)


def test_builtin_speech_names_resolve_to_the_multi_engine_corpus(monkeypatch, tmp_path):
    import speechtrain.corpora.builtin as builtin
    from speechtrain.corpora.builtin import SPEECH_DEFAULT_HOURS, resolve_manifest

    calls = []

    def fake_build(hours, seed):
        calls.append((hours, seed))
        splits = ("train", "dev", "test", "heldout_engine", "heldout_engine_train")
        return {"splits": {s: {"manifest": str(tmp_path / s / "manifest.json")} for s in splits}}

    monkeypatch.setattr(builtin, "build_speech_corpus", fake_build)
    assert resolve_manifest("builtin:speech/heldout_engine") == tmp_path / "heldout_engine" / "manifest.json"
    assert resolve_manifest("builtin:speech-2h-seed3/train") == tmp_path / "train" / "manifest.json"
    assert calls == [(SPEECH_DEFAULT_HOURS, 0), (2.0, 3)]
    with pytest.raises(ValueError, match="builtin:speech"):
        resolve_manifest("builtin:speech/nope")


def test_a_missing_flite_or_festival_program_is_named_with_its_install_command(monkeypatch):
    import speechtrain.corpora.engines as engines

    monkeypatch.setattr(engines.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="apt-get install flite"):
        engines._Flite()
    with pytest.raises(RuntimeError, match="apt-get install festival festvox-kallpc16k"):
        engines._Festival()


@pytest.mark.skipif(shutil.which("festival") is None, reason="Festival is not installed (make install adds it)")
def test_festival_reads_each_voice_in_one_process_and_names_a_voice_it_lacks(tmp_path):
    from speechtrain.corpora.engines import Utterance, _Festival
    from speechtrain.corpora.speech_corpus import FESTIVAL_VOICES

    festival = _Festival()
    text = "she read forty two books, didn't she?"
    for voice in FESTIVAL_VOICES:
        audio, rate = festival.synthesize(Utterance("u", "train", text, voice, rate=165, pitch=50, engine="festival"))
        assert rate in (16000, 32000) and 1.0 < len(audio) / rate < 5.0 and np.abs(audio).max() > 0.05
    slow, rate = festival.synthesize(Utterance("u", "train", text, "kal_diphone", 120, 50, "festival"))
    fast, _ = festival.synthesize(Utterance("u", "train", text, "kal_diphone", 200, 50, "festival"))
    assert len(slow) > 1.4 * len(fast)  # the speaking rate is Festival's duration stretch
    with pytest.raises(RuntimeError, match="voice 'nobody'"):
        festival.synthesize(Utterance("u", "train", text, "nobody", 165, 50, "festival"))
    audio, _ = festival.synthesize(Utterance("u", "train", text, "ked_diphone", 165, 50, "festival"))
    assert np.abs(audio).max() > 0.05  # still serving after an error
    festival.process.kill()
    festival.process.wait()
    with pytest.raises(RuntimeError, match="Festival stopped while reading"):
        festival.synthesize(Utterance("u", "train", text, "ked_diphone", 165, 50, "festival"))


@pytest.mark.multiprocess
def test_processes_asking_for_the_same_corpus_at_once_build_it_once(tmp_path):
    """The ranks of a run that resolves a ``builtin:`` name after they start ask for the corpus together: one builds
    it, the other waits for it (before, both built into the same folder and one crashed)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(build_corpus, tmp_path / "shared", hours=0.01, seed=5, workers=1) for _ in range(2)]
        first, second = (f.result(timeout=240) for f in futures)
    assert first == second  # the same record: the waiting process reused the build, it did not redo it
    assert len(read_nemo_manifest(first["splits"]["train"]["manifest"])) == first["splits"]["train"]["utterances"]


def test_an_engine_view_keeps_one_engines_utterances_of_a_builtin_split(tmp_path, monkeypatch):
    import speechtrain.corpora.builtin as synthetic

    folder = tmp_path / "train"
    (folder / "audio").mkdir(parents=True)
    rows = [{"audio_filepath": f"audio/{i}.wav", "duration": 1.0, "text": f"utterance {i}", "engine": e}
            for i, e in enumerate(["espeak", "piper", "festival", "piper"])]  # fmt: skip
    (folder / "manifest.json").write_text("".join(json.dumps(r) + "\n" for r in rows))
    real = synthetic.resolve_manifest

    def fake(name):
        return folder / "manifest.json" if name == "builtin:speech/train" else real(name)

    monkeypatch.setattr(synthetic, "resolve_manifest", fake)
    view = real("builtin:speech/train@piper+festival")
    assert view == folder / "manifest.piper+festival.json"
    kept = read_nemo_manifest(view)
    assert [r["engine"] for r in kept] == ["piper", "festival", "piper"]
    assert kept[0]["audio_filepath"] == str(folder / "audio" / "1.wav"), "relative audio paths still resolve"
    with pytest.raises(ValueError, match=r"no utterance .* is read by flite; its engines: \['espeak', 'festival'"):
        real("builtin:speech/train@flite")
    with pytest.raises(ValueError, match="name the engines"):
        real("builtin:speech/train@")


def test_the_corpus_command_builds_named_builtin_manifests(monkeypatch, capsys, tmp_path):
    """`make demo` builds its corpus with `python -m speechtrain.corpora.builtin NAME ...` before it sets the
    training budget: each name is resolved (built or reused) as a config would, and its manifest printed."""
    import speechtrain.corpora.builtin as synthetic
    from speechtrain.corpora.builtin import main

    asked = []
    monkeypatch.setattr(synthetic, "resolve_manifest", lambda name: asked.append(name) or tmp_path / "m.json")
    main(["builtin:speech/train", "builtin:speech/train_extra"])
    assert asked == ["builtin:speech/train", "builtin:speech/train_extra"]
    out = capsys.readouterr().out
    assert f"builtin:speech/train_extra: {tmp_path / 'm.json'}" in out and "ready in" in out


def _conv_graph(extra_op: str | None = None):
    """A tiny ONNX graph: x -> /pre/Relu -> /dec/: Conv, LeakyRelu, ConvTranspose (x2), Add, Div, Tanh -> y."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    weights = {"c.w": rng.normal(size=(6, 4, 3)), "c.b": rng.normal(size=6), "u.w": rng.normal(size=(6, 3, 4)),
               "u.b": rng.normal(size=3), "k": np.array(2.0)}  # fmt: skip
    dec = [
        helper.make_node("Conv", ["h", "c.w", "c.b"], ["a"], "/dec/c", kernel_shape=[3], pads=[2, 2], dilations=[2]),
        helper.make_node("LeakyRelu", ["a"], ["b"], "/dec/l", alpha=0.1),
        helper.make_node(
            "ConvTranspose", ["b", "u.w", "u.b"], ["d"], "/dec/u", kernel_shape=[4], pads=[1, 1], strides=[2]
        ),  # fmt: skip
        helper.make_node("Add", ["d", "d"], ["e"], "/dec/add"),
        helper.make_node("Div", ["e", "k"], ["f"], "/dec/div"),
        helper.make_node(extra_op or "Tanh", ["f"], ["y"], "/dec/t"),
    ]
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["h"], "/pre/r"), *dec], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, None])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(v.astype(np.float32), k) for k, v in weights.items()],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)])


def test_the_torch_conv_tail_computes_what_onnx_runtime_does_and_cuts_its_padding():
    import onnxruntime
    import torch

    from speechtrain.corpora.engines import _ConvTail

    model = _conv_graph()
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    tail = _ConvTail(model, "/dec/", dtype=torch.float32)
    assert tail.input == "h" and tail.output == "y"
    x = np.abs(np.random.default_rng(1).normal(size=(1, 4, 37)).astype(np.float32))  # Relu(x) = x
    (expected,) = session.run(None, {"x": x})
    got = tail(x)  # padded to 64 frames inside, cut back to 37 x 2 samples
    assert got.shape == expected.shape == (1, 3, 74)
    np.testing.assert_allclose(got[..., :-4], expected[..., :-4], atol=1e-5)  # the padding reaches the last frames
    x = x[..., :32]  # a whole bucket: no padding, the same numbers throughout
    np.testing.assert_allclose(tail(x), session.run(None, {"x": x})[0], atol=1e-5)
    assert np.abs(_ConvTail(model, "/dec/")(x) - tail(x)).max() < 0.05  # bf16


def test_a_conv_tail_with_an_operator_it_cannot_run_is_refused_by_name():
    from speechtrain.corpora.engines import _ConvTail

    with pytest.raises(ValueError, match="Sigmoid"):
        _ConvTail(_conv_graph("Sigmoid"), "/dec/")
    with pytest.raises(ValueError, match="0 nodes"):
        _ConvTail(_conv_graph(), "/nothing/")


def test_piper_with_its_decoder_in_bf16_reads_as_onnx_runtime_does():
    from speechtrain.corpora.engines import Utterance, _Piper

    u = Utterance(id="u", split="train", text="seven ducks swam in the river", voice="joe", rate=160, pitch=50,
                  engine="piper", warp=1.0, noise=0.6)  # fmt: skip
    reference, rate = _Piper(bf16=False).synthesize(u)
    audio, bf16_rate = _Piper(bf16=True).synthesize(u)
    assert bf16_rate == rate and audio.shape == reference.shape
    snr = 10 * np.log10((reference**2).sum() / ((reference - audio) ** 2).sum())
    assert snr > 30  # benchmarks/piper_speed.py: ~39 dB
