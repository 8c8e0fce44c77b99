"""Forward and backward of a small Conformer encoder (its output, layer 0's and layer 1's, on half the frames)
under a tensor-parallel size; launched by test_asr_conformer.py with torchrun (TP=2, gloo) or as one plain process
(the reference). Rank 0 writes ``<out>`` with the outputs, the gradient of the input features and the full
gradients of every parameter."""

import argparse
import os

import torch
import torch.distributed as dist

from speechtrain.asr.conformer import ConformerConfig, ConformerEncoder
from speechtrain.lightning.checkpoint import gather_full_state_dict
from speechtrain.lightning.megatron_compat import import_megatron


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--subsampling", default="dw_striding")
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
        import_megatron()
        from megatron.core import parallel_state as mpu

        mpu.initialize_model_parallel(tensor_model_parallel_size=world)
    cfg = ConformerConfig(d_model=32, num_layers=2, num_heads=4, conv_kernel_size=5, subsampling=args.subsampling,
                          subsampling_factor=8 if args.subsampling == "dw_striding" else 4,
                          subsampling_conv_channels=16, dropout=0.0, dropout_att=0.0, time_reduce_idx=1,
                          time_recovery_idx=2)  # fmt: skip
    encoder = ConformerEncoder(cfg, n_mels=20, seed=7)
    generator = torch.Generator().manual_seed(3)
    feats = torch.randn(3, 20, 90, generator=generator).requires_grad_()
    lengths = torch.tensor([90, 61, 33])
    # Layer 1 runs on half the frames (the temporal U-Net). Layers 0 and 1 are captured too (intermediate CTC's
    # input) and take part in the loss: under TP they must be the full hidden states.
    out, out_lengths, (first, second) = encoder.forward_with_layers(feats, lengths, (0, 1))
    weights = torch.randn(out.shape, generator=generator)
    first_weights = torch.randn(first.shape, generator=generator)
    ((out * weights).sum() + (first * first_weights).sum() + (second * first_weights).sum()).backward()
    grads = {name: p.grad for name, p in encoder.named_parameters()}
    full_grads = {}
    for name, param in encoder.named_parameters():
        grad = param.grad
        if world > 1 and getattr(param, "tensor_model_parallel", False):
            pieces = [torch.empty_like(grad) for _ in range(world)]
            dist.all_gather(pieces, grad.contiguous())
            grad = torch.cat(pieces, dim=param.partition_dim)
        full_grads[name] = grad
    del grads
    state = gather_full_state_dict(encoder)
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save({"out": out.detach(), "first": first.detach(), "second": second.detach(), "lengths": out_lengths,
                    "feat_grad": feats.grad, "grads": full_grads, "weights": state}, args.out)  # fmt: skip
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
