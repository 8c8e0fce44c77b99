"""NeMo's side of vs_nemo_accuracy.py: train a FastConformer (CTC, or hybrid transducer-CTC) with NeMo for a
wall-clock budget (``--seconds``) or a number of optimizer steps (``--steps``), then greedy-decode sets and write
their WERs as JSON. Runs in an environment with
``nemo-toolkit[asr]`` (never a dependency of speechtrain; this file does not import speechtrain).

    /work/nemo-env/bin/python benchmarks/vs_nemo_accuracy_nemo.py --family ctc --train train.json \\
        --tokenizer-dir TOKENIZER_DIR --seconds 480 --eval test=test.json --eval heldout_engine=held.json --out r.json

The model is NeMo's published FastConformer recipe (``fast-conformer_ctc_bpe.yaml``,
``fastconformer_hybrid_tdt_ctc_bpe.yaml``), written out here, sized like speechtrain's demo encoder: d_model 144, 8
layers, 4 heads (prediction and joint networks 256 wide, as in the demo); otherwise as published: 8x ``dw_striding``
subsampling (256 channels), xscaling, relative positions with untied biases, batch-norm convolution module with
kernel 9, dropout 0.1, SpecAugment (2 frequency masks of up to 27 bands, 10 time masks of up to 5 %), AdamW at
1e-3 with betas (0.9, 0.98) and weight decay 1e-3, cosine annealing to 1e-4.

Compromises, each forced by the CPU or the budget:

- The schedule: the published 15k warm-up steps never end in minutes. As speechtrain's recipes do, the warm-up is
  200 steps and the cosine decays over the wall-clock budget (rank 0's elapsed fraction of ``--seconds``, broadcast
  each step so both ranks use one learning rate), not over a step count nobody knows in advance; with ``--steps``,
  over those steps.
- Hybrid: NeMo's TDT loss runs on CUDA only (its CPU path raises; the pure-PyTorch one is a debugging loop that
  calls ``.cuda()``), so the CPU hybrid uses NeMo's standard RNN-T loss (numba, CPU) with the same CTC head and
  weight 0.3: ``fastconformer_hybrid_transducer_ctc_bpe.yaml``'s recipe. Decoding is the transducer's, greedy.
- Batches: lhotse duration batching, ``--batch-duration`` seconds of audio per process per step (speechtrain's demo
  runs 30), 10 buckets, 1 loader worker; 2 data-parallel processes (``ddp`` on CPU, gloo), one thread each.
- No validation during training (it would spend the budget); the sets are decoded once after it, by rank 0.

As published: fp32, no gradient clipping. The numba RNN-T loss compiles on its first step, inside the budget.
"""

import argparse
import json
import math
import os
import time
from pathlib import Path

SIZE = {"d_model": 144, "n_layers": 8, "n_heads": 4, "pred_hidden": 256, "joint_hidden": 256}


