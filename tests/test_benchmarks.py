"""Benchmarks cannot rot: each answers ``--help``, and those that need no trained archive or large corpus run a
tiny version of themselves here (seconds each)."""

import importlib.util
import json
import sys
from collections import Counter
from pathlib import Path

import pytest
from conftest import example_overrides

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
NAMES = sorted(p.stem for p in BENCHMARKS.glob("*.py"))


def _main(name):
    if str(BENCHMARKS) not in sys.path:  # as when run as a script: benchmarks import each other by file name
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.mark.parametrize("name", NAMES)
def test_every_benchmark_answers_help(name, capsys):
    with pytest.raises(SystemExit) as stop:
        _main(name)(["--help"])
    assert stop.value.code == 0 and capsys.readouterr().out.startswith("usage: ")


def test_asr_demo_benchmark_runs_the_demo_script_tiny(tmp_path, dtmf_manifest, capsys):
    overrides = [o for o in example_overrides(tmp_path, dtmf_manifest) if not o.startswith("exp_manager.exp_dir")]
    overrides += ["trainer.max_steps=4", "trainer.max_epochs=1", "+trainer.val_check_interval=4",
                  "trainer.check_val_every_n_epoch=null", "model.decoding.strategy=greedy"]  # fmt: skip
    _main("asr_demo")(["--precisions", "32", "--warmup", "1", "--no-record", "--", *overrides])
    table = capsys.readouterr().out.strip().splitlines()
    assert table[-3].startswith("| precision | train audio-s/s") and table[-1].startswith("| 32 | ")
    assert "nan" not in table[-1]


def test_asr_demo_appends_its_figures_as_records(monkeypatch):
    main = _main("asr_demo")
    calls = []
    monkeypatch.setitem(main.__globals__, "append", lambda *args, **kwargs: calls.append(args))
    rows = [{"precision": "32", "audio_s_per_s": 95.04, "wer": 0.1234, "wall": 1000.4},
            {"precision": "bf16-mixed", "audio_s_per_s": 120.0, "wer": float("nan"), "wall": 990.0}]  # fmt: skip
    main.__globals__["record"](rows, "python benchmarks/asr_demo.py")
    assert [c[:3] for c in calls] == [
        ("demo.ctc.train_speed.fp32", 95.0, "audio-s/s"),
        ("demo.ctc.val_wer.fp32", 12.34, "%"),
        ("demo.ctc.benchmark_wall_time.fp32", 1000, "s"),
        ("demo.ctc.train_speed.bf16_mixed", 120.0, "audio-s/s"),  # no WER over nothing
        ("demo.ctc.benchmark_wall_time.bf16_mixed", 990, "s"),
    ]
    assert {c[3] for c in calls} == {"python benchmarks/asr_demo.py"}


@pytest.mark.parametrize(
    "name, argv, expected",
    [
        ("fault_tolerance", ["--repeats", "2"], "NonFiniteGuard check"),
        pytest.param(  # (its 2-rank timing launches torchrun: slow)
            "asr_optimizers",
            ["--cost", "--repeats", "1"],
            ("| torch.optim.Muon | ", "| GroupedMuon | "),
            marks=pytest.mark.slow,
        ),
        ("synthetic_corpus", ["--utterances", "6", "--workers", "1"], "| eSpeak, 6 utterances | "),
        ("piper_speed", ["--utterances", "2"], "| decoder in torch, bf16 | "),
        ("bridge_size", ["--before", "HEAD"], "| **total** | **"),
        (
            "gpu_speed",
            [
                "--accelerator",
                "cpu",
                "--recipes",
                "asr_train",
                "--precisions",
                "32",
                "--batch-durations",
                "10",
                "--steps",
                "3",
                "--files",
                "12",
                "--num-workers",
                "0",
            ],
            "| asr_train | 32 | 10 | ",
        ),
        (
            "gpu_profile",
            [
                "--accelerator",
                "cpu",
                "--recipe",
                "asr_train",
                "--warmup",
                "1",
                "--steps",
                "1",
                "--files",
                "12",
                "--batch-duration",
                "10",
                "--num-workers",
                "0",
                "--shapes",
            ],
            ("per step (1 steps): wall ", "Input Shapes"),
        ),
    ],
)
def test_small_benchmarks_run_tiny(name, argv, expected, capsys):
    _main(name)(argv)
    out = capsys.readouterr().out
    for text in (expected,) if isinstance(expected, str) else expected:
        assert text in out


