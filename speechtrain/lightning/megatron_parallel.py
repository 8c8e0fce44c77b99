"""``MegatronParallel``: runs a speechtrain model's steps on Megatron Core's engine.

A model that trains under :class:`~speechtrain.lightning.MegatronStrategy` describes one micro-batch step in
two parts, which is what lets the same model run with and without pipeline parallelism:

- ``forward_step(batch) -> Tensor``: this pipeline stage's forward. The first stage reads the batch; later stages
  read the activation handed to ``set_input_tensor``. The last stage returns what ``loss_step`` needs.
- ``loss_step(batch, output) -> (loss_sum, num_tokens)``: the summed loss of the micro-batch and the number of
  tokens (or frames, or utterances) it is summed over.

The model is wrapped in Megatron Core's ``DistributedDataParallel`` (gradients accumulate in one contiguous fp32
buffer per dtype, reduced over the data-parallel group by all-reduce, or reduce-scatter under the distributed
optimizer) and each step runs Megatron's forward/backward schedule, which ends in ``finalize_model_grads``. The
global batch that one data-parallel rank receives is split into micro-batches (``micro_batch_size``), and
``trainer.accumulate_grad_batches`` loader batches make one optimizer step; the optimised loss is
``sum(loss_sum) / sum(num_tokens)`` over all micro-batches, accumulated batches and data-parallel ranks, exactly
as one process would compute it over the whole window.

Under tensor parallelism, the gradients of the parameters every TP rank holds whole (norms, biases of row-parallel
layers, depthwise convolutions, a transducer's decoder and joint) are then averaged over the TP group, in one flat
all-reduce, so that TP peers make the same update and their copies never drift apart.

Every rank issues the same collectives in the same order whatever its data: the gradient buckets are reduced in
``finalize_model_grads`` in their fixed order (``overlap_grad_reduce`` off), then the replicated
parameters' gradients over TP (TP > 1), then the token count, then the reported loss; a rank whose batch is
empty (every utterance skipped) or whose parameters partly got no gradient (a text-only SALM batch) contributes
zeros to the same calls. ``overlap_grad_reduce=True`` (the strategy's default for models whose every parameter
gets a gradient in every step, the ASR models) launches each bucket as soon as its gradients are ready,
overlapping communication with backward; a rank with an empty batch launches its buckets (zeros) itself.
"""

import contextlib
from collections.abc import Iterator
from functools import partial
from typing import Any

import torch

from speechtrain.common.batch import is_empty_batch
from speechtrain.lightning import parallel_state
from speechtrain.lightning.megatron_compat import import_megatron


def split_micro_batches(batch: Any, micro_batch_size: int | None) -> list[Any]:
    """Split a batch (tensor, or dict/list/tuple of tensors and lists) along dim 0 into micro-batches."""
    size = _batch_size(batch)
    if micro_batch_size is None or micro_batch_size >= size:
        return [batch]
    if size % micro_batch_size:
        raise ValueError(
            f"A batch of {size} cannot be split into micro-batches of {micro_batch_size}; make the batch size a "
            "multiple of strategy.micro_batch_size."
        )
    return [_slice(batch, start, start + micro_batch_size) for start in range(0, size, micro_batch_size)]


def _fields(batch: Any) -> bool:
    """A list or tuple of fields (tensors or dicts, each split), not of per-utterance items (sliced itself)."""
    return isinstance(batch, list | tuple) and bool(batch) and isinstance(batch[0], torch.Tensor | dict)


def _batch_size(batch: Any) -> int:
    if isinstance(batch, dict):
        return _batch_size(next(iter(batch.values())))
    if _fields(batch):
        return _batch_size(batch[0])
    if isinstance(batch, torch.Tensor | list | tuple):
        return len(batch)
    raise TypeError(f"Cannot split a batch of type {type(batch).__name__} into micro-batches.")


def _slice(batch: Any, start: int, end: int) -> Any:
    if isinstance(batch, dict):
        return {k: _slice(v, start, end) for k, v in batch.items()}
    if _fields(batch):
        return type(batch)(_slice(v, start, end) for v in batch)
    return batch[start:end] if isinstance(batch, torch.Tensor | list | tuple) else batch


