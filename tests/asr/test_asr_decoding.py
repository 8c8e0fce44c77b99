import math
from pathlib import Path

import pytest
import torch

from speechtrain.asr.ctc import ConformerCTCModel
from speechtrain.asr.decoding import BeamSearchDecoder, DecodingConfig, arpa_words, greedy_decode, spell
from speechtrain.asr.jobs import ensure_lm
from speechtrain.asr.ngram import NgramLM, main
from speechtrain.asr.report import validation_transcripts
from speechtrain.asr.transcribe import parse_args
from speechtrain.common.config import ConfigError
from speechtrain.common.metrics import word_error_rate
from speechtrain.common.tokenizers import CharTokenizer, train_sentencepiece
from speechtrain.core.model import SpeechModel
from speechtrain.data.lhotse_loader import LoaderConfig, read_cuts
from speechtrain.data.manifest import read_nemo_manifest
from speechtrain.lightning import MegatronStrategy, Trainer, settings


# ------------------------------------------------------------------------------------------------ n-gram LM
def test_kneser_ney_bigram_matches_a_hand_computation():
    # <s> a b </s> / <s> b </s>. Unigrams use continuation counts a:1 b:2 </s>:1, D1 = n1/(n1+2n2) = 2/4, and are
    # interpolated with the uniform distribution over {a, b, </s>, <unk>}; bigrams use raw counts, D2 = 3/5.
    lm = NgramLM.fit(["a b", "b"], order=2)
    p_a, p_b, p_end = (1 - 0.5) / 4 + 0.375 / 4, (2 - 0.5) / 4 + 0.375 / 4, (1 - 0.5) / 4 + 0.375 / 4
    expected = {
        ("a", ()): p_a,
        ("<unk>", ()): 0.375 / 4,
        ("a", ("<s>",)): (1 - 0.6) / 2 + 0.6 * p_a,  # seen: discounted count + gamma(<s>) = 0.6 * 2 / 2
        ("</s>", ("b",)): (2 - 0.6) / 2 + 0.3 * p_end,  # gamma(b) = 0.6 * 1 / 2
        ("b", ("b",)): 0.3 * p_b,  # unseen: backs off
        ("b", ("zzz",)): p_b,  # unknown history word -> <unk>, which has no bigrams
    }
    for (word, history), p in expected.items():
        assert 10 ** lm.log10_prob(word, history) == pytest.approx(p, rel=1e-9), (word, history)


@pytest.mark.parametrize("order", [1, 2, 3, 4])
def test_every_history_is_a_distribution(order):
    lm = NgramLM.fit(["the cat sat", "the cat ran", "a dog sat on the mat", "the dog"], order=order)
    words = [w for w in lm.vocabulary if w != "<s>"]
    for history in [(), ("<s>",), ("the",), ("<s>", "the"), ("the", "cat"), ("mat", "on"), ("zebra",)]:
        assert sum(10 ** lm.log10_prob(w, history) for w in words) == pytest.approx(1.0, abs=1e-9), history


def test_arpa_file_layout_and_command_line(tmp_path, capsys):
    manifest = tmp_path / "train.json"
    manifest.write_text('{"audio_filepath": "a.wav", "duration": 1, "text": "the cat sat"}\n'
                        '{"audio_filepath": "b.wav", "duration": 1, "text": "the dog"}\n')  # fmt: skip
    main([f"manifest={manifest}", f"output={tmp_path / 'lm.arpa'}", "order=2"])
    assert "Wrote a 2-gram LM" in capsys.readouterr().out
    text = (tmp_path / "lm.arpa").read_text()
    assert text.startswith("\\data\\\nngram 1=7\nngram 2=") and text.rstrip().endswith("\\end\\")
    assert "-99.000000\t<s>\t" in text  # <s> is a history only
    assert sorted(arpa_words(tmp_path / "lm.arpa")) == ["cat", "dog", "sat", "the"]
    with pytest.raises(SystemExit, match="order"):
        main([f"manifest={manifest}", f"output={tmp_path / 'x.arpa'}", "ordr=2"])


# ----------------------------------------------------------------------------------------------- beam search
CHARS = CharTokenizer([" ", "a", "b", "c", "d"])


