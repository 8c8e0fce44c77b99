import json
import re
import subprocess
import sys

import pytest
import torch

from speechtrain.asr.tokenizer import ctc_min_frames, main
from speechtrain.common.tokenizers import CharTokenizer, SentencePieceTokenizer, load_tokenizer, train_sentencepiece
from speechtrain.corpora.sentences import SentenceGenerator


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


# -- SentencePiece ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sentences():
    return SentenceGenerator(seed=0).sentences(300)


@pytest.fixture(scope="module")
def bpe_path(sentences, tmp_path_factory):
    return train_sentencepiece(sentences, tmp_path_factory.mktemp("bpe"), vocab_size=96)


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_sentencepiece_round_trip(sentences, tmp_path, model_type):
    path = train_sentencepiece(sentences, tmp_path, vocab_size=80, model_type=model_type)
    assert path == tmp_path / "tokenizer.model"
    tokenizer = SentencePieceTokenizer(path)
    assert tokenizer.vocab_size == len(tokenizer.vocab) == 80
    assert tokenizer.vocab[0] == "<unk>"
    lines = (tmp_path / "tokenizer.vocab").read_text(encoding="utf-8").splitlines()
    assert [line.split("\t")[0] for line in lines] == tokenizer.vocab
    used = set()
    for text in sentences:
        ids = tokenizer.encode(text)
        assert all(1 <= i < tokenizer.vocab_size for i in ids)  # never <unk>, never a CTC blank
        assert tokenizer.decode(ids) == text
        used.update(ids)
    assert len(used) > 60
    unseen = "the seventh cat sat on a mat"
    assert tokenizer.decode(torch.tensor(tokenizer.encode(unseen))) == unseen
    assert tokenizer.encode("") == [] and tokenizer.decode([]) == ""


def test_sentencepiece_subwords_shorten_the_sequence(sentences, bpe_path):
    tokenizer = SentencePieceTokenizer(bpe_path)
    tokens = sum(len(tokenizer.encode(text)) for text in sentences)
    assert tokens < 0.7 * sum(len(text) for text in sentences)


def test_sentencepiece_unknown_characters_are_all_named(bpe_path):
    tokenizer = SentencePieceTokenizer(bpe_path)
    with pytest.raises(ValueError, match=re.escape("['!', 'X', 'é']")):
        tokenizer.encode("the X cat é sat!")


def test_sentencepiece_decode_rejects_the_ctc_blank(bpe_path):
    tokenizer = SentencePieceTokenizer(bpe_path)
    with pytest.raises(ValueError, match="id 96 is outside 0..95"):
        tokenizer.decode([5, 96])
    with pytest.raises(ValueError, match="id -1"):
        tokenizer.decode([-1])


def test_sentencepiece_save_load(sentences, bpe_path, tmp_path):
    tokenizer = SentencePieceTokenizer(bpe_path)
    copy = tmp_path / "copy.model"
    tokenizer.save(copy)
    assert copy.read_bytes() == bpe_path.read_bytes()
    for loaded in (SentencePieceTokenizer.load(copy), load_tokenizer(str(copy))):
        assert isinstance(loaded, SentencePieceTokenizer)
        assert loaded == tokenizer and hash(loaded) == hash(tokenizer)
        assert [loaded.encode(t) for t in sentences[:50]] == [tokenizer.encode(t) for t in sentences[:50]]
    # The model lives in memory: saving works after the file is gone.
    copy.unlink()
    loaded.save(copy)
    assert copy.read_bytes() == bpe_path.read_bytes()
    assert repr(tokenizer) == "SentencePieceTokenizer(vocab_size=96)"


def test_training_is_deterministic(sentences, bpe_path, tmp_path):
    again = train_sentencepiece(sentences, tmp_path / "again", vocab_size=96)
    assert again.read_bytes() == bpe_path.read_bytes()
    assert again.with_suffix(".vocab").read_bytes() == bpe_path.with_suffix(".vocab").read_bytes()
    sample = [
        train_sentencepiece(sentences, tmp_path / f"s{i}", 64, max_sentences=150, seed=s)
        for i, s in enumerate([1, 1, 2])
    ]
    assert sample[0].read_bytes() == sample[1].read_bytes()
    assert sample[0].read_bytes() != sample[2].read_bytes()
    # Another process gives the same model (SentencePiece's own sampling would not).
    script = (
        "import sys; from speechtrain.common.tokenizers import train_sentencepiece; "
        "from speechtrain.corpora.sentences import SentenceGenerator; "
        "train_sentencepiece(SentenceGenerator(seed=0).sentences(300), sys.argv[1], 64, max_sentences=150, seed=1)"
    )
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "other")], check=True)
    assert (tmp_path / "other" / "tokenizer.model").read_bytes() == sample[0].read_bytes()


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_too_large_vocabulary_names_the_largest_that_works(sentences, tmp_path, model_type):
    with pytest.raises(ValueError, match=r"support at most \d+ .* choose a smaller vocab_size") as info:
        train_sentencepiece(sentences[:10], tmp_path, vocab_size=5000, model_type=model_type)
    largest = int(re.search(r"at most (\d+)", str(info.value)).group(1))
    path = train_sentencepiece(sentences[:10], tmp_path, vocab_size=largest, model_type=model_type)
    assert SentencePieceTokenizer(path).vocab_size == largest


