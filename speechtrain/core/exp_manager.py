"""The run manager: one folder per run, loggers, checkpoints, resume and the final archive.

``exp_manager(trainer, cfg)`` lays out::

    <exp_dir>/<name>/<version>/
        events.out.tfevents.*   TensorBoard
        metrics.csv             CSV log
        config.yaml             the full job config (when given)
        train.log               everything speechtrain and Lightning logged
        checkpoints/<name>--<monitor>=<value>-epoch=<n>.ckpt   top-k on the monitored metric
        checkpoints/<name>--last.ckpt                            the latest state, for resume
        <name>.stm              the final model archive, written when training ends
"""

import csv
import datetime
import itertools
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment
from omegaconf import DictConfig, OmegaConf

from speechtrain.common.config import env_interpolations, validate_config, with_env_interpolations
from speechtrain.lightning import CallbackGroup, TelemetryCallback, checkpoint, dist_checkpoint
from speechtrain.lightning.ema import EMA, EMAConfig
from speechtrain.lightning.fault_tolerance import PreemptionCallback, was_preempted
from speechtrain.lightning.launch import VERSION_ENV, is_global_rank_zero, job_version, shared_name

logger = logging.getLogger(__name__)

DEFAULT_EXP_DIR = "speechtrain_experiments"


@dataclass
class CheckpointConfig:
    """Checkpoint callback settings (``exp_manager.checkpoint_callback_params``).

    Attributes:
        monitor: metric that ranks checkpoints.
        mode: ``min`` or ``max`` of ``monitor``.
        save_top_k: how many best checkpoints to keep (``-1``: all).
        save_last: also keep ``<name>--last.ckpt``, the resume point.
        every_n_train_steps: save every N optimizer steps (default: after each validation).
        every_n_epochs: save every N epochs.
        filename: file name pattern; ``None`` gives ``<name>--{<monitor>:.4f}-{epoch}``.
    """

    monitor: str = "val_loss"
    mode: str = "min"
    save_top_k: int = 3
    save_last: bool = True
    every_n_train_steps: int | None = None
    every_n_epochs: int | None = None
    filename: str | None = None


@dataclass
class ExpManagerConfig:
    """Run manager settings (the ``exp_manager`` config node).

    Attributes:
        exp_dir: root of all runs (default ``./speechtrain_experiments``).
        name: run name (default: the job config's ``name``).
        version: run version folder (default: a timestamp; reused on resume).
        resume_if_exists: continue the latest run of this name from its last checkpoint.
        resume_ignore_no_checkpoint: with ``resume_if_exists``, start fresh when there is nothing to resume.
        resume_from_checkpoint: resume from this exact checkpoint file.
        create_tensorboard_logger: log to TensorBoard.
        create_csv_logger: log to ``metrics.csv``.
        create_checkpoint_callback: save checkpoints (replaces Lightning's default checkpointing).
        checkpoint_callback_params: see :class:`CheckpointConfig`.
        save_archive_on_train_end: write ``<name>.stm`` when training ends (not when it was preempted).
        create_preemption_callback: on SIGTERM / SIGUSR1, save the ``last`` checkpoint at the next step boundary
            and stop (see :mod:`speechtrain.lightning.fault_tolerance`).
        create_wandb_logger: also log to Weights & Biases (the ``trackers`` extra: ``pip install
            'speechtrain[trackers]'``); ``WANDB_MODE=offline`` works without a network.
        wandb_logger_kwargs: arguments of Lightning's ``WandbLogger`` (``project``, ``name``, ``entity``, ``tags``,
            ``offline``, ``save_dir``, ...); ``name`` defaults to the run name, ``save_dir`` to the run folder.
        create_mlflow_logger: also log to MLflow (the ``trackers`` extra).
        mlflow_logger_kwargs: arguments of Lightning's ``MLFlowLogger`` (``experiment_name``, ``run_name``,
            ``tracking_uri``, ``tags``, ...); ``experiment_name`` defaults to the run name, ``tracking_uri`` to
            ``file:<exp_dir>/mlruns``.
        ema: a moving average of the weights, validated during training and written into the model (and its
            archive) when training completes (see :mod:`speechtrain.lightning.ema`).
    """

    exp_dir: str | None = None
    name: str | None = None
    version: str | None = None
    resume_if_exists: bool = False
    resume_ignore_no_checkpoint: bool = False
    resume_from_checkpoint: str | None = None
    create_tensorboard_logger: bool = True
    create_csv_logger: bool = True
    create_checkpoint_callback: bool = True
    checkpoint_callback_params: CheckpointConfig = field(default_factory=CheckpointConfig)
    save_archive_on_train_end: bool = True
    create_preemption_callback: bool = True
    create_wandb_logger: bool = False
    wandb_logger_kwargs: dict[str, Any] = field(default_factory=dict)
    create_mlflow_logger: bool = False
    mlflow_logger_kwargs: dict[str, Any] = field(default_factory=dict)
    ema: EMAConfig = field(default_factory=EMAConfig)


