"""Fine-tuning on a shifted domain: speech 1.3x faster than anything the demo model heard.

    python benchmarks/asr_finetune_shift.py --model speechtrain_experiments/asr_demo/<run>/asr_demo.stm [--minutes 5]

1. Writes the corpus's dev and test splits sped up 1.3x (resampled: tempo and pitch together).
2. WER of the model on fast test, and on the original test.
3. ``examples/asr_finetune.py`` from the archive for ``--minutes``: the training split with speed perturbation at
   1.3x on every utterance, validation on fast dev.
4. WER of the fine-tuned model on fast test and on the original test.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import soundfile as sf
import torch

from speechtrain.asr.transcribe import transcribe_paths
from speechtrain.common.metrics import word_error_rate
from speechtrain.core.model import SpeechModel
from speechtrain.corpora.builtin import resolve_manifest
from speechtrain.data.augment import change_speed
from speechtrain.data.manifest import read_nemo_manifest

ROOT = Path(__file__).resolve().parents[1]
FACTOR = 1.3


def fast_split(split: str, out: Path) -> Path:
    """The split with every utterance sped up by FACTOR; returns its manifest."""
    folder = out / split
    folder.mkdir(parents=True)
    lines = []
    for record in read_nemo_manifest(resolve_manifest(f"builtin:espeak/{split}")):
        audio, rate = sf.read(record["audio_filepath"], dtype="float32")
        fast = change_speed(torch.from_numpy(audio), FACTOR).numpy()
        path = folder / Path(record["audio_filepath"]).name
        sf.write(path, fast, rate)
        lines.append(json.dumps({"audio_filepath": str(path), "duration": len(fast) / rate, "text": record["text"]}))
    manifest = folder / "manifest.json"
    manifest.write_text("\n".join(lines) + "\n")
    return manifest


def wer(model_path: Path, manifest: str) -> float:
    model = SpeechModel.restore_from(model_path)
    rows = transcribe_paths(model, [dict(r) for r in read_nemo_manifest(manifest)])
    return word_error_rate([r["pred_text"] or "" for r in rows], [r["text"] for r in rows])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--minutes", type=float, default=5.0)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        fast_dev, fast_test = fast_split("dev", tmp), fast_split("test", tmp)
        test = str(resolve_manifest("builtin:espeak/test"))
        before = {"fast test": wer(args.model, str(fast_test)), "test": wer(args.model, test)}
        command = [
            sys.executable, str(ROOT / "examples" / "asr_finetune.py"), f"init_from.path={args.model}",
            "model.train_ds.manifest_filepath=builtin:espeak/train", "model.train_ds.batch_duration=60",
            f"+model.train_ds.augmentation.speed={{factors: [{FACTOR}], prob: 1.0}}",
            f"model.validation_ds.manifest_filepath={fast_dev}", "trainer.max_epochs=null",
            f"trainer.max_time={{minutes: {args.minutes}}}", f"exp_manager.exp_dir={tmp / 'exp'}",
            "trainer.enable_progress_bar=false",
        ]  # fmt: skip
        result = subprocess.run(command, env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}, capture_output=True,
                                text=True, check=False)  # fmt: skip
        if result.returncode != 0:
            raise SystemExit(result.stderr[-4000:])
        (tuned,) = (tmp / "exp").glob("*/*/asr_finetune.stm")
        after = {"fast test": wer(tuned, str(fast_test)), "test": wer(tuned, test)}
    print(f"| data | demo model WER | after {args.minutes:g} min fine-tuning on 1.3x speed |")
    print("|---|---|---|")
    for key in before:
        print(f"| {key} | {100 * before[key]:.2f}% | {100 * after[key]:.2f}% |")


if __name__ == "__main__":
    main()
