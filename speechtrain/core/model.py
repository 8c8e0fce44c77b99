"""The base class of every speechtrain model: typed config, archive save/restore, pretrained initialisation.

A model declares its config as a dataclass in ``Config`` and builds itself from it::

    class MyModel(SpeechModel):
        Config = MyConfig

        def __init__(self, cfg):
            super().__init__(cfg)
            self.encoder = ...  # from self.cfg

Construction, data setup, optimizer setup and weight loading are announced on the lifecycle event bus
(:class:`speechtrain.lightning.CallbackGroup`).
"""

import fnmatch
import importlib
import logging
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import lightning.pytorch as pl
import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from speechtrain.common.batch import NoUsableDataError, is_empty_batch, no_usable_data_message
from speechtrain.common.config import (
    ConfigError,
    env_interpolations,
    settle_env_interpolations,
    to_plain,
    validate_config,
    with_env_interpolations,
)
from speechtrain.core.archive import read_model_file, write_archive
from speechtrain.core.optim import (
    OPTIMIZERS,
    SCHEDULE_ALIASES,
    SCHEDULES,
    OptimConfig,
    build_optimizer,
    build_scheduler,
)
from speechtrain.lightning import CallbackGroup, Trainer, hook_class_init_with_callbacks, settings
from speechtrain.lightning.checkpoint import gather_full_state_dict, load_checkpoint, shard_full_state_dict
from speechtrain.lightning.megatron_compat import rng_tracker_states, set_rng_tracker_states
from speechtrain.lightning.progress import logs_this_step

logger = logging.getLogger(__name__)

TARGET_KEY = "_target_"


@dataclass
class LoadReport:
    """What :meth:`SpeechModel.init_from_pretrained` did with each tensor.

    Attributes:
        loaded: model keys copied from the source.
        excluded: source keys left out by the include/exclude patterns.
        mismatched: ``(key, source shape, model shape)`` for tensors whose shapes differ (left as initialised).
        unexpected: source keys the model does not have.
        missing: model keys that received nothing (kept their initialisation).
    """

    loaded: list[str] = field(default_factory=list)
    excluded: list[str] = field(default_factory=list)
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [
            f"loaded {len(self.loaded)}, excluded {len(self.excluded)}, shape-mismatched {len(self.mismatched)}, "
            f"not in model {len(self.unexpected)}, not in source {len(self.missing)}"
        ]
        lines += [f"  shape mismatch {k}: source {tuple(s)} vs model {tuple(m)}" for k, s, m in self.mismatched]
        if self.missing:
            lines.append(
                f"  kept initialisation: {', '.join(self.missing[:20])}{' ...' if len(self.missing) > 20 else ''}"
            )
        return "\n".join(lines)


def _matches(key: str, patterns: list[str]) -> bool:
    """A glob pattern matches a key; a plain name also matches everything under it (``encoder`` -> ``encoder.*``)."""
    return any(fnmatch.fnmatchcase(key, p) or key.startswith(p.rstrip(".") + ".") for p in patterns)


def _load_source_state_dict(source: "str | Path | SpeechModel | dict[str, torch.Tensor]") -> dict[str, torch.Tensor]:
    if isinstance(source, SpeechModel):
        source.configure_model()  # layers built on first use: an unbuilt model has no weights yet
        return source.state_dict()
    if isinstance(source, dict):
        return source
    path = Path(source)
    if path.suffix == ".ckpt":
        if not path.is_file():
            raise FileNotFoundError(f"No checkpoint at {path}.")
        checkpoint = load_checkpoint(path)  # checked against its CRCs; tensors and plain data only
        if "state_dict" not in checkpoint:
            raise ValueError(f"{path} is not a Lightning checkpoint: it has no 'state_dict'.")
        return checkpoint["state_dict"]
    return read_model_file(path).state_dict


SCHEDULE_NAMES = (*SCHEDULES, *SCHEDULE_ALIASES)


