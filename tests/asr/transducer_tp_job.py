"""Loss and gradients of a small TDT transducer (Conformer encoder, prediction network, joint) under a
tensor-parallel size; launched by test_asr_transducer_tp.py with torchrun (TP=2, gloo) or as one plain process
(the reference). Every rank writes ``<out>.rank<r>`` with the loss, the token count and the full gradient of every
parameter (tensor-parallel shards gathered)."""

import argparse
import os

import torch
import torch.distributed as dist

from speechtrain.asr.transducer import ConformerTransducerModel
from speechtrain.lightning.megatron_compat import import_megatron


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--hybrid", action="store_true")
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
        import_megatron()
        from megatron.core import parallel_state as mpu

        mpu.initialize_model_parallel(tensor_model_parallel_size=world)
    torch.manual_seed(0)
    model = ConformerTransducerModel({
        "tokenizer": {"vocab": [" ", *"0123456789"]}, "preprocessor": {"n_mels": 16, "dither": 0.0},
        "spec_augment": None, "hybrid": args.hybrid,
        "encoder": {"d_model": 32, "num_layers": 2, "num_heads": 4, "conv_kernel_size": 5, "subsampling": "striding",
                    "subsampling_factor": 4, "subsampling_conv_channels": 16, "dropout": 0.0, "dropout_att": 0.0},
        "prediction": {"pred_hidden": 24, "dropout": 0.0}, "joint": {"joint_hidden": 24, "dropout": 0.0,
                                                                     "fused_batch_size": 2},
    })  # fmt: skip
    model.configure_model()
    generator = torch.Generator().manual_seed(3)
    batch = {"audio": 0.3 * torch.randn(3, 8000, generator=generator),
             "audio_lens": torch.tensor([8000, 6100, 3300]),
             "tokens": torch.randint(0, 11, (3, 9), generator=generator),
             "token_lens": torch.tensor([9, 6, 2])}  # fmt: skip
    loss_sum, count = model.loss_step(batch, model.forward_step(batch))
    (loss_sum / count).backward()
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad
        if world > 1 and getattr(param, "tensor_model_parallel", False):
            pieces = [torch.empty_like(grad) for _ in range(world)]
            dist.all_gather(pieces, grad.contiguous())
            grad = torch.cat(pieces, dim=param.partition_dim)
        grads[name] = grad
    rank = int(os.environ.get("RANK", "0"))
    torch.save({"loss": loss_sum.detach(), "count": count, "grads": grads}, f"{args.out}.rank{rank}")
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
