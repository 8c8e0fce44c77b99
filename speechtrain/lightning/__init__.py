"""The bridge between PyTorch Lightning and Megatron Core.

Everything public is importable from here: cache folders, :func:`get_vocab_size`, :func:`teardown`, the
lifecycle callbacks (:class:`BaseCallback`, :class:`CallbackGroup`, :func:`hook_class_init_with_callbacks`), the
default :class:`TelemetryCallback`, and :class:`Trainer`. Importing this package applies the SLURM
interactive-mode fix to Lightning and silences Lightning's cloud-service tips and a deprecation warning about its
own code (see :mod:`speechtrain.lightning.noise`); it never imports Megatron Core or transformer-engine (those
load when a parallel model is built).
"""

from speechtrain.lightning import parallel_state
from speechtrain.lightning.base_callback import LIFECYCLE_EVENTS, BaseCallback
from speechtrain.lightning.callbacks import CallbackGroup, hook_class_init_with_callbacks
from speechtrain.lightning.megatron_parallel import MegatronParallel
from speechtrain.lightning.noise import silence_upstream_noise
from speechtrain.lightning.optimizer import MegatronOptimizer
from speechtrain.lightning.precision import MegatronMixedPrecision
from speechtrain.lightning.settings import SPEECHTRAIN_DATASETS_CACHE, SPEECHTRAIN_HOME, SPEECHTRAIN_MODELS_CACHE
from speechtrain.lightning.slurm import is_slurm_interactive_mode, patch_slurm_interactive_mode
from speechtrain.lightning.strategy import MegatronStrategy
from speechtrain.lightning.teardown import teardown
from speechtrain.lightning.telemetry import TelemetryCallback
from speechtrain.lightning.trainer import Trainer
from speechtrain.lightning.vocab import get_vocab_size

patch_slurm_interactive_mode()
silence_upstream_noise()

__all__ = [
    "LIFECYCLE_EVENTS",
    "SPEECHTRAIN_DATASETS_CACHE",
    "SPEECHTRAIN_HOME",
    "SPEECHTRAIN_MODELS_CACHE",
    "BaseCallback",
    "CallbackGroup",
    "MegatronMixedPrecision",
    "MegatronOptimizer",
    "MegatronParallel",
    "MegatronStrategy",
    "TelemetryCallback",
    "Trainer",
    "get_vocab_size",
    "hook_class_init_with_callbacks",
    "is_slurm_interactive_mode",
    "parallel_state",
    "patch_slurm_interactive_mode",
    "teardown",
]
