"""Build a small hybrid TDT model under a tensor-parallel size and export it to ONNX into ``--out``; launched by
test_export_onnx.py with torchrun (TP=2, gloo: every rank calls export_onnx, rank 0 writes) or as one plain
process (the reference). Weights are drawn from per-layer seeded streams, so both layouts hold the same model."""

import argparse
import os

import torch
import torch.distributed as dist

from speechtrain.asr.export_onnx import export_onnx
from speechtrain.asr.transducer import ConformerTransducerModel
from speechtrain.lightning.megatron_compat import import_megatron


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
        import_megatron()
        from megatron.core import parallel_state as mpu

        mpu.initialize_model_parallel(tensor_model_parallel_size=world)
    torch.manual_seed(0)
    model = ConformerTransducerModel({
        "tokenizer": {"vocab": [" ", *"0123456789"]}, "preprocessor": {"kind": "nemo", "n_mels": 80, "dither": 0.0},
        "spec_augment": None, "hybrid": True, "loss": "tdt",
        "interctc": {"loss_weights": [], "apply_at_layers": [], "self_conditioning": False},
        "encoder": {"d_model": 32, "num_layers": 2, "num_heads": 4, "conv_kernel_size": 5, "subsampling_factor": 8,
                    "subsampling_conv_channels": 16, "dropout": 0.0, "dropout_att": 0.0},
        "prediction": {"pred_hidden": 24, "dropout": 0.0}, "joint": {"joint_hidden": 24, "dropout": 0.0},
    })  # fmt: skip
    model.configure_model()
    model.eval()
    written = export_onnx(model, args.out)
    rank = int(os.environ.get("RANK", "0"))
    assert bool(written) == (rank == 0), (rank, written)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
