"""Checkpoint save time, size on disk and load time of the two checkpoint formats (``torch``, ``torch_dist``) at DP=2.

    python benchmarks/checkpoint_io.py                                   # demo_hybrid and fastconformer_ctc_large
    python benchmarks/checkpoint_io.py --models demo_hybrid --repeats 3  # one model
    python benchmarks/checkpoint_io.py --record                          # and append the figures to results/
    python benchmarks/checkpoint_io.py --async --record                  # training blocked by a save: sync vs async

Each run is two gloo CPU processes (``torch.distributed.run``) that build a recipe's model at its size through the
bridge (``MegatronStrategy``, ``use_distributed_optimizer=true``, the format under test), train one optimizer step on
a tiny batch of the generated DTMF corpus (so the optimizer state exists), then time ``trainer.save_checkpoint`` on
every rank (between barriers) ``--repeats`` times, a fresh path each time, and count the bytes the checkpoint takes on
disk. Load: the last checkpoint read back into the live trainer (``strategy.load_checkpoint``, the model's and the
optimizer's state; what a resume does before training), right after it was written.

``--async``: how long training is held up by a ``torch_dist`` save, written synchronously and with
``trainer.strategy.async_save=true``, side by side (the two alternate, ``--repeats`` jobs each). Each job trains
``--steps`` steps and saves after step 2 from a callback, as ``ModelCheckpoint`` does; the time blocked is what the
training loop spends in checkpoint calls on rank 0: the save call (sync: the whole write; async: the sharded state,
planning, the fork of the writer, the run state) plus, async, the finalization (Megatron's index, the manifest merged
from the writers' SHA-256 digests, the marker, the rename) at the first rank agreement after the writers are done
(every 10 steps). The step after the save and a median step are timed too (on CPUs the writer competes with training
for the cores).

Models: ``demo_hybrid`` is ``examples/conf/asr_train_hybrid.yaml`` (``make demo``'s model, ``model.size=demo``) with
AdamW in place of its Muon (Muon cannot run with the distributed optimizer); ``fastconformer_ctc_large`` is
``examples/conf/fastconformer_ctc_large.yaml`` (``model.size=large``, 18 layers). Both in fp32, with a character
tokenizer of the recipe's vocabulary size (the same output layers as its BPE). ``debug`` is the tiny model of the
tests (``asr_train`` at ``model.size=debug``).
"""

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FORMATS = ("torch", "torch_dist")
# name: (recipe, vocabulary size, extra overrides)
MODELS = {
    "demo_hybrid": ("asr_train_hybrid", 64, ["model.optim.name=adamw"]),
    "fastconformer_ctc_large": ("fastconformer_ctc_large", 1024, []),
    "debug": ("asr_train", 11, ["model.size=debug", "model.preprocessor.n_mels=16"]),
}
NOTES = {
    "demo_hybrid": "asr_train_hybrid (model.size=demo) with AdamW instead of Muon (refused with the distributed "
    "optimizer), fp32",
    "fastconformer_ctc_large": "fastconformer_ctc_large recipe (model.size=large, 18 layers) in fp32",
}


def _vocabulary(size: int) -> list[str]:
    """``size`` distinct characters: the DTMF transcripts' (space, digits) first."""
    chars = [" ", *"0123456789", *"abcdefghijklmnopqrstuvwxyz", *"ABCDEFGHIJKLMNOPQRSTUVWXYZ", "'"]
    return (chars + [chr(0x4E00 + i) for i in range(max(0, size - len(chars)))])[:size]


