"""Step time of the Megatron bridge vs. a plain PyTorch loop on the same model and data (one CPU process).

    python benchmarks/bridge_overhead.py [--steps 40] [--warmup 5]

All three variants train the same transformer (speechtrain.testing.toy_models at a larger size) with Adam and
gradient clipping, on the same batches. The time of a step covers forward, backward, clipping and the
optimizer update (not data loading); the median over the timed steps is reported. Denormal floats are flushed
to zero in every variant: otherwise CPU step times depend on how many tiny values the weights happen to hold
(seen here: the same loop at 350 or 480 ms/step depending on the learning rate), which would swamp the
framework's overhead. The bridge's median ratio is appended to results/speed.jsonl
(``speed.bridge_overhead_ratio``) unless ``--no-record``.
"""

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from omegaconf import OmegaConf

from speechtrain.core.optim import build_optimizer
from speechtrain.lightning import MegatronStrategy, Trainer, teardown
from speechtrain.testing.toy_models import ToyTransformerRegressor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import append  # noqa: E402

SIZE = {
    "input_dim": 80,
    "output_dim": 80,
    "d_model": 256,
    "num_heads": 4,
    "d_ff": 1024,
    "num_layers": 4,
    "max_frames": 200,
    "num_samples": 1024,
    "batch_size": 16,
}
CLIP = 1.0


def _model() -> ToyTransformerRegressor:
    torch.manual_seed(0)
    return ToyTransformerRegressor({**SIZE, "optim": {"sched": {"name": "none"}}})


def plain_loop(steps: int) -> list[float]:
    model = _model()
    model.configure_model()
    optimizer = build_optimizer(list(model.parameters()), OmegaConf.to_object(model.cfg.optim))
    times = []
    batches = iter(model.train_dataloader())
    for _ in range(steps):
        batch = next(batches)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss_sum, frames = model.loss_step(batch, model.forward_step(batch))
        (loss_sum / frames).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        times.append(time.perf_counter() - start)
    return times


class StepTimer(pl.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.times.append(time.perf_counter() - self._start)


def lightning_run(steps: int, strategy: object) -> list[float]:
    timer = StepTimer()
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=steps,
        gradient_clip_val=CLIP,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[timer],
    )
    model = _model()
    trainer.fit(model)
    teardown(trainer, model)
    return timer.times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3, help="variants run in turn this many times (paired)")
    parser.add_argument("--no-record", action="store_true", help="print only: append nothing to results/")
    args = parser.parse_args(argv)
    torch.set_flush_denormal(True)
    variants = {
        "plain PyTorch loop": lambda: plain_loop(args.steps),
        "Lightning, default strategy": lambda: lightning_run(args.steps, "auto"),
        "Lightning + MegatronStrategy (TP=PP=DP=1, Megatron DDP + optimizer)": lambda: lightning_run(
            args.steps, MegatronStrategy()
        ),
    }
    rounds: list[dict[str, float]] = []
    for _ in range(args.rounds):  # interleaved, so that slow drifts of the machine hit every variant alike
        rounds.append({name: statistics.median(run()[args.warmup :]) * 1000 for name, run in variants.items()})
    names = list(variants)
    timed = args.steps - args.warmup
    print(f"\n| variant (median of {timed} steps per round) | ms/step per round | ratio to the plain loop per round |")
    print("|---|---|---|")
    for name in names:
        ms = " / ".join(f"{r[name]:.1f}" for r in rounds)
        ratios = [r[name] / r[names[0]] for r in rounds]
        print(f"| {name} | {ms} | {' / '.join(f'{x:.3f}' for x in ratios)} (median {statistics.median(ratios):.3f}) |")
    if not args.no_record:
        ratios = [r[names[2]] / r[names[0]] for r in rounds]
        command = shlex.join(["python", "benchmarks/bridge_overhead.py", *(sys.argv[1:] if argv is None else argv)])
        note = "bridge step time / plain loop step time, median of rounds " + " / ".join(f"{x:.3f}" for x in ratios)
        append("speed.bridge_overhead_ratio", round(statistics.median(ratios), 3), "x plain PyTorch", command, note)


if __name__ == "__main__":
    main()