def check_optim_config(optim: Any) -> None:
    """Refuse, by key, optimizer settings that cannot train (before any run folder or process exists).

    Raises:
        ConfigError: naming the ``model.optim`` key, its value and what it must be.
    """
    merged = OmegaConf.merge(OmegaConf.structured(OptimConfig), optim)
    checks = [
        ("name", merged.name in OPTIMIZERS, f"one of {', '.join(OPTIMIZERS)}"),
        ("muon_momentum", 0 <= merged.muon_momentum < 1, "in [0, 1)"),
        ("ns_steps", 1 <= merged.ns_steps < 100, "between 1 and 99"),
        ("lr", merged.lr > 0, "> 0"),
        ("weight_decay", merged.weight_decay >= 0, ">= 0"),
        ("betas", len(merged.betas) == 2 and all(0 <= b < 1 for b in merged.betas), "two numbers in [0, 1)"),
        ("sched.name", merged.sched.name in SCHEDULE_NAMES, f"one of {', '.join(SCHEDULE_NAMES)}"),
        ("sched.warmup_steps", merged.sched.warmup_steps >= 0, ">= 0"),
        ("sched.min_lr", 0 <= merged.sched.min_lr <= merged.lr, f"between 0 and model.optim.lr={merged.lr}"),
        ("sched.decay_ratio", 0 < merged.sched.decay_ratio <= 1, "in (0, 1]"),
    ]
    for key, ok, expected in checks:
        if not ok:
            value = OmegaConf.select(merged, key)
            raise ConfigError(f"model.optim.{key}={value}: must be {expected}.")


def check_validation_schedule(trainer: Any, sampler: Any, has_validation: bool) -> None:
    """Fail at start, with the fix, when a run with validation data would never validate before it stops.

    The training loaders have no length (they are lhotse samplers), so Lightning cannot see this itself: a float
    ``val_check_interval`` is a fraction of an epoch, counted in batches read from the sampler's metadata.
    """
    if not has_validation or trainer.limit_val_batches == 0 or sampler is None:
        return
    every_epochs = trainer.check_val_every_n_epoch
    if every_epochs is not None and trainer.max_epochs is not None and 0 < trainer.max_epochs < every_epochs:
        raise ValueError(
            f"This run would never validate: trainer.check_val_every_n_epoch={every_epochs} but "
            f"trainer.max_epochs={trainer.max_epochs}. Lower check_val_every_n_epoch."
        )
    interval = trainer.val_check_interval
    batches = trainer.max_steps * trainer.accumulate_grad_batches
    if every_epochs is None:  # an int interval counts batches across epochs
        if isinstance(interval, int) and trainer.max_steps > 0 and batches < interval:
            raise ValueError(
                f"This run would never validate: it stops after trainer.max_steps={trainer.max_steps} steps, before "
                f"the first validation at batch trainer.val_check_interval={interval}. Lower it, e.g. "
                f"trainer.val_check_interval={max(1, batches // 2)}."
            )
        return
    limit_train = getattr(trainer, "limit_train_batches", 1.0)  # Lightning cuts its epochs short at this
    fraction = not isinstance(limit_train, int) and limit_train < 1.0
    limit = None
    if trainer.max_steps > 0 and (isinstance(interval, int) or interval == 1.0) and not fraction:
        # Counting past the run's last batch (or the interval) cannot change the verdict: a huge lazy manifest is
        # not read to its end at start.
        limit = max(batches, interval if isinstance(interval, int) else 0)
    if isinstance(limit_train, int):
        limit = limit_train if limit is None else min(limit, limit_train)
    per_epoch = sampler.batches_per_epoch(limit)
    if isinstance(limit_train, int):
        per_epoch = min(per_epoch, limit_train)
    elif fraction:
        per_epoch = int(per_epoch * limit_train)
    if isinstance(interval, int) and interval > per_epoch:
        raise ValueError(
            f"This run would never validate: trainer.val_check_interval={interval} batches, but an epoch has "
            f"{per_epoch}. Set trainer.check_val_every_n_epoch=null to count batches across epochs, or lower it."
        )
    within = interval if isinstance(interval, int) else math.ceil(interval * per_epoch)
    first = (every_epochs - 1) * per_epoch + within
    capped = limit is not None and per_epoch > limit
    size, at = (f"more than {limit}", f"after batch {limit}") if capped else (per_epoch, f"at batch {first}")
    if trainer.max_steps > 0 and batches < first:
        raise ValueError(
            f"This run would never validate: it stops after trainer.max_steps={trainer.max_steps} steps, before the "
            f"first validation {at} (an epoch has {size} batches). Set trainer.val_check_interval "
            f"to a number of batches below that (e.g. trainer.val_check_interval={max(1, batches // 2)} "
            "trainer.check_val_every_n_epoch=null)."
        )


