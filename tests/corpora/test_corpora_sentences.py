import os
import re
import subprocess
import sys
from collections import Counter

import pytest

from speechtrain.corpora import sentences
from speechtrain.corpora.sentences import (
    TEMPLATES,
    SentenceGenerator,
    normalize_transcript,
    spell_digits,
    spell_number,
    spell_ordinal,
    spell_year,
    split_of,
)

TRANSCRIPT_RE = re.compile(r"[a-z']+(?: [a-z']+)*")


@pytest.fixture(scope="module")
def corpus():
    """20,000 sentences of seed 0 (generated once for the module)."""
    return SentenceGenerator(0).sentences(20_000)


@pytest.mark.parametrize(
    ("n", "words"),
    [
        (0, "zero"),
        (7, "seven"),
        (13, "thirteen"),
        (20, "twenty"),
        (21, "twenty one"),
        (100, "one hundred"),
        (105, "one hundred and five"),
        (110, "one hundred and ten"),
        (999, "nine hundred and ninety nine"),
        (1000, "one thousand"),
        (1005, "one thousand and five"),
        (1100, "one thousand one hundred"),
        (2024, "two thousand and twenty four"),
        (100_001, "one hundred thousand and one"),
        (1_000_000, "one million"),
        (1_000_005, "one million and five"),
        (2_000_050, "two million and fifty"),
        (
            123_456_789,
            "one hundred and twenty three million four hundred and fifty six thousand seven hundred and eighty nine",
        ),
        (
            999_999_999,
            "nine hundred and ninety nine million nine hundred and ninety nine thousand nine hundred and ninety nine",
        ),
    ],
)
def test_spell_number_british_style(n, words):
    assert spell_number(n) == words


@pytest.mark.parametrize("n", [-1, 1_000_000_000, 10**12])
def test_spell_number_rejects_values_outside_range(n):
    with pytest.raises(ValueError):
        spell_number(n)


@pytest.mark.parametrize("n", [1.0, "7", True, None])
def test_spell_number_rejects_non_integers(n):
    with pytest.raises(TypeError):
        spell_number(n)


@pytest.mark.parametrize(
    ("n", "words"),
    [(1, "first"), (2, "second"), (3, "third"), (5, "fifth"), (8, "eighth"), (9, "ninth"), (12, "twelfth")]
    + [(20, "twentieth"), (21, "twenty first"), (31, "thirty first"), (100, "one hundredth")]
    + [(101, "one hundred and first"), (1_000_000, "one millionth")],
)
def test_spell_ordinal(n, words):
    assert spell_ordinal(n) == words


@pytest.mark.parametrize(
    ("year", "words"),
    [
        (1066, "ten sixty six"),
        (1900, "nineteen hundred"),
        (1905, "nineteen oh five"),
        (1984, "nineteen eighty four"),
        (2000, "two thousand"),
        (2005, "two thousand and five"),
        (2010, "twenty ten"),
        (2024, "twenty twenty four"),
    ],
)
def test_spell_year(year, words):
    assert spell_year(year) == words


def test_spell_digits_reads_each_digit():
    assert spell_digits("0712") == "zero seven one two"
    for bad in ("", "12a", "１２"):
        with pytest.raises(ValueError):
            spell_digits(bad)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Hello, World!", "hello world"),
        ("It's 2024.", "it's two thousand and twenty four"),
        ("well-known   fact ", "well known fact"),
        ("Café au lait", "cafe au lait"),
        ("'quoted' text", "quoted text"),
        ("don’t", "don't"),
        ("room 007", "room zero zero seven"),
        ("the 3rd of May", "the third of may"),
        ("1,500 people", "one thousand five hundred people"),
        ("pi is 3.14", "pi is three point one four"),
        ("50% & more", "fifty percent and more"),
        ("call 12345678901", "call one two three four five six seven eight nine zero one"),
        ("ABC123def", "abc one hundred and twenty three def"),
        ("Straße", "strasse"),
        ("   ", ""),
        ("---", ""),
    ],
)
def test_normalize_transcript(text, expected):
    assert normalize_transcript(text) == expected


def test_normalize_transcript_is_idempotent():
    for text in ("It's 2024, isn't it?", "A-B-C 1st 2nd", "Zoë's 3 cafés"):
        once = normalize_transcript(text)
        assert normalize_transcript(once) == once
        assert TRANSCRIPT_RE.fullmatch(once)


def test_there_are_many_sentence_patterns():
    assert len(TEMPLATES) >= 40
    assert len(set(TEMPLATES)) == len(TEMPLATES)


def test_same_seed_gives_same_sentences_and_other_seed_differs():
    a = SentenceGenerator(seed=5).sentences(300)
    b = SentenceGenerator(seed=5).sentences(300)
    c = SentenceGenerator(seed=6).sentences(300)
    assert a == b
    assert a != c
    assert len(set(a) & set(c)) < 30