def test_rare_words_alignment_marks_substituted_and_deleted_reference_words():
    main = _main("asr_rare_words")
    missed_words, bucket_of = main.__globals__["missed_words"], main.__globals__["bucket_of"]
    assert missed_words("the cafe in zaragoza".split(), "the kefy in zagoza".split()) == [False, True, False, True]
    assert missed_words("please pay the rent".split(), "please the rent".split()) == [False, True, False, False]
    assert missed_words("a b".split(), "a x b".split()) == [False, False], "an insertion misses no reference word"
    assert [bucket_of(c) for c in (0, 4, 5, 99, 100, 1000)] == ["0", "1-4", "5-19", "20-99", "100-999", "1000+"]
    non_words = main.__globals__["non_words"]
    heard = Counter("the cafe in zaragoza is near the market".split())
    total, unknown, wer, fixed = non_words(["the cafe in zaragoza", "near the market"],
                                           ["the kafe in zaragosa", "near the cafe"], heard)  # fmt: skip
    assert (total, unknown) == (7, 2)
    assert wer == pytest.approx(3 / 7) and fixed == pytest.approx(1 / 7), (
        "the two misspellings fixed, the real-word error not"
    )


def test_dp_step_balance_reports_the_imbalance_and_what_the_batch_shapes_explain(tmp_path):
    """Two ranks' per-step files: rank 1's forward + backward is 50 ms slower on every other step, whatever the
    batch, so the slowest rank's mean is 12.5 ms above the ranks' mean and the shapes explain none of it."""
    import numpy as np

    analyse = _main("dp_step_balance").__globals__["analyse"]
    steps, rng = 60, np.random.default_rng(0)
    shape = np.stack(
        [rng.integers(4, 12, steps), rng.integers(40_000, 160_000, steps), rng.integers(10, 60, steps)], 1
    )
    base = 0.2 + 1e-9 * shape[:, 0] * shape[:, 1] * (shape[:, 2] + 1)  # cost grows with padded joint cells
    for rank, extra in enumerate((np.zeros(steps), np.where(np.arange(steps) % 2 == 1, 0.05, 0.0))):
        ends = 0.4 * np.arange(1, steps + 1)
        rows = np.column_stack([shape, base + extra, np.full(steps, 0.02), np.full(steps, 0.01), ends])
        np.savetxt(tmp_path / f"rank{rank}.txt", rows)
    lines = analyse(tmp_path, devices=2, skip=10)
    mean = (base[10:] + base[10:] + np.where(np.arange(10, steps) % 2 == 1, 0.05, 0.0)).mean() / 2
    slowest = (base[10:] + np.where(np.arange(10, steps) % 2 == 1, 0.05, 0.0)).mean()
    assert f"imbalance {100 * (slowest / mean - 1):.1f}%" in lines[3]
    assert "step (rank 0, end to end) 400.0 ms" in lines[0] and "all-reduce median 20.0 ms, min 20.0 ms" in lines[1]
    assert "from the shapes 0.0 ms, correlation 0.00" in lines[-1]


@pytest.mark.slow
def test_dp_step_balance_times_two_real_ranks(tmp_path, dtmf_manifest, capsys):
    overrides = [o for o in example_overrides(tmp_path, dtmf_manifest) if not o.startswith("exp_manager.exp_dir")]
    overrides += ["model.decoding.strategy=greedy", "model.train_ds.num_workers=0"]
    _main("dp_step_balance")(["--recipe", "asr_train", "--steps", "14", "--skip", "2", "--batch-duration", "8",
                              "--", *overrides])  # fmt: skip
    out = capsys.readouterr().out
    assert "steps 2-" in out and "rank 1: forward+backward" in out and "imbalance" in out


