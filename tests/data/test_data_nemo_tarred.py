"""NeMo tarred audio and lazy manifests: shards split over data-parallel ranks (each shard once per pass), brace
patterns and lists of lists, resumable streams, lazy reading."""

import json
import tracemalloc

import pytest
import torch

from speechtrain.common.tokenizers import CharTokenizer
from speechtrain.corpora.dtmf import make_dtmf_corpus
from speechtrain.data.audio_text import unusable_reason
from speechtrain.data.cut_datasets import AsrCutDataset
from speechtrain.data.lhotse_loader import LoaderConfig, get_lhotse_dataloader_from_config, read_cuts
from speechtrain.data.manifest import ManifestError
from speechtrain.data.nemo_adapters import LazyNeMoTarredIterator, expand_paths, write_tarred_dataset

TOKENIZER = CharTokenizer([" ", *"0123456789"])
SHARDS = 6


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A DTMF manifest of 48 utterances and the same utterances as a NeMo tarred set of 6 shards."""
    root = tmp_path_factory.mktemp("tarred")
    manifest = make_dtmf_corpus(root / "wav", 48, seed=3)
    records = [json.loads(line) for line in manifest.read_text().splitlines()]
    for r in records:
        r["audio_filepath"] = str(manifest.parent / r["audio_filepath"])
    manifests, tars = write_tarred_dataset(records, root / "tarred", SHARDS)
    return {"manifest": manifest, "records": records, "manifests": manifests, "tars": tars, "root": root}


def _reader(corpus, rank=0, world=1, **kwargs):
    return LazyNeMoTarredIterator(expand_paths(corpus["manifests"], "m"), expand_paths(corpus["tars"], "t"),
                                  dp_rank=rank, dp_world_size=world, seed=7, **kwargs)  # fmt: skip


@pytest.mark.parametrize("world", [1, 2, 3])
def test_each_shard_is_read_by_one_rank_once_per_pass(corpus, world):
    for passes in (1, 2):
        shards, texts = [], []
        for rank in range(world):
            reader = _reader(corpus, rank, world, max_passes=passes)
            shards += [s for p in range(passes) for s in reader.shards(p)]
            texts += [c.supervisions[0].text for c in reader]
        assert sorted(shards) == sorted(list(range(SHARDS)) * passes), "each shard once per pass, over all ranks"
        assert sorted(texts) == sorted([r["text"] for r in corpus["records"]] * passes)
    assert _reader(corpus).shards(0) != _reader(corpus).shards(1), "a new shard order every pass"


def test_tarred_cuts_carry_their_audio(corpus):
    cut = next(iter(_reader(corpus)))
    by_text = {r["text"]: r for r in corpus["records"]}
    audio = cut.load_audio()
    assert cut.recording.sources[0].type == "memory" and cut.shard_origin.endswith(".tar")
    assert audio.shape[1] == pytest.approx(by_text[cut.supervisions[0].text]["duration"] * cut.sampling_rate, abs=2)


def test_brace_patterns_nemo_cli_spelling_and_clear_errors(corpus, tmp_path):
    assert expand_paths("a_{0..2}.tar", "t") == ["a_0.tar", "a_1.tar", "a_2.tar"]
    assert expand_paths(["a__OP_0..1_CL_.tar", "b.tar"], "t") == ["a_0.tar", "a_1.tar", "b.tar"]
    tars = expand_paths(corpus["tars"], "t")
    with pytest.raises(ValueError, match="6 tar files but manifest_filepath to 2 manifests"):
        LazyNeMoTarredIterator(expand_paths(corpus["manifests"], "m")[:2], tars)
    with pytest.raises(FileNotFoundError, match="audio_9.tar"):
        LazyNeMoTarredIterator(["m.json"], [str(tmp_path / "audio_9.tar")])
    with pytest.raises(ValueError, match="6 tar shard.s. for 8 data-parallel ranks"):
        _reader(corpus, 0, 8)
    broken = tmp_path / "audio_0.tar"
    broken.write_bytes(b"not a tar" * 100)
    reader = LazyNeMoTarredIterator([expand_paths(corpus["manifests"], "m")[0]], [str(broken)], max_passes=1)
    reasons = [unusable_reason(cut) for cut in reader]  # a shard that is not a tar: its entries skipped, counted
    assert len(reasons) == 8 and all(r == "unreadable_audio" and "audio_0.tar: ReadError" in d for r, d in reasons)


def test_one_manifest_with_shard_ids_and_lists_of_lists_blend(corpus, tmp_path):
    single = tmp_path / "all.json"
    lines = [line for m in expand_paths(corpus["manifests"], "m") for line in open(m)]
    single.write_text("".join(lines))
    reader = LazyNeMoTarredIterator([str(single)], expand_paths(corpus["tars"], "t"), max_passes=1)
    assert sorted(c.supervisions[0].text for c in reader) == sorted(r["text"] for r in corpus["records"])
    single.write_text(lines[0].replace('"shard_id"', '"shard"'))
    with pytest.raises(ManifestError, match="all.json:1: .*needs shard_id"):
        list(LazyNeMoTarredIterator([str(single)], expand_paths(corpus["tars"], "t"), max_passes=1))
    manifests, tars = expand_paths(corpus["manifests"], "m"), expand_paths(corpus["tars"], "t")
    cfg = LoaderConfig(is_tarred=True, manifest_filepath=[manifests[:4], manifests[4:]],
                       tarred_audio_filepaths=[tars[:4], tars[4:]], batch_size=4, use_bucketing=False,
                       shuffle=False)  # fmt: skip
    loader = get_lhotse_dataloader_from_config(cfg, 0, 1, AsrCutDataset(TOKENIZER), epoch_batches=12)
    ids = [i for batch in loader for i in batch["ids"]]
    second = [i for i in ids if i.split("-")[2] in ("4", "5")]  # member names are <stem>-<shard>-<index>
    assert len(ids) == 48 and 8 <= len(second) <= 24, "two datasets mixed 4:2, by their shard counts"
    first = {"type": "nemo_tarred", "manifest_filepath": manifests[:4], "tarred_audio_filepaths": tars[:4]}
    second = {"type": "nemo_tarred", "manifest_filepath": manifests[4:], "tarred_audio_filepaths": tars[4:],
              "tags": {"lang": "xx"}}  # fmt: skip
    blend = [{**first, "weight": 1.0}, {"type": "group", "input_cfg": [second], "weight": 3.0}]
    cfg = LoaderConfig(input_cfg=blend, batch_size=4, use_bucketing=False, shuffle=False)
    loader = get_lhotse_dataloader_from_config(cfg, 0, 1, AsrCutDataset(TOKENIZER), epoch_batches=12)
    second = [i for batch in loader for i in batch["ids"] if i.split("-")[2] in ("4", "5")]
    assert len(second) >= 30, "input_cfg weights 1:3"
    with pytest.raises(ValueError, match=r"input_cfg\[1\].type='nemo': a blend with nemo_tarred sources"):
        get_lhotse_dataloader_from_config(LoaderConfig(input_cfg=[blend[0], {"manifest_filepath": "x.json"}],
                                                       batch_size=4), 0, 1, AsrCutDataset(TOKENIZER))  # fmt: skip


def test_tarred_loader_epochs_continue_the_stream_and_resume_mid_epoch(corpus):
    cfg = {"is_tarred": True, "manifest_filepath": corpus["manifests"], "tarred_audio_filepaths": corpus["tars"],
           "batch_duration": 4.0, "num_buckets": 3, "seed": 11, "bucket_buffer_size": 60}  # fmt: skip

    def run(resume=None, workers=0):
        loader = get_lhotse_dataloader_from_config({**cfg, "num_workers": workers}, 1, 2, AsrCutDataset(TOKENIZER),
                                                   epoch_batches=4)  # fmt: skip
        if resume:
            loader.sampler.resume(*resume)
        epochs = []
        for epoch in range(resume[0] if resume else 0, 3):
            loader.sampler.set_epoch(epoch)
            epochs.append([batch["ids"] for batch in loader])
        return epochs

    full = run()
    assert [len(e) for e in full] == [4, 4, 4]
    assert full[0] != full[1] != full[2], "epochs continue the stream instead of restarting it"
    resumed = run(resume=(1, 2))
    assert resumed[0] == full[1][2:] and resumed[1:] == full[2:]
    assert run(workers=1) == full, "loader workers decode the same batches"
    with pytest.raises(ValueError, match="set trainer.limit_train_batches"):
        get_lhotse_dataloader_from_config(cfg, 0, 1, AsrCutDataset(TOKENIZER)).sampler.batches_per_epoch()


def test_manifests_are_read_lazily(corpus, tmp_path):
    big = tmp_path / "big.json"
    line = json.dumps(corpus["records"][0]) + "\n"
    big.write_text(line * 50_000)
    tracemalloc.start()
    loader = get_lhotse_dataloader_from_config(
        {"manifest_filepath": str(big), "batch_duration": 30.0, "num_buckets": 4, "bucket_buffer_size": 500}, 0, 1,
        AsrCutDataset(TOKENIZER),
    )  # fmt: skip
    batch = next(iter(loader))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert batch["audio"].shape[0] > 1
    assert peak < 40e6, f"{peak / 1e6:.0f} MB: 50,000 lines must not be held in memory"
    bad = tmp_path / "bad.json"
    bad.write_text(line * 3 + "{oops\n")
    with pytest.raises(ManifestError, match="bad.json:4: invalid JSON"):
        list(read_cuts(LoaderConfig(manifest_filepath=str(bad), skip_bad_lines=0)))
    assert torch.is_tensor(batch["audio_lens"])


def test_a_tarred_training_run_stopped_mid_epoch_resumes_to_the_same_weights(corpus, tmp_path):
    from conftest import example_job, example_main, final_weights

    def spelled(pattern):  # NeMo's command-line spelling of braces
        return pattern.replace("{", "_OP_").replace("}", "_CL_")

    common = ["model.train_ds.is_tarred=true", f"model.train_ds.manifest_filepath={spelled(corpus['manifests'])}",
              f"model.train_ds.tarred_audio_filepaths={spelled(corpus['tars'])}", "+trainer.limit_train_batches=3",
              "trainer.max_time=null", "model.optim.sched.name=constant", "model.decoding.strategy=greedy",
              "+exp_manager.checkpoint_callback_params.every_n_train_steps=5",
              "trainer.limit_val_batches=1"]  # fmt: skip
    main, manifest = example_main(), corpus["manifest"]
    main(example_job(tmp_path / "straight", manifest, *common, "trainer.max_steps=8"))
    # Stops after batch 2 of epoch 1; its checkpoint at step 5 is mid-epoch (as after a crash or preemption).
    main(example_job(tmp_path / "split", manifest, *common, "trainer.max_steps=5"))
    main(
        example_job(tmp_path / "split", manifest, *common, "trainer.max_steps=8", "exp_manager.resume_if_exists=true")
    )
    expected, resumed = final_weights(tmp_path / "straight"), final_weights(tmp_path / "split")
    for key in expected:
        torch.testing.assert_close(resumed[key], expected[key], rtol=0, atol=0, msg=lambda m, key=key: f"{key}: {m}")
