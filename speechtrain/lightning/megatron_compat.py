"""The one place where speechtrain adapts Megatron Core: quiet imports everywhere, CPU support without CUDA.

Megatron Core assumes CUDA in a few places that a CPU run (tests, laptops, CI) reaches:

- the pipeline schedules, point-to-point communication, the tensor-parallel mappings, the DDP gradient buffers
  and the optimizers create tensors with ``device="cuda"`` or ``torch.cuda.current_device()`` and call
  ``torch.cuda.synchronize()``;
- the mixed-precision and distributed optimizers accept only parameters whose ``type()`` names a CUDA tensor,
  gradient clipping asserts CUDA gradients, and the loss scaler moves its state with ``.cuda()``;
- without apex or transformer-engine, the gradient norm falls back to a per-tensor loop with a host sync per
  tensor;
- its model-parallel RNG tracker stores and swaps CUDA generator states;
- the GPT model's rotary embedding, attention buffers, default causal mask and inference KV cache allocate on
  ``torch.cuda.current_device()`` or ``"cuda"``.

:func:`use_device` decides by the device the run trains on (the strategy's root device, so
``trainer.accelerator=cpu`` on a GPU node works too): for ``cpu`` the modules above see a ``torch`` in which
``cuda`` means the CPU, CPU tensors pass the type checks while an optimizer is built, the norm and clipping use
fused ``torch._foreach`` kernels, and :func:`model_parallel_manual_seed` / :func:`model_parallel_rng` use a CPU
tracker with Megatron's seeding rules. For ``cuda`` every original is restored: nothing is changed. Without a
strategy (scripts, tests) the default is the CPU when CUDA is absent. No other speechtrain module touches
Megatron's internals.

Megatron also warns at import time when neither transformer-engine nor Apex is installed (always the case on
CPU); those warnings are silenced here, since the fallbacks they announce are the intended CPU path.
"""

import contextlib
import importlib
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch

_PATCHED_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.tensor_parallel.mappings",  # gather/scatter buffers (gather_output, sequence parallel)
    # the engine: DDP's contiguous gradient buffers, the optimizers, the loss scaler, clipping
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.optimizer.clip_grads",
    # the GPT model (local layer spec): rotary tables, the attention matmul buffer, the default causal mask,
    # the KV cache of static-batch inference (allocated by the attention layer)
    "megatron.core.utils",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.transformer.utils",
    "megatron.core.transformer.attention",
)
_state: dict[str, Any] = {"imported": False, "cpu": None, "tracker": None, "swaps": []}


def on_cpu() -> bool:
    """Whether Megatron runs on the CPU in this process (chosen by :func:`use_device`; before that, whether CUDA
    is absent). Never imports Megatron."""
    return _state["cpu"] if _state["cpu"] is not None else not torch.cuda.is_available()


class _CpuCuda:
    """``torch.cuda`` as Megatron's modules see it in a CPU run."""

    @staticmethod
    def current_device() -> torch.device:
        return torch.device("cpu")

    @staticmethod
    def synchronize(device: Any = None) -> None:
        """CPU collectives are synchronous."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


def _on_cpu(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``factory`` (``torch.zeros``, ...) with a CUDA ``device`` (``"cuda"``, ``"cuda:0"``, an index) made the CPU."""

    def make(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        cuda = isinstance(device, int) or str(device).startswith("cuda")
        return factory(*args, device=torch.device("cpu") if cuda else device, **kwargs)

    return make


class _CpuTorch(types.ModuleType):
    """``torch`` for Megatron modules in a CPU run: ``cuda`` devices become the CPU."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CpuCuda()
        for name in ("zeros", "empty", "ones", "arange", "tensor"):
            setattr(self, name, _on_cpu(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def autocast(device_type: str, *args: Any, **kwargs: Any) -> torch.autocast:
        return torch.autocast("cpu" if device_type == "cuda" else device_type, *args, **kwargs)


# ----------------------------------------------------------------------------------- CPU versions of kernels
def _foreach_l2_norm(chunk_size: int, noop_flag: Any, tensor_lists: list, per_tensor: bool, *args: Any) -> tuple:
    """``amp_C.multi_tensor_l2norm`` with one fused ``_foreach_norm`` (Megatron's fallback syncs per tensor).
    Megatron calls it through its ``multi_tensor_applier``, a pass-through, and only with gradients to norm."""
    norms = torch._foreach_norm([t.float() for t in tensor_lists[0]])
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None


def _clip_grad_by_total_norm_fp32(
    parameters: Any, max_norm: float, total_norm: float, use_decoupled_grad: bool = False
) -> None:
    """Megatron's clipping by a known total norm, without its CUDA type assertion, as one fused scale."""
    attribute = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attribute).detach() for p in parameters if getattr(p, attribute, None) is not None]
    coefficient = max_norm / (total_norm + 1.0e-6)
    if coefficient < 1.0 and grads:
        torch._foreach_mul_(grads, coefficient)