def _disk_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _train(model_name: str, strategy: dict, out: Path, max_steps: int, callbacks: list) -> tuple:
    """One rank's trainer and model of ``model_name`` under the bridge (``strategy``: its arguments beside the
    recipe's), after ``fit`` for ``max_steps`` steps."""
    import lightning.pytorch as pl
    import torch
    from omegaconf import OmegaConf

    from speechtrain.asr.jobs import asr_model_class
    from speechtrain.core.hydra_runner import compose_config
    from speechtrain.lightning import Trainer

    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT / "examples"))
    import asr_train

    recipe, vocab_size, extra = MODELS[model_name]
    work = out / "work"
    manifest = work / "dtmf" / "manifest.json"  # made by the parent
    tokenizer = work / f"chars{vocab_size}.json"
    overrides = [
        f"model.tokenizer.path={tokenizer}", f"model.train_ds.manifest_filepath={manifest}",
        "model.train_ds.input_cfg=null", f"model.validation_ds.manifest_filepath={manifest}",
        "model.train_ds.batch_size=4", "model.train_ds.batch_duration=null", "model.train_ds.use_bucketing=false",
        "model.train_ds.num_workers=0", "model.train_ds.pin_memory=false", "model.validation_ds.num_workers=0",
        "model.decoding.strategy=greedy", *extra,
    ]  # fmt: skip
    main = asr_train.main
    cfg = compose_config(main.config_dir, recipe, overrides, main.schema, main.translate)
    pl.seed_everything(cfg.seed, verbose=False)
    strategy = {**OmegaConf.to_container(cfg.trainer.strategy, resolve=True), "use_distributed_optimizer": True,
                **strategy}  # fmt: skip
    trainer = Trainer.from_job_config(
        cfg.trainer, strategy=strategy, accelerator="cpu", devices=2, num_nodes=1, precision="32",
        max_steps=max_steps, max_time=None, max_epochs=None, limit_val_batches=0, num_sanity_val_steps=0,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(work / "root"), callbacks=callbacks,
    )  # fmt: skip
    model = asr_model_class(cfg.model)(cfg.model)
    trainer.fit(model)
    if trainer.global_step != max_steps:
        raise RuntimeError(f"{model_name}: {trainer.global_step} optimizer steps trained, expected {max_steps}")
    return trainer, model


def run_one(model_name: str, checkpoint_format: str, repeats: int, out: Path) -> None:
    """One rank of the job (launched by ``torch.distributed.run``): build, train one step, time the saves and the
    load; global rank 0 writes ``out/result.json``."""
    import torch

    from speechtrain.lightning import teardown

    rank = int(os.environ.get("RANK", "0"))
    trainer, model = _train(model_name, {"checkpoint_format": checkpoint_format}, out, 1, [])
    params = sum(p.numel() for p in model.parameters())
    barrier = torch.distributed.barrier
    saves, sizes, path = [], [], None
    for i in range(repeats):
        previous, path = path, out / f"save{i}.ckpt"
        barrier()
        start = time.perf_counter()
        trainer.save_checkpoint(path)
        barrier()
        saves.append(time.perf_counter() - start)
        if rank == 0:
            sizes.append(_disk_bytes(path))
            if previous is not None:  # one checkpoint on disk at a time
                shutil.rmtree(previous) if previous.is_dir() else previous.unlink()
        barrier()
    barrier()
    start = time.perf_counter()
    checkpoint = trainer.strategy.load_checkpoint(path)
    trainer.strategy.load_model_state_dict(checkpoint)
    trainer.strategy.load_optimizer_state_dict(checkpoint)
    barrier()
    load = time.perf_counter() - start
    if rank == 0:
        result = {"model": model_name, "format": checkpoint_format, "save_s": saves, "bytes": sizes,
                  "load_s": load, "params": params, "global_step": trainer.global_step}  # fmt: skip
        (out / "result.json").write_text(json.dumps(result) + "\n")
    teardown(trainer, model)


