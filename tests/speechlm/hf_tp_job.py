"""Import a Hugging Face Llama / Qwen2 / Qwen3 folder into Megatron's GPT under tensor parallelism, compute logits
and export it back; launched by test_speechlm_hf.py with torchrun (TP=2, gloo). For the i-th ``--hf`` folder rank 0
writes ``<out>/<i>.pt``, the logits of ``--ids`` (a saved (B, T) tensor); every rank takes part in the export to
``<out>/<i>.hf``."""

import argparse
import os

import torch
import torch.distributed as dist

from speechtrain.lightning.megatron_compat import import_megatron, model_parallel_manual_seed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf", required=True, nargs="+")
    parser.add_argument("--ids", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    import_megatron()
    from megatron.core import parallel_state as mpu

    mpu.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    model_parallel_manual_seed(1)

    from speechtrain.speechlm.backbone import gpt_logits
    from speechtrain.speechlm.hf import export_hf, import_hf

    for i, folder in enumerate(args.hf):
        model, cfg = import_hf(folder)
        with torch.no_grad():
            logits = gpt_logits(model.eval(), input_ids=torch.load(args.ids))
        export_hf(model, cfg, os.path.join(args.out, f"{i}.hf"), tokenizer_dir=folder)
        if dist.get_rank() == 0:
            torch.save(logits, os.path.join(args.out, f"{i}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
