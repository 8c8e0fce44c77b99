"""LLM tokenizer, chat templates and JSONL conversations (speechtrain.speechlm.tokenizer / prompts)."""

import json
import subprocess
import sys

import pytest
from tokenizers import Regex, Tokenizer, models, pre_tokenizers

from speechtrain.speechlm.prompts import (
    AudioRef,
    Llama3Template,
    PlainTemplate,
    Qwen2Template,
    Turn,
    conversation_from_jsonl,
    get_template,
)
from speechtrain.speechlm.tokenizer import AUDIO_PLACEHOLDER, LLMTokenizer, train_bpe_tokenizer

AUDIO = AUDIO_PLACEHOLDER
SPECIALS = [
    "<|begin_of_text|>",  # 0
    "<|end_of_text|>",  # 1
    "<|start_header_id|>",  # 2
    "<|end_header_id|>",  # 3
    "<|eot_id|>",  # 4
    AUDIO,  # 5
    "<|im_start|>",  # 6
    "<|im_end|>",  # 7
    "<|endoftext|>",  # 8
]
WORDS = ["system", "user", "assistant", "\n\n", "\n", " ", "Be", "brief", ".", "Transcribe", ":", "hello", "world"]
# ids: system 9, user 10, assistant 11, "\n\n" 12, "\n" 13, " " 14, Be 15, brief 16, "." 17, Transcribe 18,
# ":" 19, hello 20, world 21, [UNK] 22

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "she sells sea shells by the sea shore",
    "a journey of a thousand miles begins with a single step",
    "to be or not to be that is the question",
    "hello world, hello again!",
]


def word_tokenizer() -> LLMTokenizer:
    """A word-level tokenizer with a fixed vocabulary, so that expected ids can be written by hand."""
    vocab = {token: i for i, token in enumerate(SPECIALS + WORDS + ["[UNK]"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"\s+|\w+|[^\w\s]+"), behavior="isolated")
    tokenizer.add_special_tokens(SPECIALS)
    return LLMTokenizer(tokenizer, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>")


def bpe_tokenizer(special_tokens=SPECIALS) -> LLMTokenizer:
    return train_bpe_tokenizer(CORPUS * 3, vocab_size=400, special_tokens=special_tokens)


def conversation(with_answer: bool = True) -> list[Turn]:
    turns = [Turn("system", "Be brief."), Turn("user", f"Transcribe: {AUDIO}")]
    if with_answer:
        turns.append(Turn("assistant", "hello world"))
    return turns


def trained(ids, mask):
    return [i for i, m in zip(ids, mask) if m]


# ----------------------------------------------------------------------------------------------- tokenizer
def test_bpe_round_trip_exact():
    tok = bpe_tokenizer()
    for text in ["the quick brown fox", "  leading spaces", "\n\nnew lines\nand  tabs\t!", "ünïcödé 日本 🎉", ""]:
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("") == []
    assert tok.encode("the sea")[0] >= len(SPECIALS)  # no automatic bos
    assert len(tok.encode("the sea shore")) < len("the sea shore")  # merges were learned


def test_bpe_special_tokens_first_and_never_split():
    tok = bpe_tokenizer()
    assert [tok.token_to_id(t) for t in SPECIALS] == list(range(len(SPECIALS)))
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.audio_id) == (0, 1, 1, 5)
    ids = tok.encode(f"the{AUDIO}sea<|eot_id|> shore")
    assert ids.count(5) == 1 and ids.count(4) == 1
    assert tok.decode(ids) == "thesea shore"  # special tokens skipped
    with pytest.raises(KeyError, match="<|nope|>"):
        tok.token_to_id("<|nope|>")


def test_bpe_deterministic_across_processes():
    code = (
        "from speechtrain.speechlm.tokenizer import train_bpe_tokenizer; import json;"
        f"t = train_bpe_tokenizer({CORPUS!r} * 3, 400, ['<s>', '</s>']);"
        "print(json.dumps(sorted(t.tokenizer.get_vocab().items())))"
    )
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True) for _ in "ab"]
    assert runs[0].stdout == runs[1].stdout
    here = bpe_tokenizer(["<s>", "</s>"])
    assert json.loads(runs[0].stdout) == [list(kv) for kv in sorted(here.tokenizer.get_vocab().items())]
    assert (here.bos_token, here.eos_token) == ("<s>", "</s>")


