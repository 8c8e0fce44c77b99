"""A Lightning ``Trainer`` that remembers how it was built."""

import copy
import datetime
import difflib
import importlib
import inspect
import logging
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

from speechtrain import backends
from speechtrain.common.auto_precision import resolve_auto_precision
from speechtrain.common.config import (
    env_interpolations,
    settle_env_interpolations,
    to_plain,
    with_env_interpolations,
)
from speechtrain.lightning.callbacks import CallbackGroup
from speechtrain.lightning.limits import AgreeAtStepEnd, WallClockLimit, sparse_sigterm_checks
from speechtrain.lightning.progress import ModelSizeLine, ProgressLog

logger = logging.getLogger(__name__)

# The only classes a stored trainer config (``_target_``) may name: a checkpoint someone sent you must not be able to
# import or run arbitrary code, and these take plain data and do nothing on their own when built.
TRUSTED_TARGETS = frozenset({
    "speechtrain.lightning.strategy.MegatronStrategy",
    "speechtrain.lightning.precision.MegatronMixedPrecision",
    "lightning.pytorch.callbacks.EarlyStopping",
    "lightning.pytorch.callbacks.LearningRateMonitor",
    "lightning.pytorch.callbacks.ModelCheckpoint",
    "lightning.pytorch.callbacks.Timer",
    "lightning.pytorch.callbacks.GradientAccumulationScheduler",
})  # fmt: skip

TRAINER_CONFIG_KEY = "speechtrain_trainer_config"


def _snapshot(value: Any) -> Any:
    """A deep copy where possible; containers are always copied so that later mutation cannot leak in."""
    try:
        return copy.deepcopy(value)
    except Exception:
        if isinstance(value, list | tuple):
            return type(value)(_snapshot(v) for v in value)
        if isinstance(value, dict):
            return {k: _snapshot(v) for k, v in value.items()}
        return value


def _to_plain(value: Any, where: str, dropped: list[str]) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, datetime.timedelta):
        return {"seconds": value.total_seconds()}
    if isinstance(value, torch.device):
        return str(value)
    if isinstance(value, list | tuple):
        items = [_to_plain(v, f"{where}[{i}]", dropped) for i, v in enumerate(value)]
        return [v for v in items if v is not _DROPPED]
    if isinstance(value, dict):
        items = {str(k): _to_plain(v, f"{where}.{k}", dropped) for k, v in value.items()}
        return {k: v for k, v in items.items() if v is not _DROPPED}
    init_args = getattr(value, "init_args", None)
    if isinstance(init_args, dict):
        target = f"{type(value).__module__}.{type(value).__qualname__}"
        return {"_target_": target, **_to_plain(init_args, where, dropped)}
    dropped.append(f"{where} ({type(value).__name__})")
    return _DROPPED


_DROPPED = object()


def _from_plain(value: Any) -> Any:
    if isinstance(value, list):
        return [_from_plain(v) for v in value]
    if not isinstance(value, dict):
        return value
    kwargs = {k: _from_plain(v) for k, v in value.items() if k != "_target_"}
    if "_target_" not in value:
        return kwargs
    target = value["_target_"]
    if not isinstance(target, str) or target not in TRUSTED_TARGETS:
        raise ValueError(
            f"Refusing to build {target!r} from a stored trainer config: only these classes may be named there: "
            f"{', '.join(sorted(TRUSTED_TARGETS))}."
        )
    module_name, _, class_name = target.rpartition(".")
    cls = getattr(importlib.import_module(module_name), class_name)
    if not inspect.isclass(cls):  # (a listed name is a class; checked all the same)
        raise ValueError(f"Refusing to build {target!r} from a stored trainer config: it is not a class.")
    return cls(**kwargs)


def megatron_strategy_from_config(config: Mapping[str, Any]) -> pl.strategies.Strategy:
    """``trainer.strategy`` given as a mapping (YAML) is the Megatron bridge with those arguments."""
    from speechtrain.lightning.strategy import MegatronStrategy

    allowed = [p for p in inspect.signature(MegatronStrategy.__init__).parameters if p not in ("self", "kwargs")]
    allowed += [p for p in inspect.signature(pl.strategies.DDPStrategy.__init__).parameters if p not in ("self",)]
    unknown = [key for key in config if key not in allowed]
    if unknown:
        hints = []
        for key in unknown:
            guess = difflib.get_close_matches(str(key), allowed, n=1, cutoff=0.6)
            hints.append(
                f"Unknown config key 'trainer.strategy.{key}'." + (f" Did you mean '{guess[0]}'?" if guess else "")
            )
        raise ValueError("\n".join(hints))
    return MegatronStrategy(**dict(config))


