"""The one place where speechtrain adapts Megatron Core: quiet imports everywhere, CPU support without CUDA.

Megatron Core assumes CUDA in a few places that a CPU run (tests, laptops, CI) reaches:

- the pipeline schedules, point-to-point communication and the tensor-parallel gather/scatter mappings create
  tensors with ``device="cuda"`` or ``torch.cuda.current_device()``, call ``torch.cuda.synchronize()`` and
  autocast for ``"cuda"``;
- its model-parallel RNG tracker stores and swaps CUDA generator states;
- the GPT model's rotary embedding, attention buffers, default causal mask and inference KV cache allocate on
  ``torch.cuda.current_device()`` or ``"cuda"``.

When CUDA is absent, :func:`import_megatron` gives those modules a view of ``torch`` in which ``cuda`` means the
CPU, and :func:`model_parallel_manual_seed` / :func:`model_parallel_rng` use a CPU tracker with Megatron's
seeding rules. With CUDA present nothing is changed. No other speechtrain module touches Megatron's internals.

Megatron also warns at import time when neither transformer-engine nor Apex is installed (always the case on
CPU); those warnings are silenced here, since the fallbacks they announce are the intended CPU path.
"""

import contextlib
import importlib
import types
import warnings
from collections.abc import Iterator
from typing import Any

import torch

_PATCHED_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.tensor_parallel.mappings",  # gather/scatter buffers (gather_output, sequence parallel)
    # the GPT model (local layer spec): rotary tables, the attention matmul buffer, the default causal mask,
    # the KV cache of static-batch inference
    "megatron.core.utils",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.transformer.utils",
    "megatron.core.transformer.attention",
    "megatron.core.inference.contexts.static_context",
)
_state: dict[str, Any] = {"imported": False, "tracker": None}


def cuda_available() -> bool:
    """Whether Megatron can run on CUDA here."""
    return torch.cuda.is_available()


