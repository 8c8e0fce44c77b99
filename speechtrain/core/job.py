"""The typed schema of a training job config: ``name``, ``seed``, ``trainer``, ``exp_manager``, ``init_from``,
``model``."""

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl

from speechtrain.core.exp_manager import ExpManagerConfig


@dataclass
class InitFromConfig:
    """Fine-tuning start point: weights from an archive (``.stm``) or Lightning checkpoint (``.ckpt``).

    Attributes:
        path: the source file; None trains from scratch.
        include: glob patterns or module prefixes of weights to take (default all).
        exclude: patterns to leave out (e.g. ``decoder`` when the vocabulary changed).
    """

    path: str | None = None
    include: list[str] | None = None
    exclude: list[str] | None = None


def train_job_schema(
    model_config: type, name: str = "default", model_overrides_of: type | None = None, extras: type | None = None
) -> type:
    """A dataclass for a whole training job whose ``model`` node is ``model_config``.

    The ``trainer`` node is free-form but its keys are checked against ``lightning.Trainer``'s arguments. With
    ``model_overrides_of`` (and a free-form ``model_config`` such as ``dict[str, Any]``), the ``model`` node is a
    partial config of that dataclass: its keys are checked, no defaults are added (fine-tuning overrides).
    ``extras``: a dataclass whose fields become further top-level keys of the job.
    """
    model_meta = {"overrides_of": model_overrides_of} if model_overrides_of is not None else {}
    return dataclasses.make_dataclass(
        f"{model_config.__name__}Job",
        [
            ("name", str, field(default=name)),
            ("seed", int, field(default=1234)),
            ("trainer", dict[str, Any], field(default_factory=dict, metadata={"keys_from": pl.Trainer.__init__})),
            ("exp_manager", ExpManagerConfig, field(default_factory=ExpManagerConfig)),
            ("init_from", InitFromConfig, field(default_factory=InitFromConfig)),
            ("model", model_config, field(default_factory=model_config, metadata=model_meta)),
            *[(f.name, f.type, f) for f in (dataclasses.fields(extras) if extras is not None else ())],
        ],
    )
