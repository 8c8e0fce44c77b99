"""Two ranks save a checkpoint; rank 0's write fails for real (its RLIMIT_FSIZE lowered: EFBIG). Each rank writes
what it raised to ``<out>/rank<r>.txt``.

    torchrun --nproc_per_node=2 save_failure_job.py --out DIR [--tp 2]
"""

import argparse
import os
import resource
import signal
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--tp", type=int, default=1)
    args = parser.parse_args()
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    from megatron.core import parallel_state as mpu

    from speechtrain.lightning import checkpoint
    from speechtrain.lightning.megatron_compat import import_megatron, use_device

    import_megatron()
    use_device("cpu")
    mpu.initialize_model_parallel(args.tp, 1)
    if rank == 0:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
    state = {"state_dict": {"w": torch.randn(64, 1024)}, "global_step": 3}
    try:
        checkpoint.save_checkpoint(state, Path(args.out) / "last.ckpt")
        outcome = "saved"
    except OSError as error:
        outcome = f"{type(error).__name__}: {error}"
    (Path(args.out) / f"rank{rank}.txt").write_text(outcome)


if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    main()