def model_config(family: str, train: str, tokenizer_dir: str, batch_duration: float, lr: float, val: str) -> dict:
    """The recipe as a NeMo model config (plain dicts); ``val``, a manifest for ``validation_ds``, which
    ``transcribe`` reads settings from (no validation runs during training)."""
    d = SIZE["d_model"]
    cfg = {
        "sample_rate": 16000,
        "log_prediction": False,
        "ctc_reduction": "mean_volume",
        "skip_nan_grad": False,
        "tokenizer": {"dir": tokenizer_dir, "type": "bpe"},
        "train_ds": {
            "manifest_filepath": train, "sample_rate": 16000, "use_lhotse": True, "batch_duration": batch_duration,
            "batch_size": None, "use_bucketing": True, "num_buckets": 10, "max_duration": 20.0, "min_duration": 0.1,
            "shuffle": True, "num_workers": 1, "pin_memory": False, "seed": 1234,
        },
        "validation_ds": {
            "manifest_filepath": val, "sample_rate": 16000, "use_lhotse": True, "batch_size": 16, "shuffle": False,
            "num_workers": 1, "pin_memory": False,
        },
        "preprocessor": {
            "_target_": "nemo.collections.asr.modules.AudioToMelSpectrogramPreprocessor", "sample_rate": 16000,
            "normalize": "per_feature", "window_size": 0.025, "window_stride": 0.01, "window": "hann",
            "features": 80, "n_fft": 512, "log": True, "frame_splicing": 1, "dither": 1e-5, "pad_to": 0,
            "pad_value": 0.0,
        },
        "spec_augment": {
            "_target_": "nemo.collections.asr.modules.SpectrogramAugmentation", "freq_masks": 2, "time_masks": 10,
            "freq_width": 27, "time_width": 0.05,
        },
        "encoder": {
            "_target_": "nemo.collections.asr.modules.ConformerEncoder", "feat_in": 80, "feat_out": -1,
            "n_layers": SIZE["n_layers"], "d_model": d, "subsampling": "dw_striding", "subsampling_factor": 8,
            "subsampling_conv_channels": 256, "causal_downsampling": False, "ff_expansion_factor": 4,
            "self_attention_model": "rel_pos", "n_heads": SIZE["n_heads"], "att_context_size": [-1, -1],
            "xscaling": True, "untie_biases": True, "pos_emb_max_len": 5000, "conv_kernel_size": 9,
            "conv_norm_type": "batch_norm", "dropout": 0.1, "dropout_pre_encoder": 0.1, "dropout_emb": 0.0,
            "dropout_att": 0.1,
        },
        # No "sched": the learning rate follows the wall clock (WallClockCosine), as speechtrain's does.
        "optim": {"name": "adamw", "lr": lr, "betas": [0.9, 0.98], "weight_decay": 1e-3},
    }  # fmt: skip
    ctc_head = {"_target_": "nemo.collections.asr.modules.ConvASRDecoder", "feat_in": d, "num_classes": -1,
                "vocabulary": []}  # fmt: skip
    if family == "ctc":
        cfg["decoder"] = ctc_head
        cfg["decoding"] = {"strategy": "greedy_batch"}
        return cfg
    p, j = SIZE["pred_hidden"], SIZE["joint_hidden"]
    cfg["model_defaults"] = {"enc_hidden": d, "pred_hidden": p, "joint_hidden": j}
    cfg["decoder"] = {
        "_target_": "nemo.collections.asr.modules.RNNTDecoder", "normalization_mode": None,
        "random_state_sampling": False, "blank_as_pad": True,
        "prednet": {"pred_hidden": p, "pred_rnn_layers": 1, "t_max": None, "dropout": 0.2},
    }  # fmt: skip
    cfg["joint"] = {
        "_target_": "nemo.collections.asr.modules.RNNTJoint", "log_softmax": None, "preserve_memory": False,
        "fuse_loss_wer": True, "fused_batch_size": 4,
        "jointnet": {"joint_hidden": j, "activation": "relu", "dropout": 0.2, "encoder_hidden": d, "pred_hidden": p},
    }  # fmt: skip
    cfg["decoding"] = {"strategy": "greedy_batch", "greedy": {"max_symbols": 10}}
    cfg["loss"] = {"loss_name": "default", "warprnnt_numba_kwargs": {"fastemit_lambda": 0.0, "clamp": -1.0}}
    cfg["aux_ctc"] = {
        "ctc_loss_weight": 0.3, "use_cer": False, "ctc_reduction": "mean_batch",
        "decoder": {**ctc_head, "feat_in": None}, "decoding": {"strategy": "greedy"},
    }  # fmt: skip
    return cfg


def cosine_schedule(seconds: float | None, warmup_steps: int, lr: float, min_lr: float,
                      steps: int | None = None):  # noqa: ANN201  # fmt: skip
    """A callback: linear warm-up over ``warmup_steps``, then cosine from ``lr`` to ``min_lr`` over the wall-clock
    fraction of ``seconds`` spent since training started (rank 0's clock, broadcast, so every rank agrees), or over
    ``steps`` optimizer steps when given."""
    import lightning.pytorch as pl
    import torch

    class WallClockCosine(pl.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            self.start = time.monotonic()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            step = trainer.global_step
            if steps is not None:
                fraction = torch.tensor([step / steps], dtype=torch.float64)
            else:
                fraction = torch.tensor([(time.monotonic() - self.start) / seconds], dtype=torch.float64)
                if torch.distributed.is_available() and torch.distributed.is_initialized():
                    torch.distributed.broadcast(fraction, src=0)
            if trainer.is_global_zero and step % 50 == 0:  # a sign of life and of the pace (no progress bar)
                print(f"step {step}, {time.monotonic() - self.start:.0f} s", flush=True)
            if step < warmup_steps:
                value = lr * (step + 1) / warmup_steps
            else:
                value = min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * min(1.0, fraction.item())))
            for optimizer in trainer.optimizers:
                for group in optimizer.param_groups:
                    group["lr"] = value

    return WallClockCosine()


