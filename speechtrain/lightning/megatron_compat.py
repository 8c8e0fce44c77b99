"""The one place where speechtrain adapts Megatron Core: quiet imports everywhere, CPU support without CUDA.

Megatron Core assumes CUDA in a few places that a CPU run (tests, laptops, CI) reaches:

- the pipeline schedules, point-to-point communication, the tensor-parallel mappings, the DDP gradient buffers
  and the optimizers create tensors with ``device="cuda"`` or ``torch.cuda.current_device()`` and call
  ``torch.cuda.synchronize()``;
- the mixed-precision and distributed optimizers accept only parameters whose ``type()`` names a CUDA tensor,
  gradient clipping asserts CUDA gradients, and the loss scaler moves its state with ``.cuda()``;
- without apex or transformer-engine (on any device), clipping scales the gradients one tensor at a time and the
  gradient norm falls back to a per-tensor loop with a host sync per tensor: both are replaced by fused
  ``torch._foreach`` kernels on every device where those fallbacks are in use (one sync for the norm, as with
  transformer-engine);
- its model-parallel RNG tracker stores and swaps the CUDA generator's states;
- the GPT model's rotary embedding, attention buffers, default causal mask and inference KV cache allocate on
  ``torch.cuda.current_device()`` or ``"cuda"``.

:func:`use_device` decides by the device the run trains on (the strategy's root device, so
``trainer.accelerator=cpu`` on a GPU node works too): for ``cpu`` the modules above see a ``torch`` in which
``cuda`` means the CPU, CPU tensors pass the type checks while an optimizer is built, and Megatron's own RNG
tracker swaps the CPU generator's states (its seeding rules and streams unchanged). For ``cuda`` every original is
restored but the fused norm and scaling above. Without a
strategy (scripts, tests) the default is the CPU when CUDA is absent. No other speechtrain module touches
Megatron's internals.

Megatron also warns at import time when neither transformer-engine nor Apex is installed (always the case on
CPU); those warnings are silenced here, since the fallbacks they announce are the intended CPU path.
"""

import contextlib
import importlib
import os
import pickle
import queue
import sys
import types
import warnings
from collections.abc import Callable
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
    # dist_checkpointing (checkpoint_format=torch_dist): the save's validation and failure checks all-reduce flags
    # made on the current CUDA device, and writing and exchanging shards synchronise CUDA
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
    "megatron.core.dist_checkpointing.strategies.async_utils",
)  # (and the RNG tracker's module, megatron.core.tensor_parallel.random: its own torch, see _cpu_swaps)
_state: dict[str, Any] = {"imported": False, "cpu": None, "swaps": []}


class _CpuStream:
    """The current "stream" of a CPU run: CPU work is ordered already, so waiting on an event or a stream is a no-op
    (the DDP gradient buffers wait on the current stream for CUDA-graph replays before every reduction)."""

    wait_event = wait_stream = synchronize = staticmethod(lambda *args, **kwargs: None)


class _CpuCuda:
    """``torch.cuda`` as Megatron's modules see it in a CPU run: the current device and the generator are the CPU's;
    synchronising is a no-op (CPU collectives are synchronous)."""

    current_device = staticmethod(lambda: torch.device("cpu"))
    current_stream = staticmethod(lambda device=None: _CpuStream())
    synchronize = staticmethod(lambda device=None: None)
    get_rng_state = staticmethod(lambda device=None: torch.get_rng_state())
    manual_seed = staticmethod(torch.manual_seed)

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


_NO_STATE = torch.zeros(1, dtype=torch.uint8, device="cpu")  # CPU runs only (the swap is undone on CUDA)


class _CpuRandomTorch(_CpuTorch):
    """``torch`` for Megatron's RNG tracker in a CPU run: its "CUDA" generator is the CPU one, so the tracker's
    separate bookkeeping of the CPU generator (saved and restored around a recomputation, checked unchanged after
    every fork) is void here: it sees a constant state."""

    get_rng_state = staticmethod(lambda: _NO_STATE)
    set_rng_state = staticmethod(lambda state: None)


