"""AdamW against Muon (``model.optim.name=muon``) on the `make demo` recipe, and what Muon's step costs.

    python benchmarks/asr_optimizers.py --cost                        # Muon's update on the demo model's matrices
    python benchmarks/asr_optimizers.py --steps 700                   # both optimizers, 700 steps each
    python benchmarks/asr_optimizers.py --seconds 1335 --names muon   # the demo's training time, Muon only

Training runs ``examples/asr_train.py --config-name asr_train_hybrid`` as ``make demo`` does (2 processes, 30 s of
audio each per step, the closing validation only) on the built-in corpus (built first if missing: ~5.5 min), for
``--steps`` optimizer steps (the learning rate decays over them) or ``--seconds`` of training, and prints per
optimizer: steps, audio-seconds per second, greedy WER on dev / test / heldout_engine and beam + LM beside it.

``--cost``: one thread per process, the demo model's 92 hidden matrices with random gradients: the milliseconds of
one update by ``torch.optim.Muon`` (one matrix at a time), by :class:`speechtrain.lightning.muon.GroupedMuon` (one
shape at a time) and, where ``emerging-optimizers`` is installed (``pip install emerging-optimizers``), by Megatron
Core's Muon with our numbers, in one process and on each of 2 gloo data-parallel ranks (GroupedMuon's ranks share the
iterations; see :mod:`speechtrain.lightning.muon` for why Megatron's stays out).
"""

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# The demo model's hidden matrices (d_model 144, 8 layers, feed-forward 576, joint 256, prediction 256).
DEMO_SHAPES = ([(144, 144)] * 5 + [(576, 144), (144, 576)] * 2 + [(288, 144), (144, 144)]) * 8 + [
    (144, 144), (144, 144), (256, 144), (256, 256)]  # fmt: skip


def cost(repeats: int = 20, rounds: int = 5) -> None:
    """Prints the update's milliseconds per step: one process, then each of 2 gloo data-parallel ranks."""
    print(f"\n| update of {len(DEMO_SHAPES)} matrices, one thread per process | 1 process, ms | 2 ranks, ms |")
    print("|---|---|---|")
    alone = _time_updates(None, repeats, rounds)
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "times.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
                   "--rank-times", str(out), "--repeats", str(repeats), "--rounds", str(rounds)]  # fmt: skip
        subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True)
        ranks = json.loads(out.read_text())
    for name in alone:
        print(f"| {name} | {alone[name]:.1f} | {ranks[name]:.1f} |", flush=True)


def _rank_times(out: str, repeats: int, rounds: int) -> None:
    """One of the 2 ranks that ``cost`` launches; rank 0 writes the times to ``out``."""
    torch.distributed.init_process_group("gloo")
    times = _time_updates(torch.distributed.group.WORLD, repeats, rounds)
    if torch.distributed.get_rank() == 0:
        Path(out).write_text(json.dumps(times))
    torch.distributed.destroy_process_group()