def _refuse_targets(value: Any, where: str) -> None:
    """Config data must not name classes to build: a YAML file or a command line cannot make speechtrain import
    code (``trainer.strategy`` as a mapping is the Megatron bridge's own arguments, not a ``_target_``)."""
    if isinstance(value, Mapping):
        if "_target_" in value:
            raise ValueError(
                f"{where}: {{_target_: {value['_target_']}}} is not instantiated: speechtrain never imports classes "
                "named in a config. Build the object in Python and pass it, or use the config keys provided "
                "(e.g. trainer.strategy.*)."
            )
        for key, item in value.items():
            _refuse_targets(item, f"{where}.{key}")
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            _refuse_targets(item, f"{where}[{index}]")


class _EventfulCheckpointConnector(_CheckpointConnector):
    """Lightning's checkpoint restore, announced as ``on_load_checkpoint_start`` / ``_end`` lifecycle events."""

    def resume_start(self, checkpoint_path: Any = None, weights_only: bool | None = None) -> None:
        if checkpoint_path:
            CallbackGroup.get_instance().on_load_checkpoint_start()
        super().resume_start(checkpoint_path, weights_only=weights_only)

    def resume_end(self) -> None:
        restored = bool(self._ckpt_path)
        super().resume_end()
        if restored:
            CallbackGroup.get_instance().on_load_checkpoint_end()


class _StoreTrainerConfig(pl.Callback):
    """Writes the trainer's config into every checkpoint it saves."""

    def on_save_checkpoint(self, trainer: "Trainer", pl_module: pl.LightningModule, checkpoint: dict) -> None:
        checkpoint[TRAINER_CONFIG_KEY] = trainer.to_config()


def _is_megatron(strategy: Any) -> bool:
    from speechtrain.lightning.strategy import MegatronStrategy

    return isinstance(strategy, MegatronStrategy)


