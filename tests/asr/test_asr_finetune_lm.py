"""Fine-tuning's decoding: the LM after a fine-tune on few new transcripts (the archive's interpolated with theirs),
and a default decoding never worse than greedy on the validation set (the closing report says which and why)."""

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from speechtrain.asr.ctc import ConformerCTCModel
from speechtrain.asr.jobs import FinetuneLMConfig, finetune_lm, mix_weight
from speechtrain.asr.ngram import NgramLM, interpolate
from speechtrain.asr.report import choose_decoding, decoding_report
from speechtrain.common.tokenizers import CharTokenizer

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
VOCAB = [" ", *"abcdefgh"]
RATE, HOP = 16000, 160  # 10 ms frames


def test_interpolation_is_the_mixture_on_stored_ngrams_sums_to_one_and_joins_the_vocabularies():
    old = NgramLM.fit(["the cat sat", "the cat ran", "a dog sat on the mat", "the dog"], order=3)
    new = NgramLM.fit(["press one for billing", "press two for the cat"], order=2)
    mixed = interpolate([(old, 0.7), (new, 0.3)])
    assert mixed.order == 3 and mixed.known == old.known | new.known

    def p(lm, gram):
        return 10 ** lm.log10_prob(gram[-1], gram[:-1]) if gram[-1] in lm.known else 0.0

    for gram in [("the", "cat", "sat"), ("press", "one"), ("for", "the", "cat"), ("billing",), ("the", "mat")]:
        assert p(mixed, gram) == pytest.approx(0.7 * p(old, gram) + 0.3 * p(new, gram), rel=1e-9), gram
    words = sorted(mixed.known - {"<s>"})
    for history in [(), ("<s>",), ("the",), ("the", "cat"), ("press",), ("for", "the"), ("unseen",)]:
        assert sum(10 ** mixed.log10_prob(w, history) for w in words) == pytest.approx(1.0, abs=1e-9), history
    with pytest.raises(ValueError, match=r"weights must be positive and sum to 1, got \[0.7, 0.2\]"):
        interpolate([(old, 0.7), (new, 0.2)])


def _manifest(folder: Path, name: str, texts: list[str]) -> Path:
    rows = [{"audio_filepath": f"{name}{i}.wav", "duration": 1.0, "text": t} for i, t in enumerate(texts)]
    path = folder / f"{name}.json"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_finetune_lm_rule_mixes_the_archive_lm_with_the_new_transcripts(tmp_path, monkeypatch):
    from speechtrain.lightning import settings

    monkeypatch.setattr(settings, "SPEECHTRAIN_DATASETS_CACHE", tmp_path / "cache")
    archive = NgramLM.fit(["the cat sat", "a dog ran"], order=2).write_arpa(tmp_path / "archive.arpa")
    new = _manifest(tmp_path, "new", ["press one", "press two for billing", "press one"])

    def decoding(**kw):
        from omegaconf import OmegaConf

        return OmegaConf.create({"strategy": "beam", "lm_path": None, "lm_order": 2, **kw})

    cfg = decoding()
    said = finetune_lm(cfg, str(new), str(archive), FinetuneLMConfig())
    assert "interpolated with a 2-gram fitted on the 3 new transcripts" in said and "lm.use=auto" in said
    assert f"weight {mix_weight(3):.3g} on the new" in said
    lm = NgramLM.read_arpa(cfg.lm_path)
    assert {"cat", "dog", "press", "billing"} <= lm.known, "the lexicon is both LMs' words"
    assert finetune_lm(decoding(), str(new), str(archive), FinetuneLMConfig()) == said  # cached, same answer

    cfg = decoding()
    assert "alone (lm.use=new)" in finetune_lm(cfg, str(new), str(archive), FinetuneLMConfig(use="new"))
    assert "cat" not in NgramLM.read_arpa(cfg.lm_path).known
    cfg = decoding()
    assert "kept (lm.use=archive)" in finetune_lm(cfg, str(new), str(archive), FinetuneLMConfig(use="archive"))
    assert cfg.lm_path == str(archive)
    cfg = decoding()
    assert "without an LM" in finetune_lm(cfg, str(new), str(archive), FinetuneLMConfig(use="none"))
    assert (cfg.lm_path, cfg.lm_order) == (None, 0)
    cfg = decoding()
    assert "alone (the archive has no LM)" in finetune_lm(cfg, str(new), None, FinetuneLMConfig())
    cfg = decoding(lm_path=str(archive))
    assert "as given" in finetune_lm(cfg, str(new), None, FinetuneLMConfig()) and cfg.lm_path == str(archive)
    assert finetune_lm(decoding(strategy="greedy"), str(new), str(archive), FinetuneLMConfig()) == ""
    with pytest.raises(ValueError, match="lm.use=mix: the pretrained archive has no LM"):
        finetune_lm(decoding(), str(new), None, FinetuneLMConfig(use="mix"))
    with pytest.raises(ValueError, match="lm.use=best: expected one of auto, mix"):
        finetune_lm(decoding(), str(new), None, FinetuneLMConfig(use="best"))
    with pytest.raises(ValueError, match=r"lm.new_weight=1.5: .* in \(0, 1\)"):
        finetune_lm(decoding(), str(new), None, FinetuneLMConfig(new_weight=1.5))


