"""Greedy WER of speechtrain's demo recipes next to NeMo's FastConformer recipe, same data, same wall-clock training
budget, same machine.

    python benchmarks/vs_nemo_accuracy.py --nemo-python /work/nemo-env/bin/python --minutes 8
    python benchmarks/vs_nemo_accuracy.py --nemo-python ... --minutes 8 --family ctc      # one family
    python benchmarks/vs_nemo_accuracy.py --nemo-python ... --steps 1000 --family ctc   # equal steps, not time
    python benchmarks/vs_nemo_accuracy.py --nemo-python ... --minutes 1 --eval-utterances 40 --no-record  # smoke

Families: ``ctc`` (ours: ``examples/asr_train.py --config-name asr_train``; NeMo: FastConformer-CTC) and
``hybrid`` (ours: ``asr_train_hybrid``, TDT-CTC; NeMo: FastConformer hybrid transducer-CTC, with the RNN-T loss as
NeMo's TDT loss is CUDA-only). Both sides train for ``--minutes`` of ``trainer.max_time`` on 2 data-parallel CPU
processes with 30 s of audio per process per step, without validation during training, then greedy-decode ``test``
and ``heldout_engine`` (the whole sets unless ``--eval-utterances``). For each family ours runs first, then NeMo's;
the next family swaps the order, so a load that drifts over the run falls on both. NeMo runs in its own environment
(``--nemo-python``, with ``nemo-toolkit[asr]``; never a dependency of speechtrain) through
``benchmarks/vs_nemo_accuracy_nemo.py``, whose docstring gives its config and its compromises.

Same data: NeMo reads one manifest (absolute audio paths) holding what our recipe's ``train_ds`` reads in an epoch
(the hybrid's blend: ``train``, its Piper and Festival utterances 3 more times, ``train_extra``; the CTC recipe:
``train``), and our recipe's own BPE tokenizer file (128 pieces for CTC, 64 for the hybrid). Same size: NeMo's
encoder has our demo's width, depth and heads; the rest of each side is its own recipe (ours: 4x striding,
half-rate middle layers, intermediate CTC, no dropout; NeMo's: 8x ``dw_striding``, dropout 0.1, SpecAugment, ...).

``--steps N`` trains both sides for N optimizer steps instead, each schedule decaying over them: at equal steps the
comparison is of what each recipe learns per step, whatever its speed (the equal-time figures fold in that ours
steps faster on a CPU). Records then read ``vs_nemo_accuracy.<family>.steps<N>.<ours|nemo|ratio>...``.

A run takes about 4 x (``--minutes`` + 2) minutes for both families: each of the four runs adds its start-up (NeMo
starts twice as slowly: its import, then its second rank's) and its decoding to the training budget.

Records (results/vs_nemo_accuracy.jsonl): ``vs_nemo_accuracy.<family>.<ours|nemo>.greedy_wer.<set>`` (%) and
``vs_nemo_accuracy.<family>.ratio.<set>`` (ours / NeMo).
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from leave_one_out import budget, steps_trained  # noqa: E402

from results import append  # noqa: E402

RECIPES = {"ctc": "asr_train", "hybrid": "asr_train_hybrid"}
SETS = ("test", "heldout_engine")
ENV = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(ROOT)}


def recipe_sources(recipe: str) -> list[tuple[str, int]]:
    """(manifest, times read per epoch) of a recipe's ``train_ds``, from its YAML or the configs it extends."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(ROOT / "examples" / "conf" / f"{recipe}.yaml")
    ds = OmegaConf.select(cfg, "model.train_ds") or {}
    if ds.get("input_cfg"):
        return [(s["manifest_filepath"], int(s.get("repeat", 1))) for s in ds["input_cfg"]]
    if ds.get("manifest_filepath"):
        return [(ds["manifest_filepath"], 1)]
    parents = [d for d in cfg.get("defaults", []) if isinstance(d, str) and d != "_self_"]
    return recipe_sources(parents[0])


def absolute_manifest(name: str, out: Path, repeat: int = 1, limit: int = 0, mode: str = "w") -> None:
    """Write (or append) a built-in manifest with absolute audio paths, ``repeat`` times, its first ``limit`` rows
    (0: all)."""
    from speechtrain.corpora.builtin import resolve_manifest

    path = Path(resolve_manifest(name))
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    rows = rows[:limit] if limit else rows
    with open(out, mode, encoding="utf-8") as f:
        for _ in range(repeat):
            for row in rows:
                f.write(json.dumps({**row, "audio_filepath": str(path.parent / row["audio_filepath"])}) + "\n")


def recipe_tokenizer(recipe: str, out: Path) -> Path:
    """Our recipe's tokenizer (built and cached by ``prepare_only``) copied into ``out`` as NeMo wants a BPE
    folder: ``tokenizer.model`` and a ``vocab.txt`` (one piece a line)."""
    command = [sys.executable, str(ROOT / "examples" / "asr_train.py"), "--config-name", recipe, "prepare_only=true",
               "model.decoding.strategy=greedy"]  # fmt: skip
    done = subprocess.run(command, env=ENV, check=True, capture_output=True, text=True)
    (model,) = re.findall(r"^tokenizer: (.+)$", done.stdout, flags=re.M)
    out.mkdir(parents=True)
    shutil.copy(model, out / "tokenizer.model")
    pieces = Path(model).with_suffix(".vocab").read_text(encoding="utf-8").splitlines()
    (out / "vocab.txt").write_text("".join(p.split("\t")[0] + "\n" for p in pieces), encoding="utf-8")
    return out


