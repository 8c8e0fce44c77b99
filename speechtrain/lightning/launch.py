"""Which process of a launch this is, read from the launcher's environment before any process group exists.

``srun`` sets ``SLURM_PROCID`` / ``SLURM_NTASKS`` / ``SLURM_LOCALID``, torchrun ``RANK`` / ``LOCAL_RANK``, and
Lightning's own launcher ``LOCAL_RANK`` / ``NODE_RANK`` in the processes it starts. The run manager and the
one-off preparations of a job (tokenizer, LM) need to know, before ``trainer.fit`` forms the process group, whether
this process is global rank 0 and which job it belongs to.

What the ranks of one launch must agree on before then (the run folder's name, whether rank 0's one-off build
failed) travels through the launch's own rendezvous store, never through a file that an earlier launch may have
left: torchrun's agent hosts a store at ``MASTER_ADDR:MASTER_PORT`` for the workers of each attempt, and in a launch
that only sets ``RANK`` / ``WORLD_SIZE`` / ``MASTER_*`` global rank 0 starts, at that address, the store that
``init_process_group`` then takes over (see :func:`launch_store`). Under ``srun`` the job's variables name the launch.
"""

import datetime
import itertools
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from speechtrain.lightning.slurm import is_slurm_interactive_mode

_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK")
VERSION_ENV = "SPEECHTRAIN_EXP_VERSION"  # the run folder's version, shared by a job's ranks (exp_manager sets it)
NONCE_ENV = "SPEECHTRAIN_LAUNCH_NONCE"  # this launch's id, inherited by the ranks Lightning's launcher starts later
# What a launch leaves in its processes' environment: the rendezvous and ranks (torchrun, Lightning's launcher),
# Lightning's PL_* settings (its global seed, ...) and the run folder and id shared by the ranks.
LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "LOCAL_WORLD_SIZE", *_RANK_VARIABLES, VERSION_ENV,
                    NONCE_ENV)  # fmt: skip
BUILD_TIMEOUT_ENV = "SPEECHTRAIN_BUILD_TIMEOUT"
FAILED_SUFFIX = ".failed"  # rank 0's build of <target> failed: <target>.failed holds the launch id and the error


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
    ``job<SLURM_JOB_ID>`` under ``srun`` (``.<step>`` for a later step of the same allocation); None otherwise
    (global rank 0 then names the run and hands the name to the others: :func:`shared_name`)."""
    if launched_by_slurm() and os.environ.get("SLURM_JOB_ID"):
        step = os.environ.get("SLURM_STEP_ID", "0")
        return f"job{os.environ['SLURM_JOB_ID']}" + (f".{step}" if step not in ("0", "") else "")
    return None


def _timeout() -> float:
    return float(os.environ.get(BUILD_TIMEOUT_ENV, "3600"))


def _multi_process_launch() -> bool:
    """A launcher started this process as one rank of several (torchrun, or ``RANK`` / ``WORLD_SIZE`` by hand)."""
    return "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1


_STORE: dict[tuple, Any] = {}  # the store of the launch this process belongs to, by its rendezvous
_NONCE: dict[tuple, str] = {}
_NAMES = itertools.count()  # keys of the names handed out through the store, in the order every rank asks for them


def _store_key() -> tuple | None:
    if not _multi_process_launch() or not os.environ.get("MASTER_ADDR") or not os.environ.get("MASTER_PORT"):
        return None
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), agent, attempt,
            os.environ.get("TORCHELASTIC_RUN_ID"), os.environ.get("WORLD_SIZE"))  # fmt: skip


def launch_store() -> Any | None:
    """This launch's key-value store, before any process group exists; None outside a multi-process launch with a
    rendezvous address (a single process; ``srun`` alone, whose job variables name the launch).

    Under torchrun it is the store torchrun's agent hosts at ``MASTER_ADDR:MASTER_PORT`` for the workers (keys
    under this attempt's prefix: a restart after ``--max-restarts`` starts clean, and a new launch has a new
    agent). Otherwise global rank 0 starts it there, multi-tenant, so that ``init_process_group`` (``env://``) on
    rank 0 later serves from the same server rather than binding the port again. The other ranks connect as
    clients (waiting for rank 0 up to ``SPEECHTRAIN_BUILD_TIMEOUT`` seconds); no file system is involved."""
    key = _store_key()
    if key is None:
        return None
    if key not in _STORE:
        from torch.distributed import PrefixStore, TCPStore

        host = not key[2] and env_global_rank() == 0
        store = TCPStore(key[0], key[1], is_master=host, timeout=datetime.timedelta(seconds=_timeout()),
                         wait_for_workers=False, multi_tenant=host)  # fmt: skip
        _STORE.clear()
        _STORE[key] = PrefixStore(f"speechtrain/attempt{key[3]}", store)
    return _STORE[key]


def launch_nonce(wait: bool = True) -> str | None:
    """An id that every process of this launch shares and no other launch (a relaunch, a torchrun restart, a
    requeued SLURM job) has: made by global rank 0 and handed out through :func:`launch_store`, or read from
    SLURM's variables (job, step, requeue count). A single process makes its own (the ranks Lightning's launcher
    starts later inherit it). None where it cannot be known, or, without ``wait``, while rank 0 has not made it."""
    key = _store_key()
    if key is not None:
        if key not in _NONCE:
            store = launch_store()
            if is_global_rank_zero():
                store.set("nonce", uuid.uuid4().hex)
            elif not wait and not store.check(["nonce"]):
                return None
            _NONCE[key] = store.get("nonce").decode()
        return _NONCE[key]
    if launched_by_slurm() and os.environ.get("SLURM_JOB_ID"):
        return ".".join(os.environ.get(name, "0") for name in ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_RESTART_COUNT"))
    if _multi_process_launch():
        return None  # ranks by hand without a rendezvous address: nothing to agree through
    return os.environ.setdefault(NONCE_ENV, uuid.uuid4().hex)


def shared_name(make: Callable[[], str]) -> str:
    """A name every process of this launch agrees on: global rank 0 calls ``make`` and hands the result to the other
    ranks through the launch's store (:func:`launch_store`), fresh for every launch and every torchrun restart, on
    any file system. Outside a multi-process launch with a store, ``make()``."""
    key = f"name{next(_NAMES)}"
    store = launch_store()
    if store is None:
        return make()
    if is_global_rank_zero():
        name = make()
        store.set(key, name)
        return name
    return store.get(key).decode()


def _failure(marker: Path, nonce: str | None) -> str | None:
    """The error in rank 0's failure ``marker`` when it was written in this launch (``nonce``), else None."""
    try:
        written_by, _, message = marker.read_text().partition("\n")
    except OSError:
        return None
    return message.strip() if nonce is not None and written_by == nonce else None


