"""The toy transformer at TP=2 (torchrun, gloo) with one tensor-parallel rank's gradients disturbed, as
non-deterministic kernels disturb them on GPUs; launched by test_lightning_tp_replicas.py. Before every step's
gradient reduction, TP rank 1 adds noise to the gradients of the parameters each TP rank holds whole. Every rank
writes ``<out>/rank<R>.pt``: those parameters after training, their names, and the per-step losses.

``--no-average`` leaves out the TP average of those gradients (the control: the copies must then drift apart).
"""

import argparse
import os
from pathlib import Path

import lightning.pytorch as pl
import torch

from speechtrain.lightning import MegatronStrategy, Trainer, parallel_state
from speechtrain.lightning.megatron_parallel import MegatronParallel
from speechtrain.testing.toy_models import ToyTransformerRegressor


def disturb_tp_rank_one() -> None:
    finalize = MegatronParallel._finalize
    generator = torch.Generator().manual_seed(11)

    def disturbed(self, model, num_tokens, **kwargs):
        if not self._accumulating and parallel_state.tensor_parallel_rank() == 1:
            for param in self._replicated:
                noise = torch.randn(param.main_grad.shape, generator=generator) * 1e-3
                param.main_grad.add_(noise * param.main_grad.abs().mean())
        return finalize(self, model, num_tokens, **kwargs)

    MegatronParallel._finalize = disturbed


class Losses(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--no-average", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    disturb_tp_rank_one()
    if args.no_average:
        MegatronParallel._average_replicated_grads = lambda self: None
    losses = Losses()
    trainer = Trainer(accelerator="cpu", devices=2, strategy=MegatronStrategy(tensor_model_parallel_size=2),
                      precision="32", max_steps=args.steps, gradient_clip_val=1.0, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      limit_val_batches=0, callbacks=[losses])  # fmt: skip
    model = ToyTransformerRegressor({"batch_size": 8, "optim": {"name": "adam", "lr": 1e-2, "weight_decay": 0.0}})
    names = {}

    def remember_names(trainer, pl_module) -> None:
        engine = MegatronParallel.active
        by_id = {id(p): n for n, p in pl_module.named_parameters()}
        names["replicated"] = [by_id[id(p)] for p in engine._replicated]

    hook = pl.Callback()
    hook.on_train_start = remember_names
    trainer.callbacks.append(hook)
    trainer.fit(model)
    params = dict(model.named_parameters())
    sharded = sorted(n for n, p in params.items() if getattr(p, "tensor_model_parallel", False))
    record = {"names": names["replicated"], "losses": losses.losses, "sharded": sharded,
              "params": {n: params[n].detach().clone() for n in names["replicated"]}}  # fmt: skip
    Path(args.out).mkdir(parents=True, exist_ok=True)
    torch.save(record, Path(args.out) / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    main()