@pytest.mark.parametrize(
    ("texts", "kwargs", "message"),
    [
        (["abc def"], {"vocab_size": 4}, re.escape("7 characters to cover") + ".*vocab_size >= 8"),
        (["", ""], {}, "no characters"),
        ([], {}, "no characters"),
        (["abc"], {"model_type": "word"}, "'bpe' or 'unigram'"),
        (["abc"], {"vocab_size": 1}, "at least 2"),
        (["abc"], {"character_coverage": 0.0}, "character_coverage"),
        (["abc"], {"max_sentences": 0}, "max_sentences must be positive"),
    ],
)
def test_training_errors(tmp_path, texts, kwargs, message):
    with pytest.raises(ValueError, match=message):
        train_sentencepiece(texts, tmp_path, **kwargs)
    assert not (tmp_path / "tokenizer.model").exists()


def test_load_tokenizer_picks_the_kind(tmp_path):
    chars = CharTokenizer(["a", "b"])
    chars.save(tmp_path / "chars.model")  # the content decides, not the suffix
    assert load_tokenizer(tmp_path / "chars.model") == chars
    (tmp_path / "junk.model").write_bytes(b"\x00\x01junk")
    with pytest.raises(ValueError, match="neither a character vocabulary"):
        load_tokenizer(tmp_path / "junk.model")
    with pytest.raises(FileNotFoundError, match="nope.model"):
        load_tokenizer(tmp_path / "nope.model")
    (tmp_path / "empty.model").write_bytes(b"")
    with pytest.raises(ValueError, match="not a SentencePiece model"):
        SentencePieceTokenizer(tmp_path / "empty.model")
    with pytest.raises(FileNotFoundError, match="nope.model"):
        SentencePieceTokenizer(tmp_path / "nope.model")


# -- CLI -------------------------------------------------------------------------------------------------------


def _write_manifest(path, texts, seconds_per_char):
    lines = [
        json.dumps({"audio_filepath": f"{i}.wav", "duration": seconds_per_char * len(text), "text": text})
        for i, text in enumerate(texts)
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_cli_trains_and_summarizes(sentences, tmp_path, capsys):
    first = _write_manifest(tmp_path / "a.json", sentences[:150], seconds_per_char=0.08)
    second = _write_manifest(tmp_path / "b.json", sentences[150:], seconds_per_char=0.08)
    main(
        ["--manifest", str(first), str(second), "--vocab-size", "96", "--type", "bpe", "--out", str(tmp_path / "tok")]
    )
    out, err = capsys.readouterr()
    lines = out.splitlines()
    path = tmp_path / "tok" / "tokenizer.model"
    assert lines[0] == str(path)
    tokenizer = load_tokenizer(path)
    tokens = sum(len(tokenizer.encode(text)) for text in sentences)
    seconds = 0.08 * sum(len(text) for text in sentences)
    assert "vocab_size: 96 (a CTC model adds the blank at id 96)" in lines
    assert f"utterances: 300, {seconds / 3600:.2f} h of audio" in lines
    assert (
        f"tokens per utterance: {tokens / 300:.1f} ({sum(map(len, sentences)) / tokens:.2f} characters per token)"
        in lines
    )
    assert f"tokens per second of audio: {tokens / seconds:.2f}" in lines
    assert "CTC at 4x subsampling (25 frames/s): 0 utterances have too many tokens" in lines
    assert "CTC at 8x subsampling (12.5 frames/s): 0 utterances have too many tokens" in lines
    assert err == ""


def test_cli_warns_when_ctc_cannot_align(tmp_path, capsys):
    # 20 characters per second of audio: fine for 4x (25 frames/s), too fast for 8x (12.5 frames/s).
    texts = ["abcd efgh ijkl mnopqrst uvwxyz"[: 10 + i] for i in range(20)]
    manifest = _write_manifest(tmp_path / "m.json", texts, seconds_per_char=0.05)
    main(["--manifest", str(manifest), "--vocab-size", "28", "--out", str(tmp_path / "tok")])
    out, err = capsys.readouterr()
    assert "CTC at 4x subsampling (25 frames/s): 0 utterances have too many tokens" in out
    assert "warning: at 8x subsampling 20 of 20 utterances cannot be aligned by CTC" in err
    assert "warning: at 4x" not in err


def test_cli_errors_are_one_line(tmp_path):
    manifest = _write_manifest(tmp_path / "m.json", ["abc", "abd"], seconds_per_char=0.1)
    with pytest.raises(SystemExit, match="^error: .*choose a smaller vocab_size"):
        main(["--manifest", str(manifest), "--vocab-size", "500", "--out", str(tmp_path / "tok")])
    with pytest.raises(SystemExit, match="^error: manifest not found"):
        main(["--manifest", str(tmp_path / "nope.json"), "--out", str(tmp_path / "tok")])


def test_ctc_min_frames_counts_a_blank_between_repeats():
    assert ctc_min_frames([]) == 0
    assert ctc_min_frames([1, 2, 3]) == 3
    assert ctc_min_frames([1, 1, 2, 2, 2]) == 8