def read_manifest(path: str) -> tuple[list[str], list[str]]:
    audio, text = [], []
    with open(path, encoding="utf-8") as rows:
        for line in rows:
            if line.strip():
                row = json.loads(line)
                audio.append(row["audio_filepath"])
                text.append(row["text"])
    return audio, text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=["ctc", "hybrid"], required=True)
    parser.add_argument("--train", required=True, help="training manifest (NeMo JSON lines, absolute audio paths)")
    parser.add_argument("--tokenizer-dir", required=True, help="folder holding the BPE tokenizer.model")
    budget = parser.add_mutually_exclusive_group(required=True)
    budget.add_argument("--seconds", type=float, help="training wall-clock budget (max_time)")
    budget.add_argument("--steps", type=int, help="training budget in optimizer steps (max_steps)")
    parser.add_argument("--eval", action="append", required=True, metavar="NAME=MANIFEST", help="a set to decode")
    parser.add_argument("--out", required=True, help="JSON file for the WERs (written by rank 0)")
    parser.add_argument("--devices", type=int, default=2, help="data-parallel CPU processes")
    parser.add_argument("--batch-duration", type=float, default=30.0, help="seconds of audio per process per step")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (published: 1e-3)")
    parser.add_argument("--min-lr", type=float, default=1e-4, help="end of the cosine (published: 1e-4)")
    parser.add_argument("--warmup-steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)

    import datetime

    import lightning.pytorch as pl
    import torch
    from nemo.collections.asr.metrics.wer import word_error_rate
    from nemo.collections.asr.models import EncDecCTCModelBPE, EncDecHybridRNNTCTCBPEModel
    from omegaconf import OmegaConf

    pl.seed_everything(args.seed, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices, strategy="ddp" if args.devices > 1 else "auto",
        max_time=None if args.seconds is None else datetime.timedelta(seconds=args.seconds),
        max_steps=-1 if args.steps is None else args.steps, max_epochs=-1, precision=32, gradient_clip_val=0.0,
        logger=False, enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, enable_progress_bar=False, log_every_n_steps=50,
        use_distributed_sampler=False,  # lhotse shards by rank itself
        callbacks=[cosine_schedule(args.seconds, args.warmup_steps, args.lr, args.min_lr, args.steps)],
    )  # fmt: skip
    first_set = args.eval[0].split("=", 1)[1]
    cfg = model_config(args.family, args.train, args.tokenizer_dir, args.batch_duration, args.lr, first_set)
    cfg = OmegaConf.create(cfg)
    model_class = EncDecCTCModelBPE if args.family == "ctc" else EncDecHybridRNNTCTCBPEModel
    model = model_class(cfg=cfg, trainer=trainer)
    start = time.perf_counter()
    trainer.fit(model)
    train_s = time.perf_counter() - start
    if torch.distributed.is_initialized():  # else the encoder's forward all-reduces lengths with the ranks gone
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    if not trainer.is_global_zero:
        os._exit(0)  # the interpreter's shutdown of a finished rank can hang (seen with the hybrid); nothing is left
    # Decode every utterance here: NeMo's loaders shard by the model's world size, lhotse's by these variables.
    model.world_size = 1
    os.environ.update(WORLD_SIZE="1", RANK="0")
    result = {"family": args.family, "steps": int(trainer.global_step), "train_s": round(train_s, 1), "wer": {}}
    model.eval()
    torch.set_num_threads(len(os.sched_getaffinity(0)))  # the other rank is done: decode on every core
    for item in args.eval:
        name, path = item.split("=", 1)
        audio, text = read_manifest(path)
        start = time.perf_counter()
        with torch.inference_mode():
            hypotheses = model.transcribe(audio, batch_size=16, verbose=False)
        if isinstance(hypotheses, tuple):  # some NeMo versions return (best, all)
            hypotheses = hypotheses[0]
        words = [h.text if hasattr(h, "text") else h for h in hypotheses]
        result["wer"][name] = word_error_rate(hypotheses=words, references=text)
        result.setdefault("decode_s", {})[name] = round(time.perf_counter() - start, 1)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(result), flush=True)
    os._exit(0)  # the results are written; see above


if __name__ == "__main__":
    main()