class SpeechCheckpoint(ModelCheckpoint):
    """Lightning's ``ModelCheckpoint`` that announces saves on the lifecycle bus and writes the final archive.

    Args:
        archive_path: where to write the model archive when training ends (models with ``save_to``), or None.
        **kwargs: ``ModelCheckpoint`` arguments.
    """

    def __init__(self, archive_path: str | Path | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.archive_path = Path(archive_path) if archive_path else None

    def _save_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        group = CallbackGroup.get_instance()
        step = trainer.global_step
        group.on_save_checkpoint_start(global_step=step)
        try:
            super()._save_checkpoint(trainer, filepath)
            group.on_save_checkpoint_success(global_step=step)
        finally:
            group.on_save_checkpoint_end(global_step=step)

    # Lightning 2.6 refreshes "last" only when a top-k checkpoint was written at the same step: a run whose
    # metric stopped improving would resume from an old "last". Here "last" follows every epoch.
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        if self._should_save_on_train_epoch_end(trainer):
            self._refresh_last(trainer)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if not self._should_save_on_train_epoch_end(trainer):
            self._refresh_last(trainer)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, *args, **kwargs)
        # Lightning defers a step checkpoint until the monitored metric exists (the next validation), "last"
        # included: a run killed before then could not resume. Here "last" is written on schedule.
        every = self._every_n_train_steps
        if self._defer_save_until_validation and every >= 1 and trainer.global_step % every == 0:
            self._refresh_last(trainer)

    def _refresh_last(self, trainer: pl.Trainer) -> None:
        if self.save_last and not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        if self.archive_path is not None and hasattr(pl_module, "save_to") and not was_preempted(trainer):
            pl_module.save_to(self.archive_path)
            if trainer.is_global_zero:
                logger.info("Saved the final model archive to %s", self.archive_path)
                for tracker in (lg for lg in trainer.loggers if _is_tracker(lg)):
                    tracker.log_hyperparams({"final_archive": str(self.archive_path)})


class _AppendingCSVWriter(ExperimentWriter):
    """Continues an existing ``metrics.csv`` (a resumed run) where Lightning's writer would delete it."""

    def _check_log_dir_exists(self) -> None:
        if self._fs.isfile(self.metrics_file_path):
            with self._fs.open(self.metrics_file_path, "r", newline="") as handle:
                self.metrics_keys = next(csv.reader(handle), [])


class ResumableCSVLogger(CSVLogger):
    """Lightning's ``CSVLogger``, appending to the run's ``metrics.csv`` when a run is resumed."""

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _AppendingCSVWriter(log_dir=self.log_dir)
        return self._experiment


def _is_tracker(candidate: Any) -> bool:
    """A W&B or MLflow logger (they take the job config and the final archive path as parameters)."""
    return type(candidate).__name__ in ("WandbLogger", "MLFlowLogger")


def tracker_loggers(cfg: ExpManagerConfig, run_root: Path, name: str, version: str, log_dir: Path) -> list[Any]:
    """Lightning's W&B and MLflow loggers that ``cfg`` asks for (NeMo's ``create_wandb_logger`` /
    ``wandb_logger_kwargs``, ``create_mlflow_logger`` / ``mlflow_logger_kwargs``), with run-folder defaults.

    Raises:
        ImportError: a tracker is asked for but its package is not installed (the ``trackers`` extra).
    """
    loggers: list[Any] = []
    if cfg.create_wandb_logger:
        _require("wandb", "create_wandb_logger")
        from lightning.pytorch.loggers import WandbLogger

        kwargs = {k: v for k, v in cfg.wandb_logger_kwargs.items() if v is not None}
        kwargs.setdefault("name", name)
        kwargs.setdefault("save_dir", str(log_dir))
        loggers.append(WandbLogger(**kwargs))
    if cfg.create_mlflow_logger:
        _require("mlflow", "create_mlflow_logger")
        from lightning.pytorch.loggers import MLFlowLogger

        kwargs = {k: v for k, v in cfg.mlflow_logger_kwargs.items() if v is not None}
        kwargs.setdefault("experiment_name", name)
        kwargs.setdefault("run_name", version)
        kwargs.setdefault("tracking_uri", (run_root.parent / "mlruns").as_uri())
        if str(kwargs["tracking_uri"]).startswith("file:"):
            # MLflow 3 keeps its file store for compatibility only; it needs neither a server nor a database (the
            # sqlite store would add SQLAlchemy), which is what a local default should need.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        loggers.append(MLFlowLogger(**kwargs))
    return loggers


