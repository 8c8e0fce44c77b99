"""Speed and accuracy of the `make demo-ctc` job (examples/asr_train.py on the built-in corpus), per precision.

    python benchmarks/asr_demo.py                       # fp32 and bf16-mixed, the demo's default schedule
    python benchmarks/asr_demo.py --precisions bf16-mixed -- trainer.max_epochs=2

Throughput is training audio-seconds per wall-second over the training steps (first 5 steps excluded). Each
precision's figures are appended to results/demo.jsonl (``demo.ctc.train_speed.<precision>``, ...; see
benchmarks/results.py) unless ``--no-record``.
"""

import argparse
import importlib.util
import math
import shlex
import sys
import tempfile
import time
from pathlib import Path

from speechtrain.common.metrics import format_rate
from speechtrain.core.hydra_runner import compose_config
from speechtrain.lightning import BaseCallback, CallbackGroup

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import append  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


class Throughput(BaseCallback):
    """Audio seconds and wall time of training steps; the last validation WER."""

    def __init__(self, warmup: int = 5) -> None:
        self.warmup, self.steps, self.audio, self.seconds, self.wer = warmup, 0, 0.0, 0.0, float("nan")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps += 1
        if self.steps > self.warmup and batch is not None:
            self.seconds += time.perf_counter() - self._start
            self.audio += float(batch["audio_lens"].sum()) / pl_module.cfg.sample_rate

    def on_validation_end(self, trainer, pl_module):
        if "val_wer" in trainer.callback_metrics:
            self.wer = float(trainer.callback_metrics["val_wer"])


def run(precision: str, overrides: list[str], warmup: int = 5) -> dict:
    spec = importlib.util.spec_from_file_location("asr_train", EXAMPLES / "asr_train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    train = module.main
    with tempfile.TemporaryDirectory() as exp_dir:
        # The script's own config folder, YAML and schema: the benchmark cannot drift from what `make demo-ctc` runs.
        cfg = compose_config(
            train.config_dir,
            train.config_name,
            [f"trainer.precision={precision}", f"exp_manager.exp_dir={exp_dir}", "trainer.enable_progress_bar=false"]
            + overrides,
            train.schema,
        )
        meter = Throughput(warmup)
        CallbackGroup.get_instance().register(meter)
        start = time.perf_counter()
        try:
            train(cfg)
        finally:
            CallbackGroup.get_instance().unregister(meter)
        wall = time.perf_counter() - start
    speed = meter.audio / meter.seconds if meter.seconds else float("nan")
    return {"precision": precision, "audio_s_per_s": speed, "wer": meter.wer, "wall": wall}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precisions", nargs="+", default=["32", "bf16-mixed"])
    parser.add_argument("--warmup", type=int, default=5, help="training steps left out of the throughput")
    parser.add_argument("--no-record", action="store_true", help="print only: append nothing to results/")
    parser.add_argument("overrides", nargs="*", help="config overrides for every run")
    args = parser.parse_args(argv)
    rows = [run(p, args.overrides, args.warmup) for p in args.precisions]
    print("\n| precision | train audio-s/s | final val WER | wall time (s, incl. validation) |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['precision']} | {r['audio_s_per_s']:.0f} | {format_rate(r['wer'])} | {r['wall']:.0f} |")
    if not args.no_record:
        record(rows, shlex.join(["python", "benchmarks/asr_demo.py", *(sys.argv[1:] if argv is None else argv)]))


def record(rows: list[dict], command: str) -> None:
    """Append each precision's throughput, final validation WER (when there is one) and wall time."""
    for r in rows:
        name = "fp32" if r["precision"] == "32" else r["precision"].replace("-", "_")
        append(f"demo.ctc.train_speed.{name}", round(r["audio_s_per_s"], 1), "audio-s/s", command)
        if not math.isnan(r["wer"]):
            append(f"demo.ctc.val_wer.{name}", round(100.0 * r["wer"], 2), "%", command)
        append(f"demo.ctc.benchmark_wall_time.{name}", round(r["wall"]), "s", command, "incl. validation")


if __name__ == "__main__":
    main()
