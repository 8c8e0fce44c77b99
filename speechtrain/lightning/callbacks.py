"""The lifecycle event bus: the process-wide :class:`CallbackGroup` and init hooks (callbacks derive from
:class:`~speechtrain.lightning.base_callback.BaseCallback`).

The framework fires job-level events (app start/end, model/dataloader/optimizer construction, checkpoint
save/load) through ``CallbackGroup.get_instance()``; every registered callback that implements the event's
method receives it. Callbacks are ordinary Lightning callbacks too: ``update_config`` attaches them to the
trainer, so they also get Lightning's per-step hooks.

A failing observer must not kill a training run: an exception raised inside a callback's lifecycle method is
logged with the callback's name and the event, and the remaining callbacks still receive the event.
"""

import atexit
import functools
import logging
import threading
from typing import Any

from lightning.pytorch import Callback

from speechtrain.lightning.base_callback import BaseCallback
from speechtrain.lightning.telemetry import TelemetryCallback, telemetry_enabled_by_env

logger = logging.getLogger(__name__)


class CallbackGroup:
    """Process-wide singleton that fans lifecycle events out to the registered callbacks.

    ``group.on_model_init_start()`` (or any other method name) calls that method on every registered callback
    that has it. ``on_app_start`` and ``on_app_end`` are delivered at most once per process; ``on_app_end`` also
    fires from an ``atexit`` hook if the job did not emit it.

    A new group registers the :class:`~speechtrain.lightning.telemetry.TelemetryCallback` singleton first, unless
    ``SPEECHTRAIN_TELEMETRY=0``.
    """

    _instance: "CallbackGroup | None" = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self._callbacks: list[Callback] = []
        self._once_emitted: set[str] = set()
        atexit.register(self.on_app_end)
        if telemetry_enabled_by_env():
            self.register(TelemetryCallback.get_instance())

    @classmethod
    def get_instance(cls) -> "CallbackGroup":
        """The process-wide group, created on first use."""
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    @property
    def callbacks(self) -> list[Callback]:
        """The registered callbacks, in registration order (a copy)."""
        return list(self._callbacks)

    def register(self, callback: Callback) -> None:
        """Add ``callback`` unless this very object is already registered."""
        if not any(cb is callback for cb in self._callbacks):
            self._callbacks.append(callback)

    def unregister(self, callback: Callback) -> None:
        """Remove ``callback`` if registered."""
        self._callbacks = [cb for cb in self._callbacks if cb is not callback]

    def emit(self, event: str, *args: Any, **kwargs: Any) -> None:
        """Call ``event`` on every registered callback that implements it."""
        for callback in list(self._callbacks):
            method = getattr(callback, event, None)
            if not callable(method):
                continue
            try:
                method(*args, **kwargs)
            except Exception:
                logger.exception("Callback %s failed in %s; the run continues.", type(callback).__name__, event)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("on_"):
            return functools.partial(self.emit, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _emit_once(self, event: str) -> None:
        with self._lock:
            if event in self._once_emitted:
                return
            self._once_emitted.add(event)
        self.emit(event)

    def on_app_start(self) -> None:
        """Deliver ``on_app_start`` (at most once per process)."""
        self._emit_once("on_app_start")

    def on_app_end(self) -> None:
        """Deliver ``on_app_end`` (at most once per process)."""
        self._emit_once("on_app_end")

    def update_config(self, trainer: Any = None, **kwargs: Any) -> None:
        """Give every :class:`BaseCallback` the run's configuration and attach all callbacks to ``trainer``.

        Non-``BaseCallback`` objects are attached but not asked to update. Each callback gets a distinct string
        ``state_key`` (the class name, with ``#n`` for the n-th extra instance of a class) so that their states
        do not overwrite each other in checkpoints.
        """
        seen: dict[str, int] = {}
        for callback in self._callbacks:
            if isinstance(callback, BaseCallback):
                name = type(callback).__qualname__
                count = seen.get(name, 0)
                seen[name] = count + 1
                callback._state_key = name if count == 0 else f"{name}#{count}"
                try:
                    callback.update_config(trainer=trainer, **kwargs)
                except Exception:
                    logger.exception("Callback %s failed in update_config; the run continues.", name)
        if trainer is not None:
            attached = trainer.callbacks
            for callback in self._callbacks:
                if not any(cb is callback for cb in attached):
                    attached.append(callback)

    @classmethod
    def reset(cls) -> None:
        """Forget the process-wide group and telemetry (for tests and for several jobs in one process)."""
        with cls._lock:
            if cls._instance is not None:
                atexit.unregister(cls._instance.on_app_end)
            cls._instance = None
        TelemetryCallback.reset()


_initialising = threading.local()


def hook_class_init_with_callbacks(cls: type, start_method: str, end_method: str) -> None:
    """Wrap ``cls.__init__`` so that ``start_method`` / ``end_method`` are emitted around construction.

    Each object's construction emits the pair exactly once, even when ``__init__`` runs through a chain of
    ``super().__init__`` calls of several hooked classes, and even if this function is applied repeatedly.
    The end event fires even if construction raises.
    """
    init = cls.__dict__.get("__init__")
    if init is None:
        init = cls.__init__
    if getattr(init, "_speechtrain_hook", None) == (start_method, end_method):
        return

    @functools.wraps(init)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> None:
        active: set[tuple[int, str]] = _initialising.__dict__.setdefault("active", set())
        token = (id(self), start_method)
        if token in active:
            init(self, *args, **kwargs)
            return
        active.add(token)
        group = CallbackGroup.get_instance()
        group.emit(start_method)
        try:
            init(self, *args, **kwargs)
        finally:
            active.discard(token)
            group.emit(end_method)

    wrapped._speechtrain_hook = (start_method, end_method)
    cls.__init__ = wrapped
