"""Training telemetry: the run's shape, its lifecycle and its throughput, written where a person can read it.

:class:`TelemetryCallback` is registered by default in the :class:`~speechtrain.lightning.CallbackGroup` (set
``SPEECHTRAIN_TELEMETRY=0`` to leave it out). It is a process-wide singleton that initialises once, and it records
on exactly one process, global rank 0: the rank comes from ``RANK``, else ``SLURM_PROCID``, else an initialised
``torch.distributed``, else the trainer; until one of them answers, records are held back, and a process that
turns out not to be rank 0 drops them.

What it records (one JSON object per line in ``<run folder>/telemetry.jsonl``; see :meth:`TelemetryCallback.records`):

- ``config`` once ``fit`` starts (:func:`infer_config`): session tag, world and data-parallel sizes, global and
  micro batch size, sequence length (the encoder width, as NeMo's telemetry fills it), iteration and sample
  targets, log interval, whether validation and checkpointing are on, the checkpoint strategy and a perf tag.
- lifecycle events with wall-clock timestamps; every ``*_end`` carries the duration since its ``*_start``.
- ``train_interval`` every ``log_every_n_steps`` optimizer steps: iteration time, samples, audio-seconds and
  tokens per second (all data-parallel ranks, estimated as rank 0's batches x the DP size), the padding share of
  the batches, the measured global batch and mean input frames per sample, model TFLOP/s and MFU when the model
  states its FLOPs and the peak is known (``SPEECHTRAIN_PEAK_TFLOPS``, or a table of GPUs), and on a GPU the peak
  memory PyTorch's allocator has held for tensors since the run started (``gpu_max_memory_gib``; a host-side
  counter, no device sync). A model states its FLOPs with ``flops_per_batch(batch)``; telemetry calls it once per
  interval with ``{"audio_lens": <every utterance of the interval>}``, so the count
  must be a sum over utterances (Conformer-CTC's is).

The same interval figures go to the trainer's Lightning loggers (TensorBoard, CSV) under ``telemetry/``, and
everything goes to NVIDIA's OneLogger (``nv-one-logger-training-telemetry``) when that package is installed.
Telemetry never stops a run: an exporter that fails is reported once in the log and switched off.
"""

import json
import logging
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from speechtrain.lightning.base_callback import BaseCallback

logger = logging.getLogger(__name__)

DEFAULT_SESSION_TAG = "speechtrain"
TELEMETRY_FILE = "telemetry.jsonl"
DISABLE_ENV = "SPEECHTRAIN_TELEMETRY"
PEAK_TFLOPS_ENV = "SPEECHTRAIN_PEAK_TFLOPS"
# Dense bf16 tensor-core peaks (TFLOP/s per device) of the GPUs our users train on.
GPU_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}

_PAIRED = ("app", "model_init", "dataloader_init", "optimizer_init", "load_checkpoint", "save_checkpoint")


