import json

import pytest
import torch

from speechtrain.common.tokenizers import CharTokenizer
from speechtrain.corpora.dtmf import make_dtmf_corpus
from speechtrain.data.cut_datasets import AsrCutDataset
from speechtrain.data.lhotse_loader import (
    LoaderConfig,
    build_sampler,
    get_lhotse_dataloader_from_config,
    read_cuts,
)

TOKENIZER = CharTokenizer([" ", *"0123456789"])


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    return make_dtmf_corpus(tmp_path_factory.mktemp("dtmf"), 97, seed=5)


def _epoch(cuts, cfg, world, epoch=0):
    per_rank = []
    for rank in range(world):
        sampler = build_sampler(cuts, cfg, rank, world)
        sampler.set_epoch(epoch)
        per_rank.append([[c.id for c in batch] for batch in sampler])
    return per_rank


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("bucketing", [True, False])
def test_every_cut_once_per_epoch_and_equal_steps(manifest, world, bucketing):
    cfg = LoaderConfig(manifest_filepath=str(manifest), batch_duration=5.0, num_buckets=4, use_bucketing=bucketing)
    cuts = read_cuts(cfg)
    for epoch in (0, 1):
        per_rank = _epoch(cuts, cfg, world, epoch)
        assert len({len(batches) for batches in per_rank}) == 1, "ranks must take the same number of steps"
        seen = [cut for batches in per_rank for batch in batches for cut in batch]
        assert len(seen) == len(set(seen)), "no cut twice in an epoch"
        assert set(seen) == {c.id for c in cuts}, "every cut once per epoch"


def test_batches_respect_the_duration_budget_and_shuffle_by_epoch(manifest):
    cfg = LoaderConfig(manifest_filepath=str(manifest), batch_duration=4.0, num_buckets=4)
    cuts = read_cuts(cfg)
    durations = {c.id: c.duration for c in cuts}
    first, second = _epoch(cuts, cfg, 1, 0)[0], _epoch(cuts, cfg, 1, 1)[0]
    assert all(sum(durations[c] for c in batch) <= 4.0 + 1e-6 for batch in first)
    assert first != second and first == _epoch(cuts, cfg, 1, 0)[0]


def test_fixed_batch_size_per_bucket(manifest):
    bins = [0.8, 1.2]
    cfg = LoaderConfig(manifest_filepath=str(manifest), bucket_duration_bins=bins, bucket_batch_size=[6, 4, 2])
    cuts = read_cuts(cfg)
    durations = {c.id: c.duration for c in cuts}
    for batch in _epoch(cuts, cfg, 1)[0][:-3]:  # the last batches of a bucket may be partial
        longest = max(durations[c] for c in batch)
        bucket = sum(longest > b for b in bins)
        assert len(batch) <= [6, 4, 2][bucket]
    with pytest.raises(ValueError, match="one per bucket"):
        build_sampler(cuts, LoaderConfig(bucket_duration_bins=bins, bucket_batch_size=[6, 4]), 0, 1)


def test_duration_filters_and_config_errors(manifest):
    cuts = list(read_cuts(LoaderConfig(manifest_filepath=str(manifest), min_duration=0.8, max_duration=1.2)))  # lazy
    assert len(cuts) > 0 and all(0.8 <= c.duration <= 1.2 for c in cuts)
    with pytest.raises(ValueError, match="names no data"):
        read_cuts(LoaderConfig())
    with pytest.raises(ValueError, match="need a dataset with a tokenizer"):
        read_cuts(LoaderConfig(manifest_filepath=str(manifest), min_tps=2.0))
    with pytest.raises(ValueError, match="Set batch_size or batch_duration"):
        build_sampler(read_cuts(LoaderConfig(manifest_filepath=str(manifest))), LoaderConfig(), 0, 1)


def test_dataloader_from_config_gives_padded_batches_and_skips_bad_files(manifest, tmp_path):
    records = [json.loads(line) for line in manifest.read_text().splitlines()[:8]]
    for r in records:
        r["audio_filepath"] = str(manifest.parent / r["audio_filepath"])
    records[3]["audio_filepath"] = str(tmp_path / "missing.wav")
    bad = tmp_path / "bad.json"
    bad.write_text("".join(json.dumps(r) + "\n" for r in records))
    dataset = AsrCutDataset(TOKENIZER)
    loader = get_lhotse_dataloader_from_config(
        {"manifest_filepath": str(bad), "batch_size": 8, "use_bucketing": False, "shuffle": False}, 0, 1, dataset
    )
    (batch,) = list(loader)
    assert batch["audio"].shape[0] == 7 and dataset.reader.skipped["missing_audio"] == 1
    assert batch["skipped"] == {"missing_audio": 1} and batch["skip_examples"]["missing_audio"].endswith("missing.wav")
    assert torch.equal(
        batch["audio_lens"], torch.tensor([(batch["audio"][i] != 0).nonzero().max() + 1 for i in range(7)])
    )
    with pytest.raises(Exception, match="batch_sizee"):
        get_lhotse_dataloader_from_config({"manifest_filepath": str(bad), "batch_sizee": 8}, 0, 1, dataset)