class MegatronParallel:
    """Drives one model chunk through Megatron Core's DDP and schedules (see module docstring).

    Args:
        module: the LightningModule (this rank's pipeline stage); it must define ``forward_step``, ``loss_step``
            and ``set_input_tensor``. Its parameters must be on their final device and dtype.
        device: the device the run trains on (bridge tensors such as token counts are made there).
        micro_batch_size: micro-batch size (None: the whole batch is one micro-batch).
        overlap_grad_reduce: reduce gradient buckets during backward (see module docstring).
        use_distributed_optimizer: shard the gradient buffer for Megatron's ``DistributedOptimizer``.
        grad_reduce_in_fp32: accumulate and reduce gradients in fp32 whatever the parameter dtype.
    """

    active: "MegatronParallel | None" = None  # the engine of the run in progress (set by ``MegatronStrategy``)

    def __init__(
        self,
        module: torch.nn.Module,
        device: torch.device,
        micro_batch_size: int | None = None,
        overlap_grad_reduce: bool = False,
        use_distributed_optimizer: bool = False,
        grad_reduce_in_fp32: bool = True,
    ) -> None:
        for name in ("forward_step", "loss_step", "set_input_tensor"):
            if not callable(getattr(module, name, None)):
                raise TypeError(
                    f"{type(module).__name__} cannot run under MegatronStrategy: it has no {name}() "
                    "(see speechtrain.lightning.megatron_parallel for the contract)."
                )
        import_megatron()
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.enums import ModelType
        from megatron.core.transformer import TransformerConfig

        self.module = module
        self.device = torch.device(device)
        self.micro_batch_size = micro_batch_size
        self.use_distributed_optimizer = use_distributed_optimizer
        # The schedules read their settings from a TransformerConfig; the layer sizes in it are placeholders.
        tp, pp = parallel_state.tensor_parallel_world_size(), parallel_state.pipeline_parallel_world_size()
        self.config = TransformerConfig(
            num_layers=pp,
            hidden_size=8 * tp,
            num_attention_heads=tp,
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            pipeline_dtype=torch.float32,  # activations sent between pipeline stages
            variable_seq_lengths=True,  # speech: every micro-batch has its own length; shapes are sent first
            moe_token_dispatcher_type="alltoall",  # (unused: no experts) the default refuses variable lengths
            deallocate_pipeline_outputs=False,
            calculate_per_token_loss=True,
            finalize_model_grads_func=self._finalize,
        )
        module.config = self.config
        module.model_type = ModelType.encoder_or_decoder
        # finalize_model_grads looks for tied embeddings between pipeline stages (on the module that has
        # ``pre_process``); our models have none.
        module.pre_process = getattr(module, "pre_process", parallel_state.is_pipeline_first_stage())
        module.share_embeddings_and_output_weights = False
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=grad_reduce_in_fp32,
            overlap_grad_reduce=overlap_grad_reduce,
            use_distributed_optimizer=use_distributed_optimizer,
        )
        self.ddp = DistributedDataParallel(self.config, ddp_config, module)
        self._replicated = self._replicated_params()  # their gradients are averaged over TP after each step
        self._replicated_views: tuple[list[torch.Tensor], list[int]] | None = None
        self.config.no_sync_func = self._no_sync
        self._accumulating = False  # this batch is not the last of an accumulation window
        # Tokens of the window's earlier batches (gradients accumulate until the window's last batch).
        self._window_tokens = torch.zeros((), dtype=torch.int, device=self.device)

    # -------------------------------------------------------------------------------------- gradient handling
    def start_window(self) -> None:
        """Zero the gradient buffers before the first batch of an optimizer step."""
        self.ddp.zero_grad_buffer()
        self._window_tokens = torch.zeros((), dtype=torch.int, device=self.device)

    @contextlib.contextmanager
    def _no_sync(self) -> Iterator[None]:
        """The schedules' ``no_sync``: all micro-batches but the last only accumulate. Inside an accumulation
        window the last micro-batch of a loader batch only accumulates too."""
        with self.ddp.no_sync():
            yield
        if self._accumulating:
            for group in self.ddp.bucket_groups + self.ddp.expert_parallel_bucket_groups:
                group.is_last_microbatch = False

    def _finalize(self, model: list[torch.nn.Module], num_tokens: torch.Tensor | None, **kwargs: Any) -> None:
        """Megatron's ``finalize_model_grads`` at the end of a window (reduce over DP), then the division by the
        window's tokens; inside a window only the token count is carried to the next batch.

        The division is done here, with Megatron's collectives in Megatron's order (the count broadcast from the
        last pipeline stage, then summed over the data-parallel ranks), because Megatron's own tests
        ``num_tokens > 0`` on the host: a synchronisation every step. A window without tokens has zero gradients,
        so dividing by at least one changes nothing."""
        from megatron.core import parallel_state as mpu
        from megatron.core.distributed import finalize_model_grads

        tokens = self._window_tokens if num_tokens is None else self._window_tokens + num_tokens
        if self._accumulating:
            self._window_tokens = tokens
            return
        finalize_model_grads(model, num_tokens=None, **kwargs)
        self._average_replicated_grads()
        pp_group = mpu.get_pipeline_model_parallel_group()
        if torch.distributed.get_world_size(pp_group) > 1:
            torch.distributed.broadcast(tokens, src=mpu.get_pipeline_model_parallel_last_rank(), group=pp_group)
        torch.distributed.all_reduce(tokens, group=mpu.get_data_parallel_group(with_context_parallel=True))
        scaling = 1.0 / tokens.clamp(min=1).float()
        for chunk in model:
            chunk.scale_gradients(scaling)

    def _replicated_params(self) -> list[torch.nn.Parameter]:
        """The trainable parameters that every tensor-parallel rank holds whole (norms, depthwise convolutions,
        biases of row-parallel layers, a transducer's prediction and joint networks): those without Megatron's
        ``tensor_model_parallel`` mark. Parameters Megatron's ``finalize_model_grads`` already reduces over the
        tensor-parallel group (``average_gradients_across_tp_domain``) are left to it. Empty at TP=1."""
        if parallel_state.tensor_parallel_world_size() == 1:
            return []
        return [p for p in self.module.parameters() if p.requires_grad
                and not getattr(p, "tensor_model_parallel", False)
                and not getattr(p, "average_gradients_across_tp_domain", False)]  # fmt: skip

    def _average_replicated_grads(self) -> None:
        """Average the gradients of the replicated parameters over the tensor-parallel group, after the
        data-parallel reduction: one flat all-reduce. Each TP rank computes them itself, and non-deterministic
        kernels (atomics in CTC's backward, cuDNN's algorithm choices) make the copies differ in their last bits;
        reduced over DP only, TP peers would drift apart over a long run. Averaged, every peer makes the same
        update (the sum comes back bitwise identical on every rank) and the copies stay equal. A handful of
        operators per step: the flat views of the gradients (slices of Megatron's persistent gradient buffer) are
        made once."""
        if not self._replicated:
            return
        from megatron.core import parallel_state as mpu

        if self._replicated_views is None:  # Megatron's gradient buffer lives as long as this engine: views once
            views = [p.main_grad.view(-1) for p in self._replicated]
            self._replicated_views = (views, [v.numel() for v in views])
        views, sizes = self._replicated_views
        flat = torch.cat(views)
        group = mpu.get_tensor_model_parallel_group()
        torch.distributed.all_reduce(flat, group=group)
        flat.mul_(1.0 / torch.distributed.get_world_size(group))
        torch._foreach_copy_(views, flat.split(sizes))

    # ------------------------------------------------------------------------------------------------ a step
    def _loss_func(self, batch: Any, output: torch.Tensor) -> tuple:
        loss_sum, num_tokens = self.module.loss_step(batch, output)
        num_tokens = torch.as_tensor(num_tokens).to(device=loss_sum.device, dtype=torch.int).reshape(())
        # What the schedule hands back to ``run`` for this micro-batch: (loss_sum, num_tokens).
        return loss_sum, num_tokens, torch.stack([loss_sum.detach().double().reshape(()), num_tokens.double()])

    def _forward_step(self, data_iterator: Any, model: torch.nn.Module) -> tuple:
        batch = next(data_iterator)
        return self.module.forward_step(batch), partial(self._loss_func, batch)

    def run(self, batch: Any, forward_only: bool, last_in_window: bool = True) -> torch.Tensor:
        """Forward (and backward unless ``forward_only``) over the micro-batches of ``batch``.

        Args:
            batch: this data-parallel rank's batch.
            forward_only: validation (no gradients, no gradient collectives).
            last_in_window: False for a training batch whose gradients accumulate into the next batch's step
                (``accumulate_grad_batches``): no data-parallel reduction yet.

        Returns:
            The loss per token of this batch over all data-parallel ranks, identical on every rank.
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self._accumulating = not (forward_only or last_in_window)
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # loss_sum, num_tokens (last stage only)
        if is_empty_batch(batch):
            # Every utterance of this rank's batch was unreadable (skipped and counted by the dataset). The rank
            # takes part in the same collectives as the others, contributing nothing.
            if not forward_only:
                if self.ddp.ddp_config.overlap_grad_reduce and not self._accumulating:
                    # No backward ran to launch the buckets' reductions: launch them (zeros) in their order.
                    for group in self.ddp.bucket_groups + self.ddp.expert_parallel_bucket_groups:
                        group.start_grad_sync()
                self._finalize([self.ddp], None)
            return self._reduce_loss(sums)
        micro_batches = split_micro_batches(batch, self.micro_batch_size)
        results = get_forward_backward_func()(
            forward_step_func=self._forward_step,
            data_iterator=iter(micro_batches),
            model=[self.ddp],
            num_microbatches=len(micro_batches),
            seq_length=0,
            micro_batch_size=0,
            forward_only=forward_only,
        )
        if results:  # the last pipeline stage's micro-batches (the other stages report none)
            sums = torch.stack(results).sum(0)
        return self._reduce_loss(sums)

    @staticmethod
    def _reduce_loss(sums: torch.Tensor) -> torch.Tensor:
        """(loss_sum, num_tokens) of this rank -> the loss per token of the global batch, on every rank. One
        all-reduce over the world: tensor-parallel peers hold the same sums and earlier pipeline stages zeros, so
        both sums are TP x their data-parallel sums and their ratio is the data-parallel one."""
        sums = parallel_state.all_reduce(sums, torch.distributed.group.WORLD)  # (a no-op without a distributed run)
        return (sums[0] / sums[1].clamp(min=1)).float()

    def release(self) -> None:
        """Forget this engine. Megatron's DDP keeps no handles to its gradient hooks; emptying its parameter map
        turns them into no-ops, so that a later engine over the same parameters (a second ``fit``) is the only
        one that collects their gradients."""
        self.ddp.param_to_bucket_group = {}
        if MegatronParallel.active is self:
            MegatronParallel.active = None