def test_the_default_decoding_is_beam_only_where_it_is_not_worse_than_greedy_on_the_first_set():
    worse = choose_decoding("beam", {"val_wer": 0.5, "val_wer_greedy": 0.3, "val_wer_test": 0.1}, "dev")
    assert worse.strategy == "greedy"
    assert "worse than greedy on dev: 50.00% beam + LM vs 30.00% greedy WER" in worse.reason
    better = choose_decoding("beam", {"val_wer": 0.2, "val_wer_greedy": 0.3}, "dev")
    assert better.strategy == "beam" and "not worse" in better.reason
    assert choose_decoding("beam", {"val_wer": 0.3, "val_wer_greedy": 0.3}, "dev").strategy == "beam"  # a tie
    assert choose_decoding("greedy", {"val_wer": 0.3}, "dev").reason == ""
    assert choose_decoding("beam", {"val_wer": math.nan, "val_wer_greedy": 0.3}, "dev").strategy == "beam"


# ----------------------------------------------------------------------------------------- end to end, tiny model
# Each 10 ms frame of the audio holds a code (its value x 10): what the scripted model "hears" there.
AMBIGUOUS = len(VOCAB) + 1  # the code of a frame that sounds a little more like "e" than "a"


def _table() -> torch.Tensor:
    """log-probabilities per code: 0 = blank, k = the character VOCAB[k - 1] (clear), AMBIGUOUS = e 0.5, a 0.4."""
    blank = len(VOCAB)
    probs = torch.full((AMBIGUOUS + 1, blank + 1), 0.01)
    probs[0, blank] = 1.0
    for k in range(1, len(VOCAB) + 1):
        probs[k, k - 1] = 1.0
    probs[AMBIGUOUS, VOCAB.index("e")], probs[AMBIGUOUS, VOCAB.index("a")] = 0.5, 0.4
    return torch.log(probs / probs.sum(-1, keepdim=True))


