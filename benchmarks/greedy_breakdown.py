"""Time of the closing report's per-engine greedy WER (:func:`speechtrain.asr.report.greedy_breakdowns`) on one
process and shared out over data-parallel gloo ranks, for a trained archive and the demo's validation sets.

    python benchmarks/greedy_breakdown.py --model speechtrain_experiments/asr_demo/<run>/asr_demo.stm \
        [--sets builtin:speech/dev builtin:speech/test builtin:speech/heldout_engine] [--ranks 1 2]

Each rank runs one thread (as the demo's two processes do); the table gives wall seconds and utterances per second.
"""

import argparse
import os
import socket
import tempfile
import time
from pathlib import Path


def _rank(rank: int, world: int, port: int, model_path: str, sets: list[str], out: str) -> None:
    import torch

    from speechtrain.asr.ctc import resolve_manifest
    from speechtrain.asr.report import greedy_breakdowns
    from speechtrain.core.model import SpeechModel

    torch.set_num_threads(1)
    if world > 1:
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                             world_size=world)  # fmt: skip
    model = SpeechModel.restore_from(model_path)
    named = [(name.split("/")[-1], Path(resolve_manifest(name))) for name in sets]
    if world > 1:
        torch.distributed.barrier()
    start = time.perf_counter()
    result = greedy_breakdowns(model, named)
    seconds = time.perf_counter() - start
    if rank == 0:
        total = sum(n for groups in result.values() for g, (_, n) in groups.items() if " / " not in g)
        Path(out).write_text(f"{seconds} {total}")
    if world > 1:
        torch.distributed.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    sets = ["builtin:speech/dev", "builtin:speech/test", "builtin:speech/heldout_engine"]
    parser.add_argument("--sets", nargs="+", default=sets)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    print("\n| ranks | utterances | wall (s) | utterances/s |\n|---|---|---|---|")
    for world in args.ranks:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with tempfile.TemporaryDirectory() as folder:
            out = os.path.join(folder, "result")
            mp.spawn(_rank, args=(world, port, args.model, args.sets, out), nprocs=world)
            seconds, total = Path(out).read_text().split()
        print(f"| {world} | {total} | {float(seconds):.1f} | {int(total) / float(seconds):.1f} |", flush=True)


if __name__ == "__main__":
    main()
