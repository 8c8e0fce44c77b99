"""Two gloo ranks: the gradient norm and clipping over DDP's whole gradient buffers against Megatron's per-tensor
functions, launched by ``test_lightning_grad_buffers.py``.

    torchrun --nproc_per_node=2 grad_buffer_job.py --tp 1|2 --out result.json

Each rank runs one training step of the toy regressor on its own batch (TP=1: data-parallel ranks; TP=2: one
tensor-parallel pair), then rank 0 writes whether the bridge took the buffers, both norms, and the largest
difference between the gradients clipped both ways.
"""

import argparse
import json
import os
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()

    from megatron.core import parallel_state as mpu
    from megatron.core.optimizer import clip_grads

    from speechtrain.lightning import MegatronOptimizer, MegatronParallel
    from speechtrain.lightning.megatron_compat import cuda_tensor_types, import_megatron, model_parallel_manual_seed
    from speechtrain.testing.toy_models import ToyTransformerRegressor, toy_dataset

    import_megatron()
    mpu.initialize_model_parallel(args.tp, 1)
    model_parallel_manual_seed(0)
    model = ToyTransformerRegressor({"batch_size": 4})
    model.configure_model()
    model.eval()
    frames, targets, lengths = toy_dataset(model.cfg).tensors
    part = slice(4 * rank, 4 * rank + 4)
    engine = MegatronParallel(model, device=torch.device("cpu"))
    optimizer = MegatronOptimizer.build(engine, name="sgd", lr=0.1, momentum=0.0, clip_grad=1e-3)
    optimizer.mcore.zero_grad()
    engine.start_window()
    engine.run((frames[part], targets[part], lengths[part]), forward_only=False)
    optimizer.mcore.prepare_grads()
    norm = float(optimizer._grad_norm())
    reference = float(optimizer.mcore.get_grad_norm())
    params = optimizer.mcore.get_parameters()
    grads = [p.grad.clone() for p in params]
    with cuda_tensor_types():
        clip_grads.clip_grad_by_total_norm_fp32(params, 1e-3, reference)
    expected = [p.grad.clone() for p in params]
    for p, g in zip(params, grads, strict=True):
        p.grad.copy_(g)
    if optimizer.buffers is not None:
        torch._foreach_mul_([b.grad_data for b in optimizer.buffers], 1e-3 / (norm + 1.0e-6))
    clipped = max(float((p.grad - e).abs().max()) for p, e in zip(params, expected, strict=True))
    if rank == 0:
        Path(args.out).write_text(json.dumps({
            "buffers": optimizer.buffers is not None, "norm": norm, "reference": reference, "clipped": clipped,
            "clip_applied": 1e-3 / (reference + 1.0e-6) < 1.0,
        }))  # fmt: skip


if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    main()
