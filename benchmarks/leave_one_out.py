"""Leave one engine family out of the demo's training and measure greedy WER on it: the nearest proxy for voices
(and people) a model never heard.

    python benchmarks/leave_one_out.py --steps 1000                       # all engines, then piper out, festival out
    python benchmarks/leave_one_out.py --minutes 10 --left-out piper      # equal wall time, not equal steps
    python benchmarks/leave_one_out.py --steps 1000 --left-out piper      # only the Piper run (and the baseline)
    python benchmarks/leave_one_out.py --steps 1000 --left-out            # only the baseline
    python benchmarks/leave_one_out.py --steps 1000 --left-out piper --no-baseline --tag pitch -- \
        "model.train_ds.augmentation.pitch={min_factor: 0.88, max_factor: 1.15, prob: 0.5}"  # one change

Each run trains the `make demo` recipe (``examples/asr_train.py --config-name asr_train_hybrid``, 2 processes, 30 s
of audio per process per step) for the same number of optimizer steps (``--steps``: on a shared machine a run's
accuracy then does not depend on its load; the learning rate decays over them) or the same training wall time
(``--minutes``: what a user with a budget gets, a change that slows the step paying for it in steps; runs in turn on
a machine left quiet, each run's steps in its records' note), with
the recipe's training blend less every utterance of the left-out engine (the blend's other sources and their
weights as the recipe has them, each weight = its utterances x repeats). Flite is out of every run (the corpus
holds it out: ``heldout_engine``). The closing validation decodes greedy only; its per-engine table
(``greedy_breakdown.json`` in the run folder) gives the left-out engine's WER on ``test`` (sentences no training
split reads), beside the same engine's WER when it was trained on (the baseline run, ``--left-out`` none).

Beside the corpus's sets, every run validates on ``test_babble``: ``test`` with the babble of four other speakers
(``dev`` utterances, every engine) mixed in at 15-25 dB SNR, seeded, built once per invocation. People are heard
through rooms and noise; the noise and room augmentations are judged on it as well as on clean ``test``, and no
augmentation measured here generates babble (the noise one makes coloured noise), so it cannot flatter one.

Overrides after ``--`` go to every run (one recipe change to measure, named by ``--tag``: the runs become
``all_<tag>``, ``no_<engine>_<tag>``).

Records (results/leave_one_out.jsonl): ``leave_one_out.<run>.greedy_wer.<set>.<engine>`` (``<run>``: ``all`` or
``no_<engine>``, ``_<tag>`` after it; ``_<M>min`` last for a ``--minutes`` run), and ``...greedy_wer.<set>`` for each
whole set.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import append  # noqa: E402

ENGINES = ("espeak", "piper", "festival")
# The demo recipe's training blend (examples/conf/asr_train_hybrid.yaml; a test holds them equal): (split, the
# engines it reads, repeat, whether the recipe names them after '@').
RECIPE_BLEND = (("builtin:speech/train", ENGINES, 1, False), ("builtin:speech/train", ("piper", "festival"), 3, True),
                ("builtin:speech/train_extra", ("espeak",), 1, False))  # fmt: skip


def blend(left_out: str | None, count) -> list[dict]:
    """The recipe's ``input_cfg`` less the engine ``left_out`` (None: the recipe's own blend, restated):
    ``count(source)`` gives a source's utterances; a source left with no engine is dropped."""
    sources = []
    for split, engines, repeat, named in RECIPE_BLEND:
        kept = [e for e in engines if e != left_out]
        if not kept:
            continue
        name = f"{split}@{'+'.join(kept)}" if named or left_out in engines else split
        source = {"manifest_filepath": name, "weight": count(name) * repeat}
        if repeat > 1:
            source["repeat"] = repeat
        sources.append(source)
    return sources


def count_utterances(name: str) -> int:
    from speechtrain.corpora.builtin import resolve_manifest

    with open(resolve_manifest(name), encoding="utf-8") as rows:
        return sum(1 for line in rows if line.strip())


def hydra_list(sources: list[dict]) -> str:
    """An ``input_cfg`` as a Hydra override value (strings quoted: they hold ':' and '@')."""
    items = []
    for s in sources:
        fields = [f'manifest_filepath: "{s["manifest_filepath"]}"', f"weight: {s['weight']}"]
        if "repeat" in s:
            fields.append(f"repeat: {s['repeat']}")
        items.append("{" + ", ".join(fields) + "}")
    return "[" + ", ".join(items) + "]"


