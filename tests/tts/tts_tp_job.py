"""Teacher-forced forward and backward of a tiny TTS transformer (with the alignment prior), and a short guided
generation, under a tensor-parallel size; launched by test_tts_model.py with torchrun (TP=2, gloo) or as one plain
process (the reference). Rank 0 writes ``<out>``: logits, loss, cross-attention, full gradients, weights, codes."""

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

from speechtrain.lightning.checkpoint import gather_full_state_dict  # noqa: E402
from speechtrain.lightning.megatron_compat import import_megatron  # noqa: E402


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
    from test_tts_model import tiny_batch, tiny_tts

    model = tiny_tts(seed=4)
    batch = tiny_batch(model)
    model.eval()  # no dropout; the prior at half strength
    logits, tf, weights = model.teacher_forced_logits(batch, prior_strength=0.5, need_weights=True)
    loss_sum, count = model.code_losses(logits, tf)
    loss = loss_sum / count
    (loss + sum(w.square().sum() for w in weights)).backward()
    full_grads = {}
    for name, param in model.named_parameters():
        grad = param.grad
        if world > 1 and getattr(param, "tensor_model_parallel", False):
            pieces = [torch.empty_like(grad) for _ in range(world)]
            dist.all_gather(pieces, grad.contiguous())
            grad = torch.cat(pieces, dim=param.partition_dim)
        full_grads[name] = grad
    codes = model.generate_codes(["hello there", "abc"], seed=0)["codes"]
    state = gather_full_state_dict(model)
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save({"logits": logits.detach(), "loss": loss.detach(), "attention": weights[-1].detach(),
                    "grads": full_grads, "weights": state, "codes": codes}, args.out)  # fmt: skip
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