def _emissions(frames):
    """(1, F, 6) log-probs: each frame a dict of char -> probability, the rest spread over the other outputs."""
    rows = []
    for frame in frames:
        probs = torch.full((6,), 1e-3)
        for char, p in frame.items():
            probs[5 if char == "<b>" else CHARS.vocab.index(char)] = p
        rows.append((probs / probs.sum()).log())
    return torch.stack(rows)[None]


def test_the_lexicon_turns_a_misspelling_into_the_likeliest_word(tmp_path):
    lm = NgramLM.fit(["cab", "bad"], order=2).write_arpa(tmp_path / "lm.arpa")
    # Greedy reads "cad" (not a word); of the words, "cab" (.6 x .9 x .45) beats "bad" (.4 x .9 x .55).
    emissions = _emissions([{"c": 0.6, "b": 0.4}, {"a": 0.9}, {"d": 0.55, "b": 0.45}])
    lengths = torch.tensor([3])
    assert CHARS.decode(greedy_decode(emissions, lengths, blank=5)[0]) == "cad"
    beam = BeamSearchDecoder(CHARS, DecodingConfig(strategy="beam", lm_path=str(lm), lm_weight=0.5))
    assert beam(emissions, lengths) == ["cab"] and beam.lexicon_size == 2
    # Without an LM, beam search keeps the acoustically best spelling.
    assert BeamSearchDecoder(CHARS, DecodingConfig(strategy="beam"))(emissions, lengths) == ["cad"]


def test_the_lm_breaks_acoustic_ties_between_words(tmp_path):
    lm = NgramLM.fit(["cab dab"] * 5 + ["cab cab"], order=2).write_arpa(tmp_path / "lm.arpa")
    tie = [{"c": 0.5, "d": 0.5}, {"a": 0.9}, {"b": 0.9}]
    emissions = _emissions([{"c": 0.9}, {"a": 0.9}, {"b": 0.9}, {" ": 0.9}, *tie])
    beam = BeamSearchDecoder(CHARS, DecodingConfig(strategy="beam", lm_path=str(lm), lm_weight=1.0))
    assert beam(emissions, torch.tensor([7])) == ["cab dab"]  # "dab" follows "cab" 5 times in 6


def test_words_the_tokenizer_cannot_spell_are_left_out_of_the_lexicon(tmp_path):
    texts = [" ".join(["one", "two", "three", "four"][(i * j) % 4] for j in range(5)) for i in range(1, 200)]
    bpe = train_sentencepiece(texts, tmp_path / "bpe", vocab_size=24)
    from speechtrain.common.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(bpe)
    assert spell(tokenizer, "zoo") is None and "".join(spell(tokenizer, "three")).replace("\u2581", "") == "three"
    lm = NgramLM.fit(texts + ["zoo"], order=2).write_arpa(tmp_path / "lm.arpa")
    beam = BeamSearchDecoder(tokenizer, DecodingConfig(strategy="beam", lm_path=str(lm)))
    assert beam.skipped_words == ["zoo"] and beam.lexicon_size == 4


# ------------------------------------------------------------------------------------------ model integration
def _model_config(manifest, lm_path):
    return {
        "size": "debug",
        "tokenizer": {"vocab": [" ", *"0123456789"]},
        "preprocessor": {"n_mels": 16, "dither": 0.0},
        "spec_augment": None,
        "encoder": {"d_model": 16, "num_heads": 2, "num_layers": 1, "subsampling_conv_channels": 8,
                    "subsampling_factor": 2},
        "decoding": {"strategy": "beam", "lm_path": str(lm_path) if lm_path else None, "lm_order": 2},
        "train_ds": {"manifest_filepath": str(manifest), "batch_size": 8, "batch_duration": None, "num_workers": 0},
        "validation_ds": {"manifest_filepath": str(manifest), "batch_size": 16, "batch_duration": None},
    }  # fmt: skip


