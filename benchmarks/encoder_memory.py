"""Peak memory of one FastConformer training step with and without encoder activation recomputation.

    python benchmarks/encoder_memory.py [--size large] [--batch 2] [--seconds 30]

Each setting runs in a fresh process: build ``model.size`` (CTC, BPE-128-sized output), then one step (features ->
SpecAugment -> encoder -> CTC -> backward -> AdamW) on ``--batch`` utterances of ``--seconds`` s, fp32 on CPU. Memory
is the process's peak resident set (``ru_maxrss``, CPU RAM): the total, and above what the process held just
before the step (weights and all): the step's own peak, activations, gradients and optimizer state.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def measure(size: str, batch: int, seconds: float, recompute: bool) -> dict:
    import torch

    from speechtrain.asr.ctc import ConformerCTCModel

    torch.set_num_threads(2)
    vocab = [chr(0x100 + i) for i in range(128)]
    model = ConformerCTCModel({"tokenizer": {"vocab": vocab}, "size": size,
                               "encoder": {"activation_checkpointing": recompute}})  # fmt: skip
    model.configure_model()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = model.example_batch(batch, seconds)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    log_probs, lengths = model(data["audio"], data["audio_lens"])
    loss = model.ctc_losses(log_probs, lengths, data).sum() / data["token_lens"].sum()
    loss.backward()
    optimizer.step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    params = sum(p.numel() for p in model.parameters())
    return {"params": params, "peak_mib": peak / 1024, "step_mib": (peak - before) / 1024,
            "seconds": time.perf_counter() - start}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="large")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--child", choices=["on", "off"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.size, args.batch, args.seconds, args.child == "on")))
        return
    print(f"| {args.size} FastConformer, {args.batch} x {args.seconds:g} s, fp32 CPU | peak RSS | step's own peak "
          f"(above RSS before the step) | step time |")  # fmt: skip
    print("|---|---|---|---|")
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(ROOT)}
    for setting in ("off", "on"):
        command = [sys.executable, __file__, "--size", args.size, "--batch", str(args.batch), "--seconds",
                   str(args.seconds), "--child", setting]  # fmt: skip
        out = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout.splitlines()[-1]
        row = json.loads(out)
        print(
            f"| activation_checkpointing={setting == 'on'} ({row['params'] / 1e6:.0f}M params) | "
            f"{row['peak_mib']:,.0f} MiB | {row['step_mib']:,.0f} MiB | {row['seconds']:.1f} s |",
            flush=True,
        )


if __name__ == "__main__":
    main()
