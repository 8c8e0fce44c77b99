"""LoRA fine-tuning steps of a tiny GPT under a tensor-parallel size; launched by test_speechlm_lora.py with torchrun
(TP=2, gloo) or as one plain process (the reference). Rank 0 writes ``<out>`` with the logits, the losses of three
Adam steps on the adapters only, and the full (gathered) gradients of every adapter parameter."""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from speechtrain.lightning.megatron_compat import import_megatron, model_parallel_manual_seed
from speechtrain.speechlm.backbone import GPTConfig, build_gpt, ensure_parallel_state, gpt_logits
from speechtrain.speechlm.lora import (
    LoRAConfig,
    apply_lora,
    freeze_all_but_lora,
    gather_full_gradient,
    gather_tensor_parallel,
    lora_modules,
    shard_tensor,
    trainable_parameters,
)

TINY = GPTConfig(vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
                 ffn_hidden_size=64, transformer_engine=False)  # fmt: skip


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
        model_parallel_manual_seed(1)
    else:
        ensure_parallel_state(seed=1)
    from megatron.core import parallel_state as mpu

    rank, tp = mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size()
    model = torch.nn.Module()
    model.llm = build_gpt(TINY)
    names = apply_lora(model, LoRAConfig(rank=4, alpha=8, seed=5))
    # Nonzero B (else A gets no gradient): the full matrix drawn per module, then sliced like the parameter.
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, module in lora_modules(model).items():
            b = module.lora_b
            full_shape = list(b.shape)
            if getattr(b, "tensor_model_parallel", False):
                full_shape[b.partition_dim] *= tp
            full = torch.randn(full_shape, generator=generator) * 0.1
            if getattr(b, "tensor_model_parallel", False):
                full = shard_tensor(full, b.partition_dim, rank, tp, b.partition_stride)
            b.copy_(full)
            del name
    freeze_all_but_lora(model)
    model.train()
    data = torch.Generator().manual_seed(3)
    ids = torch.randint(0, TINY.vocab_size, (2, 9), generator=data)
    labels = torch.randint(0, TINY.vocab_size, (2, 9), generator=data)

    def loss_of() -> tuple[torch.Tensor, torch.Tensor]:
        logits = gpt_logits(model.llm, input_ids=ids)
        return logits, F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))

    logits, loss = loss_of()
    loss.backward()
    group = mpu.get_tensor_model_parallel_group()
    grads = {name: gather_full_gradient(p, group) for name, p in model.named_parameters() if p.requires_grad}
    optimizer = torch.optim.Adam(trainable_parameters(model), lr=1e-2)
    losses = [loss.item()]
    for _ in range(3):
        optimizer.step()
        optimizer.zero_grad()
        _, loss = loss_of()
        loss.backward()
        losses.append(loss.item())
    weights = {name: gather_tensor_parallel(p, group) for name, p in model.named_parameters() if "lora_" in name}
    if dist.get_rank() == 0:
        torch.save({"names": names, "logits": logits.detach(), "losses": losses, "grads": grads, "weights": weights},
                   args.out)  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
