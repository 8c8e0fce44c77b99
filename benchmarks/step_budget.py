"""Host synchronisations, collectives and dispatched operators per training step of each model family, counted on
the CPU with real processes (gloo) exactly as they would be made on GPUs (:mod:`speechtrain.testing.step_budget`).

    python benchmarks/step_budget.py                          # every family at DP=2, CTC at TP=2 too
    python benchmarks/step_budget.py --family ctc --tp 2      # one family and layout
    python benchmarks/step_budget.py --record                 # and append the figures to results/step_budget.jsonl

Each run is a tiny model of the family on the generated DTMF corpus through the bridge (Megatron's DDP and
optimizer), with a wall-clock limit as every recipe sets one, for ``--steps`` optimizer steps; the first ``--skip``
steps are left out. The ASR families use the recipes themselves (``asr_train``, ``asr_train_hybrid``,
``asr_train_streaming`` with ``--family streaming``) at ``model.size=debug``. Prints per family: syncs per step
and where they are made, collectives per step (and whether every rank ran the same ones in every step), and
operators per step.
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ("ctc", "hybrid", "streaming", "tts", "salm")
LAYOUTS = [("ctc", 1), ("hybrid", 1), ("tts", 1), ("salm", 1), ("ctc", 2)]


def _asr_job(recipe: str, folder: Path, manifest: Path, steps: int, extra: list[str]) -> object:
    from speechtrain.common.tokenizers import CharTokenizer
    from speechtrain.core.hydra_runner import compose_config

    sys.path.insert(0, str(ROOT / "examples"))
    import asr_train

    tokenizer = folder / "digits.json"
    CharTokenizer([" ", *"0123456789"]).save(tokenizer)
    overrides = [
        "model.size=debug", f"model.tokenizer.path={tokenizer}", f"model.train_ds.manifest_filepath={manifest}",
        "model.train_ds.input_cfg=null", f"model.validation_ds.manifest_filepath={manifest}",
        "model.train_ds.batch_size=8", "model.train_ds.batch_duration=null", "model.train_ds.num_workers=0",
        "model.decoding.strategy=greedy", "trainer.max_time=00:01:00:00", f"trainer.max_steps={steps}",
        "trainer.precision=32", "trainer.num_sanity_val_steps=0",
        "trainer.limit_val_batches=0", f"exp_manager.exp_dir={folder / 'exp'}",
        "exp_manager.create_checkpoint_callback=false", "model.preprocessor.n_mels=16", *extra,
    ]  # fmt: skip
    return asr_train.main, compose_config(
        asr_train.main.config_dir, recipe, overrides, asr_train.main.schema, asr_train.main.translate
    )


def run_one(family: str, tp: int, devices: int, steps: int, out: Path, accelerator: str = "cpu",
            sync_errors: bool = False, no_clip: bool = False) -> None:  # fmt: skip
    """Train ``family`` for ``steps`` steps on ``devices`` processes (this process is rank 0; Lightning starts the
    others by running this command again) and write each rank's counts to ``out/rank<r>.json``. On a GPU with
    ``sync_errors``, a host synchronisation other than the gradient norm stops the run with an error."""
    import lightning.pytorch as pl

    from speechtrain.corpora.dtmf import make_dtmf_corpus
    from speechtrain.lightning import BaseCallback, CallbackGroup, MegatronStrategy, Trainer
    from speechtrain.testing.step_budget import CudaSyncErrors, StepBudget

    class Recorder(BaseCallback, StepBudget):
        def __init__(self) -> None:
            BaseCallback.__init__(self)
            StepBudget.__init__(self)

        def on_train_end(self, trainer, pl_module):
            StepBudget.on_train_end(self, trainer, pl_module)
            self.write(out / f"rank{trainer.global_rank}.json", trainer.global_rank)

    pl.seed_everything(0, verbose=False)
    folder = out / "work"
    folder.mkdir(parents=True, exist_ok=True)
    manifest = make_dtmf_corpus(folder / "dtmf", 40, seed=7) if not (folder / "dtmf").exists() else (
        folder / "dtmf" / "manifest.json")  # fmt: skip
    recorder = Recorder()
    guards = [CudaSyncErrors()] if sync_errors else []
    strategy = {"tensor_model_parallel_size": tp}
    if family in ("ctc", "hybrid", "streaming"):
        recipe = {"ctc": "asr_train", "hybrid": "asr_train_hybrid", "streaming": "asr_train_streaming"}[family]
        layout = [f"trainer.devices={devices}", f"trainer.strategy.tensor_model_parallel_size={tp}",
                  f"trainer.accelerator={accelerator}"]  # fmt: skip
        if no_clip:  # no clipping, no non-finite guard: the norm only on logging steps (none in a short run)
            layout += ["trainer.gradient_clip_val=0", "trainer.strategy.max_consecutive_nonfinite_steps=0",
                       "trainer.log_every_n_steps=1000"]  # fmt: skip
        main, cfg = _asr_job(recipe, folder, manifest, steps, layout)
        CallbackGroup.get_instance().register(recorder)
        for guard in guards:
            CallbackGroup.get_instance().register(_as_lifecycle(guard))
        main(cfg)
        return
    sys.path.insert(0, str(ROOT / "tests"))
    from test_device_discipline import family_model

    model = family_model(family, folder, manifest)
    trainer = Trainer(accelerator=accelerator, devices=devices, strategy=MegatronStrategy(**strategy), precision="32",
                      max_steps=steps, max_time="00:01:00:00", limit_val_batches=0, num_sanity_val_steps=0,
                      use_distributed_sampler=False, logger=False, enable_checkpointing=False,
                      enable_model_summary=False, callbacks=[recorder, *guards])  # fmt: skip
    trainer.fit(model)


def _as_lifecycle(callback: object) -> object:
    """``callback`` as a lifecycle callback (registered with the job's ``CallbackGroup``)."""
    from speechtrain.lightning import BaseCallback

    return type(f"Lifecycle{type(callback).__name__}", (BaseCallback, type(callback)), {})()


def measure(family: str, tp: int, devices: int, steps: int, skip: int, accelerator: str = "cpu",
            sync_errors: bool = False, no_clip: bool = False) -> dict:  # fmt: skip
    """Run :func:`run_one` in a fresh process group and summarise its ranks' counts."""
    from speechtrain.lightning.launch import fresh_launch_env
    from speechtrain.testing.step_budget import summarise

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        env = fresh_launch_env(OMP_WAIT_POLICY="PASSIVE", OMP_NUM_THREADS="1")
        command = [sys.executable, __file__, "--run", family, "--tp", str(tp), "--devices", str(devices),
                   "--steps", str(steps), "--out", str(out), "--accelerator", accelerator,
                   *(["--cuda-sync-errors"] if sync_errors else []), *(["--no-clip"] if no_clip else [])]  # fmt: skip
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"{family} (TP={tp}) failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
        ranks = [json.loads(p.read_text())["steps"] for p in sorted(out.glob("rank*.json"))]
    if len(ranks) != devices:
        raise RuntimeError(f"{family}: {len(ranks)} of {devices} ranks wrote their counts")
    return {"family": family, "tp": tp, "dp": devices // tp, **summarise(ranks, skip)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", choices=FAMILIES, help="one family (default: all, and CTC at TP=2)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (with --family)")
    parser.add_argument("--devices", type=int, default=None, help="processes (default: 2 x TP... DP=2)")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps to run")
    parser.add_argument("--skip", type=int, default=2, help="first steps left out")
    parser.add_argument("--json", help="write the summaries to this file")
    parser.add_argument("--verbose", action="store_true", help="print each distinct sequence of collectives")
    parser.add_argument("--record", action="store_true", help="append the figures to results/step_budget.jsonl")
    parser.add_argument("--accelerator", default="cpu", help="gpu: the same runs on CUDA with NCCL")
    parser.add_argument(
        "--cuda-sync-errors",
        action="store_true",
        help="on a GPU: any host sync but the gradient norm stops the run (set_sync_debug_mode)",
    )
    parser.add_argument(
        "--no-clip",
        action="store_true",
        help="ctc, hybrid, streaming: no gradient clipping and no non-finite guard (no gradient norm to read)",
    )
    parser.add_argument("--run", choices=FAMILIES, help=argparse.SUPPRESS)  # one rank's job (internal)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run:
        run_one(
            args.run,
            args.tp,
            args.devices,
            args.steps,
            Path(args.out),
            args.accelerator,
            args.cuda_sync_errors,
            args.no_clip,
        )
        return
    layouts = [(args.family, args.tp)] if args.family else LAYOUTS
    results = []
    for family, tp in layouts:
        devices = args.devices or 2 * tp if family == args.family else 2 * tp
        result = measure(
            family, tp, devices, args.steps, args.skip, args.accelerator, args.cuda_sync_errors, args.no_clip
        )
        results.append(result)
        same = "yes" if result["same_collectives_on_every_rank"] else "NO"
        print(f"{family:7s} TP={tp} DP={result['dp']}: {result['syncs_per_step']} host syncs/step "
              f"(max {result['max_syncs_per_step']}), {result['collectives_per_step']} collectives/step at most "
              f"({result['collective_bytes_per_step']:,} bytes; the same on every rank: {same}; "
              f"{len(result['collective_sequences'])} distinct sequences), "
              f"{result['max_ops_per_step']:,} operators/step", flush=True)  # fmt: skip
        if args.verbose:
            for sequence in result["collective_sequences"]:
                print("    collectives:", " | ".join(sequence))
        for place, count in result["sync_places"].items():
            print(f"    {count:g}/step  {place}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    if args.record:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from results import append

        for r in results:
            layout = f"tp{r['tp']}_dp{r['dp']}" + ("_no_clip" if args.no_clip else "")
            command = f"python benchmarks/step_budget.py --family {r['family']} --tp {r['tp']}" + (
                " --no-clip" if args.no_clip else "")  # fmt: skip
            for name, key in (("host_syncs", "syncs_per_step"), ("collectives", "collectives_per_step"),
                              ("operators", "max_ops_per_step")):  # fmt: skip
                append(f"step_budget.{r['family']}.{layout}.{name}", r[key], "per step", command)


if __name__ == "__main__":
    main()