def _time_updates(group: object, repeats: int, rounds: int) -> dict[str, float]:
    """Median over ``rounds`` of the mean ms of ``repeats`` updates, the optimizers taking turns (so that a load
    from other jobs falls on all of them). With ``group`` (2 ranks holding the same gradients, as after the
    data-parallel reduction), GroupedMuon shares the iterations over the ranks and Megatron's Muon, which shares
    them only under its layer-wise distributed optimizer (bf16 weights only), runs them all on every rank."""
    from speechtrain.lightning.muon import GroupedMuon

    torch.set_num_threads(1)
    builds = {"torch.optim.Muon": lambda ps: torch.optim.Muon(ps, adjust_lr_fn="match_rms_adamw"),
              "GroupedMuon": lambda ps: GroupedMuon(ps, group=group)}  # fmt: skip
    if importlib.util.find_spec("emerging_optimizers") is not None:  # not a dependency: only for this comparison
        from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon

        # Our numbers: Nesterov momentum, Keller Jordan's coefficients, Moonshot's 0.2 * sqrt(max(rows, cols)).
        megatron = {"nesterov": True, "coefficient_type": "simple", "extra_scale_factor": 0.2}
        builds["Megatron's Muon (TensorParallelMuon)"] = lambda ps: TensorParallelMuon(ps, **megatron)
    optimizers = {}
    for name, build in builds.items():
        params = [torch.nn.Parameter(torch.randn(shape)) for shape in DEMO_SHAPES]
        for p in params:
            p.grad = torch.randn_like(p)
        optimizers[name] = build(params)
        for _ in range(3):
            optimizers[name].step()
    times: dict[str, list[float]] = {name: [] for name in builds}
    for _ in range(rounds):
        for name, optimizer in optimizers.items():
            if group is not None:
                torch.distributed.barrier(group)
            start = time.perf_counter()
            for _ in range(repeats):
                optimizer.step()
            times[name].append((time.perf_counter() - start) / repeats * 1e3)
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def train(name: str, steps: int | None, seconds: int | None, folder: Path) -> dict:
    limit = ([f"trainer.max_steps={steps}", "trainer.max_time=null", f"trainer.val_check_interval={steps}",
              "trainer.check_val_every_n_epoch=null"] if steps else
             [f"trainer.max_time={{seconds: {seconds}}}", "trainer.check_val_every_n_epoch=1000"])  # fmt: skip
    command = [sys.executable, str(ROOT / "examples" / "asr_train.py"), "--config-name", "asr_train_hybrid",
               f"name={name}", f"exp_manager.exp_dir={folder}", "trainer.devices=2",
               "model.train_ds.batch_duration=30", f"model.optim.name={name}", *limit]  # fmt: skip
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    log = subprocess.run(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=True
    ).stdout
    wall = time.perf_counter() - start
    final = re.search(r"Final: (.*?) \(transcripts", log).group(1)
    metrics = {k: float(v.rstrip("%")) for k, v in (x.split("=") for x in final.split(", "))}
    run = re.findall(r"run folder (\S+)", log)[-1]
    intervals = [json.loads(line) for line in open(Path(run) / "telemetry.jsonl")]
    intervals = [x for x in intervals if x.get("event") == "train_interval"]
    rates = sorted(x["audio_s_per_s"] for x in intervals)
    return {"steps": intervals[-1]["step"], "audio_s_per_s": rates[len(rates) // 2], "wall_s": wall, **metrics}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cost", action="store_true", help="only time Muon's update")
    parser.add_argument("--names", nargs="+", default=["adamw", "muon"])
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--seconds", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=20, help="--cost: timed updates per optimizer and round")
    parser.add_argument("--rounds", type=int, default=5, help="--cost: rounds, the optimizers taking turns")
    parser.add_argument("--rank-times", help=argparse.SUPPRESS)  # --cost's 2 ranks
    args = parser.parse_args(argv)
    if args.rank_times:
        _rank_times(args.rank_times, args.repeats, args.rounds)
        return
    if args.cost:
        cost(args.repeats, args.rounds)
        return
    if not args.steps and not args.seconds:
        parser.error("give --steps or --seconds")
    print("\n| optimizer | steps | audio-s/s | greedy dev / test / heldout_engine | beam + LM dev / test / heldout |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        for i, name in enumerate(args.names):
            r = train(name, args.steps, args.seconds, Path(folder) / str(i))
            greedy = " / ".join(f"{r[f'val_wer_greedy_{s}']:.2f}%" for s in ("dev", "test", "heldout_engine"))
            beam = " / ".join(f"{r[f'val_wer_{s}']:.2f}%" for s in ("dev", "test", "heldout_engine"))
            print(f"| {name} | {r['steps']} | {r['audio_s_per_s']:.1f} | {greedy} | {beam} |", flush=True)


if __name__ == "__main__":
    main()
