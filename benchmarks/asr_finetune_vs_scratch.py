"""Does the demo archive help on a synthesiser it never heard? Fine-tuning it vs training the same model from scratch.

    python benchmarks/asr_finetune_vs_scratch.py --model speechtrain_experiments/asr_demo/<run>/asr_demo.stm \
        [--minutes 6] [--devices 2] [--corpus builtin:speech] [--config-name asr_train_hybrid]

Both runs train for the same wall-clock budget on ``builtin:speech/heldout_engine_train`` (400 utterances of the
held-out engine, Flite: sentences never in the demo's training) and validate greedily on
``builtin:speech/heldout_engine`` (400 other utterances) every ``--every`` epochs:

1. ``examples/asr_finetune.py init_from.path=<model>`` (the archive's tokenizer, config and weights);
2. ``examples/asr_train.py`` with the archive's recipe, ``--config-name`` (``make demo``'s ``asr_train_hybrid`` by
   default; ``asr_train`` for a ``make demo-ctc`` archive), its own tokenizer and LM fitted on the 400 transcripts.

Prints both curves (greedy WER against training step) and each run's closing decoding report, and records each
run's closing greedy and default-decoding (beam + LM) WERs (results/demo.jsonl: ``demo.finetune.*``,
``demo.scratch.*``).
"""

import argparse
import csv
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import append  # noqa: E402


def run(script: str, args: list[str], out: Path, name: str, corpus: str) -> tuple[list[tuple[int, float]], str, dict]:
    """Run an example; returns ([(step, greedy val WER)], its closing output, its closing metrics)."""
    data = [f"model.train_ds.manifest_filepath={corpus}/heldout_engine_train", "model.train_ds.input_cfg=null",
            f"model.validation_ds.manifest_filepath=[{corpus}/heldout_engine]"]  # fmt: skip
    command = [sys.executable, str(ROOT / "examples" / script), *args, *data, f"name={name}",
               f"exp_manager.exp_dir={out}"]  # fmt: skip
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{script} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    metrics = sorted((out / name).glob("*/metrics.csv"))[-1]
    curve = []
    with open(metrics, newline="") as f:
        for row in csv.DictReader(f):
            if row.get("val_wer"):
                curve.append((int(row["step"]), float(row["val_wer"])))
    tail = done.stdout[done.stdout.find("Final:") :] if "Final:" in done.stdout else done.stdout[-2000:]
    closing = json.loads(metrics.with_name("final_metrics.json").read_text(encoding="utf-8"))
    return curve[:-1], re.sub(r"\n{3,}", "\n\n", tail), closing  # the last row is the closing validation


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="the demo archive (.stm)")
    parser.add_argument("--minutes", type=float, default=6.0)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--every", type=int, default=2, help="validate every N epochs")
    parser.add_argument("--corpus", default="builtin:speech", help="the corpus the archive was trained on")
    parser.add_argument("--config-name", default="asr_train_hybrid", help="the archive's recipe (examples/conf)")
    parser.add_argument("--note", default="", help="added to the records' note (e.g. the machine's load)")
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args(argv)
    minutes = int(args.minutes)
    seconds = round((args.minutes - minutes) * 60)
    common = [f"trainer.devices={args.devices}", f"trainer.max_time=00:00:{minutes:02d}:{seconds:02d}",
              "trainer.max_epochs=null", f"trainer.check_val_every_n_epoch={args.every}",
              "model.train_ds.batch_duration=30"]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        archive = f"init_from.path={Path(args.model).resolve()}"
        fine, fine_report, fine_closing = run("asr_finetune.py", [archive, *common], out, "finetune", args.corpus)
        recipe = ["--config-name", args.config_name]
        scratch, scratch_report, scratch_closing = run("asr_train.py", [*recipe, *common], out, "scratch",
                                                       args.corpus)  # fmt: skip
    print(f"| step | fine-tuned from the demo archive: greedy WER on heldout_engine | from scratch ({args.minutes:g} "
          "min each) |")  # fmt: skip
    print("| --- | --- | --- |")
    steps = sorted({s for s, _ in fine} | {s for s, _ in scratch})
    for step in steps:
        a = next((f"{w:.2%}" for s, w in fine if s == step), "")
        b = next((f"{w:.2%}" for s, w in scratch if s == step), "")
        print(f"| {step} | {a} | {b} |")
    print("\nFine-tuned:\n" + fine_report + "\nFrom scratch:\n" + scratch_report)
    if args.no_record:
        return
    command = (f"python benchmarks/asr_finetune_vs_scratch.py --model <asr_demo.stm> --minutes {args.minutes:g} "
               f"--corpus {args.corpus}")  # fmt: skip
    note = (f"{Path(args.model).name} fine-tuned {args.minutes:g} min on {args.devices} processes on "
            f"heldout_engine_train (400 Flite utterances), vs the same recipe from scratch for as long; "
            f"{args.note}").rstrip("; ")  # fmt: skip
    for run_name, closing in (("finetune", fine_closing), ("scratch", scratch_closing)):
        for kind, key in (("greedy_wer", "val_wer_greedy"), ("beam_lm_wer", "val_wer")):
            if key in closing:
                append(f"demo.{run_name}.{kind}.heldout_engine", round(100 * closing[key], 2), "%", command, note)


if __name__ == "__main__":
    main()