def test_dp_step_balance_refuses_one_process_and_too_short_a_record(tmp_path, capsys):
    import numpy as np

    main = _main("dp_step_balance")
    with pytest.raises(SystemExit):
        main(["--devices", "1"])
    assert "--devices must be at least 2" in capsys.readouterr().err
    for rank in range(2):
        np.savetxt(tmp_path / f"rank{rank}.txt", np.ones((12, 7)))
    with pytest.raises(RuntimeError, match="only 12 steps recorded; run more than --skip \\+ 10 = 60"):
        main.__globals__["analyse"](tmp_path, devices=2, skip=50)


def test_checkpoint_io_records_save_size_and_load_per_model_and_format(monkeypatch):
    main = _main("checkpoint_io")
    calls = []
    monkeypatch.setitem(main.__globals__, "append", lambda *args, **kwargs: calls.append((*args, kwargs)))
    row = {"model": "demo_hybrid", "format": "torch_dist", "save_s": [1.0, 3.0, 2.0], "bytes": [10, 12, 12],
           "load_s": 0.504, "params": 1000, "global_step": 1}  # fmt: skip
    main.__globals__["record"]([main.__globals__["summarise"](row)], "python benchmarks/checkpoint_io.py")
    assert [c[:3] for c in calls] == [
        ("checkpoint.demo_hybrid.dp2.torch_dist.save_s", 2.0, "s"),
        ("checkpoint.demo_hybrid.dp2.torch_dist.bytes", 12, "bytes"),
        ("checkpoint.demo_hybrid.dp2.torch_dist.load_s", 0.5, "s"),
    ]
    assert "median of 3 saves" in calls[0][4]["note"] and "AdamW instead of Muon" in calls[1][4]["note"]


