import json
import re

import pytest
import torch

from speechtrain.asr.tokenizers import CharTokenizer


def test_from_texts_sorts_unique_characters():
    tokenizer = CharTokenizer.from_texts(["hello world", "abc"])
    assert tokenizer.vocab == sorted(set("hello worldabc"))
    assert tokenizer.vocab[0] == " "
    assert tokenizer.vocab_size == 11


def test_round_trip_with_spaces():
    tokenizer = CharTokenizer.from_texts(["3 1 4", "1 5 9 2 6"])
    ids = tokenizer.encode("9 2 6 5")
    assert ids == [tokenizer.vocab.index(c) for c in "9 2 6 5"]
    assert all(0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.decode(ids) == "9 2 6 5"
    assert tokenizer.decode(torch.tensor(ids)) == "9 2 6 5"
    assert tokenizer.encode("") == [] and tokenizer.decode([]) == ""


def test_ids_follow_the_given_vocabulary():
    tokenizer = CharTokenizer(["b", "a", " "])
    assert tokenizer.encode("a b") == [1, 2, 0]


def test_unknown_characters_are_all_named():
    tokenizer = CharTokenizer.from_texts(["abc"])
    with pytest.raises(ValueError, match=re.escape("['X', 'Z']")):
        tokenizer.encode("aXbZX")


def test_decode_rejects_the_ctc_blank():
    tokenizer = CharTokenizer(["a", "b"])
    with pytest.raises(ValueError, match="id 2 is outside 0..1"):
        tokenizer.decode([0, 2])
    with pytest.raises(ValueError, match="id -1"):
        tokenizer.decode([-1])


@pytest.mark.parametrize(
    ("vocab", "message"),
    [([], "empty"), (["ab"], "single characters"), ([""], "single characters"), (["a", "b", "a"], "repeated")],
)
def test_invalid_vocabulary(vocab, message):
    with pytest.raises(ValueError, match=message):
        CharTokenizer(vocab)


def test_from_texts_without_characters():
    with pytest.raises(ValueError, match="no characters"):
        CharTokenizer.from_texts(["", ""])


def test_save_load_keeps_space_newline_and_unicode(tmp_path):
    tokenizer = CharTokenizer([" ", "\n", "\t", "é", "ß", '"', "\\", "a"])
    path = tmp_path / "vocab.json"
    tokenizer.save(path)
    text = path.read_text(encoding="utf-8")
    assert json.loads(text) == tokenizer.vocab
    assert "é" in text  # stored as UTF-8, not escaped
    assert len([line for line in text.splitlines() if line not in ("[", "]")]) == tokenizer.vocab_size
    loaded = CharTokenizer.load(path)
    assert loaded == tokenizer
    assert loaded.vocab == tokenizer.vocab
    assert loaded.decode(loaded.encode("a é\n")) == "a é\n"
    assert CharTokenizer.load(str(path)) == tokenizer


def test_load_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "nope.json"))):
        CharTokenizer.load(tmp_path / "nope.json")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"a\nb\n", "not a UTF-8 JSON list"),
        (b"\xff\xfe", "not a UTF-8 JSON list"),
        (b'{"vocab": ["a"]}', "must hold a JSON list"),
        (b'["a", "bc"]', "single characters"),
        (b'["a", 1]', "single characters"),
        (b'["a", "a"]', "repeated"),
        (b"[]", "empty"),
    ],
)
def test_load_corrupt_file(tmp_path, content, message):
    path = tmp_path / "vocab.json"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=message) as info:
        CharTokenizer.load(path)
    assert str(path) in str(info.value)


def test_equality_and_repr():
    assert CharTokenizer(["a", "b"]) == CharTokenizer(["a", "b"])
    assert CharTokenizer(["a", "b"]) != CharTokenizer(["b", "a"])
    assert hash(CharTokenizer(["a"])) == hash(CharTokenizer(["a"]))
    assert repr(CharTokenizer(["a", " "])) == "CharTokenizer(vocab_size=2, vocab='a ')"