def run_name(left_out: str | None, tag: str, minutes: float | None = None) -> str:
    name = ("all" if left_out is None else f"no_{left_out}") + (f"_{tag}" if tag else "")
    return name if minutes is None else f"{name}_{minutes:g}min".replace(".", "_")


def budget(steps: int | None, minutes: float | None) -> list[str]:
    """The trainer's overrides for a step budget (validated at its last step) or a wall-clock one (validated only by
    the closing validation that every run ends with); vs_nemo_accuracy.py trains ours with them too."""
    if minutes is not None:
        return ["trainer.max_steps=-1", f"trainer.max_time={{seconds: {round(60 * minutes)}}}",
                "trainer.val_check_interval=1000000000", "trainer.check_val_every_n_epoch=null"]  # fmt: skip
    return [f"trainer.max_steps={steps}", "trainer.max_time=null", f"trainer.val_check_interval={steps}",
            "trainer.check_val_every_n_epoch=null"]  # fmt: skip


def babble_test(folder: Path, seed: int = 0) -> Path:
    """``test`` with four other speakers' babble at 15-25 dB SNR (see the module docstring): its manifest path
    (``test_babble.json``, set name ``test_babble``; rows keep their engine and voice)."""
    import numpy as np
    import soundfile as sf
    import torch

    from speechtrain.corpora.builtin import resolve_manifest
    from speechtrain.data.augment import mix_at_snr
    from speechtrain.data.manifest import read_nemo_manifest

    def rows(split: str) -> tuple[Path, list[dict]]:
        manifest = resolve_manifest(f"builtin:speech/{split}")
        return manifest.parent, read_nemo_manifest(manifest)

    (test_root, tests), (dev_root, talkers) = rows("test"), rows("dev")
    out = folder / "test_babble"
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    lines = []
    for n, row in enumerate(tests):
        audio, rate = sf.read(test_root / row["audio_filepath"], dtype="float32")
        babble = np.zeros_like(audio)
        for k in rng.choice(len(talkers), 4, replace=False):
            other, _ = sf.read(dev_root / talkers[k]["audio_filepath"], dtype="float32")
            other = np.tile(other, -(-len(audio) // len(other)))[: len(audio)]
            babble += other / max(float(np.sqrt((other**2).mean())), 1e-8)
        mixed = mix_at_snr(torch.from_numpy(audio), torch.from_numpy(babble), float(rng.uniform(15.0, 25.0)))
        path = out / f"{n:05d}.wav"
        sf.write(path, (mixed / max(1.0, float(mixed.abs().max()))).numpy(), rate)
        lines.append(json.dumps({**row, "audio_filepath": str(path)}))
    manifest = folder / "test_babble.json"
    manifest.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return manifest


def steps_trained(run_dir: Path) -> int | None:
    """The optimizer steps a finished run trained, from its ``train.log`` (None if it does not say)."""
    done = re.findall(r"training: done, (\d+) steps", (run_dir / "train.log").read_text(encoding="utf-8"))
    return int(done[-1]) if done else None


def train(left_out: str | None, steps: int | None, folder: Path, tag: str = "", overrides: tuple[str, ...] = (),
          babble: Path | None = None, minutes: float | None = None):  # fmt: skip
    """One run: (closing metrics, per-engine breakdown, wall seconds, steps trained); ``babble``: an extra validation
    manifest."""
    run = run_name(left_out, tag, minutes)
    sets = ["builtin:speech/dev", "builtin:speech/test", "builtin:speech/heldout_engine"]
    sets += [str(babble)] if babble is not None else []
    command = [sys.executable, str(ROOT / "examples" / "asr_train.py"), "--config-name", "asr_train_hybrid",
               f"name=loo_{run}", f"exp_manager.exp_dir={folder}", "trainer.devices=2",
               "model.train_ds.batch_duration=30", *budget(steps, minutes), "model.decoding.strategy=greedy",
               f"model.validation_ds.manifest_filepath=[{','.join(sets)}]",
               f"model.train_ds.input_cfg={hydra_list(blend(left_out, count_utterances))}", *overrides]  # fmt: skip
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    print("+", " ".join(command), flush=True)
    subprocess.run(command, env=env, check=True)
    wall = time.perf_counter() - start
    (metrics_path,) = (folder / f"loo_{run}").rglob("final_metrics.json")
    breakdown = json.loads((metrics_path.parent / "greedy_breakdown.json").read_text(encoding="utf-8"))
    trained = steps_trained(metrics_path.parent) or steps
    return json.loads(metrics_path.read_text(encoding="utf-8")), breakdown, wall, trained


def figures(run: str, metrics: dict, breakdown: dict) -> dict[str, float]:
    """``{figure id: WER %}`` of one run: each set's greedy WER and each set's per-engine greedy WER."""
    out = {}
    for key, value in metrics.items():
        if key.startswith("val_wer_") and not key.startswith("val_wer_greedy"):
            out[f"leave_one_out.{run}.greedy_wer.{key[len('val_wer_') :]}"] = round(100.0 * value, 2)
    for set_name, groups in breakdown.items():
        for group, (wer, _) in groups.items():
            if " / " not in group:  # engines only; voices stay in the run's report
                out[f"leave_one_out.{run}.greedy_wer.{set_name}.{group}"] = round(100.0 * wer, 2)
    return out


def per_engine_wers(found: dict[str, float], run: str, set_name: str) -> str:
    """``espeak 24.45%, piper ...``: a run's per-engine greedy WER on one set."""
    keys = {engine: f"leave_one_out.{run}.greedy_wer.{set_name}.{engine}" for engine in ENGINES}
    return ", ".join(f"{engine} {found[key]:.2f}%" for engine, key in keys.items() if key in found)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    budget_group = parser.add_mutually_exclusive_group(required=True)
    budget_group.add_argument("--steps", type=int, help="optimizer steps of every run")
    budget_group.add_argument("--minutes", type=float, help="training wall time of every run (instead of steps)")
    parser.add_argument("--left-out", nargs="*", default=["piper", "festival"], choices=ENGINES,
                        help="engines left out, one run each (after the baseline run with every engine); none: the "
                             "baseline run alone")  # fmt: skip
    parser.add_argument("--no-baseline", action="store_true", help="skip the run with every engine")
    parser.add_argument("--tag", default="", help="names the change that the overrides make (in the runs' names)")
    parser.add_argument("--no-record", action="store_true")
    parser.add_argument("overrides", nargs="*", help="recipe overrides for every run (after --)")
    args = parser.parse_args(argv)
    if args.overrides and not args.tag:
        parser.error("name the change with --tag when giving overrides")
    runs = ([] if args.no_baseline else [None]) + list(args.left_out)
    if not runs:
        parser.error("nothing to run: --no-baseline and no engine left out")
    command = "python benchmarks/leave_one_out.py " + (
        f"--steps {args.steps}" if args.minutes is None else f"--minutes {args.minutes:g}"
    )
    if args.tag:
        command += f" --tag {args.tag} -- " + " ".join(f"'{o}'" for o in args.overrides)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        babble = babble_test(Path(folder))
        for left_out in runs:
            run = run_name(left_out, args.tag, args.minutes)
            metrics, breakdown, wall, trained = train(left_out, args.steps, Path(folder), args.tag,
                                                      tuple(args.overrides), babble, args.minutes)  # fmt: skip
            found = figures(run, metrics, breakdown)
            rows.append((run, found, wall))
            if not args.no_record:
                if args.minutes is None:
                    note = f"{args.steps} steps, greedy, 2 processes; {wall:.0f} s wall on a shared machine"
                else:
                    note = (f"{args.minutes:g} min training ({trained} steps), greedy, 2 processes; {wall:.0f} s "
                            "wall with start-up and validation; runs in turn")  # fmt: skip
                for figure, value in found.items():
                    append(figure, value, "%", command, note)
    print("\n| run | test | heldout_engine (flite) | test, per engine | test_babble, per engine |")
    print("|---|---|---|---|---|")
    for run, found, _ in rows:
        test = found.get(f"leave_one_out.{run}.greedy_wer.test", float("nan"))
        held = found.get(f"leave_one_out.{run}.greedy_wer.heldout_engine", float("nan"))
        per_engine, babble_wer = (per_engine_wers(found, run, name) for name in ("test", "test_babble"))
        print(f"| {run} | {test:.2f}% | {held:.2f}% | {per_engine} | {babble_wer} |", flush=True)


if __name__ == "__main__":
    main()