def _load_scaler_state(self: Any, state_dict: dict) -> None:
    """``DynamicGradScaler.load_state_dict`` onto the scaler's own device (the original calls ``.cuda()``)."""
    self._scale = state_dict["scale"].to(self.min_scale.device)
    self._growth_tracker = state_dict["growth_tracker"]
    self._hysteresis_tracker = state_dict["hysteresis_tracker"]


def _cpu_swaps() -> list[tuple[Any, str, Any, Any]]:
    """(object, attribute, original value, CPU value) for everything a CPU run swaps. The bridge clips through
    ``clip_grads`` itself (:class:`~speechtrain.lightning.optimizer.MegatronOptimizer`), never through Megatron's
    ``step()``."""
    clip_grads = importlib.import_module("megatron.core.optimizer.clip_grads")
    grad_scaler = importlib.import_module("megatron.core.optimizer.grad_scaler")
    cpu_torch = _CpuTorch()
    swaps = [
        *((importlib.import_module(name), "torch", cpu_torch) for name in _PATCHED_MODULES),
        (clip_grads, "l2_norm_impl", _foreach_l2_norm),
        (clip_grads, "clip_grad_by_total_norm_fp32", _clip_grad_by_total_norm_fp32),
        (grad_scaler.DynamicGradScaler, "load_state_dict", _load_scaler_state),
    ]
    return [(target, name, getattr(target, name), value) for target, name, value in swaps]


def use_device(device: torch.device | str) -> None:
    """Run Megatron on ``device``'s type: CPU adaptations on for ``cpu``, every original back for ``cuda``."""
    import_megatron()
    cpu = torch.device(device).type == "cpu"
    if cpu != _state["cpu"]:
        for target, name, original, value in _state["swaps"]:
            setattr(target, name, value if cpu else original)
        _state["cpu"] = cpu


