"""A tiny SALM or codec TTS model trained for a few steps on one GPU under the bridge (NCCL, a world of one), with a
validation pass; launched by ``tests/gpu/test_gpu_smoke.py``:

    python tests/gpu/family_job.py --family salm|tts --precision bf16-mixed --out result.json

Writes the optimizer steps done, the losses and every tensor made without a device inside a step or a validation
(on a GPU such a tensor lands on the CPU and breaks the step, or slows it with a copy).
"""

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

import lightning.pytorch as pl

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))


class RecordLosses(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.device = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))
        self.device = str(next(pl_module.parameters()).device)  # (fit's teardown moves the model back to the CPU)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", choices=["salm", "tts"], required=True)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--out", required=True)
    parser.add_argument("--accelerator", default="gpu", help="cpu: the same job on the CPU (gloo), to try it here")
    args = parser.parse_args()

    from test_device_discipline import family_model

    from speechtrain.corpora.dtmf import make_dtmf_corpus
    from speechtrain.lightning import MegatronStrategy, Trainer
    from speechtrain.testing.devices import RecordDevicelessFactories

    pl.seed_everything(0, verbose=False)
    folder = Path(tempfile.mkdtemp())
    model = family_model(args.family, folder, make_dtmf_corpus(folder / "dtmf", 16, seed=7))
    recorder, losses = RecordDevicelessFactories(), RecordLosses()
    trainer = Trainer(accelerator=args.accelerator, devices=1, strategy=MegatronStrategy(), precision=args.precision,
                      max_steps=4, limit_val_batches=1, val_check_interval=2, num_sanity_val_steps=0,
                      use_distributed_sampler=False, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[recorder, losses])  # fmt: skip
    trainer.fit(model)
    Path(args.out).write_text(json.dumps({
        "steps": trainer.global_step, "losses": losses.losses, "finite": all(math.isfinite(x) for x in losses.losses),
        "deviceless": recorder.calls, "device": losses.device,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