@pytest.mark.slow
def test_checkpoint_io_times_both_formats_of_a_tiny_model_on_two_ranks(capsys):
    _main("checkpoint_io")(["--models", "debug", "--repeats", "2", "--timeout", "300"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| debug | ")]
    assert [row.split(" | ")[1] for row in rows] == ["torch", "torch_dist"]
    for row in rows:
        cells = row.strip("| ").split(" | ")
        assert float(cells[3]) > 0 and int(cells[5].replace(",", "")) > 0 and float(cells[6]) > 0


def test_checkpoint_io_records_the_training_held_up_by_a_sync_and_an_async_save(monkeypatch):
    main = _main("checkpoint_io")
    calls = []
    monkeypatch.setitem(main.__globals__, "append", lambda *args, **kwargs: calls.append((*args, kwargs)))
    row = {"model": "demo_hybrid", "params": 1000, "finalized_at": [], "step_after_save_s": 0.5, "median_step_s": 0.4,
           "load": 3.0, "finalize_s": 0.0}  # fmt: skip
    done = {"async": True, "finalized_at": [10]}
    rows = [{**row, "async": False, "blocked_s": 2.0, "save_call_s": 2.0},
            {**row, **done, "blocked_s": 0.6, "save_call_s": 0.5, "finalize_s": 0.1},
            {**row, "async": False, "blocked_s": 3.0, "save_call_s": 3.0},
            {**row, **done, "blocked_s": 0.8, "save_call_s": 0.6, "finalize_s": 0.2}]  # fmt: skip
    main.__globals__["record_blocked"](rows, "python benchmarks/checkpoint_io.py --async")
    assert [c[:3] for c in calls] == [
        ("checkpoint.demo_hybrid.dp2.torch_dist.blocked_s", 2.5, "s"),
        ("checkpoint.demo_hybrid.dp2.torch_dist_async.blocked_s", 0.7, "s"),
    ]
    assert "median of 2 job(s)" in calls[1][4]["note"] and "load average 3.0" in calls[1][4]["note"]


@pytest.mark.slow
def test_checkpoint_io_async_finalizes_a_tiny_models_save_during_training(capsys):
    _main("checkpoint_io")(["--async", "--models", "debug", "--repeats", "1", "--steps", "12", "--timeout", "300"])
    rows = [line.strip("| ").split(" | ") for line in capsys.readouterr().out.splitlines()
            if line.startswith("| debug | ")]  # fmt: skip
    assert [row[1] for row in rows] == ["sync", "async"]
    assert rows[0][4] == "0.00 ([])" and rows[1][4].endswith("([10])")  # async: at the rank agreement of step 10


def test_leave_one_out_restates_the_demo_blend_and_drops_only_the_left_out_engine():
    from omegaconf import OmegaConf

    module = _load("leave_one_out")
    recipe = OmegaConf.to_container(OmegaConf.load(BENCHMARKS.parent / "examples/conf/asr_train_hybrid.yaml"))
    expected = recipe["model"]["train_ds"]["input_cfg"]
    counts = {"builtin:speech/train": 8443, "builtin:speech/train@piper+festival": 4989,
              "builtin:speech/train_extra": 11276, "builtin:speech/train@espeak+festival": 5000,
              "builtin:speech/train@festival": 2600, "builtin:speech/train@espeak+piper": 5800,
              "builtin:speech/train@piper": 2389}  # fmt: skip
    assert module.blend(None, counts.__getitem__) == expected
    assert module.blend("piper", counts.__getitem__) == [
        {"manifest_filepath": "builtin:speech/train@espeak+festival", "weight": 5000},
        {"manifest_filepath": "builtin:speech/train@festival", "weight": 7800, "repeat": 3},
        {"manifest_filepath": "builtin:speech/train_extra", "weight": 11276}]  # fmt: skip
    assert [s["manifest_filepath"] for s in module.blend("espeak", counts.__getitem__)] == [
        "builtin:speech/train@piper+festival", "builtin:speech/train@piper+festival"]  # fmt: skip
    overrides = module.hydra_list(module.blend("festival", counts.__getitem__))
    from hydra.core.override_parser.overrides_parser import OverridesParser

    (parsed,) = OverridesParser.create().parse_overrides([f"model.train_ds.input_cfg={overrides}"])
    assert parsed.value() == module.blend("festival", counts.__getitem__)
    figures = module.figures("no_piper", {"val_wer": 0.1, "val_wer_test": 0.2, "val_wer_heldout_engine": 0.4},
                             {"test": {"piper": [0.5, 144], "festival / festival:kal": [0.3, 55]}})  # fmt: skip
    assert figures == {"leave_one_out.no_piper.greedy_wer.test": 20.0,
                       "leave_one_out.no_piper.greedy_wer.heldout_engine": 40.0,
                       "leave_one_out.no_piper.greedy_wer.test.piper": 50.0}  # fmt: skip
    # An equal-time run is named by its minutes, trains to the clock and validates only at its close.
    assert module.run_name("piper", "noise", 12.5) == "no_piper_noise_12_5min"
    timed = dict(o.split("=", 1) for o in module.budget(None, 13))
    assert timed["trainer.max_steps"] == "-1" and timed["trainer.max_time"] == "{seconds: 780}"
    assert int(timed["trainer.val_check_interval"]) > 10**6
    stepped = dict(o.split("=", 1) for o in module.budget(1000, None))
    assert stepped["trainer.max_steps"] == stepped["trainer.val_check_interval"] == "1000"


def _load(name):
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_human_prompts_reads_the_asterisk_prompts_into_disjoint_16_khz_sets(tmp_path, monkeypatch):
    import gzip

    import numpy as np
    import soundfile as sf

    main = _main("human_prompts")
    sounds, names = tmp_path / "sounds", [f"p{i:02d}" for i in range(20)] + ["digits/7", "beep"]
    (sounds / "digits").mkdir(parents=True)
    lines = ["; Core Asterisk Sounds in English", ""]
    for name in names:
        sf.write(sounds / f"{name}.wav", np.zeros(800, dtype=np.float32), 8000)
        lines.append(f"{name}: " + {"digits/7": "7", "beep": "[this is a simple beep tone]"}.get(name, "Press # [#]."))
    transcripts = tmp_path / "core-sounds-en.txt.gz"
    with gzip.open(transcripts, "wt") as out:
        out.write("\n".join(lines) + "\n")
    monkeypatch.setitem(main.__globals__, "SOUNDS", sounds)
    monkeypatch.setitem(main.__globals__, "TRANSCRIPTS", transcripts)
    sets = main.__globals__["prompt_sets"](tmp_path / "cache")
    rows = {k: [json.loads(line) for line in p.read_text().splitlines()] for k, p in sets.items()}
    assert {k: len(v) for k, v in rows.items()} == {"train": 16, "dev": 1, "test": 4}  # the beep has no words
    files = [r["audio_filepath"] for part in rows.values() for r in part]
    assert len(set(files)) == 21 and all(sf.info(f).samplerate == 16000 for f in files)
    texts = {Path(r["audio_filepath"]).stem: r["text"] for part in rows.values() for r in part}
    assert texts["digits__7"] == "seven" and texts["p00"] == "press pound"


def test_human_prompts_without_the_debian_packages_says_what_to_install(tmp_path, monkeypatch):
    main = _main("human_prompts")
    monkeypatch.setitem(main.__globals__, "SOUNDS", tmp_path / "absent")
    with pytest.raises(SystemExit, match="apt-get install asterisk-core-sounds-en-wav asterisk-core-sounds-en"):
        main.__globals__["prompt_sets"](tmp_path / "cache")


def test_telephone_band_writes_the_set_through_the_channel_with_absolute_paths(tmp_path):
    import numpy as np
    import soundfile as sf

    main = _main("telephone_band")
    (tmp_path / "audio").mkdir()
    t = np.arange(16000) / 16000
    rows = []
    for i, hz in enumerate((1000.0, 6000.0)):  # one tone inside the band, one above it
        sf.write(tmp_path / "audio" / f"{i}.wav", (0.5 * np.sin(2 * np.pi * hz * t)).astype(np.float32), 16000)
        rows.append({"audio_filepath": f"audio/{i}.wav", "duration": 1.0, "text": f"tone {i}"})
    manifest = tmp_path / "set.json"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    phone = main.__globals__["through_telephone"](manifest, tmp_path / "phone")
    out = [json.loads(line) for line in phone.read_text().splitlines()]
    assert [r["text"] for r in out] == ["tone 0", "tone 1"]
    inside, above = (sf.read(r["audio_filepath"])[0] for r in out)
    assert sf.info(out[0]["audio_filepath"]).samplerate == 16000 and len(inside) == 16000
    rms = [float(np.sqrt(np.mean(x[4000:] ** 2))) for x in (inside, above)]
    assert rms[0] > 0.25 and rms[1] < 0.05 * rms[0]  # 6 kHz does not pass an 8 kHz line
    wide = main.__globals__["absolute"](manifest, tmp_path / "wide.json")
    assert all(Path(json.loads(line)["audio_filepath"]).is_absolute() for line in wide.read_text().splitlines())


def test_human_prompts_replay_draws_her_prompts_and_the_replayed_set_in_the_asked_ratio(tmp_path):
    main = _main("human_prompts")
    mine, theirs = tmp_path / "mine.json", tmp_path / "theirs.json"
    mine.write_text("".join(json.dumps({"audio_filepath": f"{i}.wav", "duration": 1, "text": "a"}) + "\n"
                            for i in range(40)))  # fmt: skip
    theirs.write_text("".join(json.dumps({"audio_filepath": f"{i}.wav", "duration": 1, "text": "b"}) + "\n"
                              for i in range(1000)))  # fmt: skip
    sources = main.__globals__["replay_sources"](mine, str(theirs), 0.5)
    assert sources == [{"manifest_filepath": str(mine), "weight": 1000, "repeat": 25},
                       {"manifest_filepath": str(theirs), "weight": 1000}]  # fmt: skip
    assert main.__globals__["replay_sources"](mine, str(theirs), 0.8)[0]["repeat"] == 6  # 240 : 1000
    with pytest.raises(SystemExit, match="--replay-share"):
        main.__globals__["replay_sources"](mine, str(theirs), 1.0)


def test_human_prompts_splits_word_errors_by_whether_the_fine_tune_heard_the_word():
    split = _main("human_prompts").__globals__["word_errors_by_seen"]
    refs, hyps = ["press one", "thousand hundred", "star"], ["press won", "housand hundred and", "star"]
    got = split(hyps, refs, {"press", "one", "hundred"})  # seen: "one" of 3 wrong; unseen: "thousand" of 2
    assert got == pytest.approx({"seen_words": 100 / 3, "unseen_words": 50.0})
    assert split(hyps, refs, set())["seen_words"] != split(hyps, refs, set())["seen_words"]  # n/a: NaN
