"""Step time of a real ASR training run with the telemetry callback on vs. off (one CPU process).

    python benchmarks/telemetry_overhead.py [--steps 60] [--rounds 6]

Trains the ``debug`` Conformer-CTC on a generated DTMF corpus through the full stack (Trainer, MegatronStrategy,
run manager with checkpoints and CSV logs), ``--rounds`` times with ``SPEECHTRAIN_TELEMETRY=1`` and as often with
``0``, alternating (and swapping which goes first) so that drifts of the machine hit both. A step's time is the
wall time between consecutive ``on_train_batch_end`` calls (data loading included); the first 5 steps of each
run are left out, and the median of the pooled steps is reported per setting. Telemetry logs every 10 steps here
(5x more often than by default).

Comparing two noisy medians cannot resolve a fraction of a percent on a shared 2-core machine, so the script also
times the telemetry hooks themselves inside the runs (``time in hooks / step time``): that is the overhead.
"""

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import lightning.pytorch as pl
import torch

from speechtrain.asr.ctc import ConformerCTCModel
from speechtrain.core.exp_manager import exp_manager
from speechtrain.corpora.dtmf import make_dtmf_corpus
from speechtrain.lightning import CallbackGroup, TelemetryCallback, Trainer


class StepClock(pl.Callback):
    """Wall time between consecutive training-batch ends."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._last: float | None = None

    def on_train_batch_end(self, *args, **kwargs) -> None:
        now = time.perf_counter()
        if self._last is not None:
            self.times.append(now - self._last)
        self._last = now


def _timed_hooks() -> list[float]:
    """Wraps the telemetry callback's per-step hook so that its own time is recorded."""
    spent: list[float] = []
    original = TelemetryCallback.on_train_batch_end

    def timed(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            spent.append(time.perf_counter() - start)

    TelemetryCallback.on_train_batch_end = timed
    return spent


def run(manifest: Path, out: Path, steps: int, telemetry: bool) -> tuple[list[float], Path]:
    os.environ["SPEECHTRAIN_TELEMETRY"] = "1" if telemetry else "0"
    CallbackGroup.reset()
    clock = StepClock()
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=steps, log_every_n_steps=10, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      limit_val_batches=0, callbacks=[clock], strategy={"tensor_model_parallel_size": 1},
                      use_distributed_sampler=False)  # fmt: skip
    run_dir = exp_manager(
        trainer,
        {
            "exp_dir": str(out),
            "create_tensorboard_logger": False,
            "save_archive_on_train_end": False,
            "checkpoint_callback_params": {"monitor": "train_loss", "every_n_train_steps": 50},
        },
        name="telemetry_bench",
    )
    model = ConformerCTCModel({
        "size": "debug",
        "tokenizer": {"vocab": [" ", *"0123456789"]},
        "spec_augment": None,
        "train_ds": {"manifest_filepath": str(manifest), "batch_size": 8, "shuffle": True},
        "validation_ds": {"manifest_filepath": None},
        "optim": {"lr": 1e-3, "sched": {"name": "constant", "warmup_steps": 0}},
    })  # fmt: skip
    trainer.fit(model)
    CallbackGroup.get_instance().on_app_end()
    return clock.times[5:], run_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args(argv)
    torch.set_flush_denormal(True)
    torch.manual_seed(0)
    hook_times = _timed_hooks()
    with tempfile.TemporaryDirectory() as tmp:
        manifest = make_dtmf_corpus(Path(tmp) / "corpus", 400, seed=0)
        times: dict[bool, list[float]] = {True: [], False: []}
        telemetry_file = None
        run(manifest, Path(tmp) / "warmup", 10, False)
        for round_index in range(args.rounds):
            for setting in (True, False) if round_index % 2 == 0 else (False, True):
                step_times, run_dir = run(manifest, Path(tmp) / "runs", args.steps, setting)
                times[setting] += step_times
                if setting:
                    telemetry_file = run_dir / "telemetry.jsonl"
        records = [json.loads(line) for line in telemetry_file.read_text().splitlines()]
    on, off = statistics.median(times[True]), statistics.median(times[False])
    hooks = statistics.mean(hook_times)
    print(f"median step time: telemetry on {on * 1e3:.2f} ms, off {off * 1e3:.2f} ms "
          f"({(on / off - 1) * 100:+.2f}%; {len(times[True])} and {len(times[False])} steps)")  # fmt: skip
    print(f"telemetry hooks: {hooks * 1e6:.0f} us per step = {hooks / off * 100:.3f}% of a step "
          f"({len(hook_times)} calls, flushes every 10 steps included)")  # fmt: skip
    interval = [r for r in records if r["event"] == "train_interval"][-1]
    print("last train_interval record:", json.dumps(interval))


if __name__ == "__main__":
    main()