def building_optimizer() -> contextlib.AbstractContextManager:
    """Around ``get_megatron_optimizer``: in a CPU run, CPU tensors answer ``type()`` with the CUDA names
    (``torch.cuda.FloatTensor`` ...) that Megatron's optimizers check parameters against. Nothing on CUDA."""
    if not on_cpu():
        return contextlib.nullcontext()
    original = torch.Tensor.type

    def type_(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
        if dtype is None and not kwargs and self.device.type == "cpu":
            return original(self).replace("torch.", "torch.cuda.", 1)
        return original(self, dtype, non_blocking, **kwargs)

    return mock.patch.object(torch.Tensor, "type", type_)


def import_megatron() -> types.ModuleType:
    """Import ``megatron.core`` quietly; the first call adapts it to the CPU when CUDA is absent. Idempotent."""
    if not _state["imported"]:
        # Megatron's announcements of the CPU fallbacks (no transformer-engine / Apex, at import and on first use),
        # its layers' warning (at every construction) about a CUDA-only tuning variable, and its notices about its
        # own internals (not about how speechtrain calls it).
        for notice in ("Transformer Engine and Apex are not installed", "Apex is not installed",
                       "Falling back to local implementations", "Falling back to Torch optimizers",
                       "CUDA_DEVICE_MAX_CONNECTIONS", "full scope is deprecated"):  # fmt: skip
            warnings.filterwarnings("ignore", message=f".*{notice}.*")
        warnings.filterwarnings("ignore", message=".*transformer_engine.*", category=UserWarning)
        for notice in ("tp_group is None", "MLP requires ffn_hidden_size", "custom_layers.transformer_engine",
                       "dynamic_context.py"):  # fmt: skip
            warnings.filterwarnings("ignore", message=f".*{notice}.*", category=DeprecationWarning)
        # (The calls below import the rest: the schedules, DDP, the optimizers, the tensor-parallel layers.)
        import megatron.core  # noqa: F401

        _tolerate_foreign_decoders()
        _torch_optimizer_step_state()
        _state["swaps"] = _cpu_swaps()
        _state["imported"] = True
        use_device("cuda" if torch.cuda.is_available() else "cpu")
    return importlib.import_module("megatron.core")


def _tolerate_foreign_decoders() -> None:
    """Megatron tags ``model.decoder.layers`` with the micro-batch index; our models' decoders have no ``layers``."""
    schedules = importlib.import_module("megatron.core.pipeline_parallel.schedules")
    original = schedules.set_current_microbatch

    def set_current_microbatch(model: Any, microbatch_id: int) -> None:
        with contextlib.suppress(AttributeError):
            original(model, microbatch_id)

    schedules.set_current_microbatch = set_current_microbatch


def _torch_optimizer_step_state() -> None:
    """Without apex / transformer-engine, Megatron's ``DistributedOptimizer`` wraps torch's Adam, whose per-parameter
    state has a ``step`` tensor that Megatron's checkpoint of the shards leaves out. Two fixes for that path (CPU
    runs, or GPUs without the ``gpu`` extra): loading the shards copies only the tensors the checkpoint has, and
    every parameter gets its own ``step`` tensor back (Megatron hands all of them one shared tensor, which torch's
    foreach Adam would then advance once per parameter). Applied once, by :func:`import_megatron`."""
    distrib = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
    if distrib.HAVE_APEX_OR_TE:
        return
    optimizer_class = distrib.DistributedOptimizer
    original_load = optimizer_class.load_state_dict

    def set_states(self: Any, model_param: torch.nn.Parameter, tensors: dict[str, torch.Tensor]) -> None:
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        for key, destination in {"param": main_param, **self.optimizer.state[main_param]}.items():
            if key in tensors:
                destination.copy_(tensors[key])

    def load_state_dict(self: Any, state_dict: dict) -> None:
        original_load(self, state_dict)
        for state in self.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()

    optimizer_class._set_main_param_and_optimizer_states = set_states
    optimizer_class.load_state_dict = load_state_dict


class CpuRNGStatesTracker:
    """Named RNG streams on the CPU generator, with the semantics of Megatron's CUDA tracker.

    ``fork(name)`` swaps the CPU generator to the named stream for the duration of the block and saves the
    advanced stream afterwards.
    """

    def __init__(self) -> None:
        self.states: dict[str, torch.Tensor] = {}

    def add(self, name: str, seed: int) -> None:
        """The stream ``torch.manual_seed(seed)`` starts (the default stream does not move)."""
        self.states[name] = torch.Generator().manual_seed(seed).get_state()

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

    if not on_cpu():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        return
    tracker = CpuRNGStatesTracker()
    torch.manual_seed(seed)
    tracker.add("data-parallel-rng", seed)
    tracker.add("model-parallel-rng", seed + 2718 + parallel_state.get_tensor_model_parallel_rank())
    _state["tracker"] = tracker
    # Megatron's own layers (attention dropout) fork ``get_cuda_rng_tracker()``: hand them the CPU tracker.
    tensor_parallel.random._CUDA_RNG_STATE_TRACKER = tracker
    tensor_parallel.random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def _tracker() -> Any:
    """The model-parallel RNG tracker: Megatron's on CUDA; in a CPU run the CPU one (None before seeding)."""
    if on_cpu():
        return _state["tracker"]
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    return get_cuda_rng_tracker()


def model_parallel_rng() -> contextlib.AbstractContextManager:
    """A context in which random ops (dropout inside tensor-parallel regions) use the model-parallel stream."""
    tracker = _tracker()
    return contextlib.nullcontext() if tracker is None else tracker.fork()


def rng_tracker_states() -> dict[str, torch.Tensor]:
    """The model-parallel RNG streams, for checkpoints."""
    tracker = _tracker()
    return {} if tracker is None else tracker.get_states()


def set_rng_tracker_states(states: dict[str, torch.Tensor]) -> None:
    """Restore what :func:`rng_tracker_states` returned."""
    tracker = _tracker()
    if tracker is not None:
        tracker.set_states(states)