def _reachable_store(seconds: float) -> Any | None:
    """:func:`launch_store` on a rank that is not its host, when the store answers within ``seconds``; else None
    (its host, global rank 0, has exited or has not started yet)."""
    key = _store_key()
    if key in _STORE:
        return _STORE[key]
    from torch.distributed import PrefixStore, TCPStore

    try:
        store = TCPStore(key[0], key[1], is_master=False, timeout=datetime.timedelta(seconds=seconds),
                         wait_for_workers=False)  # fmt: skip
    except (RuntimeError, TimeoutError, OSError):
        return None
    store.set_timeout(datetime.timedelta(seconds=_timeout()))
    _STORE.clear()
    _STORE[key] = PrefixStore(f"speechtrain/attempt{key[3]}", store)
    return _STORE[key]


def _this_launchs_failure(marker: Path) -> str | None:
    """The error in rank 0's failure ``marker`` when this launch's rank 0 wrote it, else None. Told by the launch's
    nonce where rank 0's store answers; where it does not (rank 0 failed and exited before this rank asked, or has
    not started yet), by time: a marker written after this process started is this launch's, an older one an
    earlier launch's (this launch's rank 0 removes that one when it starts)."""
    if _store_key() is not None and _reachable_store(seconds=5) is None:
        import psutil

        try:
            written = marker.stat().st_mtime
        except OSError:
            return None
        if written < psutil.Process().create_time():
            return None
        try:
            return marker.read_text().partition("\n")[2].strip()
        except OSError:
            return None
    return _failure(marker, launch_nonce(wait=False))


def build_on_rank_zero(target: Path, build: Callable[[], None], what: str) -> None:
    """Make ``target`` (a file that appears atomically when complete) once per job: global rank 0 calls ``build``,
    the other ranks wait for the file. A file that exists already is reused. When ``build`` raises, rank 0 writes
    ``<target>.failed`` (this launch's :func:`launch_nonce` and the error) before raising, and the waiting ranks stop
    at once with that error; a marker an earlier launch left is not theirs and is ignored.

    Raises:
        RuntimeError: on a waiting rank, when global rank 0 failed to build ``target``.
        TimeoutError: on a rank that waited ``SPEECHTRAIN_BUILD_TIMEOUT`` seconds (default 3600) in vain.
    """
    if target.is_file():
        return
    marker = target.with_name(target.name + FAILED_SUFFIX)
    if is_global_rank_zero():
        nonce = launch_nonce()  # (handed out before the build: the others need it to read the marker)
        marker.unlink(missing_ok=True)
        try:
            build()
        except BaseException as error:
            try:
                marker.parent.mkdir(parents=True, exist_ok=True)
                tmp = marker.with_name(f"{marker.name}.tmp{os.getpid()}")
                tmp.write_text(f"{nonce}\n{type(error).__name__}: {error}\n")
                os.replace(tmp, marker)
            except OSError:
                pass  # (the others then wait out their timeout)
            raise
        return
    timeout = _timeout()
    deadline = time.monotonic() + timeout
    while not target.is_file():
        if marker.is_file():
            message = _this_launchs_failure(marker)
            if message is not None:
                raise RuntimeError(f"Global rank 0 failed to build {what} ({target}), so global rank "
                                   f"{env_global_rank()} stops too. Rank 0's error: {message}")  # fmt: skip
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"Global rank {env_global_rank()} waited {timeout:.0f} s for global rank 0 to build {what} at "
                f"{target}. Is that folder on a file system all nodes share? ({BUILD_TIMEOUT_ENV} sets the wait.)"
            )
        time.sleep(0.5)