# ----------------------------------------------------------------------------------- CPU versions of kernels
def _foreach_l2_norm(chunk_size: int, noop_flag: Any, tensor_lists: list, per_tensor: bool, *args: Any) -> tuple:
    """``amp_C.multi_tensor_l2norm`` with one fused ``_foreach_norm`` on any device (Megatron's fallback syncs per
    tensor).
    Megatron calls it through its ``multi_tensor_applier``, a pass-through, and only with gradients to norm."""
    norms = torch._foreach_norm([t.float() for t in tensor_lists[0]])
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None


def _foreach_scale(chunk_size: int, noop_flag: Any, tensor_lists: list, scale: float) -> None:
    """``amp_C.multi_tensor_scale`` (clipping: the gradients scaled in place) as one fused kernel."""
    sources, destinations = tensor_lists
    if all(s is d for s, d in zip(sources, destinations, strict=True)):  # clipping passes [grads, grads]
        torch._foreach_mul_(destinations, scale)
    else:
        torch._foreach_copy_(destinations, torch._foreach_mul(sources, scale))


def _load_scaler_state(self: Any, state_dict: dict) -> None:
    """``DynamicGradScaler.load_state_dict`` onto the scaler's own device (the original calls ``.cuda()``)."""
    self._scale = state_dict["scale"].to(self.min_scale.device)
    self._growth_tracker = state_dict["growth_tracker"]
    self._hysteresis_tracker = state_dict["hysteresis_tracker"]