def train_ours(family: str, seconds: int | None, folder: Path, evals: dict[str, Path],
               steps: int | None = None) -> dict:  # fmt: skip
    name = f"ours_{family}"
    command = [sys.executable, str(ROOT / "examples" / "asr_train.py"), "--config-name", RECIPES[family],
               f"name={name}", f"exp_manager.exp_dir={folder}", "trainer.devices=2",
               "model.train_ds.batch_duration=30", *budget(steps, None if seconds is None else seconds / 60),
               "model.decoding.strategy=greedy",
               "model.validation_ds.manifest_filepath=[" + ",".join(str(p) for p in evals.values()) + "]"]  # fmt: skip
    start = time.perf_counter()
    print("+", " ".join(command), flush=True)
    subprocess.run(command, env=ENV, check=True)
    wall = time.perf_counter() - start
    (metrics_path,) = (folder / name).rglob("final_metrics.json")
    metrics = json.loads(metrics_path.read_text(encoding="utf-8"))
    return {"steps": steps_trained(metrics_path.parent), "wall_s": wall,
            "wer": {s: metrics[f"val_wer_{s}"] for s in evals}}  # fmt: skip


def train_nemo(python: str, family: str, seconds: int | None, folder: Path, train: Path, tokenizer: Path,
               evals: dict[str, Path], steps: int | None = None) -> dict:  # fmt: skip
    out = folder / f"nemo_{family}.json"
    limit = ["--seconds", str(seconds)] if steps is None else ["--steps", str(steps)]
    command = [python, str(ROOT / "benchmarks" / "vs_nemo_accuracy_nemo.py"), "--family", family, "--train",
               str(train), "--tokenizer-dir", str(tokenizer), *limit, "--out", str(out),
               *[f"--eval={s}={p}" for s, p in evals.items()]]  # fmt: skip
    start = time.perf_counter()
    print("+", " ".join(command), flush=True)
    subprocess.run(command, env={**ENV, "PYTHONPATH": ""}, cwd=folder, check=True)  # NeMo must not see speechtrain
    result = json.loads(out.read_text(encoding="utf-8"))
    return {"steps": result["steps"], "wall_s": time.perf_counter() - start, "wer": result["wer"]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nemo-python", required=True, help="a python with nemo-toolkit[asr]")
    parser.add_argument("--minutes", type=float, default=8.0, help="training wall time of every run")
    parser.add_argument("--steps", type=int, default=None, help="train every run for this many steps instead")
    parser.add_argument("--family", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    parser.add_argument("--eval-utterances", type=int, default=0, help="decode each set's first N (0: all; smoke)")
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args(argv)
    seconds = None if args.steps is not None else round(60 * args.minutes)
    command = "python benchmarks/vs_nemo_accuracy.py --nemo-python NEMO_PYTHON " + (
        f"--minutes {args.minutes:g}" if args.steps is None else f"--steps {args.steps}"
    )
    command += f" --family {' '.join(args.family)}"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        evals = {s: folder / "eval" / f"{s}.json" for s in SETS}  # the file's stem names our validation set
        evals["test"].parent.mkdir()
        for s, path in evals.items():
            absolute_manifest(f"builtin:speech/{s}", path, limit=args.eval_utterances)
        for index, family in enumerate(args.family):
            tokenizer = recipe_tokenizer(RECIPES[family], folder / f"tokenizer_{family}")
            train = folder / f"train_{family}.json"
            train.unlink(missing_ok=True)
            for name, repeat in recipe_sources(RECIPES[family]):
                absolute_manifest(name, train, repeat=repeat, mode="a")
            found = {}
            for side in ["ours", "nemo"] if index % 2 == 0 else ["nemo", "ours"]:
                found[side] = (
                    train_ours(family, seconds, folder, evals, args.steps) if side == "ours"
                    else train_nemo(args.nemo_python, family, seconds, folder, train, tokenizer, evals, args.steps)
                )  # fmt: skip
            rows.append((family, found))
            if not args.no_record:
                record(family, found, args.minutes, command, args.steps)
    print("\n| family | framework | steps | test greedy WER | heldout_engine greedy WER |\n|---|---|---|---|---|")
    for family, found in rows:
        for side in ("ours", "nemo"):
            wer = found[side]["wer"]
            print(f"| {family} | {'speechtrain' if side == 'ours' else 'NeMo'} | {found[side]['steps']} | "
                  f"{100 * wer['test']:.2f}% | {100 * wer['heldout_engine']:.2f}% |")  # fmt: skip
        ratios = [found["ours"]["wer"][s] / max(found["nemo"]["wer"][s], 1e-9) for s in SETS]
        print(f"| {family} | ours / NeMo | | {ratios[0]:.2f} | {ratios[1]:.2f} |", flush=True)


def record(family: str, found: dict, minutes: float, command: str, steps: int | None = None) -> None:
    if steps is None:
        done = ", ".join(f"{side} {found[side]['steps']} steps" for side in ("ours", "nemo"))
        note = f"{minutes:g} min training each, 2 CPU processes, 30 s audio per process per step; {done}"
        key = family
    else:
        took = ", ".join(f"{side} {found[side]['wall_s'] / 60:.1f} min" for side in ("ours", "nemo"))
        note = f"{steps} steps each, 2 CPU processes, 30 s audio per process per step; wall with decoding: {took}"
        key = f"{family}.steps{steps}"
    note += "; greedy; shared machine"
    for s in SETS:
        for side in ("ours", "nemo"):
            append(f"vs_nemo_accuracy.{key}.{side}.greedy_wer.{s}", round(100 * found[side]["wer"][s], 2), "%",
                   command, note)  # fmt: skip
        ratio = found["ours"]["wer"][s] / max(found["nemo"]["wer"][s], 1e-9)
        append(f"vs_nemo_accuracy.{key}.ratio.{s}", round(ratio, 3), "x", command, note)


if __name__ == "__main__":
    main()
