"""Figures live in records (``results/*.jsonl``) and RESULTS.md is generated from them (benchmarks/results.py): every
record has the required keys, RESULTS.md is what ``render`` writes, and the figures the README quotes are recorded."""

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("benchmark_results", ROOT / "benchmarks" / "results.py")
results = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = results
spec.loader.exec_module(results)

RECORDS = results.read_records()


def test_there_are_records_and_each_has_the_required_keys():
    assert "demo.jsonl" in RECORDS and sum(len(r) for r in RECORDS.values()) >= 50
    bad = []
    for name, records in RECORDS.items():
        for record in records:
            missing = [k for k in results.REQUIRED if k not in record or record[k] in (None, "")]
            if missing:
                bad.append(f"{name}: {record.get('figure')} lacks {missing}")
            elif not results.FIGURE_ID.match(record["figure"]):
                bad.append(f"{name}: figure id {record['figure']!r}")
            elif not isinstance(record["value"], int | float | str):
                bad.append(f"{name}: {record['figure']} value {record['value']!r}")
            elif not re.fullmatch(r"\d{4}-\d\d-\d\d|unknown", record["date"]):
                bad.append(f"{name}: {record['figure']} date {record['date']!r}")
    assert not bad, "\n".join(bad)


def test_each_figure_lives_in_one_file():
    owner = {}
    for name, records in RECORDS.items():
        for record in records:
            assert owner.setdefault(record["figure"], name) == name, (
                f"{record['figure']}: in {owner[record['figure']]}"
            )


def test_results_md_is_what_render_writes():
    text = (ROOT / "RESULTS.md").read_text(encoding="utf-8")
    assert text == results.render(), "RESULTS.md is stale: run `python benchmarks/results.py render`"


def test_the_readme_quotes_recorded_figures():
    """The README cites its figures by id (``demo.greedy_wer.test``): each is a recorded figure."""
    figures = {r["figure"] for records in RECORDS.values() for r in records}
    cited = set(re.findall(r"`((?:demo|tts|salm)\.[a-z0-9_.]+)`", (ROOT / "README.md").read_text()))
    assert cited and cited <= figures, sorted(cited - figures)


def test_append_fills_commit_date_and_machine_and_render_keeps_the_latest(tmp_path):
    results.append("demo.greedy_wer.test", 20.5, "%", "make demo", root=tmp_path)
    record = results.append("demo.greedy_wer.test", 19.25, "%", "make demo", note="second", root=tmp_path)
    results.append("speed.thing", 3, "x", "python benchmarks/x.py", root=tmp_path)
    assert re.fullmatch(r"[0-9a-f]{4,40}\+?|unknown", record["commit"]) and re.fullmatch(
        r"\d{4}-\d\d-\d\d", record["date"]
    )
    assert "CPUs" in record["machine"] and record["note"] == "second"
    lines = (tmp_path / "results" / "demo.jsonl").read_text().splitlines()
    assert [json.loads(line)["value"] for line in lines] == [20.5, 19.25]  # history kept, in order
    text = results.render(tmp_path)
    assert "| `demo.greedy_wer.test` | 19.25 | % |" in text and "20.5" not in text
    assert text.index("## demo") < text.index("## speed") and "| `speed.thing` | 3 | x |" in text
    with pytest.raises(ValueError, match="dotted lower-case words"):
        results.append("Demo WER", 1, "%", "make demo", root=tmp_path)


def test_from_run_records_greedy_and_beam_wer_per_set(tmp_path):
    run = tmp_path / "speechtrain_experiments" / "asr_demo" / "2026-01-01_00-00-00"
    run.mkdir(parents=True)
    metrics = {"val_wer_dev": 0.07, "val_wer_greedy_dev": 0.1154, "val_wer_test": 0.0689,
               "val_wer_greedy_test": 0.1301, "val_cer_test": 0.03, "val_loss": 1.2,
               "val_wer_heldout_engine": float("nan"), "val_wer_greedy_heldout_engine": 0.3798}  # fmt: skip
    (run / "final_metrics.json").write_text(json.dumps(metrics))
    added = results.from_run(run, wall_s=1745.4, root=tmp_path)
    got = {r["figure"]: r["value"] for r in added}
    assert got == {"demo.beam_lm_wer.dev": 7.0, "demo.greedy_wer.dev": 11.54, "demo.beam_lm_wer.test": 6.89,
                   "demo.greedy_wer.test": 13.01, "demo.greedy_wer.heldout_engine": 37.98,
                   "demo.wall_time": 1745}  # fmt: skip
    assert {r["command"] for r in added} == {"make demo"}
    greedy_only = tmp_path / "greedy"
    greedy_only.mkdir()
    (greedy_only / "final_metrics.json").write_text(json.dumps({"val_wer": 0.2, "val_cer": 0.1}))
    (record,) = results.from_run(greedy_only, prefix="demo.ctc", command="make demo-ctc", root=tmp_path)
    assert (record["figure"], record["value"]) == ("demo.ctc.greedy_wer.all", 20.0)
    with pytest.raises(FileNotFoundError, match="final_metrics.json"):
        results.from_run(tmp_path, root=tmp_path)


def test_check_fails_on_a_stale_results_md(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(results, "ROOT", tmp_path)
    results.append("demo.greedy_wer.test", 13.0, "%", "make demo", root=tmp_path)
    with pytest.raises(SystemExit) as stale:
        results.main(["check"])
    assert stale.value.code == 1 and "stale" in capsys.readouterr().err
    results.main(["render"])
    results.main(["check"])
    assert "up to date" in capsys.readouterr().out
