import math
import random

import pytest

from speechtrain.common.metrics import (
    char_error_rate,
    char_errors,
    edit_distance,
    format_rate,
    reference_hits,
    word_error_rate,
    word_errors,
)


def _reference_edit_distance(hyp, ref):
    """The textbook dynamic program, as the oracle for the bit-parallel version."""
    table = [[i + j if i * j == 0 else 0 for j in range(len(ref) + 1)] for i in range(len(hyp) + 1)]
    for i in range(1, len(hyp) + 1):
        for j in range(1, len(ref) + 1):
            substitution = table[i - 1][j - 1] + (hyp[i - 1] != ref[j - 1])
            table[i][j] = min(table[i - 1][j] + 1, table[i][j - 1] + 1, substitution)
    return table[-1][-1]


@pytest.mark.parametrize(
    ("hyp", "ref", "distance"),
    [
        ("", "", 0),
        ("abc", "", 3),
        ("", "abc", 3),
        ("kitten", "sitting", 3),
        ("sitting", "kitten", 3),
        ("flaw", "lawn", 2),
        ("aaaa", "aa", 2),
        ("abcdef", "abcdef", 0),
        ("ab", "ba", 2),
    ],
)
def test_edit_distance_known_values(hyp, ref, distance):
    assert edit_distance(hyp, ref) == distance
    assert edit_distance(list(hyp), tuple(ref)) == distance


def test_edit_distance_matches_the_dynamic_program():
    rng = random.Random(0)
    for _ in range(2000):
        alphabet = rng.choice(["ab", "abc ", "abcdefghij "])
        hyp = "".join(rng.choices(alphabet, k=rng.randint(0, 15)))
        ref = "".join(rng.choices(alphabet, k=rng.randint(0, 15)))
        assert edit_distance(hyp, ref) == _reference_edit_distance(hyp, ref), (hyp, ref)
    # Longer than a 64-bit word, on words and on ints.
    for _ in range(20):
        hyp = rng.choices(["the", "cat", "sat", "on", "mat"], k=rng.randint(60, 150))
        ref = rng.choices(["the", "cat", "sat", "on", "mat"], k=rng.randint(60, 150))
        assert edit_distance(hyp, ref) == _reference_edit_distance(hyp, ref)
        ids = [rng.randrange(5) for _ in range(100)]
        assert edit_distance(ids, ids[::-1]) == _reference_edit_distance(ids, ids[::-1])


def test_wer_hand_computed():
    # One deletion ("down") over 4 reference words, then one substitution over 3.
    assert word_errors(["the cat sat"], ["the cat sat down"]) == (1, 4)
    assert word_errors(["the dog sat"], ["the cat sat"]) == (1, 3)
    assert word_error_rate(["the cat sat", "the dog sat"], ["the cat sat down", "the cat sat"]) == pytest.approx(2 / 7)
    # Insertions count, so WER can exceed 1.
    assert word_error_rate(["a b c"], ["x"]) == pytest.approx(3.0)
    # A rate over no reference word is not applicable (NaN, shown as n/a), never 0%.
    assert math.isnan(word_error_rate(["anything"], [""])) and math.isnan(word_error_rate([""], [""]))
    assert math.isnan(char_error_rate([""], [""]))
    assert format_rate(float("nan")) == "n/a" and format_rate(0.0123) == "1.23%"


def test_cer_counts_spaces_as_characters():
    # "the cat sat" -> "the cat sat down": 5 inserted characters (" down") over 16 reference characters.
    assert char_errors(["the cat sat"], ["the cat sat down"]) == (5, 16)
    assert char_errors(["the dog sat"], ["the cat sat"]) == (3, 11)
    # A lost word boundary is one error.
    assert char_errors(["thecat"], ["the cat"]) == (1, 7)
    assert char_error_rate(["the cat sat", "thecat"], ["the cat sat down", "the cat"]) == pytest.approx(6 / 23)
    assert char_error_rate(["Cat"], ["cat"]) == pytest.approx(1 / 3)
    assert math.isnan(char_error_rate(["x"], [""]))


@pytest.mark.parametrize("errors", [word_errors, char_errors])
def test_batch_sizes_must_match(errors):
    with pytest.raises(ValueError, match="2 hypotheses for 1 references"):
        errors(["a", "b"], ["a"])


def test_cer_sums_over_batches():
    hyps = ["hello word", "good bye", ""]
    refs = ["hello world", "goodbye", "hi"]
    whole = char_errors(hyps, refs)
    parts = [char_errors([h], [r]) for h, r in zip(hyps, refs)]
    assert whole == (sum(e for e, _ in parts), sum(n for _, n in parts)) == (1 + 1 + 2, 11 + 7 + 2)


def test_reference_hits_mark_kept_words_and_count_insertions():
    assert reference_hits("the cat sat".split(), "the cat sat".split()) == ([True, True, True], 0)
    assert reference_hits("the bat sat down".split(), "the cat sat".split()) == ([True, False, True], 1)
    assert reference_hits("cat".split(), "the cat sat".split()) == ([False, True, False], 0)
    assert reference_hits([], ["a"]) == ([False], 0)
    assert reference_hits(["a", "b"], []) == ([], 2)
    rng = random.Random(5)
    for _ in range(300):
        ref = [rng.choice("abc") for _ in range(rng.randint(0, 7))]
        hyp = [rng.choice("abcd") for _ in range(rng.randint(0, 7))]
        hits, insertions = reference_hits(hyp, ref)
        assert len(hits) == len(ref)
        assert hits.count(False) + insertions == edit_distance(hyp, ref)