class _CpuCuda:
    """``torch.cuda`` as Megatron's schedules see it on a machine without CUDA."""

    @staticmethod
    def current_device() -> torch.device:
        return torch.device("cpu")

    @staticmethod
    def synchronize(device: Any = None) -> None:
        """CPU collectives are synchronous."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


def _cpu_device(device: Any) -> Any:
    if device is None:
        return None
    if isinstance(device, int) or str(device).startswith("cuda"):
        return torch.device("cpu")
    return device


class _CpuTorch(types.ModuleType):
    """``torch`` for Megatron modules on a machine without CUDA: ``cuda`` devices become the CPU."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CpuCuda()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def zeros(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(*args, device=_cpu_device(device), **kwargs)

    @staticmethod
    def empty(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.empty(*args, device=_cpu_device(device), **kwargs)

    @staticmethod
    def ones(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.ones(*args, device=_cpu_device(device), **kwargs)

    @staticmethod
    def arange(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.arange(*args, device=_cpu_device(device), **kwargs)

    @staticmethod
    def tensor(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.tensor(*args, device=_cpu_device(device), **kwargs)

    @staticmethod
    def autocast(device_type: str, *args: Any, **kwargs: Any) -> torch.autocast:
        return torch.autocast("cpu" if device_type == "cuda" else device_type, *args, **kwargs)


def import_megatron() -> types.ModuleType:
    """Import ``megatron.core`` quietly, adapting it to the CPU when CUDA is absent. Idempotent."""
    if not _state["imported"]:
        # Announcements of the CPU fallbacks (no transformer-engine / Apex), made at import and on first use.
        warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
        warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
        warnings.filterwarnings("ignore", message=".*transformer_engine.*", category=UserWarning)
        import megatron.core  # noqa: F401
        import megatron.core.pipeline_parallel.schedules  # noqa: F401
        import megatron.core.tensor_parallel  # noqa: F401

        # Megatron's layers warn on every construction about a CUDA-only tuning variable.
        warnings.filterwarnings("ignore", message=".*CUDA_DEVICE_MAX_CONNECTIONS.*")
        warnings.filterwarnings("ignore", message=".*full scope is deprecated.*")
        # Megatron's own deprecation notices about its internals (not about how speechtrain calls it).
        for notice in ("tp_group is None", "MLP requires ffn_hidden_size", "custom_layers.transformer_engine",
                       "dynamic_context.py"):  # fmt: skip
            warnings.filterwarnings("ignore", message=f".*{notice}.*", category=DeprecationWarning)
        _tolerate_foreign_decoders()
        if not cuda_available():
            cpu_torch = _CpuTorch()
            for name in _PATCHED_MODULES:
                importlib.import_module(name).torch = cpu_torch
        _state["imported"] = True
    return importlib.import_module("megatron.core")


def _tolerate_foreign_decoders() -> None:
    """Megatron tags ``model.decoder.layers`` with the micro-batch index; our models' decoders have no ``layers``."""
    schedules = importlib.import_module("megatron.core.pipeline_parallel.schedules")
    original = schedules.set_current_microbatch

    def set_current_microbatch(model: Any, microbatch_id: int) -> None:
        try:
            original(model, microbatch_id)
        except AttributeError:
            pass

    schedules.set_current_microbatch = set_current_microbatch


class CpuRNGStatesTracker:
    """Named RNG streams on the CPU generator, with the semantics of Megatron's CUDA tracker.

    ``fork(name)`` swaps the CPU generator to the named stream for the duration of the block and saves the
    advanced stream afterwards.
    """

    def __init__(self) -> None:
        self.states: dict[str, torch.Tensor] = {}

    def add(self, name: str, seed: int) -> None:
        original = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states[name] = torch.get_rng_state()
        torch.set_rng_state(original)

    def get_states(self) -> dict[str, torch.Tensor]:
        return {name: state.clone() for name, state in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = {name: state.clone() for name, state in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        if name not in self.states:
            raise KeyError(f"RNG stream {name!r} was never seeded; call model_parallel_manual_seed first.")
        original = torch.get_rng_state()
        torch.set_rng_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = torch.get_rng_state()
            torch.set_rng_state(original)


def model_parallel_manual_seed(seed: int) -> None:
    """Seed the default and model-parallel RNG streams with Megatron's rules (``seed``; ``seed + 2718 + tp_rank``).

    Call after the parallel state is initialised. On GPU this is Megatron's ``model_parallel_cuda_manual_seed``;
    on CPU the same streams live on the CPU generator.
    """
    import_megatron()
    from megatron.core import parallel_state, tensor_parallel

    if cuda_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        return
    tracker = CpuRNGStatesTracker()
    torch.manual_seed(seed)
    tracker.add("data-parallel-rng", seed)
    tracker.add("model-parallel-rng", seed + 2718 + parallel_state.get_tensor_model_parallel_rank())
    _state["tracker"] = tracker
    # Megatron's own layers (attention dropout) fork ``get_cuda_rng_tracker()``: hand them the CPU tracker.
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    random._CUDA_RNG_STATE_TRACKER = tracker
    random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def model_parallel_rng() -> contextlib.AbstractContextManager:
    """A context in which random ops (dropout inside tensor-parallel regions) use the model-parallel stream."""
    if cuda_available():
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        return get_cuda_rng_tracker().fork()
    if _state["tracker"] is None:
        return contextlib.nullcontext()
    return _state["tracker"].fork()


def rng_tracker_states() -> dict[str, torch.Tensor]:
    """The model-parallel RNG streams, for checkpoints."""
    if cuda_available():
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        return get_cuda_rng_tracker().get_states()
    return _state["tracker"].get_states() if _state["tracker"] is not None else {}


def set_rng_tracker_states(states: dict[str, torch.Tensor]) -> None:
    """Restore what :func:`rng_tracker_states` returned."""
    if cuda_available():
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        get_cuda_rng_tracker().set_states(states)
    elif _state["tracker"] is not None:
        _state["tracker"].set_states(states)
