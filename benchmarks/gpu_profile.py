"""Where a training step of a demo ASR recipe spends its time: ``torch.profiler`` over a few steps of
``examples/asr_train.py`` after a warm-up, on the GPU by default (``--accelerator cpu``: the same on the CPU).

    python benchmarks/gpu_profile.py [--recipe asr_train_hybrid] [--precision 32] [--batch-duration 60]

Prints, per step: the wall time, the time spent waiting for the data loader, the device's busy time (the sum of its
kernels' times), the number of operators dispatched and of kernels launched, those operators by part (the transducer
loss, forward and backward; the optimizer step; ``_foreach`` operators, which the CPU runs one tensor at a time; the
rest); then the operators by self CPU time and by device time. A step whose wall time is far above its device time
is bound by the host (Python and operator dispatch), not by the GPU. The data are ``benchmarks/gpu_speed.py``'s
generated 2-10 s files. ``--shapes`` records each operator's input shapes and lists the operators per shape (which
matrix product, which convolution), what the README's earlier per-operator step times needed an ad-hoc script for.
"""

import argparse
import importlib.util
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_speed import speed_data  # noqa: E402

from speechtrain.lightning import BaseCallback, CallbackGroup  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


class StepProfiler(BaseCallback):
    """Profiles optimizer steps ``warmup + 1 .. warmup + steps`` and prints the report when they are done."""

    def __init__(self, warmup: int, steps: int, rows: int, shapes: bool = False) -> None:
        super().__init__()
        self.warmup, self.steps, self.rows, self.shapes = warmup, steps, rows, shapes
        self.profile: torch.profiler.profile | None = None
        self.walls: list[float] = []
        self.waits: list[float] = []
        self._start = self._end = None

    def _sync(self, module) -> None:  # measurement only: the steps' own code has no such sync
        if module.device.type == "cuda":
            torch.cuda.synchronize(module.device)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step < self.warmup or len(self.walls) >= self.steps:
            return
        now = time.perf_counter()
        if self.profile is None:
            self._sync(pl_module)
            activities = [torch.profiler.ProfilerActivity.CPU]
            if pl_module.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profile = torch.profiler.profile(activities=activities, record_shapes=self.shapes)
            self.profile.__enter__()
            now = time.perf_counter()
        elif self._end is not None:
            self.waits.append(now - self._end)
        self._start = now

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.profile is None or self._start is None or len(self.walls) >= self.steps:
            return
        self._sync(pl_module)
        self._end = time.perf_counter()
        self.walls.append(self._end - self._start)
        if len(self.walls) == self.steps:
            self.profile.__exit__(None, None, None)
            self.report()

    def report(self) -> None:
        events = self.profile.key_averages(group_by_input_shape=self.shapes)
        steps = len(self.walls)
        device = [e for e in events if e.device_type == DeviceType.CUDA]
        busy = sum(e.self_device_time_total for e in device) / 1e3 / steps
        ops = sum(e.count for e in events if e.device_type == DeviceType.CPU and e.key.startswith("aten::")) / steps
        wait = sum(self.waits) / max(1, len(self.waits)) * 1e3
        print(f"per step ({steps} steps): wall {sum(self.walls) / steps * 1e3:.1f} ms, waiting for data {wait:.1f} ms "
              f"(between steps), device busy {busy:.1f} ms, aten operators {ops:.0f}, kernels "
              f"{sum(e.count for e in device) / steps:.0f}")  # fmt: skip
        parts = operators_by_part(self.profile.events())
        print("aten operators per step by part: " + ", ".join(f"{part} {count / steps:.0f}"
                                                             for part, count in parts.items()))  # fmt: skip
        for key in ["self_cpu_time_total"] + (["self_device_time_total"] if device else []):
            try:
                print(events.table(sort_by=key, row_limit=self.rows), flush=True)
            except Exception as error:  # a profiler table this torch cannot sort so: the summary above stands
                print(f"(no table by {key}: {error})")


# Where the step's aten operators come from: (part, what an enclosing event's name starts with or contains).
PARTS = (
    ("transducer loss", lambda name: "_TransducerLoss" in name),  # its forward and its backward
    ("optimizer", lambda name: name.startswith("Optimizer.")),
    ("_foreach", lambda name: name.startswith("aten::_foreach_")),  # one op per tensor on the CPU, few kernels on GPUs
)


def operators_by_part(events) -> dict[str, int]:
    """The aten operators of ``events`` (a profile's) by the first part in :data:`PARTS` that the operator or an
    enclosing event belongs to; the others as ``rest``."""
    counts = dict.fromkeys([part for part, _ in PARTS] + ["rest"], 0)
    for event in events:
        if event.device_type != DeviceType.CPU or not event.name.startswith("aten::"):
            continue
        names = []
        while event is not None:
            names.append(event.name)
            event = event.cpu_parent
        part = next((part for part, match in PARTS if any(match(name) for name in names)), "rest")
        counts[part] += 1
    return counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="asr_train_hybrid")
    parser.add_argument("--precision", default="32")
    parser.add_argument("--batch-duration", type=float, default=60.0)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--files", type=int, default=200)
    parser.add_argument("--num-workers", type=int, default=4, help="data loader workers")
    parser.add_argument("--accelerator", default="gpu")
    parser.add_argument("--shapes", action="store_true", help="list the operators per input shape")
    parser.add_argument("overrides", nargs="*", help="more config overrides (key=value)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        data = speed_data(Path(folder), args.files, args.accelerator, args.num_workers)
        sys.argv = [str(EXAMPLES / "asr_train.py"), "--config-name", args.recipe, *data, "trainer.devices=1",
                    f"trainer.precision={args.precision}", f"trainer.max_steps={args.warmup + args.steps + 1}",
                    "trainer.max_time=null", "+trainer.limit_val_batches=0", "trainer.enable_progress_bar=false",
                    f"exp_manager.exp_dir={folder}/exp", f"model.train_ds.batch_duration={args.batch_duration}",
                    *args.overrides]  # fmt: skip
        CallbackGroup.get_instance().register(StepProfiler(args.warmup, args.steps, args.rows, args.shapes))
        spec = importlib.util.spec_from_file_location("asr_train_example", EXAMPLES / "asr_train.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.main()


if __name__ == "__main__":
    main()
