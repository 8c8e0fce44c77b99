"""One process of a launch, for the naming and build-failure tests of test_launch_faults.py (started by torchrun, or
by hand with SLURM's or ``RANK`` / ``WORLD_SIZE`` / ``MASTER_*`` variables).

    python launch_job.py name <exp_dir> <out>     exp_manager names the run; writes <out>/attempt<A>-rank<R>.txt
    python launch_job.py build <target> ok|fail   build_on_rank_zero(<target>): rank 0 writes it, or raises

``FAIL_FIRST_ATTEMPT=1`` (name): rank 1 of torchrun's first attempt exits 1 after naming, so that torchrun restarts.
"""

import os
import sys
import time
from pathlib import Path


def name(exp_dir: str, out: str) -> None:
    import lightning.pytorch as pl

    from speechtrain.core.exp_manager import exp_manager
    from speechtrain.lightning.launch import env_global_rank

    world = int(os.environ.get("WORLD_SIZE", "1"))
    trainer = pl.Trainer(accelerator="cpu", devices=world, logger=False, enable_progress_bar=False)
    cfg = {"exp_dir": exp_dir, "create_tensorboard_logger": False, "create_csv_logger": False}
    log_dir = exp_manager(trainer, cfg, name="run")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"attempt{attempt}-rank{env_global_rank()}.txt").write_text(str(log_dir))
    if os.environ.get("FAIL_FIRST_ATTEMPT") and attempt == "0" and env_global_rank() == 1:
        sys.exit(1)


def build(target: str, outcome: str) -> None:
    late = os.environ.get("START_AFTER_FILE")  # a rank slower to start: it begins once this file exists, and 2 s on
    while late and not Path(late).exists():
        time.sleep(0.1)
    time.sleep(2.0 if late else 0.0)
    from speechtrain.lightning.launch import build_on_rank_zero

    def make() -> None:
        time.sleep(1.0)  # the other rank is waiting by then
        if outcome == "fail":
            raise ValueError("injected: no transcripts to train the tokenizer on")
        Path(target).write_text("built")

    build_on_rank_zero(Path(target), make, "the tokenizer")
    print(f"done {Path(target).read_text()}", flush=True)


if __name__ == "__main__":
    {"name": name, "build": build}[sys.argv[1]](*sys.argv[2:])