def _save_and_time(save_at: int, path: Path) -> Any:
    """A callback that saves after step ``save_at`` (at the end of its batch, as ``ModelCheckpoint`` does) and times,
    on this rank, every step (batch start to batch start), the save call and each finalization of an asynchronous
    save by the strategy (``finalized``: its step and seconds)."""
    import lightning.pytorch as pl

    class SaveAndTime(pl.Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []
            self.save_s = 0.0
            self.finalized: list[tuple[int, float]] = []

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            saves = trainer.strategy._async_saves
            for name in ("finalize_if_written", "finish") if saves is not None else ():
                setattr(saves, name, self._timed(trainer, saves, getattr(saves, name)))

        def _timed(self, trainer: Any, saves: Any, call: Any) -> Any:
            def timed(*args: Any) -> None:
                pending, start = saves.pending, time.perf_counter()
                call(*args)
                if pending and not saves.pending:
                    self.finalized.append((trainer.global_step, time.perf_counter() - start))

            return timed

        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            self.starts.append(time.perf_counter())

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step == save_at:
                start = time.perf_counter()
                trainer.save_checkpoint(path)
                self.save_s = time.perf_counter() - start

    return SaveAndTime()


SAVE_AT = 2


def run_blocked(model_name: str, async_save: bool, steps: int, out: Path) -> None:
    """One rank of an ``--async`` job: ``steps`` steps with a ``torch_dist`` save after step :data:`SAVE_AT`
    (asynchronous or not); global rank 0 writes ``out/result.json``."""
    from speechtrain.lightning import teardown

    timer = _save_and_time(SAVE_AT, out / "blocked.ckpt")
    strategy = {"checkpoint_format": "torch_dist", "async_save": async_save}
    trainer, model = _train(model_name, strategy, out, steps, [timer])
    if int(os.environ.get("RANK", "0")) == 0:
        step_s = [b - a for a, b in zip(timer.starts, timer.starts[1:])]  # step_s[i]: batch i and its hooks
        finalize_s = sum(seconds for _, seconds in timer.finalized)
        result = {"model": model_name, "async": async_save, "save_call_s": timer.save_s, "finalize_s": finalize_s,
                  "blocked_s": timer.save_s + finalize_s, "finalized_at": [step for step, _ in timer.finalized],
                  "step_after_save_s": step_s[SAVE_AT], "median_step_s": statistics.median(step_s[SAVE_AT + 1 :]),
                  "params": sum(p.numel() for p in model.parameters()), "load": os.getloadavg()[0]}  # fmt: skip
        (out / "result.json").write_text(json.dumps(result) + "\n")
    teardown(trainer, model)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def measure(model_name: str, checkpoint_format: str, repeats: int, folder: Path, timeout: int,
            job: tuple[str, ...] = ()) -> dict:  # fmt: skip
    """Run :func:`run_one` (``job``: ``--blocked`` arguments, :func:`run_blocked`) on two processes in ``folder``
    (its checkpoints removed afterwards); rank 0's result."""
    from speechtrain.common.tokenizers import CharTokenizer
    from speechtrain.corpora.dtmf import make_dtmf_corpus
    from speechtrain.lightning.launch import fresh_launch_env

    out = folder / f"{model_name}_{checkpoint_format}"
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    make_dtmf_corpus(work / "dtmf", 16, seed=7)
    vocab_size = MODELS[model_name][1]
    CharTokenizer(_vocabulary(vocab_size)).save(work / f"chars{vocab_size}.json")
    env = fresh_launch_env(OMP_WAIT_POLICY="PASSIVE", OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
               __file__, "--job", model_name, "--format", checkpoint_format, "--repeats", str(repeats),
               "--out", str(out), *job]  # fmt: skip
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        if done.returncode != 0 or not (out / "result.json").exists():
            raise RuntimeError(f"{model_name} ({checkpoint_format}) failed:\n{done.stdout[-3000:]}\n"
                               f"{done.stderr[-6000:]}")  # fmt: skip
        return json.loads((out / "result.json").read_text())
    finally:
        shutil.rmtree(out, ignore_errors=True)


def summarise(result: dict) -> dict:
    return {**result, "save_median_s": statistics.median(result["save_s"]), "bytes_last": result["bytes"][-1]}


def record(rows: list[dict], command: str) -> None:
    """Append each row's figures: ``checkpoint.<model>.dp2.<format>.save_s | .bytes | .load_s``."""
    for r in rows:
        figure = f"checkpoint.{r['model']}.dp2.{r['format']}"
        note = (f"{NOTES.get(r['model'], r['model'])}; {r['params']:,} parameters; DP=2 on 2 gloo CPU processes, "
                f"distributed optimizer, one step trained on a tiny DTMF batch")  # fmt: skip
        saves = ", ".join(f"{s:.2f}" for s in r["save_s"])
        append(f"{figure}.save_s", round(r["save_median_s"], 2), "s",
               command, note=f"median of {len(r['save_s'])} saves ({saves} s); {note}")  # fmt: skip
        append(f"{figure}.bytes", r["bytes_last"], "bytes", command, note=note)
        append(
            f"{figure}.load_s",
            round(r["load_s"], 2),
            "s",
            command,
            note=f"the last save read back (load_checkpoint, model and optimizer state), page cache warm; {note}",
        )


def record_blocked(rows: list[dict], command: str) -> None:
    """Append ``checkpoint.<model>.dp2.torch_dist.blocked_s`` (sync) and ``...torch_dist_async.blocked_s``: the
    median over the jobs of each, the jobs' figures and the load of the machine in the note."""
    for model in dict.fromkeys(r["model"] for r in rows):
        for async_save in (False, True):
            runs = [r for r in rows if r["model"] == model and r["async"] == async_save]
            if not runs:
                continue
            jobs = "; ".join(
                f"blocked {r['blocked_s']:.2f} s (save call {r['save_call_s']:.2f}, finalization {r['finalize_s']:.2f}"
                f" at step {r['finalized_at']}), step after the save {r['step_after_save_s']:.2f} s, median step "
                f"{r['median_step_s']:.2f} s, load average {r['load']:.1f}"
                for r in runs
            )  # fmt: skip
            kind = "async_save=true: the save call and the finalization" if async_save else "the save call"
            note = (f"training held up by a torch_dist save after step {SAVE_AT} ({kind}), median of {len(runs)} "
                    f"job(s), sync and async alternating in one run: {jobs}; {NOTES.get(model, model)}; "
                    f"{runs[0]['params']:,} parameters; DP=2 on 2 gloo CPU processes (a machine of 2 CPUs shared "
                    "with other jobs), distributed optimizer")  # fmt: skip
            figure = f"checkpoint.{model}.dp2.torch_dist{'_async' if async_save else ''}.blocked_s"
            append(figure, round(statistics.median(r["blocked_s"] for r in runs), 2), "s", command, note=note)


def append(*args, **kwargs) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from results import append as append_record

    return append_record(*args, **kwargs)


def compare_blocked(args: argparse.Namespace) -> None:
    """``--async``: per model, ``--repeats`` jobs saving synchronously and as many with ``async_save``,
    alternating."""
    rows = []
    print("| model | save | blocked s | save call s | finalization s (at step) | step after save s | median step s |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for model_name in args.models:
            for _ in range(args.repeats):
                for mode in ("sync", "async"):
                    job = ("--blocked", mode, "--steps", str(args.steps))
                    r = measure(model_name, "torch_dist", 1, Path(tmp), args.timeout, job)
                    rows.append(r)
                    print(f"| {model_name} | {mode} | {r['blocked_s']:.2f} | {r['save_call_s']:.2f} | "
                          f"{r['finalize_s']:.2f} ({r['finalized_at']}) | {r['step_after_save_s']:.2f} | "
                          f"{r['median_step_s']:.2f} |", flush=True)  # fmt: skip
    if args.record:
        command = (f"python benchmarks/checkpoint_io.py --async --models {' '.join(args.models)} "
                   f"--repeats {args.repeats} --steps {args.steps}")  # fmt: skip
        record_blocked(rows, command)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS)[:2])
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    parser.add_argument("--repeats", type=int, default=3, help="saves timed per model and format")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per model and format")
    parser.add_argument("--record", action="store_true", help="append the figures to results/checkpoint.jsonl")
    parser.add_argument("--async", dest="blocked", action="store_true",
                        help="time the training held up by a torch_dist save, sync vs async_save")  # fmt: skip
    parser.add_argument("--steps", type=int, default=14, help="--async: steps per job (a save after step 2)")
    parser.add_argument("--job", choices=list(MODELS), help=argparse.SUPPRESS)  # one rank's job (internal)
    parser.add_argument("--format", choices=FORMATS, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--blocked", choices=("sync", "async"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.job and args.blocked:
        run_blocked(args.job, args.blocked == "async", args.steps, Path(args.out))
        return
    if args.job:
        run_one(args.job, args.format, args.repeats, Path(args.out))
        return
    if args.blocked:
        compare_blocked(args)
        return
    rows = []
    print("| model | format | parameters | save s (median) | saves s | bytes on disk | load s |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for model_name in args.models:
            for checkpoint_format in args.formats:
                r = summarise(measure(model_name, checkpoint_format, args.repeats, Path(tmp), args.timeout))
                rows.append(r)
                print(f"| {model_name} | {checkpoint_format} | {r['params']:,} | {r['save_median_s']:.2f} | "
                      f"{', '.join(f'{s:.2f}' for s in r['save_s'])} | {r['bytes_last']:,} | {r['load_s']:.2f} |",
                      flush=True)  # fmt: skip
    if args.record:
        command = "python benchmarks/checkpoint_io.py --models " + " ".join(args.models) + (
            f" --repeats {args.repeats}")  # fmt: skip
        record(rows, command)


if __name__ == "__main__":
    main()