def test_lhotse_cuts_input(manifest, tmp_path):
    cuts = read_cuts(LoaderConfig(manifest_filepath=str(manifest)))
    cuts.to_file(tmp_path / "cuts.jsonl.gz")
    again = read_cuts(LoaderConfig(cuts_path=str(tmp_path / "cuts.jsonl.gz")))
    assert [c.id for c in again] == [c.id for c in cuts]


def test_estimate_duration_bins_splits_audio_evenly(manifest, capsys):
    from speechtrain.datatools.estimate_duration_bins import estimate_bins, main

    cuts = read_cuts(LoaderConfig(manifest_filepath=str(manifest)))
    bins = estimate_bins([str(manifest)], 4)
    assert len(bins) == 3 and bins == sorted(bins)
    total = sum(c.duration for c in cuts)
    edges = [0.0, *bins, float("inf")]
    shares = [sum(c.duration for c in cuts if lo < c.duration <= hi) / total for lo, hi in zip(edges, edges[1:])]
    assert all(abs(share - 0.25) < 0.1 for share in shares), shares
    main([str(manifest), "-b", "4"])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "num_buckets: 4" and out[1].startswith("bucket_duration_bins: [")


def test_input_cfg_blends_by_weight_with_tags_and_uses_every_cut(tmp_path):
    a = make_dtmf_corpus(tmp_path / "a", 300, seed=1)
    b = make_dtmf_corpus(tmp_path / "b", 300, seed=2)
    cuts_b = read_cuts(LoaderConfig(manifest_filepath=str(b)))
    cuts_b.to_file(tmp_path / "b.jsonl.gz")
    cfg = LoaderConfig(
        input_cfg=[
            {"type": "nemo", "manifest_filepath": str(a), "weight": 3.0, "tags": {"corpus": "a"}},
            {"type": "group", "weight": 1.0, "input_cfg": [
                {"type": "lhotse", "cuts_path": str(tmp_path / "b.jsonl.gz"), "tags": {"corpus": "b"}},
            ]},
        ],
        seed=4,
    )  # fmt: skip
    blended = list(read_cuts(cfg))
    assert len(blended) == 600 and len({c.id for c in blended}) == 600
    head = [c.custom["corpus"] for c in blended[:200]]
    assert 0.65 <= head.count("a") / len(head) <= 0.85, head.count("a")
    with pytest.raises(ValueError, match=r"input_cfg\[0\].weight must be positive"):
        read_cuts(LoaderConfig(input_cfg=[{"manifest_filepath": str(a), "weight": 0}]))
    with pytest.raises(ValueError, match=r"input_cfg\[0\]: unknown key\(s\) \['manifest'\]"):
        read_cuts(LoaderConfig(input_cfg=[{"manifest": str(a)}]))
    with pytest.raises(ValueError, match="not a source type"):
        read_cuts(LoaderConfig(input_cfg=[{"type": "tarred", "manifest_filepath": str(a)}]))


def test_input_cfg_repeat_reads_a_source_n_times_with_new_ids_and_weights_by_cuts_keep_the_mix(tmp_path):
    a = make_dtmf_corpus(tmp_path / "a", 60, seed=1)
    b = make_dtmf_corpus(tmp_path / "b", 200, seed=2)
    cfg = LoaderConfig(
        input_cfg=[
            {"manifest_filepath": str(a), "repeat": 3, "weight": 180, "tags": {"corpus": "a"}},
            {"manifest_filepath": str(b), "weight": 200, "tags": {"corpus": "b"}},
        ],
        seed=1,
    )  # fmt: skip
    blended = list(read_cuts(cfg))
    assert len(blended) == 380 and len({c.id for c in blended}) == 380
    ids_a = [c.id for c in blended if c.custom["corpus"] == "a"]
    assert len(ids_a) == 180 and len({i.rsplit("_repeat", 1)[0] for i in ids_a}) == 60
    # weights proportional to cuts x repeat: every stretch of the epoch has about the same mix
    for part in (blended[:190], blended[190:]):
        assert 0.35 <= sum(c.custom["corpus"] == "a" for c in part) / len(part) <= 0.6
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match=r"input_cfg\[0\].repeat must be a whole number"):
            read_cuts(LoaderConfig(input_cfg=[{"manifest_filepath": str(a), "repeat": bad}]))


@pytest.mark.parametrize("world", [2, 3])
def test_a_validation_set_is_decoded_exactly_once_at_any_data_parallel_size(tmp_path, world):
    """23 utterances (a multiple of neither 2 nor 3) in batches of 7: the ranks' shares together hold each
    utterance once, and every rank steps through the same number of batches (the short ones pad with empty
    batches), whatever lhotse's own sharding would repeat at the end of the set."""
    manifest = make_dtmf_corpus(tmp_path / "dtmf", 23, seed=3)
    cfg = {"manifest_filepath": str(manifest), "batch_size": 7, "shuffle": False, "use_bucketing": False}
    dataset = AsrCutDataset(CharTokenizer([" ", *"0123456789"]))
    seen, lengths = [], set()
    for rank in range(world):
        loader = get_lhotse_dataloader_from_config(cfg, rank, world, dataset, evaluation=True)
        batches = list(loader)
        lengths.add(len(batches))
        seen += [utterance for batch in batches for utterance in batch["ids"]]
    assert len(seen) == 23 and len(set(seen)) == 23, sorted(seen)  # (lhotse alone: 24 at DP=3, one repeated)
    assert len(lengths) == 1