def test_sentences_are_unique_across_calls_and_batches_concatenate():
    whole = SentenceGenerator(seed=2).sentences(500)
    gen = SentenceGenerator(seed=2)
    parts = gen.sentences(200) + gen.sentences(0) + gen.sentences(300)
    assert parts == whole
    assert len(set(whole)) == len(whole)
    with pytest.raises(ValueError):
        gen.sentences(-1)


def test_single_sentences_are_valid_and_deterministic():
    a, b = SentenceGenerator(9), SentenceGenerator(9)
    for _ in range(200):
        text = a.sentence()
        assert text == b.sentence()
        assert sentences.MIN_WORDS <= len(text.split()) <= sentences.MAX_WORDS


def test_output_does_not_depend_on_python_hash_seed():
    code = (
        "from speechtrain.corpora.sentences import SentenceGenerator\n"
        "print('|'.join(SentenceGenerator(3).sentences(300)))"
    )
    outputs = set()
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        outputs.add(result.stdout)
    assert len(outputs) == 1
    assert outputs.pop().strip() == "|".join(SentenceGenerator(3).sentences(300))


def test_corpus_sentences_are_unique_normalized_and_of_sensible_length(corpus):
    assert len(corpus) == len(set(corpus)) == 20_000
    for text in corpus:
        assert normalize_transcript(text) == text, text
        assert TRANSCRIPT_RE.fullmatch(text), text
        assert 4 <= len(text.split()) <= 25, text


def test_corpus_spells_numbers_out(corpus):
    assert not any(ch.isdigit() for text in corpus for ch in text)
    words = Counter(word for text in corpus for word in text.split())
    for number_word in ("hundred", "thousand", "twenty", "seven", "zero", "fifteen", "first"):
        assert words[number_word] > 0, number_word


def test_corpus_vocabulary_is_broad(corpus):
    words = {word for text in corpus for word in text.split()}
    assert len(words) >= 2000
    # Not dominated by a few frames: the most common sentence opening covers a small share.
    openings = Counter(" ".join(text.split()[:2]) for text in corpus)
    assert openings.most_common(1)[0][1] < 0.05 * len(corpus)


def test_corpus_mixes_statements_questions_and_imperatives(corpus):
    first = Counter(text.split()[0] for text in corpus)
    for word in ("did", "does", "have", "how", "what", "please", "when", "if", "the", "i", "it"):
        assert first[word] > 20, word


def test_vocabulary_tables_are_clean():
    for noun, plural in sentences.OBJECTS + sentences.FOODS + sentences.ANIMALS + sentences.PROFESSIONS:
        assert TRANSCRIPT_RE.fullmatch(noun) and TRANSCRIPT_RE.fullmatch(plural)
    for forms in sentences.THING_VERBS + sentences.PERSON_VERBS + sentences.INTRANSITIVE_VERBS:
        assert len(forms) == 5
    # Irregular forms are stored, not derived.
    verbs = {forms[0]: forms for forms in sentences.THING_VERBS + sentences.INTRANSITIVE_VERBS}
    assert verbs["buy"] == ("buy", "buys", "bought", "bought", "buying")
    assert verbs["swim"] == ("swim", "swims", "swam", "swum", "swimming")
    assert dict(sentences.OBJECTS)["knife"] == "knives"
    assert dict(sentences.ANIMALS)["mouse"] == "mice"


def test_generating_30000_sentences_gives_30000_and_the_same_again():
    # (its speed is not asserted here: figures come from benchmarks, not from timing asserts that flake under load)
    batch = SentenceGenerator(11).sentences(30_000)
    assert len(batch) == 30_000 and batch[:100] == SentenceGenerator(11).sentences(100)


def test_split_of_is_deterministic_and_follows_fractions(corpus):
    fractions = {"train": 0.9, "dev": 0.05, "test": 0.05}
    splits = [split_of(text, fractions) for text in corpus]
    assert splits == [split_of(text, dict(fractions)) for text in corpus]
    counts = Counter(splits)
    assert set(counts) == set(fractions)
    for name, fraction in fractions.items():
        assert abs(counts[name] / len(corpus) - fraction) < 0.01, (name, counts)


def test_split_of_depends_on_normalized_text_and_seed(corpus):
    fractions = {"a": 1.0, "b": 1.0}
    assert split_of("Hello, World!", fractions) == split_of("hello world", fractions)
    by_seed = [split_of(text, fractions, seed=1) for text in corpus[:2000]]
    by_default = [split_of(text, fractions) for text in corpus[:2000]]
    assert by_seed != by_default
    assert 900 < by_seed.count("a") < 1100


def test_split_of_skips_empty_splits_and_validates():
    texts = SentenceGenerator(4).sentences(500)
    assert {split_of(t, {"train": 1.0, "dev": 0.0, "test": 0.0}) for t in texts} == {"train"}
    assert {split_of(t, {"dev": 0.0, "train": 3.0}) for t in texts} == {"train"}
    for bad in ({}, {"train": -0.1, "dev": 1.0}, {"train": 0.0}, {"train": float("nan")}):
        with pytest.raises(ValueError):
            split_of("some sentence", bad)
