"""One training job of the toy transformer under a given parallel layout; launched by the parallel tests with
``torchrun`` (or as a plain single process for the reference). Every rank writes ``<out>/rank<R>.pt`` with the
per-step losses and its (sharded) final weights."""

import argparse
import os
import signal
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from speechtrain.lightning import MegatronStrategy, Trainer, parallel_state
from speechtrain.testing.toy_models import ToyTransformerRegressor


class RecordLosses(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer, pl_module):
        # This rank's own normalisation statistics (before an archive or checkpoint averages them).
        self.norm_stats = {n: b.clone() for n, b in pl_module.named_buffers() if n.endswith(("running_mean", "_var"))}
        # The parallel state is torn down with the trainer: read the ranks while it exists.
        self.ranks = {
            "tp_rank": parallel_state.tensor_parallel_rank(),
            "pp_rank": parallel_state.pipeline_parallel_rank(),
            "dp_rank": parallel_state.data_parallel_rank(),
        }


class KillAt(pl.Callback):
    """Dies like a preempted job (SIGKILL, no clean-up) once ``step`` optimizer steps are done."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def hold_write(step: int) -> None:
    """The writer of the asynchronous save at ``step`` never finishes (it sleeps in place of writing): a kill then
    falls while that save is in flight."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    write = FileSystemWriterAsync.write_preloaded_data_multithread

    def held(transforms, use_msc, rank, buckets, results):
        if any(f"step={step}.ckpt" in str(bucket[0]) for bucket in buckets):
            time.sleep(3600)
        write(transforms, use_msc, rank, buckets, results)

    FileSystemWriterAsync.write_preloaded_data_multithread = staticmethod(held)


def megatron_gathered_optimizer_state() -> None:
    """``torch_dist`` saves the distributed optimizer's state through Megatron's own gather on data-parallel rank 0
    (the reference for speechtrain's per-rank description of it)."""
    from speechtrain.lightning import dist_checkpoint

    def gathered(optimizer, model_sharded, is_loading=False):
        metadata = {"distrib_optim_sharding_type": dist_checkpoint._DISTRIB_OPTIM_SHARDING,
                    "distrib_optim_fully_reshardable_mem_efficient": True}  # fmt: skip
        return dist_checkpoint._mcore(optimizer).sharded_state_dict(model_sharded, is_loading, metadata=metadata)

    dist_checkpoint.optimizer_sharded_state_dict = gathered


class SaveAtStart(pl.Callback):
    """Saves a checkpoint before the first step (of a resumed run: the state just read back)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_start(self, trainer, pl_module):
        trainer.save_checkpoint(self.path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--accelerator", default="cpu", help="gpu: the same job on CUDA devices (NCCL)")
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--plain", action="store_true", help="no MegatronStrategy: Lightning's default, 1 process")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=None)
    parser.add_argument("--accumulate", type=int, default=1, help="trainer.accumulate_grad_batches")
    parser.add_argument("--optimizer", default="adam", help="adam (the toy's default) or sgd")
    parser.add_argument("--input-norm", action="store_true", help="a batch norm on the input frames")
    parser.add_argument("--precision", default="32")
    parser.add_argument("--ckpt-dir", help="save a checkpoint every --save-every steps here")
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--kill-at", type=int, help="SIGKILL every rank when this many steps are done")
    parser.add_argument("--resume", help="checkpoint to resume from")
    parser.add_argument("--archive", help="save the trained model here (.stm) after fit")
    parser.add_argument("--relative-positions", action="store_true")
    parser.add_argument("--distributed-optimizer", action="store_true")
    parser.add_argument("--checkpoint-format", default="torch", help="the strategy's checkpoint_format")
    parser.add_argument("--save-at-start", help="save a checkpoint here before the first step")
    parser.add_argument("--async-save", action="store_true", help="the strategy's async_save")
    parser.add_argument("--hold-write-at", type=int, help="the asynchronous save at this step is never written")
    parser.add_argument("--megatron-gather", action="store_true", help="optimizer state saved by Megatron's gather")
    args = parser.parse_args()

    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    strategy = (
        "auto"
        if args.plain
        else MegatronStrategy(
            tensor_model_parallel_size=args.tp,
            pipeline_model_parallel_size=args.pp,
            micro_batch_size=args.micro_batch_size,
            use_distributed_optimizer=args.distributed_optimizer,
            checkpoint_format=args.checkpoint_format,
            async_save=args.async_save,
        )
    )
    if args.hold_write_at:
        from speechtrain.lightning.megatron_compat import import_megatron

        import_megatron()
        hold_write(args.hold_write_at)
    if args.megatron_gather:
        megatron_gathered_optimizer_state()
    recorder = RecordLosses()
    callbacks = [recorder]
    if args.ckpt_dir:
        callbacks.append(
            ModelCheckpoint(
                dirpath=args.ckpt_dir, filename="{step}", every_n_train_steps=args.save_every, save_top_k=-1
            )
        )
    if args.kill_at:
        callbacks.append(KillAt(args.kill_at))
    if args.save_at_start:
        callbacks.append(SaveAtStart(args.save_at_start))
    trainer = Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=strategy,
        precision=args.precision,
        max_steps=args.steps,
        accumulate_grad_batches=args.accumulate,
        gradient_clip_val=0.05,
        logger=False,
        enable_checkpointing=bool(args.ckpt_dir),
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=callbacks,
    )
    dp = (args.devices * args.num_nodes) // (args.tp * args.pp)
    model = ToyTransformerRegressor(
        {
            "batch_size": args.global_batch // (dp * args.accumulate),
            "relative_positions": args.relative_positions,
            "input_norm": args.input_norm,
            "optim": {"name": args.optimizer, "lr": 1e-2, "weight_decay": 0.0, "momentum": 0.0},
        }
    )  # layers built in configure_model
    trainer.fit(model, ckpt_path=args.resume)
    params = {
        name: (
            p.detach().float().cpu().clone(),
            getattr(p, "partition_dim", None) if getattr(p, "tensor_model_parallel", False) else None,
        )
        for name, p in model.named_parameters()
    }
    optimizer = trainer.optimizers[0] if trainer.optimizers else None
    optimizer = type(getattr(optimizer, "mcore", optimizer)).__name__  # Megatron's class under the bridge
    record = {"losses": recorder.losses, "params": params, "optimizer": optimizer, "global_step": trainer.global_step,
              "norm_stats": recorder.norm_stats, **recorder.ranks}  # fmt: skip
    if args.archive:
        model.save_to(args.archive)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    torch.save(record, Path(args.out) / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    main()
