import json
from pathlib import Path

import pytest

from speechtrain.asr.ngram import NgramLM
from speechtrain.asr.report import decoding_report, lm_statistics


def test_lm_statistics_counts_oov_and_matches_a_hand_computed_perplexity():
    lm = NgramLM.fit(["a b", "a c", "b c"], order=1)
    oov, ppl = lm_statistics(lm, ["a b", "a zzz c"])
    assert oov == pytest.approx(1 / 5)  # zzz: one of five running words
    # Unigrams: the unknown word is skipped (and resets the context); every known word and each </s> is scored.
    scored = ["a", "b", "</s>", "a", "c", "</s>"]
    expected = 10 ** (-sum(lm.log10_prob(w) for w in scored) / len(scored))
    assert ppl == pytest.approx(expected)


def test_report_puts_greedy_first_and_breaks_down_by_engine(tmp_path):
    import numpy as np
    import soundfile as sf
    import torch

    class Cfg:
        class decoding:  # noqa: N801
            strategy, lm_path = "beam", None

    class Model(torch.nn.Module):  # transcribes the first utterance right and the others as "x"
        cfg = Cfg()

        def text_normalizer(self, text):
            return text.lower()

        def transcribe(self, paths, batch_size, strategy):
            assert strategy == "greedy"
            return ["hello world"] + ["x"] * (len(paths) - 1)

    sf.write(tmp_path / "a.wav", np.zeros(160, dtype=np.float32), 16000)
    rows = [{"text": "hello world", "engine": "piper", "voice": "piper:joe"},
            {"text": "one two", "engine": "espeak", "voice": "en+m1"},
            {"text": "three", "engine": "espeak", "voice": "en+f2"}]  # fmt: skip
    rows = [{"audio_filepath": "a.wav", "duration": 0.01, **r} for r in rows]
    (tmp_path / "manifest.json").write_text("".join(json.dumps(r) + "\n" for r in rows))
    metrics = {"val_wer_greedy_test": 0.5, "val_cer_greedy_test": 0.25, "val_wer_test": 0.1, "val_cer_test": 0.05}
    report = decoding_report(Model(), metrics, [("test", tmp_path / "manifest.json"), ("dev", tmp_path / "no")])
    lines = report.splitlines()
    assert lines[0] == "LM: none: beam search without an LM."  # which LM the beam search used, above the table
    table = lines.index("") + 1
    assert lines[table].startswith("set | greedy WER | greedy CER | beam+LM WER")
    assert lines[table + 2] == "test | 50.00% | 25.00% | 10.00% | 5.00% | n/a | n/a"
    assert "test | piper | 0.00% | 1" in report and "test | espeak | 100.00% | 2" in report
    assert "test | espeak / en+m1 | 100.00% | 1" in report


class _EchoModel:
    """Greedy "decoding" that reads each utterance's transcript back from its file name: ``<i>.wav`` -> the i-th
    text, except the espeak ones it gets wrong; it records the files it decoded."""

    def __init__(self, texts):
        self.texts, self.decoded = texts, []

    def text_normalizer(self, text):
        return text.lower()

    def transcribe(self, paths, batch_size, strategy):
        assert strategy == "greedy"
        if any(Path(p).stem == "broken" for p in paths):
            raise RuntimeError("Error opening 'broken.wav': Format not recognised.")
        ids = [int(Path(p).stem) for p in paths]
        self.decoded += ids
        return [("x " if i % 3 == 0 else "") + self.texts[i] for i in ids]


def _breakdown_manifest(folder):
    rows = [{"audio_filepath": f"{i}.wav", "duration": 1.0 + (i * 7) % 5, "text": f"word{i} w",
             "engine": ["espeak", "piper", "festival"][i % 3], "voice": f"v{i % 2}"} for i in range(23)]  # fmt: skip
    (folder / "m.json").write_text("".join(json.dumps(r) + "\n" for r in rows))
    broken = [rows[0], {**rows[1], "audio_filepath": "broken.wav"}, rows[2]]  # the file of rank 1's share
    (folder / "broken.json").write_text("".join(json.dumps(r) + "\n" for r in broken))
    return [r["text"] for r in rows]


def _breakdown_rank(rank, folder, port):  # one of two gloo ranks, no Megatron state
    import torch

    from speechtrain.asr.report import greedy_breakdowns

    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        model = _EchoModel(_breakdown_manifest_texts(folder))
        result = greedy_breakdowns(model, [("test", folder / "m.json"), ("none", folder / "missing.json")])
        broken = greedy_breakdowns(_EchoModel(model.texts), [("broken", folder / "broken.json")])
        # The closing validation's transcripts, this rank's half of them: gathered, nothing is decoded again.
        reused = greedy_breakdowns(
            _NoDecoding(), [("test", folder / "m.json")], [_validation_share(model, rank, 2, folder)]
        )
        (folder / f"rank{rank}.json").write_text(json.dumps({"result": result, "decoded": model.decoded,
                                                             "broken": broken, "reused": reused}))  # fmt: skip
        # Neither rank tears gloo down while the other may still be sending (a SIGABRT in teardown, seen once in CI
        # on a loaded machine).
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