def _require(module: str, key: str) -> None:
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise ImportError(f"exp_manager.{key}=true needs the {module} package: pip install 'speechtrain[trackers]'.")


def _new_version(run_root: Path) -> str:
    """A timestamp folder under ``run_root``, created here: ``mkdir`` without ``exist_ok``, the next suffix
    (``_1``, ``_2``, ...) when the name is taken, so that two runs started in the same second get two folders."""
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    _remember_new_folder(run_root / stamp)  # the topmost folder this creates (removed if the job fails at start)
    created = list(_NEW_RUN_FOLDER)
    run_root.mkdir(parents=True, exist_ok=True)
    for count in itertools.count():
        version = f"{stamp}_{count}" if count else stamp
        try:
            (run_root / version).mkdir()
        except FileExistsError:
            continue
        if not created or created[0] == run_root / stamp:
            created = [run_root / version]
        _NEW_RUN_FOLDER[:] = created
        return version
    raise AssertionError("unreachable")


def _has_checkpoints(folder: Path) -> bool:
    return folder.is_dir() and any(p.name.endswith((".ckpt", ".ckpt.partial", ".ckpt.old")) for p in folder.iterdir())


def _resumed_run(run_root: Path, version: str | None) -> Path | None:
    """The run folder being resumed: ``version`` when given, else the version whose checkpoints were written last
    (each save renames a file into its ``checkpoints`` folder)."""
    if version is not None:
        return run_root / version if _has_checkpoints(run_root / version / "checkpoints") else None
    runs = [d for d in run_root.iterdir() if _has_checkpoints(d / "checkpoints")] if run_root.is_dir() else []
    return max(runs, key=lambda d: ((d / "checkpoints").stat().st_mtime_ns, d.name)) if runs else None


def find_last_checkpoint(run_root: Path, version: str | None = None, set_aside: bool = False) -> Path | None:
    """The checkpoint to resume from, looked for in the run being resumed only (see :func:`_resumed_run`): its
    ``*last.ckpt`` when it passes the integrity check, else the newest of its other checkpoints that does, with a
    warning naming the one skipped and why. None when the run has no checkpoint. With ``set_aside`` (global rank 0
    of the resuming run), a file that fails the check is renamed to ``<name>.corrupt``: kept for a look, and out of
    the way of the run's next ``last`` checkpoint.

    Raises:
        ValueError: the run has checkpoints, but none of them is readable.
    """
    run = _resumed_run(run_root, version)
    if run is None:
        return None
    folder = run / "checkpoints"
    names = {p.name.removesuffix(checkpoint.PARTIAL).removesuffix(checkpoint.OLD) for p in folder.iterdir()}
    paths = [p for name in names if name.endswith(".ckpt") for p in checkpoint.checkpoint_candidates(folder / name)]
    # ``*last.ckpt`` first (the latest state), then the others, newest first.
    paths.sort(key=lambda p: (not p.name.partition(".ckpt")[0].endswith("last"), -p.stat().st_mtime_ns, p.name))
    refused = []
    for path in paths:
        try:
            if path.is_file():
                checkpoint.verify_file(path)
            elif dist_checkpoint.is_dist_checkpoint(path):  # a torch_dist folder: its hashes and run state
                dist_checkpoint.verify(path)
        except (ValueError, OSError) as error:  # (OSError: set aside by rank 0 meanwhile)
            refused.append(f"{path.name}: {error}")
            if set_aside and isinstance(error, ValueError):
                os.replace(path, path.with_name(path.name + ".corrupt"))
                refused[-1] += f" (moved to {path.name}.corrupt)"
            continue
        if refused:
            logger.warning("Not resuming from %s; resuming from the previous good checkpoint %s instead.",
                           "; ".join(refused), path)  # fmt: skip
        return path
    raise ValueError(f"No readable checkpoint in {folder} to resume from: {'; '.join(refused) or 'none found'}.")