def telemetry_enabled_by_env() -> bool:
    """False when ``SPEECHTRAIN_TELEMETRY`` is ``0``, ``false``, ``off`` or ``no``."""
    return os.environ.get(DISABLE_ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def global_rank(trainer: Any = None) -> int | None:
    """This process's global rank: ``RANK``, else ``SLURM_PROCID``, else ``torch.distributed``, else ``trainer``.

    None when nothing knows yet (a single process before its trainer exists).
    """
    for var in ("RANK", "SLURM_PROCID"):
        value = os.environ.get(var, "").strip()
        if value:
            try:
                return int(value)
            except ValueError:
                logger.debug("Ignoring %s=%r: not an integer.", var, value)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    if trainer is not None:
        rank = getattr(trainer, "global_rank", None)
        if isinstance(rank, int):
            return rank
    return None


def session_tag() -> str:
    """``EXP_NAME``, else ``SLURM_JOB_NAME``, else ``speechtrain``."""
    return os.environ.get("EXP_NAME") or os.environ.get("SLURM_JOB_NAME") or DEFAULT_SESSION_TAG


def _get(node: Any, key: str) -> Any:
    """``node[key]`` / ``node.key`` for dicts, OmegaConf nodes and objects; None when absent."""
    if node is None:
        return None
    if isinstance(node, dict):
        return node.get(key)
    try:
        return node.get(key)  # DictConfig (and anything dict-like)
    except (AttributeError, TypeError):
        return getattr(node, key, None)
    except Exception:  # an OmegaConf node with a missing mandatory value
        return None


def _positive_int(value: Any) -> int | None:
    try:
        number = int(value)
    except (TypeError, ValueError):
        return None
    return number if number > 0 else None


def per_rank_batch_size(train_ds: Any) -> tuple[int | None, str]:
    """(samples per data-parallel rank and step, how batches are formed) from a ``train_ds`` config node.

    With bucketing and ``bucket_batch_size`` the mean of the bucket sizes (as an int), else ``batch_size``; a
    duration-bounded (``batch_duration``) loader has no fixed count: None. Null or missing keys are skipped.
    """
    buckets = _get(train_ds, "bucket_batch_size")
    if buckets is not None and _get(train_ds, "use_bucketing") is not False:
        sizes = [size for size in (_positive_int(b) for b in buckets) if size]
        if sizes:
            return int(statistics.mean(sizes)), "bucket_batch_size"
    size = _positive_int(_get(train_ds, "batch_size"))
    if size:
        return size, "batch_size"
    return None, "batch_duration" if _get(train_ds, "batch_duration") else "unknown"


def parallel_sizes(trainer: Any) -> tuple[int, int, int, int]:
    """(world size, tensor-parallel, pipeline-parallel, data-parallel) sizes of the run."""
    world = _positive_int(getattr(trainer, "world_size", None)) or _positive_int(os.environ.get("WORLD_SIZE")) or 1
    strategy = getattr(trainer, "strategy", None)
    tp = _positive_int(getattr(strategy, "tensor_model_parallel_size", None)) or 1
    pp = _positive_int(getattr(strategy, "pipeline_model_parallel_size", None)) or 1
    return world, tp, pp, max(1, world // (tp * pp))


def sequence_length(model: Any) -> int | None:
    """The encoder width ``d_model`` (what NeMo's telemetry reports as the sequence length), if the model has one."""
    for owner in (getattr(model, "encoder", None), model):
        width = _positive_int(getattr(owner, "d_model", None))
        if width:
            return width
    cfg = getattr(model, "cfg", None)
    for node in (_get(cfg, "encoder"), cfg):
        for key in ("d_model", "hidden_size"):
            width = _positive_int(_get(node, key))
            if width:
                return width
    return None


def infer_config(trainer: Any, model: Any = None) -> dict[str, Any]:
    """The run's shape as a flat dict (the ``config`` record); every rule tolerates missing or null keys."""
    world, tp, pp, dp = parallel_sizes(trainer)
    per_rank, batching = per_rank_batch_size(_get(getattr(model, "cfg", None), "train_ds"))
    accumulate = _positive_int(getattr(trainer, "accumulate_grad_batches", None)) or 1
    global_batch = per_rank * dp * accumulate if per_rank else None  # samples per optimizer step
    strategy = getattr(trainer, "strategy", None)
    micro = _positive_int(getattr(strategy, "micro_batch_size", None)) or per_rank
    seq = sequence_length(model)
    max_steps = _positive_int(getattr(trainer, "max_steps", None))
    checkpoint_callbacks = list(getattr(trainer, "checkpoint_callbacks", None) or [])
    asynchronous = bool(getattr(strategy, "async_save", False)) or any(
        getattr(cb, "async_save", False) for cb in checkpoint_callbacks
    )
    val_interval = getattr(trainer, "val_check_interval", None)
    limit_val = getattr(trainer, "limit_val_batches", 1.0)
    validation = bool(val_interval) and bool(limit_val)  # check_val_every_n_epoch=None: by steps, still on
    val_manifests = _get(_get(getattr(model, "cfg", None), "validation_ds"), "manifest_filepath")
    if _get(getattr(model, "cfg", None), "validation_ds") is not None and not val_manifests:
        validation = False
    tag = session_tag()
    version = os.environ.get("PERF_VERSION_TAG") or "0.0.0"
    return {
        "session_tag": tag,
        "world_size": world,
        "tensor_parallel_size": tp,
        "pipeline_parallel_size": pp,
        "data_parallel_size": dp,
        "batching": batching,
        "global_batch_size": global_batch,
        "micro_batch_size": micro,
        "seq_length": seq,
        "train_iterations_target": max_steps,
        "train_samples_target": max_steps * global_batch if max_steps and global_batch else None,
        "log_every_n_steps": getattr(trainer, "log_every_n_steps", None),
        "validation_enabled": validation,
        "checkpointing_enabled": bool(checkpoint_callbacks),
        "checkpoint_strategy": "async" if asynchronous else "sync",
        "perf_tag": f"{tag}_{version}_bf{global_batch or 0}_se{seq or 0}_ws{world}",
    }


def batch_piece(batch: Any) -> tuple[int, Any, int, Any] | None:
    """What the interval statistics need from one batch: (samples, audio lengths, padded length, token lengths).

    Only small tensors are kept (never the audio), and nothing is summed here: a host-side sum at every step would
    synchronise a GPU. Batches that are not dicts count their samples from the first tensor.
    """
    if not isinstance(batch, dict):
        first = batch[0] if isinstance(batch, list | tuple) and batch else batch
        return (int(first.shape[0]), None, 0, None) if isinstance(first, torch.Tensor) and first.dim() else None
    lens, tokens, audio = batch.get("audio_lens"), batch.get("token_lens"), batch.get("audio")
    lens = lens.detach() if isinstance(lens, torch.Tensor) and lens.dim() == 1 else None
    tokens = tokens.detach() if isinstance(tokens, torch.Tensor) and tokens.dim() == 1 else None
    anchor = lens if lens is not None else tokens
    if anchor is None:
        return None
    padded = int(audio.shape[-1]) if isinstance(audio, torch.Tensor) and lens is not None else 0
    return int(anchor.shape[0]), lens, padded, tokens


def peak_tflops() -> float | None:
    """Peak TFLOP/s of one device: ``SPEECHTRAIN_PEAK_TFLOPS``, else the GPU table; None on CPU."""
    value = os.environ.get(PEAK_TFLOPS_ENV)
    if value:
        try:
            return float(value)
        except ValueError:
            logger.warning("Ignoring %s=%r: not a number.", PEAK_TFLOPS_ENV, value)
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        for key, peak in GPU_PEAK_TFLOPS.items():
            if key in name:
                return peak
    return None


class JsonlExporter:
    """Appends each record as one JSON line to ``path`` (flushed, so a killed run keeps what it wrote)."""

    name = "jsonl"

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")

    def export(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, default=str) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class LightningLoggerExporter:
    """Sends the numeric fields of ``train_interval`` records to the trainer's loggers under ``telemetry/``."""

    name = "lightning_loggers"

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def export(self, record: dict[str, Any]) -> None:
        if record.get("event") != "train_interval":
            return
        metrics = {
            f"telemetry/{key}": float(value)
            for key, value in record.items()
            if isinstance(value, int | float) and not isinstance(value, bool) and key not in ("step", "time", "t")
        }
        for lightning_logger in getattr(self.trainer, "loggers", None) or []:
            lightning_logger.log_metrics(metrics, step=record.get("step"))

    def close(self) -> None:
        """Nothing to release."""


class OneLoggerExporter:
    """Forwards lifecycle events and the inferred config to NVIDIA OneLogger (``nv_one_logger``, 2.x API).

    Configures OneLogger's provider with our session tag and world size unless the job configured it already
    (with its own exporters). Events held back before the config was known are replayed with their timestamps.
    """

    name = "one_logger"

    def __init__(self, config: dict[str, Any]) -> None:
        from nv_one_logger.api.config import OneLoggerConfig
        from nv_one_logger.training_telemetry.api import callbacks
        from nv_one_logger.training_telemetry.api.checkpoint import CheckPointStrategy
        from nv_one_logger.training_telemetry.api.config import TrainingTelemetryConfig
        from nv_one_logger.training_telemetry.api.training_telemetry_provider import TrainingTelemetryProvider

        self._callbacks = callbacks
        provider = TrainingTelemetryProvider.instance()
        if not provider.one_logger_ready:
            provider.with_base_config(
                OneLoggerConfig(
                    application_name="speechtrain",
                    world_size_or_fn=config["world_size"],
                    session_tag_or_fn=config["session_tag"],
                )
            ).configure_provider()
        self._provider = provider
        self._telemetry_config = TrainingTelemetryConfig(
            perf_tag_or_fn=config["perf_tag"],
            global_batch_size_or_fn=config["global_batch_size"] or 0,
            micro_batch_size_or_fn=config["micro_batch_size"],
            seq_length_or_fn=config["seq_length"],
            train_iterations_target_or_fn=config["train_iterations_target"],
            train_samples_target_or_fn=config["train_samples_target"],
            log_every_n_train_iterations=config["log_every_n_steps"] or 50,
            is_validation_iterations_enabled_or_fn=config["validation_enabled"],
            is_save_checkpoint_enabled_or_fn=config["checkpointing_enabled"],
            save_checkpoint_strategy=(
                CheckPointStrategy.ASYNC if config["checkpoint_strategy"] == "async" else CheckPointStrategy.SYNC
            ),
        )
        self._config_sent = False

    def export(self, record: dict[str, Any]) -> None:
        event = record.get("event")
        if event in (None, "config", "train_interval"):
            return
        method = getattr(self._callbacks, f"on_{event}", None)
        if method is None:
            return
        msec = record["time"] * 1000.0
        if event == "save_checkpoint_start":
            method(global_step=record.get("global_step") or 0, start_time_msec=msec)
        elif event == "save_checkpoint_success":
            method(global_step=record.get("global_step") or 0, time_msec=msec)
        elif event.endswith("_start"):
            method(start_time_msec=msec)
        else:
            method(finish_time_msec=msec)
        if event == "app_start" and not self._config_sent:
            self._provider.set_training_telemetry_config(self._telemetry_config)
            self._config_sent = True

    def close(self) -> None:
        """Nothing to release (OneLogger flushes on ``app_end``)."""


def one_logger_available() -> bool:
    """Whether NVIDIA's OneLogger training telemetry is importable."""
    try:
        import nv_one_logger.training_telemetry.api.callbacks  # noqa: F401
    except Exception:
        return False
    return True


class TelemetryCallback(BaseCallback):
    """Records the run's config, lifecycle events and throughput (see the module docstring).

    A process-wide singleton: constructing it again returns the same object, and it initialises once. Call
    :meth:`reset` to start over (tests, several jobs in one process).

    Args:
        output_dir: folder for ``telemetry.jsonl``; the run manager sets it to the run folder. Without one the
            records are kept in memory only (:meth:`records`).
        exporters: extra exporters (objects with ``export(record)`` and ``close()``).
    """

    _instance: "TelemetryCallback | None" = None
    _lock = threading.Lock()

    def __new__(cls, *args: Any, **kwargs: Any) -> "TelemetryCallback":
        with cls._lock:
            if cls._instance is None:
                cls._instance = super().__new__(cls)
                cls._instance._initialised = False
            return cls._instance

    def __init__(self, output_dir: str | Path | None = None, exporters: Iterable[Any] = ()) -> None:
        if self._initialised:
            if output_dir is not None:
                self.set_output_dir(output_dir)
            for exporter in exporters:
                self.add_exporter(exporter)
            return
        self._initialised = True
        self._records: list[dict[str, Any]] = []
        self._pending: list[dict[str, Any]] = []  # before this process knows its rank
        self._exporters: list[Any] = []
        self._failed: set[str] = set()
        self._enabled: bool | None = None  # None: rank not known yet
        self._starts: dict[str, float] = {}
        self._t0 = time.time()
        self._ended = False
        self._config: dict[str, Any] | None = None
        self._output_dir: Path | None = None
        self._interval: dict[str, Any] = {}
        self._last_batch_end: float | None = None
        self._sample_rate: int | None = None
        self._hop = 160
        self._steps_failed = False
        self._peak = None
        self._flops_fn: Callable[[Any], Any] | None = None
        self._dp = 1
        self._log_every = 50
        for exporter in exporters:
            self.add_exporter(exporter)
        if output_dir is not None:
            self.set_output_dir(output_dir)
        self._decide_rank()

    @classmethod
    def get_instance(cls) -> "TelemetryCallback":
        """The process-wide telemetry callback."""
        return cls()

    @classmethod
    def reset(cls) -> None:
        """Close and forget the process-wide instance."""
        with cls._lock:
            instance, cls._instance = cls._instance, None
        if instance is not None:
            instance._close_exporters()

    # -------------------------------------------------------------------------------------------- state
    @property
    def enabled(self) -> bool | None:
        """True on global rank 0, False elsewhere, None while the rank is unknown."""
        return self._enabled

    @property
    def config(self) -> dict[str, Any] | None:
        """The inferred run config (after ``update_config``)."""
        return self._config

    def records(self) -> list[dict[str, Any]]:
        """Everything recorded on this process so far (a copy)."""
        return list(self._records)

    def set_output_dir(self, output_dir: str | Path, trainer: Any = None) -> None:
        """Write ``telemetry.jsonl`` under ``output_dir`` (records made so far are written first).

        ``trainer`` tells this process's rank when nothing else does; other ranks than 0 write nothing.
        """
        self._decide_rank(trainer)
        path = Path(output_dir) / TELEMETRY_FILE
        if self._output_dir == Path(output_dir):
            return
        self._output_dir = Path(output_dir)
        if self._enabled is False:
            return
        try:
            exporter = JsonlExporter(path)
        except OSError as error:
            logger.warning("Telemetry cannot write %s (%s); it stays in memory.", path, error)
            return
        for record in self._records:
            self._safe_export(exporter, record)
        self._exporters = [e for e in self._exporters if not isinstance(e, JsonlExporter)] + [exporter]

    def add_exporter(self, exporter: Any, replay: bool = True) -> None:
        """Send records to ``exporter`` too (with the ones recorded so far when ``replay``)."""
        if any(e is exporter for e in self._exporters):
            return
        self._exporters.append(exporter)
        if replay:
            for record in self._records:
                self._safe_export(exporter, record)

    # ------------------------------------------------------------------------------------------ recording
    def _decide_rank(self, trainer: Any = None) -> None:
        rank = global_rank(trainer)
        if rank is None or self._enabled is not None:
            return
        self._enabled = rank == 0
        pending, self._pending = self._pending, []
        if self._enabled:
            for record in pending:
                self._emit(record)

    def record(self, event: str, **fields: Any) -> None:
        """Record ``event`` now (``time``: Unix seconds, ``t``: seconds since telemetry started)."""
        if self._enabled is False:
            return
        now = time.time()
        record = {"event": event, "time": round(now, 3), "t": round(now - self._t0, 3), **fields}
        if self._enabled is None:
            self._pending.append(record)
        else:
            self._emit(record)

    def _emit(self, record: dict[str, Any]) -> None:
        self._records.append(record)
        for exporter in list(self._exporters):
            self._safe_export(exporter, record)

    def _safe_export(self, exporter: Any, record: dict[str, Any]) -> None:
        name = getattr(exporter, "name", type(exporter).__name__)
        try:
            exporter.export(record)
        except Exception as error:
            if name not in self._failed:
                self._failed.add(name)
                logger.warning("Telemetry exporter %s failed (%s: %s); it is switched off.", name,
                               type(error).__name__, error)  # fmt: skip
            self._exporters = [e for e in self._exporters if e is not exporter]

    def _lifecycle(self, name: str, **fields: Any) -> None:
        base, _, phase = name.rpartition("_")
        key = base if base in _PAIRED else None
        now = time.time()
        if key and phase == "start":
            self._starts[key] = now
        elif key and phase == "end" and key in self._starts:
            fields["duration_s"] = round(now - self._starts.pop(key), 3)
        self.record(name, **fields)

    def _close_exporters(self) -> None:
        for exporter in self._exporters:
            try:
                exporter.close()
            except Exception:
                logger.debug("Telemetry exporter %s did not close cleanly.", exporter, exc_info=True)
        self._exporters = []

    # ------------------------------------------------------------------------------------ lifecycle events
    def on_app_start(self) -> None:
        self._lifecycle("app_start")

    def on_app_end(self) -> None:
        if self._ended:
            return
        self._ended = True
        self._lifecycle("app_end")
        self._close_exporters()

    def on_model_init_start(self) -> None:
        self._lifecycle("model_init_start")

    def on_model_init_end(self) -> None:
        self._lifecycle("model_init_end")

    def on_dataloader_init_start(self) -> None:
        self._lifecycle("dataloader_init_start")

    def on_dataloader_init_end(self) -> None:
        self._lifecycle("dataloader_init_end")

    def on_optimizer_init_start(self) -> None:
        self._lifecycle("optimizer_init_start")

    def on_optimizer_init_end(self) -> None:
        self._lifecycle("optimizer_init_end")

    def on_load_checkpoint_start(self) -> None:
        self._lifecycle("load_checkpoint_start")

    def on_load_checkpoint_end(self) -> None:
        self._lifecycle("load_checkpoint_end")

    def on_save_checkpoint_start(self, global_step: int) -> None:
        self._lifecycle("save_checkpoint_start", global_step=global_step)

    def on_save_checkpoint_success(self, global_step: int) -> None:
        self._lifecycle("save_checkpoint_success", global_step=global_step)

    def on_save_checkpoint_end(self, global_step: int) -> None:
        self._lifecycle("save_checkpoint_end", global_step=global_step)

    def update_config(self, trainer: Any = None, model: Any = None, **kwargs: Any) -> None:
        """Learn this process's rank and the run's shape; attach the Lightning-logger and OneLogger exporters."""
        self._decide_rank(trainer)
        if self._enabled is None:  # nothing else can tell: a single process
            self._enabled = True
            pending, self._pending = self._pending, []
            for record in pending:
                self._emit(record)
        if not self._enabled:
            return
        self._config = infer_config(trainer, model)
        self._dp = self._config["data_parallel_size"]
        self._log_every = max(1, int(self._config["log_every_n_steps"] or 50))
        cfg = getattr(model, "cfg", None)
        self._sample_rate = _positive_int(_get(cfg, "sample_rate"))
        stride = _get(_get(cfg, "preprocessor"), "window_stride")
        self._hop = max(1, round(float(stride) * self._sample_rate)) if stride and self._sample_rate else 160
        self._flops_fn = getattr(model, "flops_per_batch", None)
        self._peak = peak_tflops()
        self.record("config", **self._config)
        if trainer is not None:
            self.add_exporter(LightningLoggerExporter(trainer), replay=False)
        if one_logger_available():
            try:
                self.add_exporter(OneLoggerExporter(self._config))
            except Exception as error:
                logger.warning("OneLogger is installed but could not be configured (%s); skipping it.", error)

    # ------------------------------------------------------------------------------- per-step throughput
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._interval = {}
        self._last_batch_end = None

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self._enabled and not self._steps_failed and self._interval.get("steps"):
            try:
                self._flush_interval(trainer)
            except Exception as error:
                logger.warning("Telemetry's last interval record failed (%s: %s).", type(error).__name__, error)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self._last_batch_end = None  # the gap since the last step was not training

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self._last_batch_end = None

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self._enabled or self._steps_failed:
            return
        try:
            self._count_step(trainer, batch)
        except Exception as error:  # never let telemetry stop training
            self._steps_failed = True
            logger.warning("Telemetry's per-step records failed (%s: %s); they are off for this run.",
                           type(error).__name__, error)  # fmt: skip

    def _count_step(self, trainer: Any, batch: Any) -> None:
        now = time.perf_counter()
        last, self._last_batch_end = self._last_batch_end, now
        if last is None:
            return
        interval = self._interval
        # Optimizer steps: with accumulate_grad_batches=N each loader batch is 1/N of one.
        interval["steps"] = interval.get("steps", 0) + 1 / max(1, getattr(trainer, "accumulate_grad_batches", 1))
        interval["seconds"] = interval.get("seconds", 0.0) + (now - last)
        piece = batch_piece(batch)
        if piece is not None:
            interval.setdefault("pieces", []).append(piece)
        if interval["steps"] >= self._log_every - 1e-9:
            self._flush_interval(trainer)

    def _interval_totals(self, pieces: list[tuple[int, Any, int, Any]]) -> dict[str, float]:
        """Sums over an interval's batches: samples, valid and padded audio samples, frames, tokens, FLOPs."""
        totals: dict[str, float] = {}
        if not pieces:
            return totals
        totals["samples"] = float(sum(piece[0] for piece in pieces))
        lens = [piece[1] for piece in pieces if piece[1] is not None]
        if lens:
            all_lens = torch.cat(lens)
            totals["valid_audio"] = float(all_lens.sum())
            totals["padded_audio"] = float(sum(len(piece[1]) * piece[2] for piece in pieces if piece[1] is not None))
            totals["frames"] = float((torch.div(all_lens, self._hop, rounding_mode="floor") + 1).sum())
            if self._flops_fn is not None:
                # Token lengths too when every batch has them (a transducer's joint scales with them).
                with_audio = [piece for piece in pieces if piece[1] is not None]
                flops_batch = {"audio_lens": all_lens}
                if all(piece[3] is not None and len(piece[3]) == len(piece[1]) for piece in with_audio):
                    flops_batch["token_lens"] = torch.cat([piece[3] for piece in with_audio])
                flops = self._flops_fn(flops_batch)
                if flops is not None:
                    totals["flops"] = float(flops)
        tokens = [piece[3] for piece in pieces if piece[3] is not None]
        if tokens:
            totals["tokens"] = float(torch.cat(tokens).sum())
        return totals

    def _flush_interval(self, trainer: Any) -> None:
        interval, self._interval = self._interval, {}
        steps, seconds = interval["steps"], max(interval["seconds"], 1e-9)
        dp = self._dp

        total = self._interval_totals(interval.get("pieces", [])).get
        fields: dict[str, Any] = {
            "step": int(getattr(trainer, "global_step", 0)),
            "steps": round(steps, 3),
            "iteration_time_s": round(seconds / steps, 5),
        }
        samples = total("samples")
        if samples is not None:
            fields["samples_per_s"] = round(samples * dp / seconds, 3)
            fields["measured_global_batch_size"] = round(samples * dp / steps, 2)
        valid, padded = total("valid_audio"), total("padded_audio")
        if valid is not None and self._sample_rate:
            fields["audio_s_per_s"] = round(valid / self._sample_rate * dp / seconds, 3)
        if valid is not None and padded:
            fields["padding_ratio"] = round(1.0 - valid / padded, 4)
        frames = total("frames")
        if frames is not None and samples:
            fields["mean_frames_per_sample"] = round(frames / samples, 1)
        tokens = total("tokens")
        if tokens is not None:
            fields["tokens_per_s"] = round(tokens * dp / seconds, 3)
        flops = total("flops")
        if flops is not None:
            achieved = flops * dp / seconds / 1e12
            fields["model_tflops_per_s"] = round(achieved, 4)
            if self._peak:
                fields["mfu"] = round(achieved / (self._peak * (self._config or {}).get("world_size", 1)), 5)
        device = getattr(getattr(trainer, "strategy", None), "root_device", None)
        if isinstance(device, torch.device) and device.type == "cuda":
            fields["gpu_max_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
        self.record("train_interval", **fields)