def test_the_lm_and_tokenizer_read_input_cfg_manifests_once_and_an_engine_view_as_its_split(tmp_path, monkeypatch):
    from types import SimpleNamespace

    import speechtrain.corpora.builtin as synthetic
    from speechtrain.asr.jobs import _training_texts

    a, b, c = (tmp_path / f"{n}.json" for n in "abc")
    for path in (a, b, c):
        path.write_text('{"audio_filepath": "x.wav", "duration": 1.0, "text": "one two"}\n')
    monkeypatch.setattr(synthetic, "resolve_manifest",
                        lambda name: c if str(name) == "builtin:speech/train" else Path(name))  # fmt: skip
    data = SimpleNamespace(manifest_filepath=None, cuts_path=None, is_tarred=False, input_cfg=[
        {"manifest_filepath": str(a), "weight": 2, "repeat": 3},
        {"type": "group", "input_cfg": [{"manifest_filepath": str(b)}, {"manifest_filepath": str(a)}]},
        {"manifest_filepath": "builtin:speech/train@piper", "repeat": 2},
        {"manifest_filepath": "builtin:speech/train"},
    ])  # fmt: skip
    files, _ = _training_texts(data, "an n-gram LM")
    assert files == [("nemo", a.resolve()), ("nemo", c.resolve()), ("nemo", b.resolve())]
    with pytest.raises(ValueError, match="input_cfg manifest to fit"):
        _training_texts(SimpleNamespace(manifest_filepath=None, cuts_path=None, input_cfg=None), "a tokenizer")


def test_a_fitted_lm_travels_in_the_archive_and_validate_reports_both_decodings(tmp_path, dtmf_manifest,
                                                                               monkeypatch):  # fmt: skip
    monkeypatch.setattr(settings, "SPEECHTRAIN_DATASETS_CACHE", tmp_path / "cache")
    decoding = DecodingConfig(strategy="beam", lm_order=2)
    ensure_lm(decoding, str(dtmf_manifest))
    assert decoding.lm_path and str(tmp_path / "cache" / "lms") in decoding.lm_path
    first_fit = Path(decoding.lm_path).stat().st_mtime_ns
    again = DecodingConfig(strategy="beam", lm_order=2)
    ensure_lm(again, str(dtmf_manifest))  # cached
    assert again.lm_path == decoding.lm_path and Path(decoding.lm_path).stat().st_mtime_ns == first_fit

    torch.manual_seed(0)
    model = ConformerCTCModel(_model_config(dtmf_manifest, decoding.lm_path))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))  # an untrained model would only say blank
    audio = [r.recording.sources[0].source for r in read_cuts(LoaderConfig(manifest_filepath=str(dtmf_manifest)))]
    before = model.transcribe(audio[:8])
    words = set(arpa_words(decoding.lm_path))
    assert any(before) and all(w in words for text in before for w in text.split())
    model.save_to(tmp_path / "model.stm")
    Path(decoding.lm_path).unlink()  # the archive carries the LM
    restored = SpeechModel.restore_from(tmp_path / "model.stm")
    assert restored.transcribe(audio[:8]) == before

    def validate(m):
        trainer = Trainer(strategy=MegatronStrategy(), logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False,
                          use_distributed_sampler=False)  # fmt: skip
        return {k: float(v) for k, v in trainer.validate(m, verbose=False)[0].items()}

    beam = validate(restored)
    greedy_cfg = {"decoding": {"strategy": "greedy"}}
    greedy = validate(SpeechModel.restore_from(tmp_path / "model.stm", override_config=greedy_cfg))
    assert beam["val_wer_greedy"] == pytest.approx(greedy["val_wer"]) and "val_wer_greedy" not in greedy
    rows = read_nemo_manifest(dtmf_manifest)
    refs = [r["text"] for r in rows]
    hyps = restored.transcribe([str(dtmf_manifest.parent / r["audio_filepath"]) for r in rows])
    assert beam["val_wer"] == pytest.approx(word_error_rate(hyps, refs))
    assert not math.isnan(beam["val_cer"])
    # The closing report's per-engine breakdown reads validate's greedy transcripts, each found by its cut ID.
    greedy_texts = restored.transcribe([str(dtmf_manifest.parent / r["audio_filepath"]) for r in rows],
                                       strategy="greedy")  # fmt: skip
    assert validation_transcripts(dtmf_manifest, rows, [restored.closing_greedy[0]]) == greedy_texts


def test_decoding_options_are_checked():
    with pytest.raises(ValueError, match="decoding.strategy must be one of greedy, beam"):
        ConformerCTCModel({"size": "debug", "tokenizer": {"vocab": [" ", "a"]}, "decoding": {"strategy": "beams"}})
    with pytest.raises(ConfigError, match="decoding=beams"):
        parse_args(["model_path=m.stm", "audio=a.wav", "decoding=beams"])
    assert parse_args(["model_path=m.stm", "audio=a.wav", "lm_weight=0.5"]).decoding_overrides() == {"lm_weight": 0.5}
