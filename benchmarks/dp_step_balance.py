"""Whether the data-parallel ranks of a recipe wait for each other at every step, and why.

    python benchmarks/dp_step_balance.py [--recipe asr_train_hybrid] [--steps 300] [--skip 50] [overrides ...]

Trains ``examples/asr_train.py`` as ``make demo`` does (2 processes, 30 s of audio each, the recipe's built-in corpus,
which it builds first if it is not there, fresh weights, no validation) and records, per step and per rank: the time
from the start of the step's forward pass to Megatron's ``finalize_model_grads`` (forward and backward), the time
spent in ``finalize_model_grads`` (the data-parallel all-reduce: waiting for the slowest rank, then the transfer),
the rest of the optimizer step (the loss's all-reduce, Lightning's hooks, the gradient norm, the update), and the
batch's shape (with ``accumulate_grad_batches`` > 1: the window's last batch's forward and backward). It prints:

- each rank's mean forward + backward time, and the mean over steps of the slowest rank's time against the mean of
  all ranks' times: the *imbalance*, what the faster ranks wait for at each step's all-reduce;
- the all-reduce's median and minimum (the minimum is close to the transfer alone), the rest of the optimizer step,
  and the whole step;
- how much of the rank-to-rank difference the batches' shapes explain: a least-squares fit of the forward + backward
  time on padded frames (batch size x longest utterance) and padded joint cells (that x the longest transcript),
  and the correlation between the fit's rank-to-rank difference and the measured one. A low correlation says the
  waits come from timing noise (the operating system, the other processes), not from unequal batches, and that
  balancing the batches' cost across ranks would recover little.

The hooks (``benchmarks/dp_step_balance_hooks/sitecustomize.py``) are installed in every process of the run (the
ranks Lightning starts run ``examples/asr_train.py`` afresh) through ``PYTHONPATH``; a ``sitecustomize`` of the
interpreter's own is shadowed for the run. Times are host times: on a GPU each timestamp first waits for the device
(measurement only).
"""

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from speechtrain.lightning.launch import fresh_launch_env

ROOT = Path(__file__).resolve().parents[1]
ENV = "SPEECHTRAIN_DP_BALANCE_DIR"
HOOKS = Path(__file__).resolve().parent / "dp_step_balance_hooks"  # its sitecustomize.py


def analyse(folder: Path, devices: int, skip: int) -> list[str]:
    """The report's lines from the per-rank files of one run."""
    ranks = [np.loadtxt(folder / f"rank{r}.txt", ndmin=2) for r in range(devices)]
    steps = min(len(r) for r in ranks)
    if steps <= skip + 10:
        raise RuntimeError(f"only {steps} steps recorded; run more than --skip + 10 = {skip + 10}")
    ranks = [r[skip:steps] for r in ranks]
    compute = np.stack([r[:, 3] for r in ranks])  # (ranks, steps)
    reduce = np.stack([r[:, 4] for r in ranks])
    step_time = np.diff(ranks[0][:, 6]).mean()
    update = np.stack([r[:, 5] for r in ranks]).mean()
    slowest, mean = compute.max(0).mean(), compute.mean(0).mean()
    lines = [f"steps {skip}-{steps} of {devices} ranks; step (rank 0, end to end) {1e3 * step_time:.1f} ms"]
    for r in range(devices):
        p5, p95 = 1e3 * np.percentile(compute[r], [5, 95])
        lines.append(
            f"rank {r}: forward+backward {1e3 * compute[r].mean():.1f} ms (p5 {p5:.0f}, p95 {p95:.0f}); all-reduce "
            f"median {1e3 * np.median(reduce[r]):.1f} ms, min {1e3 * reduce[r].min():.1f} ms"
        )
    lines.append(f"slowest rank per step {1e3 * slowest:.1f} ms against the ranks' mean {1e3 * mean:.1f} ms: "
                 f"imbalance {100 * (slowest / mean - 1):.1f}% (the faster ranks wait for it)")  # fmt: skip
    lines.append(
        f"of the step: forward+backward {100 * mean / step_time:.0f}% (the ranks' mean), the all-reduce with the wait "
        f"for the slowest rank {100 * reduce.mean() / step_time:.0f}%, the rest of the optimizer step (loss "
        f"all-reduce, gradient norm, update) {100 * update / step_time:.0f}%, the rest (loader, loop, hooks) "
        f"{100 * (1 - (mean + reduce.mean() + update) / step_time):.0f}%"
    )
    every = np.concatenate(ranks)
    padded = every[:, 0] * every[:, 1]
    features = np.stack([padded, padded * (every[:, 2] + 1), np.ones(len(every))], 1)
    coef, *_ = np.linalg.lstsq(features, every[:, 3], rcond=None)
    fitted = features @ coef
    r2 = 1 - ((every[:, 3] - fitted) ** 2).sum() / ((every[:, 3] - every[:, 3].mean()) ** 2).sum()
    per_rank = fitted.reshape(devices, -1)
    diff_fit, diff = per_rank[0] - per_rank[1:].mean(0), compute[0] - compute[1:].mean(0)
    corr = float(np.corrcoef(diff_fit, diff)[0, 1]) if diff_fit.std() > 0 else 0.0
    lines.append(
        f"batch shape (padded frames, padded joint cells) explains R^2 = {r2:.2f} of the forward+backward time; "
        f"rank-to-rank difference: measured std {1e3 * diff.std():.1f} ms, from the shapes "
        f"{1e3 * diff_fit.std():.1f} ms, correlation {corr:.2f}"
    )
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="asr_train_hybrid")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--skip", type=int, default=50, help="leading steps left out (warm-up)")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--batch-duration", type=float, default=30.0, help="seconds of audio per process")
    parser.add_argument("--preload", help="a library put in LD_PRELOAD (e.g. tcmalloc, as make demo does)")
    parser.add_argument("overrides", nargs="*", help="more config overrides (key=value)")
    args = parser.parse_args(argv)
    if args.devices < 2:
        parser.error("--devices must be at least 2: one process has nobody to wait for")
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        path = os.pathsep.join([str(HOOKS), str(ROOT), os.environ.get("PYTHONPATH", "")])
        # A run of its own: no rendezvous inherited from a caller's process group (its port may still be held).
        env = fresh_launch_env(**{ENV: str(folder), "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": path})
        if args.preload:
            env["LD_PRELOAD"] = args.preload
        command = [sys.executable, str(ROOT / "examples" / "asr_train.py"), "--config-name", args.recipe,
                   f"trainer.devices={args.devices}", f"trainer.max_steps={args.steps}", "trainer.max_time=null",
                   "+trainer.limit_val_batches=0", "trainer.enable_progress_bar=false",
                   f"model.train_ds.batch_duration={args.batch_duration}", f"exp_manager.exp_dir={folder / 'exp'}",
                   *args.overrides]  # fmt: skip
        result = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise SystemExit(f"the training run failed:\n{result.stderr[-3000:]}")
        for line in analyse(folder, args.devices, args.skip):
            print(line)


if __name__ == "__main__":
    main()