def test_save_from_folder_round_trip(tmp_path):
    tok = bpe_tokenizer()
    tok.pad_token = "<|endoftext|>"
    tok.save(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["bos_token"] == "<|begin_of_text|>" and config["pad_token"] == "<|endoftext|>"
    loaded = LLMTokenizer.from_folder(tmp_path)
    assert (loaded.bos_id, loaded.eos_id, loaded.pad_id) == (0, 1, 8)
    assert loaded.vocab_size == tok.vocab_size
    text = "to be or not\n to be " + AUDIO
    assert loaded.encode(text) == tok.encode(text)


def test_from_folder_dict_tokens_and_no_config(tmp_path):
    tok = bpe_tokenizer()
    tok.tokenizer.save(str(tmp_path / "tokenizer.json"))
    bare = LLMTokenizer.from_folder(tmp_path)
    assert bare.bos_id is None and bare.eos_id is None and bare.pad_id is None
    config = {"bos_token": {"content": "<|begin_of_text|>", "lstrip": False}, "eos_token": "<|eot_id|>"}
    config["chat_template"] = "{{ x }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    loaded = LLMTokenizer.from_folder(tmp_path)
    assert (loaded.bos_id, loaded.eos_id, loaded.pad_id) == (0, 4, 4)
    loaded.save(tmp_path / "again")
    assert json.loads((tmp_path / "again" / "tokenizer_config.json").read_text())["chat_template"] == "{{ x }}"
    with pytest.raises(FileNotFoundError):
        LLMTokenizer.from_folder(tmp_path / "missing")


def test_add_special_tokens_grows_vocab():
    tok = train_bpe_tokenizer(CORPUS, 300, ["<s>", "</s>"])
    size = tok.vocab_size
    with pytest.raises(KeyError, match="audioplaceholder"):
        _ = tok.audio_id
    assert tok.add_special_tokens([AUDIO, "<s>", "<|im_end|>", AUDIO]) == 2
    assert tok.vocab_size == size + 2
    assert {tok.audio_id, tok.token_to_id("<|im_end|>")} == {size, size + 1}
    assert tok.encode(f"sea{AUDIO}shore").count(tok.audio_id) == 1
    assert tok.add_special_tokens([AUDIO]) == 0


# ----------------------------------------------------------------------------------------------- templates
def test_llama3_hand_written_ids_and_mask():
    tok = word_tokenizer()
    template = get_template("llama3")
    ids, mask = template.encode(conversation(), tok)
    expected = [0, 2, 9, 3, 12, 15, 14, 16, 17, 4]  # <bot> system: "Be brief."
    expected += [2, 10, 3, 12, 18, 19, 14, 5, 4]  # user: "Transcribe: <audio>"
    expected += [2, 11, 3, 12, 20, 14, 21, 4]  # assistant: "hello world"
    assert ids == expected
    assert mask == [False] * (len(expected) - 4) + [True] * 4
    assert trained(ids, mask) == [20, 14, 21, 4]

    prompt, prompt_mask = template.encode(conversation(with_answer=False), tok, add_generation_prompt=True)
    assert prompt == expected[:-4] and not any(prompt_mask)
    assert template.stop_ids(tok) == [4, 1]
    assert set(template.special_tokens) == set(SPECIALS[:6])


def test_qwen2_hand_written_ids_and_mask():
    tok = word_tokenizer()
    template = get_template("qwen2")
    assert isinstance(template, Qwen2Template)
    ids, mask = template.encode(conversation(), tok)
    expected = [6, 9, 13, 15, 14, 16, 17, 7, 13]  # <|im_start|>system\nBe brief.<|im_end|>\n
    expected += [6, 10, 13, 18, 19, 14, 5, 7, 13]  # user
    expected += [6, 11, 13, 20, 14, 21, 7, 13]  # assistant
    assert ids == expected
    assert mask == [False] * (len(expected) - 5) + [True] * 4 + [False]

    prompt, prompt_mask = template.encode(conversation(with_answer=False), tok, add_generation_prompt=True)
    assert prompt == expected[:-5] and not any(prompt_mask)
    assert template.stop_ids(tok) == [7, 1]
    assert set(template.special_tokens) == {"<|endoftext|>", "<|im_start|>", "<|im_end|>", AUDIO}


def test_qwen2_default_system_option():
    tok = word_tokenizer()
    turns = [Turn("user", "hello"), Turn("assistant", "world")]
    assert (
        get_template("qwen2").render(turns)
        == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\nworld<|im_end|>\n"
    )
    with_system = get_template("qwen2", default_system="Be brief.")
    assert with_system.render(turns).startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user")
    ids, _ = with_system.encode(turns, tok)
    assert ids[:9] == [6, 9, 13, 15, 14, 16, 17, 7, 13]
    # a conversation with its own system turn keeps it
    assert with_system.render([Turn("system", "x"), *turns]).count("system") == 1


def test_llama3_trims_content_and_multi_turn_mask():
    tok = word_tokenizer()
    turns = [Turn("user", " hello\n"), Turn("assistant", "world "), Turn("user", "hello"), Turn("assistant", "world")]
    template = Llama3Template()
    assert template.render(turns).count("<|end_header_id|>\n\nhello<|eot_id|>") == 2
    ids, mask = template.encode(turns, tok)
    assert trained(ids, mask) == [21, 4, 21, 4]
    untrimmed = Llama3Template(trim_content=False).render(turns)
    assert "\n\n hello\n<|eot_id|>" in untrimmed


def test_plain_template():
    tok = word_tokenizer()
    template = get_template("plain")
    turns = [Turn("user", f"Transcribe:{AUDIO}"), Turn("assistant", "hello world")]
    assert template.render(turns, tokenizer=tok) == f"<|begin_of_text|>Transcribe:{AUDIO} hello world<|end_of_text|>"
    ids, mask = template.encode(turns, tok)
    assert ids == [0, 18, 19, 5, 14, 20, 14, 21, 1]
    assert mask == [False] * 4 + [True] * 5  # the space before the answer belongs to it
    prompt, _ = template.encode(turns[:1], tok, add_generation_prompt=True)
    assert prompt == ids[:4]
    assert template.stop_ids(tok) == [1]
    custom = PlainTemplate(bos_token=None, eos_token="<|eot_id|>")
    assert custom.encode(turns, tok)[0][-1] == 4 and custom.special_tokens == ["<|eot_id|>", AUDIO]
    no_eos = LLMTokenizer(tok.tokenizer)
    with pytest.raises(ValueError, match="eos"):
        template.encode(turns, no_eos)


def test_template_errors():
    tok = word_tokenizer()
    with pytest.raises(ValueError, match="llama3.*plain.*qwen2"):
        get_template("chatml")
    with pytest.raises(ValueError, match="user turn"):
        get_template("llama3").encode(conversation(), tok, add_generation_prompt=True)
    with pytest.raises(ValueError, match="Empty"):
        get_template("qwen2").encode([], tok)
    with pytest.raises(ValueError, match="role"):
        Turn("narrator", "hi")
    bare = LLMTokenizer(Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")))
    with pytest.raises(KeyError, match="begin_of_text"):
        get_template("llama3").encode(conversation(), bare)


def test_bpe_mask_marks_exactly_the_answer():
    tok = bpe_tokenizer()
    for name in ("llama3", "qwen2", "plain"):
        template = get_template(name)
        turns = [Turn("user", f"to be or not {AUDIO}"), Turn("assistant", "the sea shore\nhello")]
        ids, mask = template.encode(turns, tok)
        answer = tok.decode(trained(ids, mask))
        assert answer.strip() == "the sea shore\nhello", name
        assert "the sea shore\nhello" in tok.decode(ids)
        assert ids.count(tok.audio_id) == 1


# ------------------------------------------------------------------------------------------------ JSONL
def test_conversation_from_jsonl_groups_items():
    record = {
        "conversations": [
            {"from": "System", "type": "text", "value": "Be brief."},
            {"from": "USER", "type": "text", "value": "Transcribe:"},
            {"from": "user", "type": "audio", "value": "a.wav", "duration": 2.5, "offset": 0.5},
            {"from": "Assistant", "type": "text", "value": "hello world"},
            {"from": "human", "type": "audio", "value": "b.wav"},
            {"from": "gpt", "value": "again"},
        ]
    }
    turns = conversation_from_jsonl(record)
    assert [t.role for t in turns] == ["system", "user", "assistant", "user", "assistant"]
    assert turns[1].content == f"Transcribe: {AUDIO}"
    assert turns[1].audio == [AudioRef("a.wav", 2.5, {"offset": 0.5})]
    assert turns[3].content == AUDIO and turns[3].audio == [AudioRef("b.wav")] and turns[3].num_audio == 1
    assert conversation_from_jsonl(record["conversations"][:4]) == turns[:3]
    assert conversation_from_jsonl(record, sep="\n")[1].content == f"Transcribe:\n{AUDIO}"
    ids, _ = get_template("llama3").encode(turns[:3], word_tokenizer())
    assert ids == [0, 2, 9, 3, 12, 15, 14, 16, 17, 4, 2, 10, 3, 12, 18, 19, 14, 5, 4, 2, 11, 3, 12, 20, 14, 21, 4]


@pytest.mark.parametrize(
    "item, message",
    [
        ({"from": "narrator", "type": "text", "value": "x"}, r"conversations\[1\].*narrator.*assistant"),
        ({"from": "User", "type": "text"}, r"conversations\[1\].*'value'"),
        ({"from": "User", "type": "audio", "value": ""}, r"conversations\[1\].*'value'"),
        ({"from": "User", "type": "video", "value": "x"}, r"conversations\[1\].*video"),
        ({"type": "text", "value": "x"}, r"conversations\[1\].*speaker"),
        ("hello", r"conversations\[1\].*object"),
    ],
)
def test_conversation_from_jsonl_errors(item, message):
    record = {"conversations": [{"from": "User", "type": "text", "value": "ok"}, item]}
    with pytest.raises(ValueError, match=message):
        conversation_from_jsonl(record)


def test_conversation_from_jsonl_empty():
    with pytest.raises(ValueError, match="conversations"):
        conversation_from_jsonl({"conversations": []})
    with pytest.raises(ValueError, match="conversations"):
        conversation_from_jsonl({})


# --------------------------------------------------------------------------------- Hugging Face parity
LLAMA3_JINJA = (
    r"{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    r"message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    r"{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    r"{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
QWEN2_JINJA = (
    r"{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    r"{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    r"{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    r"{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.mark.parametrize(
    "name, jinja, options",
    [
        ("llama3", LLAMA3_JINJA, {}),
        ("qwen2", QWEN2_JINJA, {"default_system": "You are a helpful assistant."}),
    ],
)
def test_matches_hf_apply_chat_template(name, jinja, options):
    transformers = pytest.importorskip("transformers")
    tok = bpe_tokenizer()
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok.tokenizer, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>", chat_template=jinja
    )
    template = get_template(name, **options)
    conversations = [
        [Turn("system", "Be brief."), Turn("user", " to be or\n\nnot "), Turn("assistant", "\nthe sea shore ")],
        [Turn("user", f"hello world, {AUDIO} again!"), Turn("assistant", "a journey"), Turn("user", "of a")],
    ]
    for turns in conversations:
        messages = [{"role": t.role, "content": t.content} for t in turns]
        generate = turns[-1].role == "user"
        text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=generate)
        assert template.render(turns, add_generation_prompt=generate) == text
        ids, _ = template.encode(turns, tok, add_generation_prompt=generate)
        assert ids == hf(text, add_special_tokens=False)["input_ids"]
