"""Which process of a launch this is, read from the launcher's environment before any process group exists.

``srun`` sets ``SLURM_PROCID`` / ``SLURM_NTASKS`` / ``SLURM_LOCALID``, torchrun ``RANK`` / ``LOCAL_RANK``, and
Lightning's own launcher ``LOCAL_RANK`` / ``NODE_RANK`` in the processes it starts. The run manager and the
one-off preparations of a job (tokenizer, LM) need to know, before ``trainer.fit`` forms the process group, whether
this process is global rank 0 and which job it belongs to.
"""

import os
import time
from collections.abc import Callable
from pathlib import Path

from speechtrain.lightning.slurm import is_slurm_interactive_mode

_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK")
VERSION_ENV = "SPEECHTRAIN_EXP_VERSION"  # the run folder's version, shared by a job's ranks (exp_manager sets it)
# What a launch leaves in its processes' environment: the rendezvous and ranks (torchrun, Lightning's launcher),
# Lightning's PL_* settings (its global seed, ...) and the run folder shared by the ranks.
LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "LOCAL_WORLD_SIZE", *_RANK_VARIABLES, VERSION_ENV)
BUILD_TIMEOUT_ENV = "SPEECHTRAIN_BUILD_TIMEOUT"


def fresh_launch_env(**extra: str) -> dict[str, str]:
    """This process's environment for starting a new, independent multi-process run (``torchrun``, a training
    script that launches its own ranks), plus ``extra``: without what an earlier run in this process left
    (:data:`LAUNCH_VARIABLES` and ``PL_*``). Inherited, they would join the new run to the old rendezvous, whose port
    may still be held, or give it the old run's ranks, seed or run folder."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES and not k.startswith("PL_")}
    env.update(extra)
    return env


def launched_by_slurm() -> bool:
    """This process is one task of an ``srun`` / ``sbatch`` launch (not an interactive allocation's shell)."""
    return "SLURM_PROCID" in os.environ and "SLURM_NTASKS" in os.environ and not is_slurm_interactive_mode()


def env_global_rank() -> int:
    """This process's global rank as the launcher set it (0 when nothing says otherwise)."""
    if "RANK" in os.environ:
        return int(os.environ["RANK"])
    if launched_by_slurm():
        return int(os.environ["SLURM_PROCID"])
    return 0


def is_global_rank_zero() -> bool:
    """Global rank 0 of the launch: every rank variable the launcher set is 0 (or absent)."""
    if env_global_rank() != 0:
        return False
    return all(os.environ.get(name, "0") == "0" for name in _RANK_VARIABLES)


def job_version() -> str | None:
    """A run-folder version every process of this launch computes alike, without talking to the others:
    ``job<SLURM_JOB_ID>`` under ``srun`` (``.<step>`` for a later step of the same allocation), the rendezvous id
    under torchrun when one was given; None otherwise."""
    if launched_by_slurm() and os.environ.get("SLURM_JOB_ID"):
        step = os.environ.get("SLURM_STEP_ID", "0")
        return f"job{os.environ['SLURM_JOB_ID']}" + (f".{step}" if step not in ("0", "") else "")
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    if "RANK" in os.environ and run_id not in ("", "none"):
        return f"run-{run_id}"
    return None


def build_on_rank_zero(target: Path, build: Callable[[], None], what: str) -> None:
    """Make ``target`` (a file that appears atomically when complete) once per job: global rank 0 calls ``build``,
    the other ranks wait for the file. A file that exists already is reused.

    Raises:
        TimeoutError: on a rank that waited ``SPEECHTRAIN_BUILD_TIMEOUT`` seconds (default 3600) in vain.
    """
    if target.is_file():
        return
    if is_global_rank_zero():
        build()
        return
    timeout = float(os.environ.get(BUILD_TIMEOUT_ENV, "3600"))
    deadline = time.monotonic() + timeout
    while not target.is_file():
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"Global rank {env_global_rank()} waited {timeout:.0f} s for global rank 0 to build {what} at "
                f"{target}. Is that folder on a file system all nodes share? ({BUILD_TIMEOUT_ENV} sets the wait.)"
            )
        time.sleep(0.5)


def shared_name(folder: Path, make: Callable[[], str], stale_s: float = 120.0) -> str:
    """A name that every process of a torchrun launch without a rendezvous id agrees on: global rank 0 calls
    ``make`` and publishes the result in ``folder`` (a file keyed by the rendezvous address); the other ranks read
    it. Outside such a launch, ``make()``. A published file older than ``stale_s`` seconds belongs to an earlier
    launch and is waited past."""
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return make()
    key = f"{os.environ.get('MASTER_ADDR', 'localhost')}-{os.environ.get('MASTER_PORT', '0')}"
    published = folder / f".launch-{key}"
    if is_global_rank_zero():
        name = make()
        folder.mkdir(parents=True, exist_ok=True)
        tmp = published.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(name)
        os.replace(tmp, published)
        return name
    deadline = time.monotonic() + float(os.environ.get(BUILD_TIMEOUT_ENV, "3600"))
    while time.monotonic() < deadline:
        if published.is_file() and time.time() - published.stat().st_mtime < stale_s:
            return published.read_text().strip()
        time.sleep(0.2)
    raise TimeoutError(f"Global rank {env_global_rank()} waited for global rank 0 to name the run in {published}.")