class _NoDecoding:
    def text_normalizer(self, text):
        return text.lower()

    def transcribe(self, paths, batch_size, strategy):
        raise AssertionError("decoded again")


def _validation_share(model, rank, size, folder):
    """What a closing validation leaves one of ``size`` ranks: {cut id: greedy text} of every size-th utterance of
    ``folder``'s m.json, the cut IDs as the manifest's lines get them, the texts as ``model`` hears them."""
    from speechtrain.data.nemo_adapters import manifest_cut_ids

    records = [json.loads(line) for line in (folder / "m.json").read_text().splitlines()]
    ids = manifest_cut_ids(folder / "m.json", records)
    texts = _EchoModel(model.texts).transcribe([f"{i}.wav" for i in range(23)], 16, "greedy")
    return {ids[i]: texts[i] for i in range(rank, 23, size)}


def _breakdown_manifest_texts(folder):
    return [json.loads(line)["text"] for line in (folder / "m.json").read_text().splitlines()]


@pytest.mark.multiprocess
def test_greedy_breakdowns_share_the_decoding_over_data_parallel_ranks_and_agree_with_one_process(tmp_path):
    import socket

    import torch.multiprocessing as mp

    from speechtrain.asr.report import greedy_breakdowns

    texts = _breakdown_manifest(tmp_path)
    single = _EchoModel(texts)
    expected = greedy_breakdowns(single, [("test", tmp_path / "m.json")])
    assert sorted(single.decoded) == list(range(23))
    assert expected["test"]["espeak"] == (pytest.approx(0.5), 8)  # one insertion per two-word transcript
    assert expected["test"]["piper"] == (0.0, 8) and expected["test"]["festival / v1"] == (0.0, 3)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_breakdown_rank, args=(tmp_path, port), nprocs=2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, seen in enumerate(ranks):  # every rank has the whole breakdown, from its half of the decoding
        # A file one rank cannot read leaves that set's breakdown out on every rank; nobody waits for the failed one.
        assert seen["broken"] == {"broken": {}}
        assert {k: {g: tuple(v) for g, v in b.items()} for k, b in seen["result"].items()} == expected
        assert sorted(seen["decoded"]) == list(range(rank, 23, 2))
        assert {k: {g: tuple(v) for g, v in b.items()} for k, b in seen["reused"].items()} == expected
    # longest first within each share (fewer padded frames per batch)
    durations = [1.0 + (i * 7) % 5 for i in ranks[0]["decoded"]]
    assert durations == sorted(durations, reverse=True)


def test_the_breakdown_reads_the_closing_validations_transcripts_and_decodes_only_where_one_is_missing(tmp_path):
    from speechtrain.asr.report import greedy_breakdowns, validation_transcripts

    texts = _breakdown_manifest(tmp_path)
    expected = greedy_breakdowns(_EchoModel(texts), [("test", tmp_path / "m.json")])
    share = _validation_share(_EchoModel(texts), 0, 1, tmp_path)
    assert greedy_breakdowns(_NoDecoding(), [("test", tmp_path / "m.json")], [share]) == expected
    records = [json.loads(line) for line in (tmp_path / "m.json").read_text().splitlines()]
    ids = list(share)
    m = tmp_path / "m.json"
    assert validation_transcripts(m, records, [share]) == [share[ids[i]] for i in range(23)]
    # One utterance missing (skipped in validation), seen twice, another file's, or an ID of another form: decoded.
    missing = dict(list(share.items())[1:])
    tag_and_line = ids[0].split("-", 1)[1]
    assert validation_transcripts(m, records, [missing]) is None
    assert validation_transcripts(m, records, [share, {ids[5]: "x"}]) is None
    assert validation_transcripts(m, records, [{**missing, f"other-{tag_and_line}": "x"}]) is None
    assert validation_transcripts(m, records, [{**missing, "0": "x"}]) is None
    assert validation_transcripts(m, records, [{**missing, ids[0][:-1] + "\u00b2": "x"}]) is None  # a superscript two
    echo = _EchoModel(texts)
    assert greedy_breakdowns(echo, [("test", tmp_path / "m.json")], [missing]) == expected
    assert sorted(echo.decoded) == list(range(23))
