"""WER/CER normalisation options (case, punctuation, numbers): what they do and where they are used."""

import pytest

from speechtrain.asr.transcribe import parse_args, summarize
from speechtrain.common.metrics import TextNormalizer, WerConfig, word_error_rate


@pytest.mark.parametrize(
    ("cfg", "text", "expected"),
    [
        (WerConfig(), "Hello, World!", "Hello, World!"),
        (WerConfig(lowercase=True), "Hello, World!", "hello, world!"),
        (WerConfig(remove_punctuation=True), "Don't (ever) stop -- 3.5% of 1,000!", "Don't ever stop 3.5% of 1,000"),
        (
            WerConfig(True, True, True),
            "Twenty-five cats, one hundred dogs; 1,000 birds.",
            "25 cats 100 dogs 1000 birds",
        ),
        (WerConfig(True, False, True), "three point five percent", "3.5%"),
    ],
)
def test_each_option_does_what_it_says(cfg, text, expected):
    assert TextNormalizer(cfg)(text) == expected


def test_normalised_wer_forgives_only_the_chosen_differences():
    refs, hyps = ["The cat sat, twenty five times."], ["the cat sat 25 times"]
    assert word_error_rate(hyps, refs) == pytest.approx(5 / 6)
    norm = TextNormalizer(WerConfig(lowercase=True, remove_punctuation=True, numbers=True))
    assert word_error_rate([norm(h) for h in hyps], [norm(r) for r in refs]) == 0.0
    assert norm.describe() == "lowercase, no punctuation, numbers as digits"
    with pytest.raises(ValueError, match="wer.numbers=true needs wer.lowercase=true"):
        TextNormalizer(WerConfig(numbers=True))


def test_transcription_reports_with_the_choice_recorded():
    rows = [{"audio_filepath": "a.wav", "duration": 1.0, "text": "Hello, World!", "pred_text": "hello world"}]
    plain = summarize(rows, 1.0)[1]
    assert plain.startswith("WER 100.00%") and plain.endswith("transcripts as written")
    normalised = summarize(rows, 1.0, TextNormalizer({"lowercase": True, "remove_punctuation": True}))[1]
    assert normalised.startswith("WER 0.00%") and normalised.endswith("transcripts lowercase, no punctuation")
    cfg = parse_args(["model_path=m.stm", "audio=a.wav", "wer.lowercase=true"])
    assert cfg.wer.lowercase is True and cfg.wer.numbers is False
