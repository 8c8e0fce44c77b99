"""examples/asr_train.py with a fault injected, for the multi-process reliability tests.

    python fault_job.py <hydra overrides>

with FAULT=kill|kill_in_save|raise, FAULT_STEP=<global step>, FAULT_RANK=<rank>.

``kill`` sends SIGKILL to this process at the start of that step (nothing is saved on the way out);
``kill_in_save`` sends it inside the write of the ``last`` checkpoint saved at that step, once the new file is
complete and fsynced but before it is renamed into place; ``raise`` raises
``RuntimeError("injected failure on rank R")`` at the start of that step. The final losses of each step are written to
``$LOSS_LOG`` (one JSON line per step, global rank 0) when set.
"""

import importlib.util
import json
import os
import signal
from pathlib import Path

from speechtrain.lightning import BaseCallback, CallbackGroup

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "asr_train.py"
_replace = os.replace


def _kill_before_renaming_last(step: int, trainer_of: dict):
    def replace(src, dst, *args, **kwargs):
        trainer = trainer_of.get("trainer")
        if str(dst).endswith("last.ckpt") and trainer is not None and trainer.global_step == step:
            os.kill(os.getpid(), signal.SIGKILL)
        return _replace(src, dst, *args, **kwargs)

    return replace


class Fault(BaseCallback):
    def __init__(self) -> None:
        self.kind = os.environ.get("FAULT")
        self.step = int(os.environ.get("FAULT_STEP", "-1"))
        self.rank = int(os.environ.get("FAULT_RANK", "0"))
        self.loss_log = os.environ.get("LOSS_LOG")
        self.trainer_of: dict = {}
        if self.kind == "kill_in_save" and self.rank == 0:
            os.replace = _kill_before_renaming_last(self.step, self.trainer_of)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.trainer_of["trainer"] = trainer
        if trainer.global_step != self.step or trainer.global_rank != self.rank:
            return
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "raise":
            raise RuntimeError(f"injected failure on rank {trainer.global_rank}")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.loss_log and trainer.is_global_zero:
            loss = float(trainer.callback_metrics["reduced_train_loss"])
            with open(self.loss_log, "a") as f:
                f.write(json.dumps({"step": trainer.global_step, "loss": loss}) + "\n")


if __name__ == "__main__":
    CallbackGroup.get_instance().register(Fault())
    spec = importlib.util.spec_from_file_location("asr_train", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main()