def _cpu_swaps() -> list[tuple[Any, str, Any, Any]]:
    """(object, attribute, original value, CPU value) for everything a CPU run swaps. The bridge clips through
    ``clip_grads`` itself (:class:`~speechtrain.lightning.optimizer.MegatronOptimizer`), never through Megatron's
    ``step()``."""
    grad_scaler = importlib.import_module("megatron.core.optimizer.grad_scaler")
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    cpu_torch = _CpuTorch()
    swaps = [
        *((importlib.import_module(name), "torch", cpu_torch) for name in _PATCHED_MODULES),
        (random, "torch", _CpuRandomTorch()),
        (random, "_get_cuda_rng_state", lambda *args, **kwargs: torch.get_rng_state()),
        (random, "_set_cuda_rng_state", lambda state, *args, **kwargs: torch.set_rng_state(state)),
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


def fused_cpu_kernels(optimizer: Any) -> None:
    """In a CPU run, the torch optimizers inside Megatron's (``optimizer``: a ``MegatronOptimizer`` or a chain of
    them) take their fused kernels: Adam/AdamW ``fused``, SGD ``foreach``. torch picks those by default only for
    CUDA tensors; on the CPU it loops over the parameters in Python, a noticeable share of the step of a model of
    many small tensors such as the demo's. Per group, so it also holds after ``load_state_dict`` (call it again
    then: loading restores the groups' saved flags). On CUDA, Megatron's choice stands (transformer-engine or Apex
    FusedAdam, or torch's own CUDA default)."""
    if not _state["cpu"]:
        return
    for chained in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        # (Muon + AdamW, ``speechtrain.lightning.muon``, is two torch optimizers: Muon's own step is batched)
        for inner in getattr(chained.optimizer, "optimizers", None) or [chained.optimizer]:
            fused = isinstance(inner, torch.optim.Adam | torch.optim.AdamW)
            if not fused and not isinstance(inner, torch.optim.SGD):
                continue
            for group in inner.param_groups:
                if all(p.device.type == "cpu" and p.is_floating_point() for p in group["params"]):
                    group["fused"], group["foreach"] = (True, False) if fused else (None, True)


def cuda_tensor_types() -> contextlib.AbstractContextManager:
    """Around ``get_megatron_optimizer`` and clipping: in a CPU run, CPU tensors answer ``type()`` with the CUDA
    names (``torch.cuda.FloatTensor`` ...) that Megatron's optimizers and clipping check tensors against. Nothing
    on CUDA (Megatron is imported, and its device chosen, before this is reached)."""
    if not _state["cpu"]:
        return contextlib.nullcontext()
    original = torch.Tensor.type

    def type_(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
        if dtype is None and not kwargs and self.device.type == "cpu":  # (under a TorchFunctionMode, such as
            name = original(self)  # ``with torch.device(...)``, the original dispatches back here: rename once)
            return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
        return original(self, dtype, non_blocking, **kwargs)

    return mock.patch.object(torch.Tensor, "type", type_)


def import_megatron() -> types.ModuleType:
    """Import ``megatron.core`` quietly; the first call adapts it to the CPU when CUDA is absent. Idempotent."""
    if not _state["imported"]:
        # Megatron's announcements of the CPU fallbacks (no transformer-engine / Apex, at import and on first use),
        # its layers' warning (at every construction) about a CUDA-only tuning variable, and its notices about its
        # own internals (not about how speechtrain calls it).
        quiet = "Transformer Engine and Apex are not|Apex is not installed|Falling back to|CUDA_DEVICE_MAX_CONNECTIONS"
        warnings.filterwarnings("ignore", message=f".*({quiet}|full scope is deprecated|transformer_engine).*")
        quiet = "tp_group is None|MLP requires ffn_hidden_size|custom_layers.transformer_engine|dynamic_context.py"
        warnings.filterwarnings("ignore", message=f".*({quiet}).*", category=DeprecationWarning)
        # (The calls below import the rest: the schedules, DDP, the optimizers, the tensor-parallel layers.)
        import megatron.core  # noqa: F401

        _tolerate_foreign_decoders()
        _write_results_beside_the_shards()
        _torch_optimizer_step_state()
        _state["swaps"] = _cpu_swaps()
        _fused_fallback_kernels()
        _state["imported"] = True
        use_device("cuda" if torch.cuda.is_available() else "cpu")
    return importlib.import_module("megatron.core")


def _fused_fallback_kernels() -> None:
    """On every device: where Megatron falls back to its per-tensor norm and scaling (no transformer-engine, no
    Apex), the fused ``torch._foreach`` versions instead (the fallback norm reads each tensor's norm on the host);
    and its vocab-parallel cross-entropy's target masking without boolean indexing (:func:`_predicted_logits`)."""
    clip_grads = importlib.import_module("megatron.core.optimizer.clip_grads")
    if getattr(clip_grads.l2_norm_impl, "__name__", "") == "local_multi_tensor_l2_norm":
        clip_grads.l2_norm_impl = _foreach_l2_norm
    if getattr(clip_grads.multi_tensor_scale_impl, "__name__", "") == "local_multi_tensor_scale":
        clip_grads.multi_tensor_scale_impl = _foreach_scale
    cross_entropy = importlib.import_module("megatron.core.tensor_parallel.cross_entropy")
    cross_entropy.VocabParallelCrossEntropy.calculate_predicted_logits = staticmethod(_predicted_logits)


def _predicted_logits(
    logits: torch.Tensor, target: torch.Tensor, logits_max: torch.Tensor, vocab_start: int, vocab_end: int
) -> tuple[torch.Tensor, ...]:
    """``VocabParallelCrossEntropy.calculate_predicted_logits`` (same contract and numbers) with ``masked_fill``
    where Megatron assigns through a boolean mask (``x[mask] = 0``): on a GPU that turns the mask into indices with
    ``nonzero``, a host synchronisation, twice per loss."""
    logits -= logits_max.unsqueeze(dim=-1)  # in place, as Megatron's: the softmax reuses this memory
    target_mask = (target < vocab_start) | (target >= vocab_end)  # targets of another rank's vocabulary slice
    masked_target_1d = (target - vocab_start).masked_fill(target_mask, 0).view(-1)
    logits_2d = logits.view(-1, logits.size()[-1])
    rows = torch.arange(logits_2d.size()[0], device=logits_2d.device)
    predicted = logits_2d[rows, masked_target_1d].clone().contiguous().view_as(target).masked_fill(target_mask, 0.0)
    exp_logits = torch.exp(logits, out=logits)
    return target_mask, masked_target_1d, predicted, exp_logits.sum(dim=-1), exp_logits


class _WriteResults:
    """The queue through which Megatron's checkpoint writer hands its results (the list of what it wrote, or the
    exception it met) back to the rank: ``put`` by the writer, ``get_nowait`` by the rank once the writer is done.
    A synchronous save writes in the rank's own process: the results stay in memory. An asynchronous save writes in
    a process forked from the rank: the results come back in a file beside the shards, which the rank reads once
    and removes (before the folder's hashes are taken). Megatron's own queue is served by a ``multiprocessing``
    manager process, spawned at the first save and left running: a rank killed with SIGKILL (preemption, a crash)
    leaves it orphaned and spinning, holding the job's output open."""

    def __init__(self, path: str) -> None:
        self.path, self.pid = path, os.getpid()
        self.local: queue.Queue = queue.Queue()

    def put(self, results: Any) -> None:
        if os.getpid() == self.pid:
            self.local.put(results)
            return
        tmp = f"{self.path}.tmp"
        with open(tmp, "wb") as f:
            pickle.dump(results, f)
        os.replace(tmp, self.path)  # whole or absent: the rank never reads a half-written file

    def get_nowait(self) -> Any:
        with contextlib.suppress(queue.Empty):
            return self.local.get_nowait()
        try:
            with open(self.path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            raise queue.Empty from None
        os.unlink(self.path)
        return pickle.loads(data)  # written during this save by this rank's own writer process


def _write_results_beside_the_shards() -> None:
    """Megatron's writer gets a :class:`_WriteResults` per save instead of its manager-served queue (every device)."""
    writer = importlib.import_module("megatron.core.dist_checkpointing.strategies.filesystem_async")
    writer.get_write_results_queue = lambda mp_mode="spawn": None  # (no manager: the writer's queue is set below)
    original = writer.FileSystemWriterAsync.prepare_write_data

    def prepare_write_data(self: Any, plan: Any, planner: Any) -> None:
        original(self, plan, planner)
        if self.write_buckets:  # (None when this rank writes nothing, as in Megatron)
            rank = torch.distributed.get_rank()
            self.results_queue = _WriteResults(os.path.join(self.checkpoint_dir, f".write_results_rank{rank}"))

    writer.FileSystemWriterAsync.prepare_write_data = prepare_write_data


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
    foreach Adam would then advance once per parameter). And its ``state_dict`` before the first step (which
    ``dist_checkpointing``'s loading calls) finds the state Adam allocates lazily. Applied once, by
    :func:`import_megatron`."""
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

    original_state_dict = optimizer_class.state_dict

    def state_dict(self: Any) -> dict:
        # Before the first step (a resumed run describing what to load into: ``sharded_state_dict(is_loading=True)``)
        # torch's Adam has no state yet, and Megatron reads the step from it: the state Adam would allocate, at step 0.
        if not self.optimizer.state and isinstance(self.optimizer, torch.optim.Adam | torch.optim.AdamW):
            for group in self.optimizer.param_groups:
                for param in group["params"]:
                    self.optimizer.state[param].update(
                        step=torch.zeros((), dtype=torch.float32, device=param.device),
                        **{key: torch.zeros_like(param) for key in self.optimizer_state_keys},
                    )
        return original_state_dict(self)

    optimizer_class._set_main_param_and_optimizer_states = set_states
    optimizer_class.load_state_dict = load_state_dict
    optimizer_class.state_dict = state_dict


def model_parallel_manual_seed(seed: int) -> None:
    """Seed the default and model-parallel RNG streams with Megatron's rules (``seed``; ``seed + 2718 + tp_rank``):
    Megatron's ``model_parallel_cuda_manual_seed``, on the CPU generator in a CPU run. Call after the parallel state
    is initialised."""
    import_megatron()
    importlib.import_module("megatron.core.tensor_parallel").model_parallel_cuda_manual_seed(seed)


def _tracker() -> Any:
    """Megatron's model-parallel RNG tracker once seeded, else None (never imports Megatron)."""
    random = sys.modules.get("megatron.core.tensor_parallel.random")
    tracker = getattr(random, "_CUDA_RNG_STATE_TRACKER", None)
    return tracker if tracker is not None and tracker.is_initialized() else None


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
        tracker.set_states(dict(states))  # (Megatron keeps the dict it is given and updates it in place)