class _WallClockProgress:
    """Fraction of ``max_time`` spent training, the same number on every rank, for the learning-rate schedule.

    Rank 0's clock is broadcast at steps 0, 1, 2, 4, ... (doubling) and then every ``every`` optimizer steps (a
    collective and a host sync each); in between, the fraction advances by the time per step measured between the
    last two broadcasts. The doubling start makes a run shorter than ``every`` steps decay too. Every rank computes the
    same function of the step, so the learning rates agree without a collective per step.

    ``steps``: the run's optimizer steps when ``max_epochs`` bounds it too; the fraction is then the larger of the
    two, so that the schedule ends with whichever bound stops the run first.
    """

    def __init__(self, timer: Any, trainer: Any, every: int = 50, steps: int | None = None) -> None:
        self.timer, self.trainer, self.every, self.steps = timer, trainer, every, steps
        self._synced: tuple[int, float] | None = None  # (step, fraction) of the last broadcast
        self._per_step = 0.0

    def _broadcast(self) -> float:
        progress = torch.tensor([self.timer.time_elapsed("train") / self.timer._duration], dtype=torch.float64)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            backend = torch.distributed.get_backend()
            device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
            progress = progress.to(device)
            torch.distributed.broadcast(progress, src=0)
        return float(progress.item())

    def __call__(self) -> float:
        step = self.trainer.global_step
        if self._synced is None or step - self._synced[0] >= min(self.every, max(1, self._synced[0])):
            fraction = self._broadcast()
            if self._synced is not None and step > self._synced[0]:
                self._per_step = (fraction - self._synced[1]) / (step - self._synced[0])
            self._synced = (step, fraction)
        elapsed = self._synced[1] + self._per_step * (step - self._synced[0])
        return max(elapsed, step / self.steps) if self.steps else elapsed


def _rng_state() -> dict[str, Any]:
    """This process's random streams (Python, NumPy, torch CPU and CUDA, Megatron's model-parallel tracker)."""
    numpy_state = np.random.get_state()
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return {
        "cuda": cuda,
        "model_parallel": rng_tracker_states(),
        "torch": torch.get_rng_state(),
        "python": list(random.getstate()[1]),
        "python_gauss": random.getstate()[2],
        "numpy": torch.from_numpy(numpy_state[1].astype(np.int64)),
        "numpy_pos": int(numpy_state[2]),
        "numpy_gauss": (int(numpy_state[3]), float(numpy_state[4])),
    }


def _all_ranks_rng_states() -> dict[str, Any]:
    """Every process's random streams, by global rank (a collective when distributed): each data-parallel rank
    draws its own dither, SpecAugment and dropout, so a checkpoint written by one rank must hold them all."""
    state = _rng_state()
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return {"by_rank": {0: state}}
    states: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(states, state)
    return {"by_rank": dict(enumerate(states))}


def _restore_rank_rng_state(saved: dict[str, Any]) -> None:
    """This process's streams from :func:`_all_ranks_rng_states` (checkpoints before it held one rank's only)."""
    if "by_rank" not in saved:
        _set_rng_state(saved)
        return
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank not in saved["by_rank"]:
        logger.warning("The checkpoint holds random states of %d processes; process %d starts from rank 0's.",
                       len(saved["by_rank"]), rank)  # fmt: skip
    _set_rng_state(saved["by_rank"].get(rank, saved["by_rank"][0]))


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if state.get("model_parallel"):
        set_rng_tracker_states(state["model_parallel"])
    random.setstate((3, tuple(state["python"]), state["python_gauss"]))
    has_gauss, gauss = state["numpy_gauss"]
    np.random.set_state(("MT19937", state["numpy"].numpy().astype(np.uint32), state["numpy_pos"], has_gauss, gauss))