class Trainer(pl.Trainer):
    """``lightning.pytorch.Trainer`` that records the arguments it was built with.

    ``trainer.init_args`` holds a copy of the constructor arguments as passed (positional ones by name).
    :meth:`to_config` turns them into plain data that is stored in checkpoints; :meth:`from_config` and
    :meth:`from_checkpoint` build an equivalent trainer from it. Arguments that are objects survive when they
    record their own ``init_args`` (speechtrain's strategies and plugins do); others (loggers, third-party
    callbacks) are left out with a warning, since the run manager re-creates those.

    Before ``fit`` starts, the lifecycle :class:`CallbackGroup` gets the run's configuration and its callbacks
    are attached to this trainer.

    ``precision="auto"`` becomes ``bf16-mixed`` or ``32-true`` for this machine before anything else
    (:mod:`speechtrain.common.auto_precision`); ``init_args`` records the answer.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        backends.configure_process(backends.device_type_of(kwargs.get("accelerator")))
        if kwargs.get("precision") == "auto":  # bf16-mixed where it is faster here (speechtrain.common.auto_precision)
            kwargs["precision"] = resolve_auto_precision(kwargs.get("accelerator", "auto"))
        bound = inspect.signature(pl.Trainer.__init__).bind(None, *args, **kwargs)
        arguments = dict(bound.arguments)
        arguments.pop("self")
        _refuse_targets(arguments, "trainer")
        self.init_args: dict[str, Any] = _snapshot(arguments)
        # Arguments read from the environment (from_job_config): saved as their interpolation text, never the value.
        self.env_interpolations: dict[str, str] = {}
        if isinstance(kwargs.get("strategy"), Mapping):
            kwargs["strategy"] = megatron_strategy_from_config(kwargs["strategy"])
        if _is_megatron(kwargs.get("strategy")) and kwargs.get("precision") is not None and not kwargs.get("plugins"):
            # The bridge's own plugin, given the precision as asked (Lightning would turn 16-mixed into bf16-mixed
            # on CPU without a word; Megatron's loss scaler runs there as well).
            from speechtrain.lightning.precision import MegatronMixedPrecision

            kwargs["plugins"] = [MegatronMixedPrecision(kwargs.pop("precision"))]
        if kwargs.get("enable_progress_bar", True) is not False and not sys.stdout.isatty():
            # A progress bar written to a file shows nothing until the end: log lines instead (progress.py).
            kwargs["enable_progress_bar"] = False
            kwargs["callbacks"] = [*(kwargs.get("callbacks") or []), ProgressLog()]
        if kwargs.get("enable_model_summary", True) is not False and not sys.stdout.isatty():
            kwargs["enable_model_summary"] = False  # its table, as one line (progress.py)
            kwargs["callbacks"] = [*(kwargs.get("callbacks") or []), ModelSizeLine()]
        # Lightning's per-batch time and SIGTERM checks, agreed on every few steps in one reduction (limits.py).
        kwargs["callbacks"] = [*(kwargs.get("callbacks") or []), AgreeAtStepEnd()]
        if kwargs.get("max_time") is not None:
            kwargs["callbacks"].append(WallClockLimit(kwargs.pop("max_time")))
        CallbackGroup.get_instance().on_app_start()
        super().__init__(*args, **kwargs)
        sparse_sigterm_checks(self)
        self._checkpoint_connector = _EventfulCheckpointConnector(self)
        self.callbacks.append(_StoreTrainerConfig())

    def fit(self, model: pl.LightningModule, *args: Any, **kwargs: Any) -> None:
        """Lightning's ``fit``; checkpoints are resumed with ``weights_only=True`` unless asked otherwise. The model
        is back on the run's device afterwards (:meth:`_back_on_device`)."""
        CallbackGroup.get_instance().update_config(trainer=self, model=model)
        kwargs.setdefault("weights_only", True)
        result = super().fit(model, *args, **kwargs)
        self._back_on_device(model)
        return result

    def validate(self, model: pl.LightningModule | None = None, *args: Any, **kwargs: Any) -> Any:
        """Lightning's ``validate``, the model back on the run's device afterwards (:meth:`_back_on_device`)."""
        result = super().validate(model, *args, **kwargs)
        self._back_on_device(model if model is not None else self.lightning_module)
        return result

    def _back_on_device(self, model: Any) -> None:
        """Lightning's teardown moves the module to the CPU at the end of ``fit`` and ``validate``. What the scripts
        do next (the closing report's decodes, with their tensor-parallel collectives; SALM's evaluation; the
        Hugging Face export) runs on the device the run trained on: under NCCL, CPU tensors cannot enter a
        collective."""
        device = self.strategy.root_device
        if isinstance(model, torch.nn.Module) and device.type != "cpu":
            model.to(device)

    def to_config(self) -> dict[str, Any]:
        """The constructor arguments as plain, YAML-safe data (see class docstring)."""
        dropped: list[str] = []
        config = with_env_interpolations(_to_plain(self.init_args, "trainer", dropped), self.env_interpolations)
        if dropped:
            logger.warning(
                "Trainer config leaves out arguments that cannot be stored as data: %s.", ", ".join(dropped)
            )
        return config

    @classmethod
    def from_job_config(cls, config: Any, **overrides: Any) -> "Trainer":
        """Build a trainer from a job config's ``trainer`` node (a Hydra recipe's): resolved to run, with the values
        read from the environment (``${oc.env:...}``) remembered as their text for what it saves."""
        env = env_interpolations(config)
        trainer = cls(**{**to_plain(config), **overrides})
        trainer.env_interpolations = {key: text for key, text in env.items() if key.split(".")[0] not in overrides}
        return trainer

    @classmethod
    def from_config(cls, config: dict[str, Any], **overrides: Any) -> "Trainer":
        """Build a trainer from :meth:`to_config` output; ``overrides`` replace stored arguments."""
        kwargs = _from_plain(to_plain(settle_env_interpolations(dict(config), "the stored trainer config")))
        if isinstance(kwargs.get("max_time"), dict):
            kwargs["max_time"] = datetime.timedelta(**kwargs["max_time"])
        kwargs.update(overrides)
        return cls(**kwargs)

    @classmethod
    def from_checkpoint(cls, path: str | Path, **overrides: Any) -> "Trainer":
        """Build the trainer that wrote the Lightning checkpoint ``path`` (checked against its CRCs, loaded
        without unpickling code: :func:`speechtrain.lightning.checkpoint.load_checkpoint`)."""
        from speechtrain.lightning.checkpoint import load_checkpoint

        checkpoint = load_checkpoint(path)
        if TRAINER_CONFIG_KEY not in checkpoint:
            raise KeyError(f"{path} holds no trainer config (it was not written by a speechtrain Trainer).")
        return cls.from_config(checkpoint[TRAINER_CONFIG_KEY], **overrides)
