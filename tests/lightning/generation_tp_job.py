"""Sampled generation (TTS codes, SALM answers) at TP=2 with a *different* random stream on each tensor-parallel
rank, launched by test_lightning_generation_tp.py with torchrun (gloo). Without the per-step agreement the ranks
would sample different tokens, stop at different steps and one would wait forever in the other's all-reduce. Each
rank writes ``<out>.<rank>``: its TTS codes and steps, and its SALM answers."""

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS), str(TESTS / "tts"), str(TESTS / "speechlm")]

from speechtrain.lightning.megatron_compat import import_megatron, model_parallel_manual_seed  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--manifest", required=True)
    parser.add_argument("--tokenizer", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    import_megatron()
    from megatron.core import parallel_state as mpu

    mpu.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    model_parallel_manual_seed(1)
    rank = dist.get_rank()
    from test_speechlm_model import first_batch, tiny_salm
    from test_tts_model import tiny_tts

    tts = tiny_tts(seed=4).eval()
    result = tts.generate_codes(["hello there", "abc"], temperature=1.5, top_k=None, seed=100 + rank)
    salm = tiny_salm(args.tokenizer, args.manifest, seed=0)
    torch.manual_seed(200 + rank)  # the global stream differs between the ranks too
    generator = torch.Generator().manual_seed(300 + rank)
    answers = salm.generate(first_batch(salm), greedy=False, temperature=2.0, top_k=0, generator=generator)
    torch.save({"codes": result["codes"], "steps": result["steps"], "answers": answers}, f"{args.out}.{rank}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