def exp_manager(
    trainer: pl.Trainer,
    cfg: ExpManagerConfig | DictConfig | dict | None = None,
    name: str = "default",
    job_config: DictConfig | dict | None = None,
) -> Path:
    """Set up the run folder, loggers, checkpointing and resume for ``trainer``; return the run folder.

    Args:
        trainer: the trainer, before ``fit``.
        cfg: an ``exp_manager`` config node (see :class:`ExpManagerConfig`).
        name: run name when ``cfg.name`` is unset.
        job_config: the whole job config, saved as ``config.yaml`` in the run folder.

    Raises:
        FileNotFoundError: ``resume_if_exists`` found no checkpoint and ``resume_ignore_no_checkpoint`` is off,
            or ``resume_from_checkpoint`` does not exist.
    """
    if not isinstance(cfg, ExpManagerConfig):
        cfg = OmegaConf.to_object(validate_config(cfg or {}, ExpManagerConfig))
    name = cfg.name or name
    run_root = Path(cfg.exp_dir or DEFAULT_EXP_DIR).expanduser().resolve() / name

    resume_path = None
    version = cfg.version
    if cfg.resume_from_checkpoint:
        resume_path = Path(cfg.resume_from_checkpoint)
        if not resume_path.exists():
            raise FileNotFoundError(f"exp_manager.resume_from_checkpoint: no checkpoint at {resume_path}.")
    elif cfg.resume_if_exists:
        resume_path = find_last_checkpoint(run_root, cfg.version, set_aside=is_global_rank_zero())
        if resume_path is None and not cfg.resume_ignore_no_checkpoint:
            raise FileNotFoundError(
                f"exp_manager.resume_if_exists=true, but there is no checkpoint under {run_root}/*/checkpoints. "
                "Set exp_manager.resume_ignore_no_checkpoint=true to start a new run in that case."
            )
        if resume_path is not None:
            version = resume_path.parent.parent.name
    made_here = False  # this process created the run folder (_new_version)
    if version is None:
        # Ranks that Lightning launches later re-run the script and inherit VERSION_ENV; ranks that srun starts
        # derive the same name from the job.
        inherited = None if is_global_rank_zero() else os.environ.get(VERSION_ENV)
        version = inherited or job_version()
        if version is None:
            # Global rank 0 creates the folder and hands its name to the other ranks through the launch's store.
            version = shared_name(lambda: _new_version(run_root))
            made_here = is_global_rank_zero()
            if made_here:
                os.environ[VERSION_ENV] = version
    log_dir = run_root / version
    if not made_here:
        _remember_new_folder(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    if is_global_rank_zero():
        _attach_file_log(log_dir / "train.log")
        leftovers = list(log_dir.glob(f".{name}.stm.*.tmp"))  # an archive write that was killed (write_archive)
        for leftover in leftovers:
            leftover.unlink(missing_ok=True)
        if (log_dir / "checkpoints").is_dir():
            leftovers += checkpoint.clean_leftovers(log_dir / "checkpoints")
        for leftover in leftovers:
            logger.info("Removed %s, left by a save that was interrupted.", leftover)

    loggers: list = []
    if cfg.create_tensorboard_logger:
        loggers.append(TensorBoardLogger(save_dir=run_root.parent, name=name, version=version))
    if cfg.create_csv_logger:
        loggers.append(ResumableCSVLogger(save_dir=run_root.parent, name=name, version=version))
    loggers += tracker_loggers(cfg, run_root, name, version, log_dir)
    trainer.loggers = loggers
    trainer._default_root_dir = str(log_dir)
    for callback in CallbackGroup.get_instance().callbacks:
        if isinstance(callback, TelemetryCallback):
            callback.set_output_dir(log_dir, trainer)  # telemetry.jsonl in the run folder (global rank 0)

    if cfg.create_checkpoint_callback:
        params = cfg.checkpoint_callback_params
        callback = SpeechCheckpoint(
            archive_path=log_dir / f"{name}.stm" if cfg.save_archive_on_train_end else None,
            dirpath=log_dir / "checkpoints",
            filename=params.filename or f"{name}--{{{params.monitor}:.4f}}-{{epoch}}",
            monitor=params.monitor,
            mode=params.mode,
            save_top_k=params.save_top_k,
            save_last=params.save_last,
            every_n_train_steps=params.every_n_train_steps,
            every_n_epochs=params.every_n_epochs,
        )
        callback.CHECKPOINT_NAME_LAST = f"{name}--last"
        trainer.callbacks[:] = [cb for cb in trainer.callbacks if not isinstance(cb, ModelCheckpoint)] + [callback]

    if cfg.ema.enable and not any(isinstance(cb, EMA) for cb in trainer.callbacks):
        # Ahead of the checkpoint callback: the average is swapped out again before a checkpoint is written, and
        # written into the model before the final archive is.
        first_checkpoint = next((i for i, cb in enumerate(trainer.callbacks) if isinstance(cb, ModelCheckpoint)),
                                len(trainer.callbacks))  # fmt: skip
        ema = cfg.ema
        trainer.callbacks.insert(first_checkpoint, EMA(ema.decay, ema.every_n_steps, ema.validate_original_weights))

    if cfg.create_preemption_callback and not any(isinstance(cb, PreemptionCallback) for cb in trainer.callbacks):
        trainer.callbacks.append(PreemptionCallback())

    if resume_path is not None:
        trainer.ckpt_path = str(resume_path)
        logger.info("Resuming from %s", resume_path)
    if job_config is not None and trainer.is_global_zero:
        config = job_config if isinstance(job_config, DictConfig) else OmegaConf.create(job_config)
        (log_dir / "config.yaml").write_text(OmegaConf.to_yaml(config))
        for tracker in (lg for lg in loggers if _is_tracker(lg)):
            # values read from the environment (API keys, data roots) go to trackers as their text
            tracker.log_hyperparams(
                with_env_interpolations(OmegaConf.to_container(config, resolve=True), env_interpolations(config))
            )
    logger.info("Run folder: %s", log_dir)
    return log_dir


_NEW_RUN_FOLDER: list[Path] = []  # the topmost folder this process created for its run folder, if any


def _remember_new_folder(log_dir: Path) -> None:
    _NEW_RUN_FOLDER.clear()
    if log_dir.exists() or not is_global_rank_zero():
        return
    top = log_dir
    while not top.parent.exists():
        top = top.parent
    _NEW_RUN_FOLDER.append(top)


def forget_new_run_folder() -> None:
    """Start of a job: a run folder an earlier job of this process created is never this job's to remove."""
    _NEW_RUN_FOLDER.clear()


def discard_new_run_folder() -> Path | None:
    """Remove the run folder this process created (with the parents it created) when it holds no checkpoint and
    no archive: a job stopped by a config or data error at start leaves nothing behind. Returns the removed
    folder, or None (nothing created here, another rank, or a checkpoint exists)."""
    if not _NEW_RUN_FOLDER or not _NEW_RUN_FOLDER[0].exists():
        return None
    top = _NEW_RUN_FOLDER[0]
    if any(p.suffix in (".ckpt", ".stm") for p in top.rglob("*")):
        return None
    _detach_file_log()
    shutil.rmtree(top, ignore_errors=True)
    _NEW_RUN_FOLDER.clear()
    return top


def log_to_run_file(level: int, message: str) -> None:
    """Write ``message`` to the run's ``train.log`` only (not the console), e.g. the error that ended a run or the
    closing summary printed on stdout."""
    target = logging.getLogger("speechtrain")
    record = target.makeRecord(target.name, level, __file__, 0, message, (), None)
    for handler in target.handlers:
        if getattr(handler, "speechtrain_run_log", False):
            handler.handle(record)


def print_final(line: str) -> None:
    """Print a run's closing ``Final: ...`` line on stdout and keep it in the run's ``train.log``."""
    print(f"\n{line}", flush=True)
    log_to_run_file(logging.INFO, line)


def _detach_file_log() -> None:
    for name in ("speechtrain", "lightning.pytorch"):
        target = logging.getLogger(name)
        for old in [h for h in target.handlers if getattr(h, "speechtrain_run_log", False)]:
            target.removeHandler(old)
            old.close()


def _attach_file_log(path: Path) -> None:
    """Send speechtrain's and Lightning's log records to ``path`` too (replacing an earlier run's file)."""
    for name in ("speechtrain", "lightning.pytorch"):
        target = logging.getLogger(name)
        for old in [h for h in target.handlers if getattr(h, "speechtrain_run_log", False)]:
            target.removeHandler(old)
            old.close()
        handler = logging.FileHandler(path)
        handler.speechtrain_run_log = True
        handler.setFormatter(logging.Formatter("[%(asctime)s %(levelname)s %(name)s] %(message)s"))
        target.addHandler(handler)
        if target.level == logging.NOTSET or target.level > logging.INFO:
            target.setLevel(logging.INFO)
