"""The job lifecycle events and :class:`BaseCallback`, the Lightning callback that receives them (through
:class:`~speechtrain.lightning.callbacks.CallbackGroup`)."""

from typing import Any

from lightning.pytorch import Callback

LIFECYCLE_EVENTS = (
    "on_app_start",
    "on_app_end",
    "on_model_init_start",
    "on_model_init_end",
    "on_dataloader_init_start",
    "on_dataloader_init_end",
    "on_optimizer_init_start",
    "on_optimizer_init_end",
    "on_load_checkpoint_start",
    "on_load_checkpoint_end",
    "on_save_checkpoint_start",
    "on_save_checkpoint_end",
    "on_save_checkpoint_success",
)


class BaseCallback(Callback):
    """A Lightning callback with no-op job lifecycle hooks; override the ones you need."""

    def on_app_start(self) -> None:
        """The job started (entry script or first trainer)."""

    def on_app_end(self) -> None:
        """The job ends; fired at most once per process."""

    def on_model_init_start(self) -> None:
        """A model's construction begins."""

    def on_model_init_end(self) -> None:
        """A model's construction ended."""

    def on_dataloader_init_start(self) -> None:
        """Dataloader construction begins."""

    def on_dataloader_init_end(self) -> None:
        """Dataloader construction ended."""

    def on_optimizer_init_start(self) -> None:
        """Optimizer and scheduler construction begins."""

    def on_optimizer_init_end(self) -> None:
        """Optimizer and scheduler construction ended."""

    def on_load_checkpoint_start(self) -> None:
        """Loading weights (checkpoint, archive or pretrained init) begins."""

    def on_load_checkpoint_end(self) -> None:
        """Loading weights ended."""

    def on_save_checkpoint_start(self, global_step: int) -> None:
        """Writing a checkpoint begins."""

    def on_save_checkpoint_end(self, global_step: int) -> None:
        """Writing a checkpoint ended (whether or not it succeeded)."""

    def on_save_checkpoint_success(self, global_step: int) -> None:
        """A checkpoint was written completely."""

    def update_config(self, trainer: Any = None, **kwargs: Any) -> None:
        """The run's configuration is known (called once ``fit`` is about to start)."""

    @property
    def state_key(self) -> str:
        return getattr(self, "_state_key", None) or super().state_key