def _model_env_interpolations(cfg: Any) -> dict[str, str]:
    """:func:`~speechtrain.common.config.env_interpolations` of a model config; for the ``model`` node of a job's
    config, found from the whole config (a value may refer to another node: ``${trainer.data_root}``)."""
    if not isinstance(cfg, DictConfig) or cfg._get_parent() is None:
        return env_interpolations(cfg) if isinstance(cfg, dict | DictConfig) else {}
    prefix = cfg._get_full_key(None) + "."
    found = env_interpolations(cfg._get_root())
    return {key[len(prefix) :]: text for key, text in found.items() if key.startswith(prefix)}


class SpeechModel(pl.LightningModule):
    """Base of all speechtrain models (see module docstring).

    Args:
        cfg: the model config (dict, ``DictConfig`` or an instance of ``Config``); unknown keys raise a
            :class:`~speechtrain.common.config.ConfigError` that names them.
    """

    Config: ClassVar[type | None] = None
    registry: ClassVar[dict[str, type["SpeechModel"]]] = {}
    # model.optim.name=muon: the submodules (dotted names) that stay with AdamW besides embeddings, biases, norms,
    # convolutions and recurrent weights: the model's input and output layers. None: this model does not run Muon.
    MUON_ADAMW_MODULES: ClassVar[tuple[str, ...] | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        SpeechModel.registry[f"{cls.__module__}.{cls.__qualname__}"] = cls
        hook_class_init_with_callbacks(cls, "on_model_init_start", "on_model_init_end")

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        if not isinstance(cfg, dict | DictConfig):
            cfg = OmegaConf.structured(cfg)
        # Values read from the environment (``${oc.env:...}``): used resolved, saved as their text (save_to).
        self.env_interpolations = _model_env_interpolations(cfg)
        cfg = {k: v for k, v in to_plain(cfg).items() if k != TARGET_KEY}
        self.cfg: DictConfig = validate_config(cfg, self.Config) if self.Config is not None else OmegaConf.create(cfg)
        if self.cfg.get("optim") is not None:
            check_optim_config(self.cfg.optim)
        self._artifacts: dict[str, Path] = {}
        self._artifact_dir = None

    # ----------------------------------------------------------------------------------------------- artifacts
    def register_artifact(self, config_key: str, path: str | Path) -> Path:
        """Pack the file at ``path`` into archives of this model; ``config_key`` is where the config names it."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"Artifact {config_key!r}: no file at {path}.")
        self._artifacts[config_key] = path
        return path

    # -------------------------------------------------------------------------------------------- archives
    def save_to(self, path: str | Path) -> Path:
        """Write this model (config, weights, artifacts, trainer config if any) to one archive file.

        The archive holds the full weights whatever the parallel layout (tensor-parallel shards are joined and
        pipeline stages merged), so it restores in any layout. In a distributed run every rank must call this;
        global rank 0 writes.
        """
        path = Path(path)
        if path.suffix == ".nemo":
            raise ValueError(f"{path}: {type(self).__name__} cannot be exported to NeMo's .nemo format (NeMo has no "
                             "such model); save it as .stm.")  # fmt: skip
        state_dict = gather_full_state_dict(self)  # collective under model parallelism: every rank takes part
        trainer = self._trainer
        if trainer is not None and not trainer.is_global_zero:
            return path
        target, model_config = self.archive_identity()
        config = {TARGET_KEY: target, **with_env_interpolations(model_config, self.env_interpolations)}
        trainer_config = trainer.to_config() if isinstance(trainer, Trainer) else None
        return write_archive(path, config, state_dict, self._artifacts, trainer_config)

    def archive_identity(self) -> tuple[str, dict[str, Any]]:
        """The class name and config an archive of this model records (a subclass may save itself as another
        model, e.g. a distillation student as a plain TTS model)."""
        return f"{type(self).__module__}.{type(self).__qualname__}", to_plain(self.cfg)

    @classmethod
    def restore_from(
        cls,
        path: str | Path,
        map_location: str | torch.device = "cpu",
        strict: bool = True,
        override_config: dict[str, Any] | None = None,
    ) -> "SpeechModel":
        """Rebuild a model from an archive written by :meth:`save_to`, or from a NeMo ``.nemo`` checkpoint
        (:mod:`speechtrain.asr.nemo_import`).

        Called on ``SpeechModel`` the archive's recorded class is used; it must be a speechtrain model (or one
        already imported): an archive cannot make this function import arbitrary code. Called on a subclass,
        that subclass is used.

        Args:
            path: the archive.
            map_location: device for the weights.
            strict: require the archive's weights to match the model exactly.
            override_config: values merged over the stored config before the model is built.
        """
        group = CallbackGroup.get_instance()
        group.on_load_checkpoint_start()
        try:
            archive = read_model_file(path)
            config = settle_env_interpolations(archive.config, path)
            target = config.pop(TARGET_KEY, None)
            model_cls = cls if cls is not SpeechModel else cls.resolve_class(target, path)
            if override_config:
                config = to_plain(OmegaConf.merge(OmegaConf.create(config), OmegaConf.create(override_config)))
            model = model_cls(config)
            model.configure_model()
            model.load_state_dict(shard_full_state_dict(model, archive.state_dict), strict=strict)  # TP slices
            model.to(map_location)
            model._artifact_dir = archive.artifact_dir
            for key, file in archive.artifacts.items():
                model._artifacts.setdefault(key, file)
        finally:
            group.on_load_checkpoint_end()
        logger.info("Restored %s from %s.", type(model).__name__, path)
        return model

    @staticmethod
    def resolve_class(target: str | None, source: str | Path) -> type["SpeechModel"]:
        """The model class named ``target`` by an archive (imported only from the ``speechtrain`` package)."""
        if not target:
            raise ValueError(f"{source} does not name its model class; call restore_from on the class itself.")
        if target not in SpeechModel.registry and target.startswith("speechtrain."):
            importlib.import_module(target.rpartition(".")[0])
        if target not in SpeechModel.registry:
            raise ValueError(
                f"{source} holds a {target!r}, which is not an imported speechtrain model. Import its module "
                "first, or call restore_from on the class itself."
            )
        return SpeechModel.registry[target]

    @classmethod
    def from_pretrained(cls, name_or_path: str | Path, **kwargs: Any) -> "SpeechModel":
        """Restore a model from a local archive path (``.stm``, or NeMo's ``.nemo``) or by name from
        ``SPEECHTRAIN_MODELS_CACHE``.

        There is no model hub: a name resolves to ``<cache>/<name>.stm`` or ``.nemo``, or the first such file inside
        ``<cache>/<name>/``.
        """
        path = Path(name_or_path).expanduser()
        if not path.is_file():
            cache = settings.SPEECHTRAIN_MODELS_CACHE
            candidates = [cache / f"{name_or_path}.stm", cache / f"{name_or_path}.nemo",
                          *sorted((cache / str(name_or_path)).glob("*.stm")),
                          *sorted((cache / str(name_or_path)).glob("*.nemo"))]  # fmt: skip
            found = [c for c in candidates if c.is_file()]
            if not found:
                available = sorted(p.stem for p in cache.glob("*.stm")) if cache.is_dir() else []
                raise FileNotFoundError(
                    f"No model archive {name_or_path!r}: not a file, and not in the models cache {cache} "
                    f"(available: {', '.join(available) or 'none'}). Models are never downloaded; put the .stm "
                    "file there or pass its path."
                )
            path = found[0]
        return cls.restore_from(path, **kwargs)

    def init_from_pretrained(
        self,
        source: "str | Path | SpeechModel | dict[str, torch.Tensor]",
        include: list[str] | None = None,
        exclude: list[str] | None = None,
    ) -> LoadReport:
        """Copy matching weights from an archive, a Lightning ``.ckpt``, another model or a state dict.

        Tensors whose shapes differ (a new vocabulary, say) are skipped and reported, never a crash.

        Args:
            source: where the weights come from.
            include: glob patterns (or plain module prefixes) of keys to take; default all.
            exclude: patterns of keys to leave out, applied after ``include``.

        Returns:
            A :class:`LoadReport`; it is also logged.
        """
        group = CallbackGroup.get_instance()
        group.on_load_checkpoint_start()
        try:
            source_state = _load_source_state_dict(source)
            self.configure_model()
            own_state = self.state_dict()
            source_state = shard_full_state_dict(self, source_state)  # full tensors -> this rank's TP slices
            report = LoadReport()
            selected = {}
            for key, tensor in source_state.items():
                if (include and not _matches(key, include)) or (exclude and _matches(key, exclude)):
                    report.excluded.append(key)
                elif key not in own_state:
                    report.unexpected.append(key)
                elif tuple(tensor.shape) != tuple(own_state[key].shape):
                    report.mismatched.append((key, tuple(tensor.shape), tuple(own_state[key].shape)))
                else:
                    selected[key] = tensor
                    report.loaded.append(key)
            self.load_state_dict(selected, strict=False)
            report.missing = [k for k, v in own_state.items() if k not in selected and isinstance(v, torch.Tensor)]
        finally:
            group.on_load_checkpoint_end()
        logger.info(
            "Initialised %s from %s: %s",
            type(self).__name__,
            source if not isinstance(source, dict) else "state dict",
            report,
        )
        return report

    # ------------------------------------------------------------------------------- Lightning integration
    def setup(self, stage: str) -> None:
        """Builds the datasets for ``stage`` through :meth:`setup_data`, announced as dataloader init events."""
        group = CallbackGroup.get_instance()
        group.on_dataloader_init_start()
        try:
            self.setup_data(stage)
        finally:
            group.on_dataloader_init_end()

    def setup_data(self, stage: str) -> None:
        """Build datasets/dataloaders for ``stage`` (``fit``, ``validate``, ``test``, ``predict``). Optional."""

    def configure_optimizers(self) -> Any:
        """The optimizer and per-step scheduler from ``cfg.optim`` (:class:`OptimConfig`), with init events."""
        group = CallbackGroup.get_instance()
        group.on_optimizer_init_start()
        try:
            optim_cfg = OmegaConf.to_object(
                OmegaConf.merge(OmegaConf.structured(OptimConfig), self.cfg.get("optim", {}))
            )
            optimizer = build_optimizer([p for p in self.parameters() if p.requires_grad], optim_cfg)
            timer = self._max_time_timer()
            if timer is not None:
                progress = _WallClockProgress(timer, self.trainer, steps=self._epoch_bound_steps())
                scheduler = build_scheduler(optimizer, optim_cfg, 0, progress=progress)
            else:
                scheduler = build_scheduler(optimizer, optim_cfg, self._total_steps())
        finally:
            group.on_optimizer_init_end()
        if scheduler is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_fit_start(self) -> None:
        check_validation_schedule(self.trainer, self._resumable_sampler(), bool(getattr(self, "_val_loaders", None)))
        self._log_parameter_counts()

    def _log_parameter_counts(self) -> None:
        """Under tensor parallelism Lightning's model summary counts global rank 0's shard: say so, with the whole
        model's counts beside it."""
        from speechtrain.lightning import parallel_state

        tp = parallel_state.tensor_parallel_world_size()
        if tp == 1 or not self.trainer.is_global_zero:
            return
        params = list(self.parameters())
        logger.info(
            "Parameters: %s per rank (tensor-parallel shard 1 of %d, what the model summary counts); whole model "
            "%s, of which %s trainable.",
            f"{sum(p.numel() for p in params):,}", tp, f"{parallel_state.whole_model_numel(params):,}",
            f"{parallel_state.whole_model_numel(p for p in params if p.requires_grad):,}",
        )  # fmt: skip

    def _resumable_sampler(self) -> Any:
        """The training sampler, when the model keeps its loader in ``_train_loader`` and it can resume."""
        sampler = getattr(getattr(self, "_train_loader", None), "sampler", None)
        return sampler if callable(getattr(sampler, "resume", None)) else None

    def on_train_epoch_start(self) -> None:
        self._batches_done = 0
        self._usable_in_epoch = 0

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # Counted at the start: checkpoints are written by callbacks at the end of a batch, before the module's
        # own on_train_batch_end runs, and that batch has been trained on by then.
        self._batches_done = batch_idx + 1
        skips = getattr(self, "_skips", None)  # a SkipTally: models whose datasets skip bad utterances keep one
        if skips is not None:
            skips.add_batch(batch)
            if not is_empty_batch(batch):
                self._usable_in_epoch = getattr(self, "_usable_in_epoch", 0) + len(batch["ids"])

    def on_train_epoch_end(self) -> None:
        """Reports the utterances skipped during the epoch (batches carry their counts, loader workers' included)."""
        skips = getattr(self, "_skips", None)
        if skips is not None and not self._any_usable_in_epoch():
            train_ds = self.cfg.get("train_ds") or {}
            manifests = train_ds.get("manifest_filepath") or train_ds.get("cuts_path") or "?"
            raise NoUsableDataError(no_usable_data_message(
                f"training epoch {self.current_epoch}", "model.train_ds.manifest_filepath",
                manifests if isinstance(manifests, str) else list(manifests), dict(skips.counts), dict(skips.examples),
            ))  # fmt: skip
        summary = skips.take_summary() if skips is not None else None
        if summary:
            logger.warning("Epoch %d: %s", self.current_epoch, summary)

    def _any_usable_in_epoch(self) -> bool:
        """Whether any data-parallel rank trained on an utterance this epoch (the same answer on every rank)."""
        count = torch.tensor([float(getattr(self, "_usable_in_epoch", 0))], device=self.device)
        trainer = self._trainer
        if trainer is not None and trainer.world_size > 1:
            count = trainer.strategy.reduce(count, reduce_op="sum")
        return float(count.sum()) > 0

    # ------------------------------------------------------------------------------------- the training step
    NO_TRAINING_DATA = "model.train_ds names no data: there is nothing to train on."

    def training_step(self, batch: dict[str, Any] | None, batch_idx: int) -> torch.Tensor | None:
        """One step on this rank's batch: :meth:`loss_step` of :meth:`forward_step` (a family's two halves, which
        the Megatron bridge runs itself under pipeline parallelism), as the mean over the batch's loss units, logged
        as ``train_loss`` with :meth:`log_step_extras` on logging steps. An empty batch (a rank with nothing left)
        returns None."""
        if is_empty_batch(batch):
            return None
        loss_sum, count = self.loss_step(batch, self.forward_step(batch))
        loss = loss_sum / count.clamp(min=1)
        if logs_this_step(self._trainer):
            self.log("train_loss", loss, prog_bar=True, batch_size=len(batch["ids"]))
            self.log_step_extras(batch)
        return loss

    def log_step_extras(self, batch: dict[str, Any]) -> None:
        """A family's further training-step metrics (none here)."""

    def every_parameter_gets_a_gradient(self) -> bool:
        """Whether every trainable parameter gets a gradient in every training step, whatever the data: then the
        bridge reduces gradient buckets while backward runs (``overlap_grad_reduce``). False unless a family says
        so."""
        return False

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Shows training speed (audio-seconds per second, all data-parallel ranks) and the time left in the bar."""
        self.log_training_speed(batch)

    def train_dataloader(self) -> Any:
        """The loader :meth:`setup_data` built into ``_train_loader``."""
        if getattr(self, "_train_loader", None) is None:
            raise ValueError(self.NO_TRAINING_DATA)
        return self._train_loader

    def val_dataloader(self) -> list[Any]:
        """The loaders :meth:`setup_data` built into ``_val_loaders`` (one per validation set)."""
        return list(getattr(self, "_val_loaders", None) or [])

    def log_training_speed(self, batch: Any) -> bool:
        """Logs training speed (audio-seconds per second over all data-parallel ranks, smoothed; from the batch's
        ``audio_seconds``, which the collators add) and the minutes left to the progress bar, on logging steps. Call
        at the end of each training batch; returns False when nothing was logged (the first batch, an empty one, or
        not a logging step)."""
        from speechtrain.lightning import parallel_state

        now = time.perf_counter()
        last, self._last_step_end = getattr(self, "_last_step_end", None), now
        if last is None or is_empty_batch(batch):
            return False
        # The batch's audio in seconds from the collator (host-side metadata): reading it from the device's length
        # tensor would wait for the step.
        seconds = float(batch.get("audio_seconds", 0.0)) if isinstance(batch, dict) else 0.0
        speed = seconds * parallel_state.data_parallel_world_size() / max(now - last, 1e-9)
        self._speed = speed if getattr(self, "_speed", None) is None else 0.9 * self._speed + 0.1 * speed
        if not logs_this_step(self._trainer):
            return False
        self.log("audio_s_per_s", self._speed, prog_bar=True, batch_size=1)
        eta = self._minutes_left(now - last)
        if eta is not None:
            self.log("eta_min", eta, prog_bar=True, batch_size=1)
        return True

    def _minutes_left(self, step_seconds: float) -> float | None:
        timer = self._max_time_timer()
        if timer is not None:
            return timer.time_remaining("train") / 60.0
        if self.trainer.max_steps > 0:
            return (self.trainer.max_steps - self.trainer.global_step) * step_seconds / 60.0
        return None

    def _max_time_timer(self) -> Any:
        """Lightning's ``Timer`` when the run is bounded by ``trainer.max_time`` and not by ``max_steps``: the
        schedule then decays over the wall-clock budget, or over ``max_epochs`` where those end the run sooner (the
        precedence is max_steps, then the first of max_time and max_epochs to run out)."""
        from lightning.pytorch.callbacks import Timer

        trainer = self.trainer
        if trainer.max_steps > 0:
            return None
        return next((c for c in trainer.callbacks if isinstance(c, Timer) and c._duration), None)

    def _total_steps(self) -> int:
        """Optimizer steps of the whole run, for the learning-rate schedule."""
        trainer = self.trainer
        if trainer.max_steps > 0:
            return trainer.max_steps
        bound = self._epoch_bound_steps()
        if bound is not None:
            return bound
        estimated = trainer.estimated_stepping_batches
        if not math.isfinite(estimated) or estimated <= 0:
            raise ValueError(
                "The training data has no length, so the learning-rate schedule cannot know the run's length: "
                "set trainer.max_steps (or model.optim.sched.max_steps)."
            )
        return int(estimated)

    def _epoch_bound_steps(self) -> int | None:
        """Optimizer steps of ``max_epochs`` epochs when that bounds the run and the sampler can count its batches,
        else None. Counted from the sampler's metadata: Lightning's estimate would start the epoch's data iterator
        before a resumed run has set the sampler's epoch, replaying the wrong order."""
        trainer = self.trainer
        sampler = self._resumable_sampler()
        if sampler is None or trainer.max_epochs is None or trainer.max_epochs <= 0:
            return None
        return max(1, sampler.batches_per_epoch() * trainer.max_epochs // trainer.accumulate_grad_batches)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Adds the RNG states and the position in the epoch, so that a resumed run draws the same random
        numbers and trains on the same batches as an uninterrupted one."""
        checkpoint["speechtrain_rng"] = _all_ranks_rng_states()
        checkpoint["speechtrain_data"] = {
            "epoch": self.current_epoch,
            "batches_done": getattr(self, "_batches_done", 0),
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if "speechtrain_rng" in checkpoint:
            _restore_rank_rng_state(checkpoint["speechtrain_rng"])
        sampler = self._resumable_sampler()
        if sampler is not None and "speechtrain_data" in checkpoint:
            sampler.resume(checkpoint["speechtrain_data"]["epoch"], checkpoint["speechtrain_data"]["batches_done"])

    @property
    def num_parameters(self) -> int:
        """Number of trainable parameters."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad)