class ScriptedCTC(ConformerCTCModel):
    """A tiny Conformer-CTC whose output is the script written into its audio (:func:`_say`): greedy decoding then
    hears exactly that, and beam search with an LM decides the ambiguous frames. A learnable scale keeps training
    real (a loss with a gradient)."""

    def build_layers(self) -> None:
        super().build_layers()
        self.scale = torch.nn.Parameter(torch.ones(()))

    def forward(self, audio: torch.Tensor, audio_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._built()
        frames = audio.shape[1] // HOP
        codes = torch.round(audio[:, HOP // 2 :: HOP][:, :frames] * 10).long().clamp(0, AMBIGUOUS)
        log_probs = torch.log_softmax(_table().to(audio.device)[codes] * self.scale, -1)
        return log_probs, audio_lens // HOP

    def host_lengths(self, batch, lengths):
        return lengths.cpu(), batch["token_lens"].cpu()

    def every_parameter_gets_a_gradient(self) -> bool:
        return False


def _say(path: Path, text: str, ambiguous: str = "") -> None:
    """Audio that says ``text`` to :class:`ScriptedCTC`: 3 frames per character, 2 blank frames between; a
    character of a word in ``ambiguous`` that is an "a" sounds like "e or a"."""
    codes = [0] * 5
    for word in text.split():
        for char in word:
            code = AMBIGUOUS if char == "a" and word in ambiguous.split() else VOCAB.index(char) + 1
            codes += [code] * 3 + [0] * 2
        codes += [VOCAB.index(" ") + 1] * 2 + [0] * 2
    codes += [0] * 5
    sf.write(path, np.repeat(np.array(codes, dtype=np.float32) / 10, HOP), RATE, subtype="FLOAT")


def _data(folder: Path, name: str, texts: list[str], ambiguous: str = "") -> Path:
    rows = []
    for i, text in enumerate(texts):
        _say(folder / f"{name}{i}.wav", text, ambiguous)
        audio = folder / f"{name}{i}.wav"
        rows.append({"audio_filepath": str(audio), "duration": sf.info(audio).duration, "text": text})
    path = folder / f"{name}.json"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("archive_text", ["fig hag gag", "cab bad dab fed"], ids=["lm_hurts", "lm_helps"])
def test_a_finetune_whose_lm_hurts_defaults_to_greedy_and_one_whose_lm_helps_keeps_beam(
    tmp_path, monkeypatch, archive_text
):
    """The archive's LM knows the validation set's words (helps: it turns the ambiguous "bed" into "bad") or not
    (hurts: fitted on unrelated text, its lexicon cannot spell them); the new transcripts are other words. The
    fine-tune's closing validation compares beam + LM with greedy on its validation set and keeps the better one as
    the archive's default decoding; the report says which and which LM."""
    from speechtrain.core.hydra_runner import compose_config
    from speechtrain.lightning import CallbackGroup, settings

    monkeypatch.setattr(settings, "SPEECHTRAIN_DATASETS_CACHE", tmp_path / "cache")
    torch.manual_seed(0)
    tokenizer = tmp_path / "chars.json"
    CharTokenizer(VOCAB).save(tokenizer)
    base = ScriptedCTC({"size": "debug", "tokenizer": {"path": str(tokenizer)}, "preprocessor": {"dither": 0.0},
                        "interctc": {"apply_at_layers": [], "loss_weights": [], "self_conditioning": False},
                        "encoder": {"time_reduce_idx": -1, "time_recovery_idx": -1},
                        "decoding": {"strategy": "beam", "lm_order": 2,
                                     "lm_path": str(NgramLM.fit(archive_text.split(), order=2).write_arpa(
                                         tmp_path / "archive.arpa"))}})  # fmt: skip
    base.configure_model()
    base.save_to(tmp_path / "base.stm")
    train = _data(tmp_path, "train", ["ace head", "face"])
    dev = _data(tmp_path, "dev", ["cab bad", "bad dab"], ambiguous="bad")
    spec = importlib.util.spec_from_file_location("asr_finetune_example", EXAMPLES / "asr_finetune.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    overrides = [f"init_from.path={tmp_path / 'base.stm'}", f"exp_manager.exp_dir={tmp_path / 'exp'}",
                 "trainer.max_epochs=null", "trainer.max_steps=1", "trainer.enable_progress_bar=false",
                 "trainer.enable_model_summary=false", "trainer.accelerator=cpu",
                 "exp_manager.checkpoint_callback_params.save_top_k=0", "model.optim.lr=1e-6",
                 "model.optim.sched.warmup_steps=0", f"model.train_ds.manifest_filepath={train}",
                 "model.train_ds.batch_size=2", "model.train_ds.batch_duration=null", "model.train_ds.num_workers=0",
                 f"model.validation_ds.manifest_filepath={dev}", "model.validation_ds.num_workers=0"]  # fmt: skip
    cfg = compose_config(EXAMPLES / "conf", "asr_finetune", overrides, module.FINETUNE_SCHEMA)
    try:
        module.main(cfg)
    finally:
        CallbackGroup.get_instance().callbacks.clear()
    (archive,) = (tmp_path / "exp").rglob("asr_finetune.stm")
    report = (archive.parent / "decoding_report.md").read_text()
    closing = json.loads((archive.parent / "final_metrics.json").read_text())
    assert closing["val_wer_greedy"] == pytest.approx(0.5)  # "bed" for "bad": two of the four words
    assert "LM: the archive's (" in report and "interpolated with a 2-gram fitted on the 2 new transcripts" in report
    tuned = ScriptedCTC.restore_from(archive)
    if archive_text.startswith("fig"):
        assert closing["val_wer"] > closing["val_wer_greedy"]
        assert report.startswith("Default decoding: greedy (beam + LM was worse than greedy on dev")
        assert tuned.cfg.decoding.strategy == "greedy", "the archive's default decoding"
    else:
        assert closing["val_wer"] == 0.0
        assert report.startswith("Default decoding: beam + LM (beam + LM was not worse than greedy on dev")
        assert tuned.cfg.decoding.strategy == "beam"
    assert Path(tuned.cfg.decoding.lm_path).is_file()  # the mixed LM travels in the archive either way


def test_report_names_the_lm_and_the_default_decoding(tmp_path):
    class Cfg:
        class decoding:  # noqa: N801
            strategy, lm_path = "greedy", None

    class Model:
        cfg = Cfg()
        lm_origin = "the archive's (12 words), kept (lm.use=archive)"

        def text_normalizer(self, text):
            return text

    metrics = {"val_wer": 0.5, "val_wer_greedy": 0.3, "val_cer": 0.2, "val_cer_greedy": 0.1}
    choice = choose_decoding("beam", metrics, "dev")
    report = decoding_report(Model(), metrics, [("dev", tmp_path / "none.json")], {}, choice)
    lines = report.splitlines()
    assert lines[0].startswith("Default decoding: greedy (beam + LM was worse than greedy on dev")
    assert lines[1] == "LM: the archive's (12 words), kept (lm.use=archive)."
    assert "dev | 30.00% | 10.00% | 50.00% | 20.00% | n/a | n/a" in lines


def test_interpolated_lm_loads_in_the_ctc_beam_search(tmp_path):
    from speechtrain.asr.decoding import BeamSearchDecoder, DecodingConfig

    pytest.importorskip("flashlight.lib.text")
    old = NgramLM.fit(["cab bad", "dab"], order=2)
    new = NgramLM.fit(["fed", "bed cab"], order=2)
    path = interpolate([(old, 0.5), (new, 0.5)]).write_arpa(tmp_path / "mix.arpa")
    decoder = BeamSearchDecoder(CharTokenizer(VOCAB), DecodingConfig(strategy="beam", lm_path=str(path)))
    assert decoder.lexicon_size == 5
